"""Bad input gets a precise error before any work is done."""
import pytest

from angelspec.runtime import Engine, Request, SamplingParams


@pytest.mark.parametrize("req, match", [
    (Request([]), "prompt is empty"),
    (Request(list(range(1, 90)) * 3), "does not fit the context"),
    (Request([1, 2, 1000]), "token ids must be integers"),
    (Request([1, 2], drafter="eagle"), "unknown drafter 'eagle'"),
    (Request([1, 2], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (Request([1, 2], SamplingParams(temperature=-1.0)), "temperature"),
    (Request([1, 2], SamplingParams(temperature=float("nan"))), "temperature"),
])
def test_bad_requests_raise_clear_errors(tiny, req, match):
    eng = Engine(tiny, max_batch=2, max_len=128)
    with pytest.raises(ValueError, match=match):
        eng.generate([Request([3, 4], SamplingParams(max_new_tokens=4)), req])


def test_generation_stops_at_the_context_limit(tiny):
    eng = Engine(tiny, max_batch=1, max_len=32)
    res = eng.generate([Request(list(range(1, 29)), SamplingParams(max_new_tokens=100), "ngram")])[0]
    assert res.finish_reason == "length" and len(res.tokens) == 32 - 28
