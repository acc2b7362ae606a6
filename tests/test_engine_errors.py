"""Bad input gets a precise error before any work is done."""
import pytest

from angelspec.drafters import Drafter, Proposal
from angelspec.runtime import Engine, Request, SamplingParams


@pytest.mark.parametrize("req, match", [
    (Request([]), "prompt is empty"),
    (Request(list(range(1, 90)) * 3), "does not fit the context"),
    (Request([1, 2, 1000]), "token ids must be integers"),
    (Request([1, 2], drafter="eagle"), "unknown drafter 'eagle'"),
    (Request([1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    (Request([1, 2], SamplingParams(temperature=-1.0)), "temperature"),
    (Request([1, 2], SamplingParams(temperature=float("nan"))), "temperature"),
])
def test_bad_requests_raise_clear_errors(tiny, req, match):
    eng = Engine(tiny, max_batch=2, max_len=128)
    with pytest.raises(ValueError, match=match):
        eng.generate([Request([3, 4], SamplingParams(max_tokens=4)), req])


def test_generation_stops_at_the_context_limit(tiny):
    eng = Engine(tiny, max_batch=1, max_len=32)
    res = eng.generate([Request(list(range(1, 29)), SamplingParams(max_tokens=100), "ngram")])[0]
    assert res.finish_reason == "length" and len(res.tokens) == 32 - 28


@pytest.mark.parametrize("drafter, match", [
    ("ngram:draft_len=abc", r"draft_len must be an integer in \[1, 32\], got 'abc'"),
    ("ngram:draft_len=-3", "draft_len must be an integer"),
    ("ngram:draft_len=999", "draft_len must be an integer"),
    ("ngram:max_ngram=0", r"max_ngram must be an integer in \[1, 8\]"),
    ("none:draft_len=4", "drafter none: unknown option 'draft_len'"),
    ("ngram:draft_len", "must look like key=value"),
])
def test_drafter_options_are_validated_before_admission(tiny, drafter, match):
    eng = Engine(tiny, max_batch=2, max_len=128)
    with pytest.raises(ValueError, match=match):
        eng.generate([Request([3, 4], SamplingParams(max_tokens=4), drafter)])
    assert eng.drafters.keys() <= {"none"}  # nothing was built for the bad names


def test_temperatures_below_the_floor_are_refused(tiny):
    eng = Engine(tiny, max_batch=1, max_len=128)
    for t in (1e-39, 1e-45, 5e-4):
        with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number >= 0.001"):
            eng.generate([Request([3, 4], SamplingParams(max_tokens=4, temperature=t, seed=1))])
    out = eng.generate([Request([3, 4], SamplingParams(max_tokens=4, temperature=1e-3, seed=1))])[0]
    assert len(out.tokens) == 4


def test_drafter_instances_are_bounded_and_shared(tiny):
    eng = Engine(tiny, max_batch=1, max_len=128, max_drafters=3)
    run = lambda d: eng.generate([Request([3, 4], SamplingParams(max_tokens=2), d)])  # noqa: E731
    run("ngram:draft_len=3,max_ngram=2")
    run("ngram:max_ngram=2,draft_len=3")  # the same drafter, spelled otherwise: no new instance
    assert sorted(eng.drafters) == ["ngram:draft_len=3,max_ngram=2", "none"]
    run("ngram:draft_len=4")
    with pytest.raises(ValueError, match=r"too many drafter variants in use \(3\)"):
        run("ngram:draft_len=5")
    run("ngram:draft_len=4")  # existing ones still serve


class Broken(Drafter):
    """A drafter that fails on its second proposal."""

    def __init__(self):
        super().__init__(3)
        self.calls = 0

    def propose(self, states):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom")
        return [Proposal.empty() for _ in states]


def test_a_drafter_failure_fails_its_requests_only(tiny):
    """Requests on a drafter that raises end with its error; the others in the same steps
    finish with exactly the tokens they get alone."""
    params = SamplingParams(max_tokens=12)
    alone = Engine(tiny, max_batch=1, max_len=128).generate([Request([5, 6, 7], params, "ngram")])[0]
    eng = Engine(tiny, max_batch=3, max_len=128, drafters={"broken": Broken()})
    out = eng.generate([Request([5, 6, 7], params, "ngram"), Request([8, 9], params, "broken"),
                        Request([5, 6, 7], params, "none")])
    assert out[1].finish_reason == "error" and "drafter broken failed: RuntimeError: boom" in out[1].error
    assert out[0].tokens == out[2].tokens == alone.tokens
    assert not eng.busy and len(eng.free) == 3  # every slot is free again
