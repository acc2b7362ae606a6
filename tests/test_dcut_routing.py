"""D-cut and `auto` routing inside the engine: both only change what is drafted and verified,
never the output (greedy == batch-1 autoregressive, token for token)."""
import time

import pytest
import torch
from test_lossless import NoisyOracle, autoregressive, prompts

from angelspec.drafters import Drafter, Proposal
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.calibration import Calibration
from angelspec.runtime.cost import CostTable, fingerprint, profile
from angelspec.runtime.gate import DraftGate
from angelspec.runtime.router import (
    DETACH_AFTER,
    POOLED,
    DomainClassifier,
    DrafterEvidence,
    Router,
    RouteState,
    contenders,
)


def table(per_token: float) -> CostTable:
    n = [1, 8, 32, 128]
    return CostTable(n, [0.03 + per_token * (x - 1) for x in n], fingerprint())


class Random(Drafter):
    """Confident and wrong: what the router must learn to leave."""
    name = "random"

    def __init__(self, draft_len=4):
        super().__init__(draft_len)
        self.g = torch.Generator().manual_seed(3)

    def propose(self, states):
        return [Proposal(torch.randint(0, 97, (self.draft_len,), generator=self.g),
                         torch.full((self.draft_len,), 0.9)) for _ in states]


@pytest.mark.parametrize("per_token", [0.0, 0.002, 0.05])
@pytest.mark.parametrize("batch", [1, 4])
def test_dcut_is_lossless_and_cuts_when_tokens_are_dear(tiny, per_token, batch):
    ps = prompts(6)
    ref = autoregressive(tiny, ps, 30)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 6, seed=1)
    eng = Engine(tiny, max_batch=batch, max_len=256, drafters={"oracle": oracle}, dcut=True,
                 cost=table(per_token))
    out = eng.generate([Request(p, SamplingParams(max_tokens=30), "oracle") for p in ps])
    assert [r.tokens for r in out] == ref
    # the real forwards calibrate the table, per number of requests in a forward
    assert batch in eng.hooks.fwd_offset and set(eng.hooks.fwd_offset) <= set(range(1, batch + 1))
    if per_token == 0.0:  # verifying is free: nothing is cut
        assert eng.stats.dcut_kept == eng.stats.dcut_drafted
    if per_token == 0.05:  # a token costs more than a 0.7-confidence draft brings
        assert eng.stats.dcut_kept < 0.5 * eng.stats.dcut_drafted


def test_dcut_prices_a_verified_token_at_its_requests_context(tiny):
    """Every verified token attends to all of its request's keys: the profile's per-key cost
    (CostTable.shift) makes a token dearer after many keys. The same drafts are verified after a
    short prompt and mostly cut after a long one; the output is batch-1 ar's either way."""
    t = CostTable([1, 8, 32, 128], [0.03 + 0.0005 * (n - 1) for n in (1, 8, 32, 128)], fingerprint(),
                  context=16, per_key=2e-4)
    assert t.shift(16) == 0.0 and t.shift(216) == pytest.approx(0.04) and t.shift(6) < 0
    back = CostTable.from_json(t.to_json())
    assert (back.context, back.per_key) == (16, pytest.approx(2e-4))
    short = prompts(3)
    long = [(p * (200 // len(p) + 1))[:200] for p in short]
    kept = []
    for ps in (short, long):
        ref = autoregressive(tiny, ps, 30)
        oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 6, seed=1)
        eng = Engine(tiny, max_batch=1, max_len=256, drafters={"oracle": oracle}, dcut=True, cost=t)
        out = eng.generate([Request(p, SamplingParams(max_tokens=30), "oracle") for p in ps])
        assert [r.tokens for r in out] == ref
        kept.append(eng.stats.dcut_kept / eng.stats.dcut_drafted)
    assert kept[0] > 0.8 and kept[1] < 0.5 * kept[0]


def test_gate_sits_out_a_drafter_that_costs_more_than_it_brings_and_probes_it():
    gate = DraftGate(lambda n: 0.03 + 0.001 * n)
    gate.observe("slow", 4, seconds=0.4, kept=8, accepted=2)  # 0.1 s per request for 0.5 tokens
    gate.observe("fast", 2, seconds=0.0002, kept=4, accepted=3)  # nearly free, 1.5 tokens
    names = ["slow"] * 3 + ["fast"]
    assert gate.plan(1, names, 0.01) == ["none"] * 3 + ["fast"]
    assert gate.plan(2, names, 0.01) == ["slow", "none", "none", "fast"]  # one request probes
    gate.observe("slow", 1, seconds=0.1, kept=2, accepted=0)
    assert gate.plan(3, names, 0.01) == ["none"] * 3 + ["fast"]  # still bad: out for 2 steps now
    assert gate.plan(4, names, 0.01) == ["none"] * 3 + ["fast"]
    assert gate.plan(5, names, 0.01)[0] == "slow"
    for _ in range(10):  # it got cheap and good (the estimates are running averages)
        gate.observe("slow", 1, seconds=0.0001, kept=2, accepted=2)
    assert gate.plan(6, names, 0.01) == names


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gate_keeps_a_drafter_that_pays_through_runs_of_misses(seed):
    """One request: each step accepts a whole draft token or none. At 0.5 accepted a step, where
    0.24 pays (0.7 ms drafting + 0.4 ms a verified token against a 4.5 ms step), the gate must
    not bench it after a few misses in a row (a short running average sat such a drafter out on
    20-40% of the steps); at 0.1 accepted it sits out most steps."""
    import random
    for p, lo, hi in ((0.5, 380, 400), (0.1, 0, 100)):
        gate, rng, drafted = DraftGate(lambda n: 0.004 + 0.0004 * (n - 1)), random.Random(seed), 0
        for step in range(1, 401):
            if gate.plan(step, ["mtp"], 0.0005) == ["mtp"]:
                drafted += 1
                gate.observe("mtp", 1, seconds=0.0007, kept=1, accepted=int(rng.random() < p))
        assert lo <= drafted <= hi, (p, drafted)


def test_gate_times_steps_not_a_requests_catch_up_on_its_prompt():
    """A request's first proposal (the drafter catching up on its whole prompt) and a probe's
    (catching up on every step it sat out) do not make the drafter look dear: the first is not
    timed (a drafter whose time is unknown drafts), a probe may only lower its time."""
    gate = DraftGate(lambda n: 0.004 + 0.0004 * (n - 1))
    gate.observe("mtp", 1, seconds=0.009, kept=1, accepted=1, timed=False)  # 9 ms: the prompt
    assert gate.est["mtp"][0] is None and gate.plan(1, ["mtp"], 0.0005) == ["mtp"]
    idle = DraftGate(lambda n: 0.004 + 0.0004 * (n - 1))  # judged as if free: by what it brings
    idle.observe("ngram", 16, seconds=0.001, kept=0, accepted=0, timed=False)
    assert idle.plan(1, ["ngram"] * 16, 0.0005) == ["none"] * 16
    gate.observe("mtp", 1, seconds=0.0007, kept=1, accepted=1)
    assert gate.est["mtp"][0] == pytest.approx(0.0007)
    for step in range(2, 40):  # it stops paying: benched, then probes
        if gate.plan(step, ["mtp"], 0.0005) == ["mtp"]:
            gate.observe("mtp", 1, seconds=0.003 if "mtp" in gate.probing else 0.0007, kept=1, accepted=0)
    assert gate.est["mtp"][0] == pytest.approx(0.0007) and gate.skipped > 20


def test_gate_never_benches_a_drafter_that_costs_next_to_nothing():
    """Drafting at most CHEAP of the step: nothing to save by skipping it; D-cut alone trims
    what it proposes, even after a run of rejected drafts."""
    gate = DraftGate(lambda n: 0.03 + 0.001 * n)
    for _ in range(10):
        # 0.9 ms for both, 2.6% of the step (bf16 steps made ngram this dear): nothing accepted
        gate.observe("ngram", 2, seconds=0.0009, kept=6, accepted=0)
        gate.observe("slow", 2, seconds=0.02, kept=6, accepted=0)  # 10 ms, nothing accepted
    names = ["ngram", "ngram", "slow", "slow"]
    assert gate.plan(1, names, 0.001) == ["ngram", "ngram", "none", "none"]


def test_gate_sits_out_a_cheap_drafter_whose_tokens_dcut_never_keeps():
    """None of its drafts verified (16 requests on a 2-core CPU, where a verified token costs
    nearly what it can bring): its drafting is all it adds, so it sits out and probes like any
    other drafter, and drafts again once D-cut keeps a probe's tokens."""
    gate = DraftGate(lambda n: 0.03 + 0.001 * n)
    for _ in range(10):
        gate.observe("ngram", 16, seconds=0.0008, kept=0, accepted=0)
    names = ["ngram"] * 16
    assert gate.plan(1, names, 0.001) == ["none"] * 16
    assert gate.plan(2, names, 0.001) == ["ngram"] + ["none"] * 15  # one request probes
    gate.observe("ngram", 1, seconds=0.00005, kept=3, accepted=2)
    assert gate.plan(3, names, 0.001) == names


def test_calibration_scales_confidences_to_the_acceptance_dcut_saw():
    """Per drafter and depth, confidence x (accepted + prior) / (confidence + prior), over the
    verified tokens whose parent was accepted; at most 1; a depth never judged keeps factor 1."""
    cal = Calibration()
    chain = Proposal(torch.tensor([5, 6, 7]), torch.tensor([0.9, 0.9, 0.9]))
    assert cal.apply("ngram", chain) == chain.confidence.tolist()  # nothing seen yet
    for _ in range(200):  # the first token accepted half the time, the second never
        cal.observe("ngram", chain, [0])
        cal.observe("ngram", chain, [])
    c = cal.apply("ngram", chain)
    assert abs(c[0] - 0.5) < 0.05 and c[1] < 0.05  # the 2nd judged only after the 1st passed
    assert c[2] == pytest.approx(0.9)  # never judged: its parent was never accepted
    assert cal.apply("mtp", chain) == chain.confidence.tolist()  # per drafter
    shy = Proposal(torch.tensor([5]), torch.tensor([0.5]))
    for _ in range(300):  # an under-confident drafter is read higher, at most 1
        cal.observe("shy", shy, [0])
    assert cal.apply("shy", shy)[0] > 0.95
    assert cal.apply("shy", Proposal(torch.tensor([5]), torch.tensor([0.9])))[0] == 1.0
    tree = Proposal(torch.tensor([5, 6, 8]), torch.tensor([0.9, 0.9, 0.5]), torch.tensor([-1, 0, -1]))
    assert tree.depths() == [1, 2, 1]
    c = cal.apply("ngram", tree)  # by depth: the sibling reads depth 1's factor
    assert c[2] == pytest.approx(0.5 * c[0] / 0.9) and c[1] < 0.05


def test_a_request_on_its_last_token_does_not_draft(tiny):
    """Its draft could never be used (the step's own token ends it): no drafting time is spent on
    it, and the gate is not told that its drafter brought nothing."""
    class Wrong(Drafter):  # always wrong, so every step commits one token: steps at 1..5 tokens
        name = "wrong"

        def __init__(self, reference):
            super().__init__(4)
            self.reference, self.asked = reference, []

        def propose(self, states):
            out = []
            for s in states:
                done = len(s.tokens) - s.n_prompt
                self.asked.append(done)
                bad = (self.reference[tuple(s.tokens[:s.n_prompt])][done] + 1) % 97
                out.append(Proposal(torch.full((4,), bad), torch.full((4,), 0.9)))
            return out

    ps = prompts(3)
    ref = autoregressive(tiny, ps, 6)
    oracle = Wrong({tuple(p): r for p, r in zip(ps, ref)})
    eng = Engine(tiny, max_batch=3, max_len=256, drafters={"wrong": oracle}, dcut=False)
    out = eng.generate([Request(p, SamplingParams(max_tokens=6), "wrong") for p in ps])
    assert [r.tokens for r in out] == ref
    assert sorted(set(oracle.asked)) == [1, 2, 3, 4]  # at 5 of 6 tokens, only the step's own is left


def test_a_slow_drafter_sits_out_under_dcut_and_output_stays_lossless(tiny):
    class Slow(NoisyOracle):
        def propose(self, states):
            time.sleep(0.02 * len(states))
            return super().propose(states)

    ps = prompts(4)
    ref = autoregressive(tiny, ps, 40)
    slow = Slow({tuple(p): r for p, r in zip(ps, ref)}, 4, p_wrong=0.5)
    eng = Engine(tiny, max_batch=4, max_len=256, drafters={"oracle": slow}, dcut=True,
                 cost=table(0.0001))
    out = eng.generate([Request(p, SamplingParams(max_tokens=40), "oracle") for p in ps])
    assert [r.tokens for r in out] == ref
    assert eng.gate.skipped > 0


def test_the_gate_prices_a_drafter_by_its_handling_too_and_output_stays_lossless(tiny):
    """Drafting cost is more than the proposals: D-cut's cut, calibrating on the verdicts and
    feeding the drafter are timed into its drafting seconds, so a drafter that is quick to
    propose but whose drafts are slow to handle sits out once it does not pay."""
    class SlowToHandle(Calibration):
        def observe(self, name, proposal, path):
            time.sleep(0.01)
            return super().observe(name, proposal, path)

    ps = prompts(4)
    ref = autoregressive(tiny, ps, 40)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 4, p_wrong=0.5)
    eng = Engine(tiny, max_batch=4, max_len=256, drafters={"oracle": oracle}, dcut=True,
                 cost=table(0.0001))
    eng.calibration = SlowToHandle()
    out = eng.generate([Request(p, SamplingParams(max_tokens=40), "oracle") for p in ps])
    assert [r.tokens for r in out] == ref
    assert eng.gate.est["oracle"][0] >= 0.01  # seconds a request: its handling counted
    assert eng.gate.skipped > 0


def test_ngram_confidence_is_its_acceptance_rate_at_each_depth_and_match_length():
    """Token k's confidence is the request's rate of accepting depth k once depths 1..k-1 were
    accepted, scored against the tokens committed after each draft, for drafts from an n-gram
    match of the same length n, starting from the rate over all matches."""
    from types import SimpleNamespace

    from angelspec.drafters import NgramDrafter

    ngram = NgramDrafter(draft_len=3)
    view = SimpleNamespace(tokens=[1, 2, 3, 4, 5, 1, 2, 3], drafter_state={})
    p = ngram.propose([view])[0]  # a 3-gram match
    assert p.tokens.tolist() == [4, 5, 1] and p.confidence.tolist() == [0.5, 0.5, 0.5]
    view.tokens += [4, 5, 1, 2]  # all three accepted, then the bonus token
    p = ngram.propose([view])[0]  # a 3-gram match again: its own 1/1 on top of all (2/3, worth 2)
    assert p.tokens.tolist() == [3, 4, 5]
    assert p.confidence.tolist() == pytest.approx([(1 + 2 * 2 / 3) / 3] * 3)
    view.tokens += [1]  # the first token (3) was rejected: depths 2 and 3 were not reached
    p = ngram.propose([view])[0]  # a 1-gram match, never seen: the rates over all matches
    assert p.tokens.tolist() == [2, 1]
    assert p.confidence.tolist() == pytest.approx([2 / 4, 2 / 3])


def test_profiled_cost_table_grows_with_tokens(tiny):
    t = profile(tiny.model, max_tokens=16, reps=2)
    assert t.n[0] == 1 and t.n[-1] == 16 and all(s > 0 for s in t.seconds)
    # a curve per number of requests B, over 1..8 tokens per request (within max_tokens)
    assert set(t.batches) == {1, 2, 4, 8, 16}
    assert t.batches[4][0] == [4, 8, 12, 16] and t.batches[16][0] == [16]
    back = CostTable.from_json(t.to_json())
    assert back.n == t.n and back.batches.keys() == t.batches.keys()
    # one request's tokens timed after 4x the context too: the cost of a key (never negative)
    assert t.context > 0 and t.per_key >= 0 and back.per_key == pytest.approx(t.per_key, abs=1e-12)
    assert back.batches[2][0] == t.batches[2][0] == [2, 4, 6, 8, 12, 16]


def test_the_profile_times_each_forward_after_one_of_its_own_shape(tiny, monkeypatch):
    """Decoding steps follow each other; a forward right after a much larger one ran slower, so
    each timed forward comes second of a pair of the same shape (after the context's prefill)."""
    calls, forward = [], tiny.model.forward
    monkeypatch.setattr(tiny.model, "forward", lambda x, batch, cache, **kw: (
        calls.append((len(x), batch.slots.tolist(), kw.get("logit_rows") is None)),
        forward(x, batch, cache, **kw))[1])
    profile(tiny.model, max_tokens=8, reps=2)
    steps = [c for c in calls if c[2]]  # not the prefills (which ask for one logit row)
    assert len(steps) % 2 == 0 and len(steps) > 10
    assert all(a == b for a, b in zip(steps[::2], steps[1::2]))
    assert len({tuple(c[1]) for c in steps}) > 3  # shapes alternate between the pairs


def test_dcut_reads_the_curve_of_its_steps_number_of_requests():
    t = CostTable([1, 4, 16], [0.01, 0.02, 0.08], fingerprint(),
                  {1: ([1, 2, 4], [0.010, 0.011, 0.012]), 16: ([16, 32], [0.05, 0.06])})
    assert t.tensors()[0].tolist() == [1, 4, 16]
    assert t.tensors(1)[0].tolist() == [1, 2, 4] and t.tensors(2)[0].tolist() == [1, 2, 4]
    assert t.tensors(12)[1].tolist() == [0.05, 0.06]  # the measured B nearest in ratio
    assert CostTable([1], [0.01], fingerprint()).tensors(16)[0].tolist() == [1]  # main curve


def test_cost_curves_never_fall():
    """A forward over more tokens is never cheaper: a dip in a profile (noise) stays level, so
    no draft token looks free (a start-up profile measured C(2) 0.3 ms below C(1))."""
    t = CostTable([1, 2, 4], [0.0040, 0.0037, 0.0045], fingerprint(), {1: ([1, 2, 3], [0.004, 0.0036, 0.0041])})
    assert t.tensors()[1].tolist() == [0.0040, 0.0040, 0.0045]
    assert t.tensors(1)[1].tolist() == [0.004, 0.004, 0.0041]
    assert CostTable.from_json(t.to_json()).tensors(1)[1].tolist() == pytest.approx([0.004, 0.004, 0.0041])


def test_router_switches_away_from_a_bad_drafter_losslessly(tiny):
    ps = prompts(4)
    ref = autoregressive(tiny, ps, 60)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 4, p_wrong=0.1)
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    # shadow drafts always affordable: when the switch comes must not hang on how fast this
    # machine runs the oracle against the tiny model's steps (the budget's own test is apart)
    router = Router(clf, routes={"chat": "random", "code": "random", "math": "random"},
                    candidates=("random", "oracle"), shadow_every=2, min_obs=2, budget=1.0)
    eng = Engine(tiny, max_batch=2, max_len=256, router=router,
                 drafters={"oracle": oracle, "random": Random()})
    out = eng.generate([Request(p, SamplingParams(max_tokens=60), "auto") for p in ps])
    assert [r.tokens for r in out] == ref
    long = [r for r in out if len(r.tokens) >= 40]  # (some prompts reach eos early)
    assert len(long) >= 2
    assert all(r.switches[0][1:] == ("random", "oracle") and r.drafter == "oracle" for r in long)


def test_shadow_drafts_wait_until_the_budget_affords_them():
    """Shadow drafting may cost at most `budget` of the steps' time: a due shadow draft whose
    measured time is more than the credit earned so far is asked for again at the next step, and
    taken once the steps have earned it; the credit is capped at one second."""
    router = Router(None, candidates=("ngram", "mtp"), shadow_every=1, budget=0.1)
    router.note_draft_time("ngram", 0.0001)
    router.note_draft_time("mtp", 0.002)  # 2 ms a shadow draft
    route = RouteState("chat", ("ngram", "mtp"))
    asked = []
    for _ in range(8):
        router.add_step(0.0055, 1, 1)  # each step earns 0.55 ms
        asked.append(router.shadow_due(route, "ngram", lambda n: True))
    assert asked == [None, None, None, "mtp", None, None, None, "mtp"]
    for _ in range(20):
        router.add_step(1.0, 1, 1)
    assert router.credit == 1.0


def test_finished_requests_move_a_domains_route(tiny):
    """Two requests of a domain in a row that switched to the same drafter move the domain's
    route: the third starts on it and has nothing to switch."""
    ps = prompts(4)
    ref = autoregressive(tiny, ps, 60)
    p, r = max(zip(ps, ref), key=lambda x: len(x[1]))
    oracle = NoisyOracle({tuple(p): r}, 4, p_wrong=0.1)
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    router = Router(clf, routes={"chat": "random", "code": "random", "math": "random"},
                    candidates=("random", "oracle"), shadow_every=2, min_obs=2)
    eng = Engine(tiny, max_batch=1, max_len=256, router=router,
                 drafters={"oracle": oracle, "random": Random()})
    runs = [eng.generate([Request(p, SamplingParams(max_tokens=60), "auto")])[0] for _ in range(3)]
    assert all(x.tokens == r for x in runs)
    assert [x.switches[0][1:] for x in runs[:2]] == [("random", "oracle")] * 2
    assert router.routes[clf.predict(p)] == "oracle"
    assert runs[2].switches == [] and runs[2].drafter == "oracle"


def test_only_contenders_follow_a_routed_request(tiny, monkeypatch):
    """A drafter the build measured far slower for a domain never drafts nor catches up there."""
    assert contenders({"chat": {"mtp": 34.0, "ngram": 37.0, "dfly": 30.0}}) == {"chat": ["mtp", "ngram"]}
    # ngram, a lookup, always contends: a route measured on a few prompts can be wrong, and only
    # a drafter that shadow-drafts can correct it (engine of 2026-12-01: chat measured mtp 61.3,
    # ngram 48.4 tokens/s on 3 prompts, while ngram served chat at twice mtp's speed)
    assert contenders({"chat": {"mtp": 61.3, "ngram": 48.4, "dfly": 47.1}}) == {"chat": ["mtp", "ngram"]}
    ps = prompts(3)
    ref = autoregressive(tiny, ps, 40)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 4)
    monkeypatch.setattr(oracle, "propose", lambda states: pytest.fail("oracle is no contender"))
    monkeypatch.setattr(oracle, "on_commit", lambda *a: pytest.fail("oracle is no contender"))
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    only = {"chat": ["random"], "code": ["random"], "math": ["random"]}
    router = Router(clf, routes={d: "random" for d in only}, candidates=("random", "oracle"),
                    shadow_every=2, min_obs=2, contenders=only)
    eng = Engine(tiny, max_batch=2, max_len=256, router=router,
                 drafters={"oracle": oracle, "random": Random()})
    out = eng.generate([Request(p, SamplingParams(max_tokens=40), "auto") for p in ps])
    assert [r.tokens for r in out] == ref and all(not r.switches for r in out)


def test_no_shadow_drafts_for_a_request_whose_drafter_sits_out(tiny):
    """Where the gate sits a routed request's drafter out (it does not pay at this load), its
    contenders do not shadow-draft for it either: they would not pay there, and at 16 requests
    in flight on a 2-core CPU those shadow drafts were what `auto` cost over `ngram`."""
    class Slow(Random):
        def propose(self, states):
            time.sleep(0.02 * len(states))
            asked.append(len(states))
            return super().propose(states)

    class Spy(NoisyOracle):
        def propose(self, states):
            shadowed.append(len(states))
            return super().propose(states)

    asked, shadowed = [], []
    ps = prompts(2)
    ref = autoregressive(tiny, ps, 40)
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    router = Router(clf, routes={d: "slow" for d in ("chat", "code", "math")}, candidates=("slow", "spy"),
                    shadow_every=1, min_obs=1000, budget=1.0)  # shadows every step, never a switch
    eng = Engine(tiny, max_batch=2, max_len=256, router=router, dcut=True, cost=table(0.0001),
                 drafters={"slow": Slow(), "spy": Spy({tuple(p): r for p, r in zip(ps, ref)}, 4)})
    out = eng.generate([Request(p, SamplingParams(max_tokens=40), "auto") for p in ps])
    assert [r.tokens for r in out] == ref
    assert eng.gate.skipped > 0 and 0 < sum(shadowed) <= sum(asked) < eng.stats.steps


def test_a_request_whose_drafter_keeps_sitting_out_stops_feeding_its_contenders(tiny):
    """After DETACH_AFTER steps in a row without its own drafter, a routed request's costly
    contenders stop following it (no more hidden rows handed over, their evidence dropped, so
    it never switches to one that missed tokens); ngram, a lookup, keeps following. Lossless."""
    route = RouteState("chat", ("ngram", "mtp", "dfly"), evidence={"mtp": DrafterEvidence()},
                       pending=[("mtp", 3, None), ("ngram", 3, None)])
    router = Router(None)
    assert [router.sat_out(route, "ngram", True) for _ in range(DETACH_AFTER - 1)] == [[]] * (DETACH_AFTER - 1)
    assert router.sat_out(route, "ngram", False) == [] and route.idle == 0  # a step it drafted
    for _ in range(DETACH_AFTER - 1):
        router.sat_out(route, "ngram", True)
    assert router.sat_out(route, "ngram", True) == ["mtp", "dfly"]
    assert route.candidates == ("ngram",) and route.evidence == {} and route.pending == [("ngram", 3, None)]

    class Slow(Random):
        def propose(self, states):
            time.sleep(0.02 * len(states))
            return super().propose(states)

    class Spy(NoisyOracle):
        def on_commit(self, state, hidden):
            fed.append(len(state.tokens))

    fed = []
    ps = prompts(2)
    ref = autoregressive(tiny, ps, 60)
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    router = Router(clf, routes={d: "slow" for d in ("chat", "code", "math")}, candidates=("slow", "spy"),
                    shadow_every=1, min_obs=1000)
    eng = Engine(tiny, max_batch=2, max_len=256, router=router, dcut=True, cost=table(0.0001),
                 drafters={"slow": Slow(), "spy": Spy({tuple(p): r for p, r in zip(ps, ref)}, 4)})
    out = eng.generate([Request(p, SamplingParams(max_tokens=60), "auto") for p in ps])
    assert [r.tokens for r in out] == ref
    assert eng.gate.skipped >= DETACH_AFTER and 2 <= len(fed) < sum(r.stats.steps for r in out)


def test_auto_needs_a_router(tiny):
    with pytest.raises(ValueError, match="auto"):
        Engine(tiny, max_batch=1).generate([Request([1, 2], SamplingParams(), "auto")])


def test_domain_classifier_learns_token_statistics():
    g = torch.Generator().manual_seed(0)
    make = lambda lo, hi: torch.randint(lo, hi, (12,), generator=g).tolist()  # noqa: E731
    xs = [make(0, 40) for _ in range(20)] + [make(30, 70) for _ in range(20)] + [make(60, 97) for _ in range(20)]
    ys = ["chat"] * 20 + ["code"] * 20 + ["math"] * 20
    clf = DomainClassifier.fit(xs, ys, 97)
    test = [make(0, 30), make(40, 60), make(70, 97)]
    assert [clf.predict(x) for x in test] == ["chat", "code", "math"]
    assert clf.accuracy(xs, ys) > 0.9


def test_router_prices_drafting_time_at_the_engines_load():
    """One request's slow drafter delays the whole batch: worth switching to at batch 1, not
    under load, where it is not even shadow-drafted any more."""
    cost = lambda n: 0.025 + 0.002 * (n - 1)  # noqa: E731
    for rate, rows, switch in ((57.0, 4, True), (200.0, 40, False)):
        router = Router(None, candidates=("ngram", "mtp"), min_obs=1, margin=0.1)
        router.draft_seconds = {"ngram": 0.0001, "mtp": 0.012}
        for _ in range(50):
            router.add_step(rows / rate, rows, rows)  # rows tokens per step: rate tokens/s
        route = RouteState("chat", ("ngram", "mtp"))
        route.evidence["mtp"] = DrafterEvidence(2, accepted=4, drafted=6)  # 2 of 3 accepted
        route.evidence["ngram"] = DrafterEvidence(1, accepted=1, drafted=3)
        assert router.could_win(route, "mtp", "ngram", cost) == switch
        assert router.observe(route, "ngram", 1, 3, [], cost) == ("mtp" if switch else "ngram")


def test_a_new_request_is_not_shadow_drafted_by_a_drafter_that_cannot_win_at_this_load():
    """A request that has no evidence of a contender yet is judged by the contender's longest
    draft (a proposal near a request's end is clipped), its time and what its shadow drafts for
    the domain's earlier requests accepted: under load it is not asked (each first shadow draft
    of a trained drafter catches it up on the whole context), at batch 1 it is unless the
    domain's evidence says it cannot win. A drafter whose time is not known yet shadow-drafts for
    one request at a time until it is."""
    cost = lambda n: 0.004 + 0.0008 * (n - 1)  # noqa: E731
    for rate, rows, asked in ((300.0, 2, True), (600.0, 16, False)):
        router = Router(None, candidates=("ngram", "mtp"), shadow_every=1, budget=1.0)
        for _ in range(50):
            router.add_step(rows / rate, rows, rows)
        router.note_draft_time("ngram", 0.0001)
        router.note_draft_time("mtp", 0.004)
        router.record(RouteState("chat"), "mtp", 0, Proposal(torch.tensor([1]), torch.ones(1)))  # clipped
        router.record(RouteState("chat"), "mtp", 0, Proposal(torch.tensor([1, 2, 3]), torch.ones(3)))
        route = RouteState("chat", ("ngram", "mtp"))
        assert (router.shadow_due(route, "ngram", lambda n: True, cost) == "mtp") == asked
    # the domain's earlier requests scored its shadow drafts: at batch 1 a new request is asked
    # while they were often accepted, or were few, not once 16 accepted 0.3 of 3 tokens each
    for accepted, shadows, asked in ((2.5, 16, True), (0.3, 2, True), (0.3, 16, False)):
        router = Router(None, candidates=("ngram", "mtp"), shadow_every=1, budget=1.0)
        for _ in range(50):
            router.add_step(2 / 300.0, 2, 2)
        router.note_draft_time("ngram", 0.0001)
        router.note_draft_time("mtp", 0.004)
        router.record(RouteState("chat"), "mtp", 0, Proposal(torch.tensor([1, 2, 3]), torch.ones(3)))
        router.pooled["chat", "mtp"] = DrafterEvidence(shadows, accepted * shadows, 3 * shadows)
        route = RouteState("chat", ("ngram", "mtp"))
        assert (router.shadow_due(route, "ngram", lambda n: True, cost) == "mtp") == asked
        code = RouteState("code", ("ngram", "mtp"))  # another domain's evidence is its own
        assert router.shadow_due(code, "ngram", lambda n: True, cost) == "mtp"
    # scored shadow drafts pool per domain, the older ones fading past POOLED
    router, route = Router(None, candidates=("ngram", "mtp")), RouteState("chat", ("ngram", "mtp"))
    for i in range(100):
        router.record(route, "mtp", i, Proposal(torch.tensor([5, 6, 7]), torch.ones(3)))
        router.observe(route, "ngram", 0, 0, [0] * i + [5, 6, 9], cost)  # 2 of 3 accepted
    pool = router.pooled["chat", "mtp"]
    assert pool.n == POOLED and pool.accepted == pytest.approx(2 * POOLED) and pool.drafted == pytest.approx(3 * POOLED)
    router = Router(None, candidates=("ngram", "mtp"), shadow_every=1, budget=1.0)
    router.add_step(0.01, 1, 1)
    a, b = RouteState("chat", ("ngram", "mtp")), RouteState("chat", ("ngram", "mtp"))
    assert router.shadow_due(a, "ngram", lambda n: True, cost) == "mtp"
    assert router.shadow_due(b, "ngram", lambda n: True, cost) is None  # mtp's time: still learning
    router.note_draft_time("mtp", 0.001)
    assert router.shadow_due(b, "ngram", lambda n: True, cost) == "mtp"


def test_confirmed_requests_lengthen_the_next_ones_first_shadow_interval():
    """Each finished request whose scores confirmed its drafter doubles the interval the next
    request of its domain starts at (up to max_every); a switch resets it."""
    router = Router(None, routes={"chat": "ngram"}, candidates=("ngram", "mtp"), shadow_every=4,
                    max_every=32, min_obs=2)

    def request(confirmed: bool) -> int:
        name, route = router.first([1, 2, 3], lambda n: True)
        route.evidence["mtp"] = DrafterEvidence(3 if confirmed else 1, accepted=0, drafted=9)
        route.used[name] = 10
        router.finish(route)
        return route.first_interval

    assert [request(True) for _ in range(5)] == [4, 8, 16, 32, 32]
    assert request(False) == 32  # too little evidence: says nothing
    _, route = router.first([1, 2, 3], lambda n: True)
    route.switches.append((5, "ngram", "mtp"))
    router.finish(route)
    assert request(True) == 4
    _, route = router.first([1], lambda n: True)
    assert router.shadow_due(route, "ngram", lambda n: True) is None
    assert route.interval == route.next_shadow == 8


def test_route_cost_is_the_cost_tables_curve():
    from angelspec.plugins import interpolate_cost
    from angelspec.runtime.router import route_cost

    t = CostTable([1, 2, 4, 8, 16, 32], [0.0266, 0.0297, 0.0337, 0.0448, 0.0528, 0.119], fingerprint())
    c, (n, s) = route_cost(t), t.tensors()
    for k in (0, 0.5, 1, 1.7, 5.5, 13.25, 31.9, 32, 33.5, 200):
        ref = interpolate_cost(torch.tensor([float(k)], dtype=torch.float64), n, s)
        assert c(k) == pytest.approx(float(ref[0]), rel=1e-12)
