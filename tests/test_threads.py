"""The thread governor: fewer threads when forwards stall against the profile (a neighbour took
a core), all of them again once the neighbour leaves, and nothing tried on an idle machine."""
import pytest
import torch

from angelspec.runtime.threads import ThreadGovernor


@pytest.fixture
def governor():
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to govern")
    full = torch.get_num_threads()
    yield ThreadGovernor(window=4, retry_s=0.0, max_retry_s=0.0)
    torch.set_num_threads(full)


def feed(g, ratio, windows=1):
    """`windows` decisions of the governor at this ratio (a trial takes 2 steps, a window 4)."""
    for _ in range(windows):
        for _ in range(4 if g.trial is None else 2):
            g.observe(ratio * 0.01, 0.01)
    assert torch.get_num_threads() == g.n


def test_an_engine_leaves_the_callers_thread_count_alone(tiny):
    from angelspec.runtime import Engine, Request, SamplingParams
    from angelspec.runtime.cost import profile

    eng = Engine(tiny, max_batch=1, max_len=64, cost=profile(tiny.model, max_tokens=4))
    eng.governor.n = eng.governor.reduced  # as after a stall
    before = torch.get_num_threads()
    eng.generate([Request([3, 4], SamplingParams(max_tokens=4))])
    assert torch.get_num_threads() == before


def test_idle_forwards_change_nothing(governor):
    full = governor.full
    feed(governor, 1.1, windows=20)
    feed(governor, 1.4, windows=5)  # slower than profiled, but no stall
    assert torch.get_num_threads() == full and governor.switches == 0


def test_a_stall_moves_to_fewer_threads_and_back_when_it_ends(governor):
    full, reduced = governor.full, governor.reduced
    feed(governor, 3.0)  # stalls on all threads: a trial of fewer
    assert torch.get_num_threads() == reduced
    feed(governor, 1.8)  # faster on fewer: kept
    assert torch.get_num_threads() == reduced
    feed(governor, 1.8)  # retry_s passed: all threads on trial again ...
    assert torch.get_num_threads() == full
    feed(governor, 3.0)  # ... still stalling: back to fewer
    assert torch.get_num_threads() == reduced
    feed(governor, 1.8)
    feed(governor, 1.0)  # the neighbour left: all threads win the trial and stay
    assert torch.get_num_threads() == full
    feed(governor, 1.0, windows=5)
    assert torch.get_num_threads() == full


def test_long_contexts_slower_than_the_profile_are_not_a_stall(governor):
    """Full threads at 1.7x the profile won their trial: that is this workload's idle pace."""
    full = governor.full
    feed(governor, 1.7)  # looks like a stall: trial
    feed(governor, 3.0)  # fewer threads are slower: full again, 1.7 is the baseline now
    assert torch.get_num_threads() == full
    switches = governor.switches
    feed(governor, 1.7, windows=10)
    assert governor.switches == switches
