"""Speculative decoding == batch-1 autoregressive decoding, token for token: greedy, and seeded
sampling."""
import pytest
import torch
from conftest import tiny_target

from angelspec.drafters import Drafter, Proposal
from angelspec.model import Segment
from angelspec.runtime import Engine, Request, SamplingParams


class NoisyOracle(Drafter):
    """Proposes the true greedy continuation with random corruptions: exercises every acceptance
    length from 0 to the full draft, so rollback happens at every offset."""
    name = "oracle"

    def __init__(self, reference: dict, draft_len: int, p_wrong: float = 0.3, seed: int = 0):
        super().__init__(draft_len)
        self.reference, self.p_wrong = reference, p_wrong
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, states):
        out = []
        for s in states:
            full = self.reference[tuple(s.tokens[:s.n_prompt])]
            done = len(s.tokens) - s.n_prompt
            truth = torch.tensor(full[done: done + self.draft_len], dtype=torch.long)
            wrong = torch.rand(len(truth), generator=self.g) < self.p_wrong
            noise = torch.randint(0, 97, (len(truth),), generator=self.g)
            out.append(Proposal(torch.where(wrong, noise, truth), torch.full((len(truth),), 0.7)))
        return out


class TreeOracle(NoisyOracle):
    """Three noisy copies of the true continuation merged into a token tree, in random order: the
    accepted path often runs through a later branch, whose KV entries must move into place."""
    name = "tree"

    def propose(self, states):
        out = []
        for s in states:
            full = self.reference[tuple(s.tokens[:s.n_prompt])]
            done = len(s.tokens) - s.n_prompt
            truth = full[done: done + self.draft_len]
            paths = []
            for _ in range(3):
                wrong = (torch.rand(len(truth), generator=self.g) < self.p_wrong).tolist()
                noise = torch.randint(0, 97, (len(truth),), generator=self.g).tolist()
                paths.append(([n if w else t for t, n, w in zip(truth, noise, wrong)], [0.7] * len(truth)))
            out.append(Proposal.tree(paths))
        return out


def prompts(n, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 8, 30, 1, 12][:n]
    return [torch.randint(0, vocab - 1, (L,), generator=g).tolist() for L in lengths]


def autoregressive(target, ps, max_tokens):
    eng = Engine(target, max_batch=1, max_len=256)
    return [eng.generate([Request(p, SamplingParams(max_tokens=max_tokens), "ar")])[0].tokens
            for p in ps]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_len", [1, 3, 7])
def test_greedy_speculative_output_equals_autoregressive(tiny, batch, draft_len):
    ps = prompts(6)
    ref = autoregressive(tiny, ps, 40)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, draft_len, seed=draft_len)
    eng = Engine(tiny, max_batch=batch, max_len=256, draft_len=draft_len,
                 drafters={"oracle": oracle})
    params = SamplingParams(max_tokens=40)
    for drafter in ["ngram", "oracle"]:
        eng.drafters["ngram"] = type(eng.drafter("ngram"))(draft_len=draft_len)
        results = eng.generate([Request(p, params, drafter) for p in ps])
        assert [r.tokens for r in results] == ref, drafter
        stats = [r.stats for r in results]
        assert sum(s.drafted for s in stats) > 0
        assert all(s.committed == len(r.tokens) - 1 for s, r in zip(stats, results))
    # the oracle is right 70% of the time: some steps accept several tokens, some none
    assert sum(s.accepted for s in stats) > sum(s.steps for s in stats) * 0.3


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dcut", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_seeded_sampling_equals_the_autoregressive_sample_whatever_is_drafted(tiny, batch, dcut, tree):
    """Sampling: the target's own token at each position is drawn with a uniform keyed by (seed,
    position), and a draft token is kept iff it equals it. So a seeded speculative sample is the
    seeded batch-1 autoregressive sample, token for token, under any drafter, draft length, tree
    shape, D-cut and batch (that it follows the target's distribution: test_sampling.py)."""
    from angelspec.runtime.cost import CostTable, fingerprint

    ps = prompts(6)
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=i) for i in range(6)]
    ar = Engine(tiny, max_batch=1, max_len=256)
    ref = [ar.generate([Request(p, q, "ar")])[0].tokens for p, q in zip(ps, params)]
    oracle = (TreeOracle if tree else NoisyOracle)({tuple(p): r for p, r in zip(ps, ref)}, 5, seed=2)
    cost = CostTable([1, 8, 32, 128], [0.03 + 0.002 * (n - 1) for n in (1, 8, 32, 128)], fingerprint())
    eng = Engine(tiny, max_batch=batch, max_len=256, drafters={"oracle": oracle}, dcut=dcut,
                 cost=cost if dcut else None)
    for drafter in ("oracle", "ngram:branches=3" if tree else "ngram"):
        out = eng.generate([Request(p, q, drafter) for p, q in zip(ps, params)])
        assert [r.tokens for r in out] == ref, drafter
        if drafter == "oracle":
            assert sum(r.stats.accepted for r in out) > sum(r.stats.steps for r in out) * 0.3
            # a step that accepted any draft token accepted its first (a prefix is accepted)
            assert all(r.stats.first <= r.stats.tried <= r.stats.steps for r in out)
            assert 0 < sum(r.stats.first for r in out) <= sum(r.stats.accepted for r in out)
    assert len({tuple(r) for r in ref}) == len(ref)


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_with_a_datastore_is_lossless(tiny, batch):
    """Datastore drafts (here from the true outputs of half the prompts, and random sequences)
    are verified like any others: the output stays the autoregressive one."""
    from angelspec.drafters import Datastore, NgramDrafter

    ps = prompts(6)
    ref = autoregressive(tiny, ps, 40)
    store = Datastore.build([p + r for p, r in zip(ps[:3], ref[:3])] + prompts(6, seed=1))
    eng = Engine(tiny, max_batch=batch, max_len=256,
                 drafters={"ngram": NgramDrafter(draft_len=4, datastore=store)})
    results = eng.generate([Request(p, SamplingParams(max_tokens=40), "ngram") for p in ps])
    assert [r.tokens for r in results] == ref
    assert sum(r.stats.accepted for r in results[:3]) > sum(r.stats.accepted for r in results[3:])


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("dcut", [False, True])
def test_token_trees_are_lossless(tiny, batch, dcut):
    """Trees: every node attends to its own ancestors only, and the deepest path the target
    follows is committed with its KV moved into place: greedy output is batch-1 `ar`'s for the
    oracle's trees and ngram's (seeded sampling: the test above)."""
    from angelspec.runtime.cost import CostTable, fingerprint

    ps = prompts(6)
    ref = autoregressive(tiny, ps, 40)
    cost = CostTable([1, 8, 32, 128], [0.03 + 0.002 * (n - 1) for n in (1, 8, 32, 128)], fingerprint())
    oracle = TreeOracle({tuple(p): r for p, r in zip(ps, ref)}, 5, p_wrong=0.4, seed=batch)
    eng = Engine(tiny, max_batch=batch, max_len=256, drafters={"tree": oracle}, dcut=dcut,
                 cost=cost if dcut else None)
    for drafter in ("tree", "ngram:branches=3"):
        out = eng.generate([Request(p, SamplingParams(max_tokens=40), drafter) for p in ps])
        assert [r.tokens for r in out] == ref, drafter
        if drafter == "tree":
            assert sum(r.stats.accepted for r in out) > sum(r.stats.steps for r in out) * 0.5


def test_a_sliding_window_target_verifies_the_trees_chains(tmp_path):
    """The tree kernel needs full attention: with a sliding window, each tree is cut to its
    stored chain, and the output is still batch-1 `ar`'s."""
    target = tiny_target(tmp_path, arch="mistral", sliding_window=8)
    ps = prompts(4)
    ref = autoregressive(target, ps, 30)
    oracle = TreeOracle({tuple(p): r for p, r in zip(ps, ref)}, 5, p_wrong=0.4)
    eng = Engine(target, max_batch=4, max_len=256, drafters={"tree": oracle})
    out = eng.generate([Request(p, SamplingParams(max_tokens=30), "tree") for p in ps])
    assert [r.tokens for r in out] == ref
    assert sum(r.stats.accepted for r in out) > 0


def test_a_tree_path_through_later_branches_leaves_the_cache_as_prefill_does(tiny):
    """After steps that accepted paths through second and third branches, the cache holds what a
    fresh prefill of the committed tokens computes."""
    ps = prompts(3)
    ref = autoregressive(tiny, ps, 30)
    oracle = TreeOracle({tuple(p): r for p, r in zip(ps, ref)}, 5, p_wrong=0.5)
    eng = Engine(tiny, max_batch=3, max_len=128, drafters={"tree": oracle})
    moved = []
    move = eng.cache.move
    eng.cache.move = lambda slot, src, dst: (moved.append(slot), move(slot, src, dst))
    committed = {i: list(p) for i, p in enumerate(ps)}
    for ev in eng.stream([Request(p, SamplingParams(max_tokens=30), "tree") for p in ps]):
        committed[ev.index] += ev.tokens
        if ev.finish_reason or not ev.tokens:
            continue
        toks = committed[ev.index][:-1]
        fresh = tiny.model.new_cache(1, 128)
        tiny.model.forward(torch.tensor(toks), tiny.model.batch([Segment(0, 0, len(toks))]), fresh)
        for layer in range(tiny.config.num_layers):
            assert torch.allclose(eng.cache.keys(layer)[ev.index, ..., :len(toks)],
                                  fresh.keys(layer)[0, ..., :len(toks)], atol=1e-5)
            assert torch.allclose(eng.cache.v[layer][ev.index, :, :len(toks)],
                                  fresh.v[layer][0, :, :len(toks)], atol=1e-5)
    assert len(moved) > 3  # some accepted paths ran through a later branch


def test_kv_rollback_leaves_cache_equal_to_fresh_prefill(tiny):
    ps = prompts(3)
    ref = autoregressive(tiny, ps, 30)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 5, p_wrong=0.5)
    eng = Engine(tiny, max_batch=3, max_len=128, drafters={"oracle": oracle})
    stream = eng.stream([Request(p, SamplingParams(max_tokens=30), "oracle") for p in ps])
    committed = {i: list(p) for i, p in enumerate(ps)}
    checked = 0
    for ev in stream:
        committed[ev.index] += ev.tokens
        if ev.finish_reason or not ev.tokens:
            continue
        # mid-generation: slot holds every committed token except the newest
        toks = committed[ev.index][:-1]
        slot = ev.index  # slots are handed out in order while all requests fit
        fresh = tiny.model.new_cache(1, 128)
        tiny.model.forward(torch.tensor(toks), tiny.model.batch([Segment(0, 0, len(toks))]), fresh)
        n = len(toks)
        for layer in range(tiny.config.num_layers):
            assert torch.allclose(eng.cache.keys(layer)[slot, ..., :n], fresh.keys(layer)[0, ..., :n],
                                  atol=1e-5)
            assert torch.allclose(eng.cache.v[layer][slot, :, :n], fresh.v[layer][0, :, :n], atol=1e-5)
        checked += 1
    assert checked > 10


def test_requests_finish_at_different_steps_and_free_their_slots(tiny):
    ps = prompts(6)
    ref = autoregressive(tiny, ps, 25)
    eng = Engine(tiny, max_batch=2, max_len=256)  # 6 requests through 2 slots
    lengths = [5, 25, 1, 12, 25, 3]
    reqs = [Request(p, SamplingParams(max_tokens=n), "ngram") for p, n in zip(ps, lengths)]
    results = eng.generate(reqs)
    assert [r.tokens for r in results] == [r[:n] for r, n in zip(ref, lengths)]
    eos = tiny.config.eos_token_ids[0]
    assert all(r.finish_reason == ("stop" if r.tokens[-1] == eos else "length") for r in results)


def test_stop_tokens_end_a_request_and_are_included(tiny):
    p = prompts(1)[0]
    ref = autoregressive(tiny, [p], 30)[0]
    stop = ref[10]
    first = ref.index(stop)
    res = Engine(tiny, max_batch=1).generate(
        [Request(p, SamplingParams(max_tokens=30, stop_token_ids=[stop]), "ngram")])[0]
    assert res.tokens == ref[: first + 1] and res.finish_reason == "stop"


def test_greedy_lossless_on_default_target(default_target):
    """The real model: ngram drafts, batch 1 and 3, token-identical to batch-1 ar."""
    texts = ["Write a Python function that adds two numbers.", "What is 12 times 7?",
             "Name three colours of the rainbow."]
    ps = [default_target.encode_chat(t) for t in texts]
    ref = autoregressive(default_target, ps, 40)
    for batch in (1, 3):
        eng = Engine(default_target, max_batch=batch, max_len=256, draft_len=5)
        out = eng.generate([Request(p, SamplingParams(max_tokens=40), "ngram") for p in ps])
        assert [r.tokens for r in out] == ref


def test_packed_prefill_of_short_and_long_prompts_stays_exact(tiny):
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (150, 5, 140, 60, 70)]
    ref = autoregressive(tiny, ps, 20)
    eng = Engine(tiny, max_batch=5, max_len=256)
    out = eng.generate([Request(p, SamplingParams(max_tokens=20), "ngram") for p in ps])
    assert [r.tokens for r in out] == ref
