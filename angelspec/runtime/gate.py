"""Drafting that stops when it does not pay: D-cut's keep ratio 0, decided before drafting.

D-cut trims drafts after they are made, so their drafting time is already spent. Under load a
trained drafter (a forward of its own every step) can cost more than every token it brings.
Before each step the gate asks, for each drafter in the batch, whether drafting for its n
requests raises the step's expected tokens per second. It answers from running estimates of one
request's drafting seconds t (its proposals, and its share of the step's work on drafts besides
the forward: D-cut's cut, calibration, feeding the drafter; step.bookkeeping), its draft tokens
that survive D-cut k, and its accepted tokens a:

    tokens = B + sum(n * a),  seconds = T_fixed + sum(n * t) + C(B + sum(n * k))

Drafters are added in order of a / t while the ratio grows; a drafter that would lower it sits
out for `backoff` steps (doubling up to MAX_BACKOFF while it keeps not paying). When its time is
up, one of its requests drafts as a probe and refreshes the estimates. Skipping drafts is
always lossless: a request that does not draft gets its next token from the verification
forward, exactly as `none`. Only used with D-cut (D-cut off means fixed draft lengths).

The estimates of k and a average a drafting drafter's last ~WINDOW requests (a step of n
requests weighs 1 - (1 - 1/WINDOW)^n; the plain mean of its first WINDOW): one request's
accepted count is 0 or a whole run, and a few misses in a row on a shorter average benched a
drafter whose tokens paid (MTP at one request sat out most steps while its tokens paid:
docs/results/design-measurements.md). A probe's counts, the only ones in a while, weigh FAST. The time t
follows its steps' times with weight FAST, but not a step where one of its requests proposed for
the first time (it catches the drafter up on the whole prompt, a prefill's work, several steps'
worth), and a probe, which catches up on every step it sat out,
may only lower it. A drafter whose time is not known yet is judged as if drafting were free (at
16 requests in flight with requests joining every few steps, most steps were untimed, and a
drafter left unjudged drafted on every step although D-cut kept none of its tokens).

A drafter whose drafting costs at most CHEAP of the step (ngram: a lookup) drafts as
long as D-cut keeps some of its tokens (at least KEPT a request, on average): what its drafts
cost to verify is D-cut's call, made on each draft's own confidence. Judged by running estimates
of what it brings instead, a run of failed copies would bench it while its matches go unused:
its probes are single requests whose accepted length is mostly 0 or a whole copy, so the
estimate recovers slowly while the backoff doubles. But when D-cut keeps none of its tokens
(many requests in flight on a CPU, where a verified token costs nearly what it can bring), its
drafting and the step's handling of drafts are all it adds, so it sits out like any other
drafter, and its probes ask D-cut again. Nor is it cheap when that handling, counted in t, costs
more than CHEAP of the step (as with 16 requests in flight on a 2-core CPU); it is then judged
by what it brings.
"""
from __future__ import annotations

MAX_BACKOFF = 32
WINDOW = 32  # requests a drafting drafter's counts average over
FAST = 0.3  # weight of a step's time, and of a probe's counts
CHEAP = 0.05  # drafting below this fraction of the step's time is not judged by what it brings
KEPT = 0.05  # while D-cut keeps at least this many of its tokens a request (running average)


class DraftGate:
    def __init__(self, cost):
        self.cost = cost  # C(n): seconds of a verification forward over n tokens
        self.est: dict[str, tuple[float | None, float, float]] = {}  # name -> (t, k, a) per request
        self.until: dict[str, int] = {}  # name -> first step it may draft again
        self.backoff: dict[str, int] = {}
        self.probing: set[str] = set()  # drafters whose next observation is a probe's
        self.seen: dict[str, int] = {}  # name -> requests observed
        self.skipped = 0  # requests that sat out a step (for benchmarks)

    def plan(self, step: int, names: list[str], t_fixed: float, cost=None) -> list[str]:
        """The drafter each request uses this step: its own, or "none" when its drafter sits out
        (one request of a drafter whose time is up drafts as a probe). `cost`: C(n) for this
        step's number of requests (default: the gate's)."""
        cost = cost or self.cost
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name != "none":
                groups.setdefault(name, []).append(i)
        out = list(names)
        B = len(names)
        tokens, seconds, kept = float(B), t_fixed + cost(B), 0.0
        est = {g: (t or 0.0, k, a) for g, (t, k, a) in self.est.items() if g in groups}
        ranked = sorted(est, key=lambda g: est[g][2] / max(est[g][0], 1e-9), reverse=True)
        for g in ranked:
            idx = groups[g]
            if step < self.until.get(g, 0):  # sitting out
                self._skip(out, idx)
                continue
            if self.until.get(g, -1) == step:  # its time is up: one request probes
                self._skip(out, idx[1:])
                self.probing.add(g)
                continue
            t, k, a = est[g]
            n = len(idx)
            add_s = n * t + cost(B + kept + n * k) - cost(B + kept)
            if (n * t <= CHEAP * seconds and k >= KEPT) or (tokens + n * a) * seconds > tokens * (seconds + add_s):
                tokens, seconds, kept = tokens + n * a, seconds + add_s, kept + n * k
                self.backoff[g] = 1
            else:
                wait = self.backoff.get(g, 1)
                self.until[g] = step + wait
                self.backoff[g] = min(2 * wait, MAX_BACKOFF)
                self._skip(out, idx)
        return out

    def _skip(self, out: list[str], idx: list[int]) -> None:
        for i in idx:
            out[i] = "none"
        self.skipped += len(idx)

    def observe(self, name: str, requests: int, seconds: float, kept: int, accepted: int,
                timed: bool = True) -> None:
        """What one step's drafting with `name` cost and brought, over `requests` requests (timed:
        whether `seconds` is a step's drafting cost; see the module's docstring)."""
        if name == "none" or not requests:
            return
        t, k, a = seconds / requests, kept / requests, accepted / requests
        probe = name in self.probing
        self.probing.discard(name)
        seen = self.seen.get(name, 0) + requests
        self.seen[name] = seen
        if name not in self.est:
            self.est[name] = (t if timed else None, k, a)
            return
        t0, k0, a0 = self.est[name]
        w = FAST if probe else max(1 - (1 - 1 / WINDOW) ** requests, requests / seen)
        if timed:
            blended = t if t0 is None else FAST * t + (1 - FAST) * t0
            t0 = min(t0, blended) if probe and t0 is not None else blended
        self.est[name] = (t0, w * k + (1 - w) * k0, w * a + (1 - w) * a0)
