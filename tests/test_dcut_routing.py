"""D-cut and `auto` routing inside the engine: both only change what is drafted and verified,
never the output (greedy == batch-1 autoregressive, token for token)."""
import pytest
import torch

from angelspec.drafters import Drafter, Proposal
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.cost import CostTable, fingerprint, profile
from angelspec.runtime.router import DomainClassifier, Router
from test_lossless import NoisyOracle, autoregressive, prompts


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
    out = eng.generate([Request(p, SamplingParams(max_new_tokens=30), "oracle") for p in ps])
    assert [r.tokens for r in out] == ref
    if per_token == 0.0:  # verifying is free: nothing is cut
        assert eng.dcut_kept == eng.dcut_drafted
    if per_token == 0.05:  # a token costs more than a 0.7-confidence draft brings
        assert eng.dcut_kept < 0.5 * eng.dcut_drafted


def test_profiled_cost_table_grows_with_tokens(tiny):
    t = profile(tiny.model, max_tokens=16, reps=2)
    assert t.n[0] == 1 and t.n[-1] == 16 and all(s > 0 for s in t.seconds)
    assert CostTable.from_json(t.to_json()).n == t.n


def test_router_switches_away_from_a_bad_drafter_losslessly(tiny):
    ps = prompts(4)
    ref = autoregressive(tiny, ps, 60)
    oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 4, p_wrong=0.1)
    clf = DomainClassifier.fit([[1, 2, 3], [50, 60], [80, 81]], ["chat", "code", "math"], 97)
    router = Router(clf, routes={"chat": "random", "code": "random", "math": "random"},
                    candidates=("random", "oracle"), shadow_every=2, min_obs=2)
    eng = Engine(tiny, max_batch=2, max_len=256, router=router,
                 drafters={"oracle": oracle, "random": Random()})
    out = eng.generate([Request(p, SamplingParams(max_new_tokens=60), "auto") for p in ps])
    assert [r.tokens for r in out] == ref
    long = [r for r in out if r.stats.steps >= 15]  # (some prompts reach eos early)
    assert len(long) >= 2
    assert all(r.switches[0][1:] == ("random", "oracle") and r.drafter == "oracle" for r in long)


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
