"""Sampled verification keeps the target's distribution, and a seed pins the output; sampling
parameters are validated."""
import math

import pytest
import torch

from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.verify import verify_greedy, verify_rejection
from angelspec.sampling import position_uniforms, probs_from_logits

N = 60_000


def committed_distribution(p, draft, index=0, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        _, toks = verify_rejection(p, draft, torch.rand(len(p), generator=g, dtype=torch.float64))
        counts[toks[index]] += 1
    return counts / n


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


P = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1],
                  [0.2, 0.2, 0.2, 0.2, 0.2]])


def test_rejection_sampling_preserves_target_distribution_whatever_is_drafted():
    # a deterministic proposal (an argmax, a lookup): the committed token must still follow p
    for x in range(5):
        dist = committed_distribution(P[:2], torch.tensor([x]))
        assert tv(dist, P[0]) < 0.01, x


def test_the_draft_never_changes_a_committed_token_only_how_many_come():
    # the target's own sample at each row comes from that row's uniform alone, so the same
    # uniforms commit the same tokens whatever was drafted: a seed repeats under any drafter
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        u = torch.rand(3, generator=g, dtype=torch.float64)
        runs = [verify_rejection(P, torch.tensor(d), u) for d in ([0, 1], [0, 3], [4, 4], [1, 1])]
        own = verify_rejection(P[:1], torch.tensor([], dtype=torch.long), u[:1])[1]
        for accepted, toks in runs:
            assert toks[0] == own[0]  # the first committed token never depends on the draft
            assert accepted == len(toks) - 1


def test_second_token_follows_target_given_first_accepted():
    # with a draft of 2 tokens, the second committed token given the first was accepted is
    # distributed as the target's second-position distribution
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    n_acc = 0
    for _ in range(N):
        _, toks = verify_rejection(P, torch.tensor([0, 3]), torch.rand(3, generator=g, dtype=torch.float64))
        if toks[0] == 0:
            counts[toks[1]] += 1
            n_acc += 1
    assert abs(n_acc / N - 0.5) < 0.01
    assert tv(counts / n_acc, P[1]) < 0.015


def test_position_uniforms_depend_on_seed_and_position_only():
    a = position_uniforms(7, 10, 5)
    assert torch.equal(a[2:], position_uniforms(7, 12, 3))  # however a span is split into steps
    assert not torch.equal(a, position_uniforms(8, 10, 5))
    u = position_uniforms(0, 0, 20_000)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert len(set(u.tolist())) == len(u)


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


def test_top_p_on_a_large_vocabulary_equals_the_full_sort_row_by_row():
    g = torch.Generator().manual_seed(3)
    # peaked rows (nucleus in the top 64), flatter ones (in the top 4096) and flat ones (all)
    logits = torch.cat([torch.randn(3, 20_000, generator=g) * s for s in (12.0, 3.0, 0.05)])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    probs = torch.softmax(logits, -1)
    sorted_p, idx = probs.sort(-1, descending=True)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= 0.9, 0.0)
    ref = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    ref = ref / ref.sum(-1, keepdim=True)
    out = probs_from_logits(logits, params)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0) and torch.equal(out > 0, ref > 0)
    assert torch.equal(out[4:5], probs_from_logits(logits[4:5], params))  # alone as in a batch
    sizes = [int((r > 0).sum()) for r in out[::3]]  # each of the three searches was needed
    assert sizes[0] <= 64 < sizes[1] <= 4096 < sizes[2]


@pytest.mark.parametrize("bad, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(temperature=-0.1), "temperature"),
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
        p = SamplingParams(max_tokens=30, temperature=1.0, seed=seed)
        return eng.generate([Request([5, 6, 7, 8], p, drafter)])[0].tokens

    assert run(1) == run(1) == run(1, "none")
    assert run(1) != run(2)
