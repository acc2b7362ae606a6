"""Rejection sampling keeps the target's distribution; sampling parameters are validated."""
import math

import pytest
import torch

from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.sampling import probs_from_logits
from angelspec.runtime.verify import verify_greedy, verify_rejection

N = 60_000


def committed_distribution(p, draft, q, index=0, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        _, toks = verify_rejection(p, draft, q, g)
        counts[toks[index]] += 1
    return counts / n


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


P = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1],
                  [0.2, 0.2, 0.2, 0.2, 0.2]])


def test_rejection_sampling_with_sampled_draft_preserves_target_distribution():
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.25, 0.25, 0.25, 0.15, 0.1]])
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(5)
    for _ in range(N):  # the draft tokens are themselves drawn from q, as a real drafter does
        draft = torch.stack([torch.multinomial(q[t], 1, generator=g)[0] for t in range(2)])
        _, toks = verify_rejection(P, draft, q, g)
        counts[toks[0]] += 1
    assert tv(counts / N, P[0]) < 0.01


def test_rejection_sampling_with_deterministic_draft_preserves_target_distribution():
    # an argmax-style proposal: q is one-hot (None); the committed token must still follow p
    for x in range(5):
        dist = committed_distribution(P[:2], torch.tensor([x]), None)
        assert tv(dist, P[0]) < 0.01, x


def test_treating_softmax_as_q_for_an_argmax_proposal_would_fail_this_test():
    # the statistical test has the power to catch the classic bug
    wrong_q = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    dist = committed_distribution(P[:2], torch.tensor([1]), wrong_q, n=20_000)
    assert tv(dist, P[0]) > 0.03


def test_second_token_follows_target_given_first_accepted():
    # with a one-hot draft of 2 tokens, the second committed token given the first was accepted
    # is distributed as the target's second-position distribution
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    n_acc = 0
    for _ in range(N):
        _, toks = verify_rejection(P, torch.tensor([0, 3]), None, g)
        if toks[0] == 0:
            counts[toks[1]] += 1
            n_acc += 1
    assert abs(n_acc / N - 0.5) < 0.01
    assert tv(counts / n_acc, P[1]) < 0.015


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_bonus():
    logits = torch.log(torch.tensor([[0.1, 0.9, 0, 0], [0.8, 0.1, 0.1, 0], [0, 0, 0, 1.0]]) + 1e-9)
    assert verify_greedy(logits, torch.tensor([1, 0])) == (2, [1, 0, 3])
    assert verify_greedy(logits, torch.tensor([1, 2])) == (1, [1, 0])
    assert verify_greedy(logits, torch.tensor([0, 0])) == (0, [1])
    assert verify_greedy(logits[:1], torch.tensor([], dtype=torch.long)) == (0, [1])


def test_top_k_and_top_p_restrict_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert p[0, 2] > 0 and p[0, 3] == 0


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"), (dict(temperature="hot"), "temperature"),
])
def test_out_of_range_sampling_parameters_are_clear_errors(tiny, bad, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny).generate([Request([1, 2, 3], SamplingParams(**bad))])


def test_same_seed_same_sample_different_seeds_differ(tiny):
    eng = Engine(tiny, max_batch=2)

    def run(seed, drafter="ngram"):
        p = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed)
        return eng.generate([Request([5, 6, 7, 8], p, drafter)])[0].tokens

    assert run(1) == run(1)
    assert run(1) != run(2)
