"""How many threads the engine's step runs on, adapted to the cores it really gets.

Every kernel of a step is a parallel region whose threads wait for each other at its end. When
another process takes one of the cores, a region waits for its preempted thread at every op, and
fewer threads than cores can then run faster than all of them (docs/serving.md). The governor
watches each forward's time against the profiled cost of the same forward (C_B(n), measured on
an idle machine with all threads) and, when forwards run much
slower than profiled, tries fewer threads for a few steps and keeps whichever count ran faster;
while on fewer threads it retries all of them now and then (every 2 s, twice as long after each
retry that loses, at most every 32 s), so the idle speed comes back when the neighbour leaves. On
an idle machine forwards run as profiled and nothing is tried.
"""
from __future__ import annotations

import time

import torch


class ThreadGovernor:
    """Chooses between `full` threads (torch's count when made) and `reduced` (half, at least
    one) from the ratio measured / profiled forward time, averaged over `window` steps. The
    engine applies the choice for its steps only (`enter`): the process's own count is left as
    the caller set it."""

    def __init__(self, window: int = 4, stall: float = 1.5, retry_s: float = 2.0,
                 max_retry_s: float = 32.0):
        self.full = torch.get_num_threads()
        self.reduced = max(1, self.full // 2)
        self.n = self.full  # the count chosen
        self.window, self.stall = window, stall
        self.first_retry_s, self.retry_s, self.max_retry_s = retry_s, retry_s, max_retry_s
        self.ratios: list[float] = []
        self.mean = {self.full: None, self.reduced: None}  # last window's mean ratio per count
        self.trial: int | None = None  # the count on trial (None: settled)
        # full threads' ratio when they last won a trial: long contexts make forwards slower
        # than the profile without any neighbour, and that must not look like a stall
        self.baseline = 1.0
        self.since = time.perf_counter()  # when the current count was settled on
        self.switches = 0

    def enter(self) -> int:
        """Before a step: apply the chosen count; returns the caller's, to restore after it."""
        outer = torch.get_num_threads()
        if outer != self.n:
            torch.set_num_threads(self.n)
        return outer

    def _use(self, n: int) -> None:
        if n != self.n:
            self.n = n
            torch.set_num_threads(n)
            self.switches += 1

    def observe(self, seconds: float, profiled: float) -> None:
        """One forward took `seconds` where the profile expects `profiled`."""
        if self.full == self.reduced or profiled <= 0:
            return
        self.ratios.append(seconds / profiled)
        # a trial is short: a stalled count runs ~2x slower, which two steps show
        if len(self.ratios) < (self.window if self.trial is None else max(2, self.window // 2)):
            return
        ratios, self.ratios = sorted(self.ratios), []
        if len(ratios) > 2:
            ratios = ratios[:-1]  # the slowest step of a window is dropped
        mean = sum(ratios) / len(ratios)
        now = self.n
        self.mean[now] = mean
        other = self.reduced if now == self.full else self.full
        if self.trial is not None:  # a trial window ended: keep the faster count
            best = now if self.mean[other] is None or mean <= self.mean[other] else other
            if best == self.full:
                self.baseline = max(1.0, self.mean[self.full])
                self.retry_s = self.first_retry_s
            elif now == self.full:  # a retry of all threads lost: retry less often
                self.retry_s = min(2 * self.retry_s, self.max_retry_s)
            self._use(best)
            self.trial, self.since = None, time.perf_counter()
        elif now == self.full and mean > self.stall * self.baseline:  # stalls: try fewer
            self.trial = self.reduced
            self._use(self.reduced)
        elif now == self.reduced and time.perf_counter() - self.since > self.retry_s:
            self.trial = self.full  # has the neighbour left? try all threads again
            self._use(self.full)
