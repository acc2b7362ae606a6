"""`auto` drafter routing (docs/algorithms.md, section 4): a domain classifier picks each request's
first drafter, then shadow drafting lets the evidence switch it.

1. **Classifier.** Multinomial naive Bayes over the prompt's token ids (chat template included,
   as served), trained on the data step's prompts with their domains. The domain maps to a
   route (the build measures each domain's fastest drafter; missing drafts fall back to ngram)
   and to its contenders: the drafters measured within `CONTEND` of the fastest, and always
   `ngram`, whose shadow draft is a cheap lookup. Only contenders follow a request's commits.
2. **Online rule.** Every few steps ONE other contender (round robin) also drafts for the
   request (not while the gate sits the request's own drafter out: see StepHooks.shadow).
   Once the positions it covers are committed, its accepted length is the length of its prefix
   matching the committed tokens (exact under greedy), so no extra target forward is needed.
   A drafter's value for the request is what it adds to the engine's throughput:

       value = (1 + mean accepted) - rate * (mean draft time + C(rows + k) - C(rows))

   with rate the engine's recent tokens per second, rows its tokens verified per step, k the
   drafter's mean draft length and C the measured verification cost: under load one request's
   drafting delays the whole batch (at batch 1 this ranks drafters by their own tokens per
   second). After `min_obs` scores the request switches to a drafter that beats the current one
   by `margin`. The interval starts at `shadow_every` and doubles (up to `max_every`) while the
   scores confirm the current drafter; finished requests pass their interval on to the next of
   their domain (requests are short, and every shadow draft of a losing contender costs), and
   after `MOVE_AFTER` requests of a domain in a row ended on the same other drafter, the
   domain's route moves there. Shadow drafting never takes more than `budget` of the engine's
   step time, and a contender that could not win even if always accepted is not asked. Before
   it has drafted for a request (its first shadow draft there catches it up on the whole
   context: the costly one) it is judged by its longest draft and, once its shadow drafts for
   the domain's earlier requests were scored, by their mean accepted length plus an optimism
   that shrinks with their number (k / sqrt(n) for drafts of k tokens): every new request's
   first shadow drafts are the costly ones (docs/results/design-measurements.md). A drafter
   whose time is not known yet shadow-drafts for one request until it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from angelspec.plugins import interpolate_cost
from angelspec.prompts import DOMAINS

DEFAULT_ROUTES = {"chat": "mtp", "code": "dfly", "math": "dfly"}
# what a build measures per domain for `auto`. Hybrids (`ngram+mtp`, ...) are served by name but
# not candidates: they never won a domain's measurement, and as contenders their shadow drafts
# cost `auto` more than they brought (docs/results/design-measurements.md)
CANDIDATES = ("mtp", "dfly", "ngram")
# a drafter within CONTEND of a domain's fastest (build measurement) stays a contender: twice the
# measurement's noise (build.ROUTE_MARGIN). A wider margin let trained drafters that were clearly
# slower than ngram contend too, and following and shadow-drafting for every request cost `auto`
# against ngram alone (docs/results/design-measurements.md)
CONTEND = 0.1
ALWAYS_CONTENDS = ("ngram",)  # costs next to nothing to shadow-draft
MOVE_AFTER = 2  # requests of a domain in a row that ended on another drafter move its route there
# steps in a row the gate sat a request's own drafter out, after which its contenders (but those
# that always contend) stop following it: they shadow-draft only while its own drafter drafts
DETACH_AFTER = 8
# the scored shadow drafts a domain's evidence of a contender counts at most: older ones fade (its
# mean kept, n capped), so the optimism k / sqrt(n) never falls below k / 8 and a workload that
# changes can bring a contender back
POOLED = 64


def contenders(speed: dict) -> dict:
    """domain -> the drafters whose measured tokens/s is within CONTEND of the domain's best, and
    those that always contend."""
    return {d: [c for c, v in s.items() if v >= (1 - CONTEND) * max(s.values()) or c in ALWAYS_CONTENDS]
            for d, s in speed.items()}


class DomainClassifier:
    def __init__(self, log_prior: torch.Tensor, log_prob: torch.Tensor, domains=DOMAINS):
        self.log_prior, self.log_prob, self.domains = log_prior, log_prob, tuple(domains)

    @classmethod
    def fit(cls, token_lists: list[list[int]], labels: list[str], vocab_size: int,
            domains=DOMAINS, alpha: float = 0.5) -> "DomainClassifier":
        counts = torch.full((vocab_size, len(domains)), alpha, dtype=torch.float64)
        docs = torch.ones(len(domains), dtype=torch.float64)
        for ids, label in zip(token_lists, labels):
            d = domains.index(label)
            counts[:, d].index_add_(0, torch.tensor(ids, dtype=torch.long),
                                    torch.ones(len(ids), dtype=torch.float64))
            docs[d] += 1
        return cls((docs / docs.sum()).log().float(), (counts / counts.sum(0)).log().float(), domains)

    def predict(self, ids: list[int]) -> str:
        # each distinct token counts once: long prompts do not drown the prior in repeats
        scores = self.log_prior + self.log_prob[torch.tensor(sorted(set(ids)), dtype=torch.long)].sum(0)
        return self.domains[int(scores.argmax())]

    def accuracy(self, token_lists: list[list[int]], labels: list[str]) -> float:
        hits = sum(self.predict(ids) == y for ids, y in zip(token_lists, labels))
        return hits / max(len(labels), 1)

    def state_dict(self) -> dict:
        return {"log_prior": self.log_prior, "log_prob": self.log_prob}


@dataclass
class DrafterEvidence:
    """Per request and drafter: accepted tokens and draft lengths of scored proposals."""
    n: int = 0
    accepted: float = 0.0
    drafted: float = 0.0

    def add(self, accepted: int, drafted: int) -> None:
        self.n += 1
        self.accepted += accepted
        self.drafted += drafted


@dataclass
class RouteState:
    domain: str
    candidates: tuple = ()  # the drafters that follow this request and may shadow-draft for it
    evidence: dict = field(default_factory=dict)  # drafter -> DrafterEvidence
    pending: list = field(default_factory=list)  # (drafter, start position, tokens) to score
    steps: int = 0
    turn: int = 0
    interval: int = 0  # steps between shadow drafts (0: not started)
    first_interval: int = 0  # the interval it starts at (what earlier requests of its domain showed)
    next_shadow: int = 0
    switches: list = field(default_factory=list)  # (step, from, to)
    used: dict = field(default_factory=dict)  # drafter -> steps it drafted
    idle: int = 0  # steps in a row its own drafter sat out

    def main_drafter(self, current: str) -> str:
        return max(self.used, key=self.used.get) if self.used else current


class Router:
    def __init__(self, classifier: DomainClassifier | None, routes: dict | None = None,
                 candidates: tuple = ("mtp", "dfly", "ngram"), shadow_every: int = 4,
                 min_obs: int = 3, margin: float = 0.1, max_every: int = 32,
                 budget: float = 0.05, contenders: dict | None = None):
        self.classifier = classifier
        self.routes = dict(routes or DEFAULT_ROUTES)
        self.candidates = tuple(candidates)
        self.contenders = {d: tuple(c) for d, c in (contenders or {}).items()}
        self.shadow_every, self.min_obs, self.margin = shadow_every, min_obs, margin
        self.max_every = max_every
        self.budget = budget  # shadow drafting may cost at most this share of the steps' time
        self.credit = 0.0  # seconds of shadow drafting currently affordable
        self.draft_seconds: dict[str, float] = {}  # drafter -> EMA of one request's draft time
        self.draft_tokens: dict[str, int] = {}  # drafter -> its longest shadow proposal
        self.learning: set[str] = set()  # drafters shadow-drafting once to learn their time
        self.pooled: dict[tuple[str, str], DrafterEvidence] = {}  # (domain, drafter) -> its scored shadow drafts
        self.rate = 0.0  # EMA of the engine's tokens per second (0: no step yet)
        self.rows = 1.0  # EMA of the tokens one verification forward checks
        self.settled: dict[str, int] = {}  # domain -> finished requests in a row that confirmed
        self.moving: dict[str, tuple] = {}  # domain -> (drafter, requests in a row that ended on it)

    def settings(self) -> dict:
        return {"routes": self.routes, "candidates": list(self.candidates),
                "shadow_every": self.shadow_every, "max_every": self.max_every,
                "min_obs": self.min_obs, "margin": self.margin, "budget": self.budget,
                "contenders": {d: list(c) for d, c in self.contenders.items()}}

    def first(self, prompt_ids: list[int], available) -> tuple[str, RouteState]:
        domain = self.classifier.predict(prompt_ids) if self.classifier else "chat"
        name = self.routes.get(domain, "ngram")
        name = name if available(name) else "ngram"
        others = [c for c in self.contenders.get(domain, self.candidates) if available(c)]
        start = min(self.shadow_every * 2 ** self.settled.get(domain, 0), self.max_every)
        return name, RouteState(domain, tuple(dict.fromkeys([name] + others)), first_interval=start)

    def finish(self, route: RouteState) -> None:
        """A request is done: if its shadow scores confirmed its drafter (no switch), the next
        request of its domain starts shadow-drafting at twice the interval; a switch resets it.
        When MOVE_AFTER requests of a domain in a row ended on the same other drafter than the
        domain's route, that drafter becomes the route (the first drafter of its next requests;
        the old one stays a contender, so the evidence can move it back)."""
        final = route.switches[-1][2] if route.switches else None
        if route.switches:
            self.settled[route.domain] = 0
        elif any(ev.n >= self.min_obs for n, ev in route.evidence.items() if n != route.main_drafter("")):
            self.settled[route.domain] = min(self.settled.get(route.domain, 0) + 1, 16)
        if final is None or final == self.routes.get(route.domain):
            self.moving.pop(route.domain, None)
            return
        name, count = self.moving.get(route.domain, (final, 0))
        count = count + 1 if name == final else 1
        if count >= MOVE_AFTER:
            self.routes[route.domain] = final
            self.moving.pop(route.domain, None)
        else:
            self.moving[route.domain] = (final, count)

    def sat_out(self, route: RouteState, current: str, idle: bool) -> list[str]:
        """One step of a request: whether the gate sat its drafter `current` out. After
        DETACH_AFTER such steps in a row, the contenders that cost something to follow (all but
        ALWAYS_CONTENDS) stop following it, their evidence and shadow drafts for it dropped (so it
        never switches to a drafter that missed its tokens); returns them, for the engine to
        release. Under a load where its own drafter does not pay, their shadow drafts would not
        either, and following (the target's hidden rows sliced for each trained contender every
        step) is all they add (measured: docs/results/design-measurements.md)."""
        route.idle = route.idle + 1 if idle else 0
        if route.idle < DETACH_AFTER:
            return []
        gone = [c for c in route.candidates if c != current and c not in ALWAYS_CONTENDS]
        if gone:
            route.candidates = tuple(c for c in route.candidates if c not in gone)
            for c in gone:
                route.evidence.pop(c, None)
            route.pending = [x for x in route.pending if x[0] not in gone]
        return gone

    def note_draft_time(self, name: str, seconds: float) -> None:
        old = self.draft_seconds.get(name)
        self.draft_seconds[name] = seconds if old is None else 0.9 * old + 0.1 * seconds
        self.learning.discard(name)

    def _note_drafted(self, name: str, tokens: int) -> None:
        # the longest: a proposal near its request's end is clipped to the tokens left
        self.draft_tokens[name] = max(self.draft_tokens.get(name, 0), tokens)

    def add_step(self, seconds: float, tokens: int, rows: int) -> None:
        """After an engine step of `seconds` that committed `tokens` and verified `rows`: earn
        shadow-drafting credit (`budget` of the step's time, capped at one second) and follow
        the load."""
        self.credit = min(self.credit + self.budget * seconds, 1.0)
        rate = tokens / max(seconds, 1e-9)
        self.rate = rate if not self.rate else 0.9 * self.rate + 0.1 * rate
        self.rows = 0.9 * self.rows + 0.1 * rows

    def shadow_due(self, route: RouteState, current: str, available, cost_fn=None) -> str | None:
        """The candidate to shadow-draft this step, if any (and if the budget affords it)."""
        route.steps += 1
        if not route.interval:
            route.interval = route.first_interval or self.shadow_every
            route.next_shadow = route.interval
        if route.steps < route.next_shadow:
            return None
        route.next_shadow = route.steps + route.interval
        others = [c for c in route.candidates if c != current and available(c)]
        if not others:
            return None
        name = others[(route.turn + 1) % len(others)]
        if not self.could_win(route, name, current, cost_fn):
            route.turn += 1
            return None
        if name not in self.draft_seconds:  # its time unknown: one request learns it
            if name in self.learning:
                route.next_shadow = route.steps + 1
                return None
            self.learning.add(name)
        cost = self.draft_seconds.get(name, 0.0)
        if cost > self.credit:
            route.next_shadow = route.steps + 1  # due, but not affordable yet: ask next step
            return None
        self.credit -= cost
        route.turn += 1
        return name

    def record(self, route: RouteState, name: str, position: int, proposal) -> None:
        """A shadow proposal (a chain or a tree) for positions position.. (scored once they are
        committed)."""
        route.pending.append((name, position, proposal))
        self._note_drafted(name, len(proposal.tokens))

    def observe(self, route: RouteState, current: str, accepted: int, drafted: int,
                committed: list[int], cost) -> str:
        """After a step: score the current drafter and any shadow proposal whose positions are now
        all committed; return the drafter to use from the next step on."""
        if drafted:  # a step without drafts (cut by D-cut, or sat out) says nothing of the drafter
            route.evidence.setdefault(current, DrafterEvidence()).add(accepted, drafted)
        keep, scored = [], False
        for name, pos, prop in route.pending:
            if pos + prop.depth() > len(committed):
                keep.append((name, pos, prop))
                continue
            matched = prop.matched(committed[pos:pos + prop.depth()])
            route.evidence.setdefault(name, DrafterEvidence()).add(matched, len(prop.tokens))
            pool = self.pooled.setdefault((route.domain, name), DrafterEvidence())
            pool.add(matched, len(prop.tokens))
            if pool.n > POOLED:
                pool.accepted, pool.drafted, pool.n = (pool.accepted * POOLED / pool.n,
                                                       pool.drafted * POOLED / pool.n, POOLED)
            scored = True
        route.pending = keep
        best, best_value = current, self.value(route, current, cost)
        if best_value is None:
            best_value, bar = 1.0, self.margin  # no drafts scored yet (cut or sat out): 1 token/step
        else:
            ev = route.evidence[current]
            bar = self.margin * (1 + ev.accepted / ev.n)
        for name, ev in route.evidence.items():
            if name != current and ev.n >= self.min_obs:
                value = self.value(route, name, cost)
                if value > best_value + bar:
                    best, best_value = name, value
        if best != current:
            route.switches.append((route.steps, current, best))
            route.pending = []
            route.interval = self.shadow_every
        elif scored and all(ev.n >= self.min_obs for n, ev in route.evidence.items() if n != current):
            route.interval = min(2 * route.interval, self.max_every)  # the evidence agrees: back off
        return best

    def value(self, route: RouteState, name: str, cost) -> float | None:
        """Tokens per step drafter `name` adds for the request, less what its drafting and
        verification time costs the engine at its current rate (None: no evidence yet)."""
        ev = route.evidence.get(name)
        if not ev or not ev.n:
            return None
        return self._value(name, ev.drafted / ev.n, ev.accepted / ev.n, cost)

    def _value(self, name: str, k: float, a: float, cost) -> float:
        """value() of `name` drafting k tokens a step of which a are accepted."""
        verify = cost(self.rows + k) - cost(self.rows) if cost else 0.0
        return 1 + a - self.rate * (self.draft_seconds.get(name, 0.0) + verify)

    def could_win(self, route: RouteState, name: str, current: str, cost) -> bool:
        """Whether shadow-drafting `name` can pay: its time or its draft length unknown yet, or its
        value beats the current drafter's with every draft token accepted (its length in this
        request), or, before it has drafted for this request, with its longest draft accepted up
        to the domain's mean plus k / sqrt(n) (n: its scored shadow drafts there)."""
        ev, mine = route.evidence.get(name), self.value(route, current, cost)
        if ev and ev.n:
            k = a = ev.drafted / ev.n
        else:
            k = a = self.draft_tokens.get(name)
            pool = self.pooled.get((route.domain, name))
            if k is not None and pool and pool.n:
                a = min(k, pool.accepted / pool.n + k / math.sqrt(pool.n))
        if k is None or name not in self.draft_seconds:
            return True
        return self._value(name, k, a, cost) > (1.0 if mine is None else mine)


def route_cost(cost_table, batch: int | None = None):
    """C(n) in seconds from a CostTable (its curve for `batch` requests, or its main curve), for
    Router.value, the gate and D-cut's calibration, called for every request at every step: the
    piecewise-linear curve (plugins.interpolate_cost) evaluated once at every whole n it covers,
    then interpolated in Python (its nodes are whole numbers, so this is the same curve). None:
    no table, verification counted as free."""
    if cost_table is None:
        return None
    n, t = cost_table.tensors(batch)
    top = int(n[-1]) + 1
    grid = interpolate_cost(torch.arange(top + 1, dtype=torch.float64), n, t).tolist()

    def cost(k: float) -> float:
        if not 0 <= k < top:
            return float(interpolate_cost(torch.tensor([float(k)], dtype=torch.float64), n, t)[0])
        i = int(k)
        return grid[i] + (grid[i + 1] - grid[i]) * (k - i)
    return cost
