"""What runs around the speculative step (step.py) without being the step: the draft gate (which
drafters draft this step), the router (`auto`: shadow drafts and switching) and the timing
statistics D-cut and the gate weigh draft tokens with (T_fixed, the forwards' offset from the
profiled C_B(n), the thread governor)."""
from __future__ import annotations

from angelspec.runtime.request import RequestState
from angelspec.runtime.step import StepContext, StepRecord, propose


class StepHooks:
    """The engine's hooks; `plan` is called first in every step (it fixes the step's cost curve)."""

    def __init__(self, engine):
        self.engine = engine
        self.curve = None  # C_B(n) of this step's B requests at their context (None: no cost profile)
        self.shift = 0.0  # seconds per verified token the step's context adds to the profiled C_B(n)
        self.t_fixed_ema = 0.0  # a step's time outside drafting and the forward (D-cut's T_fixed)
        # requests in a forward -> EMA of (its measured time - the step's curve at its tokens):
        # the profile ran at one moment and the machine drifts; D-cut and the gate weigh draft
        # tokens against the curve + this offset
        self.fwd_offset: dict[int, float] = {}

    @property
    def gate(self):
        e = self.engine
        return e.gate if e.dcut else None  # D-cut off: fixed draft lengths

    def plan(self, active: list[RequestState], names: list[str]) -> list[str]:
        """The drafter of each request this step: the gate may sit costly drafters out."""
        e = self.engine
        self.curve = None
        if e.cost is not None:
            profiled = e.curve(len(active))[1]
            self.shift = e.cost.shift(sum(len(s.tokens) for s in active) / len(active))
            self.curve = (lambda k, d=self.shift: profiled(k) + d * k) if self.shift else profiled
        if self.gate is not None:
            names = self.gate.plan(e.stats.steps, names, self.t_fixed(len(active)), self.curve)
        return names

    def t_fixed(self, batch: int) -> float:
        return max(self.t_fixed_ema + self.fwd_offset.get(batch, 0.0), 0.0)

    def shadow(self, ctx: StepContext, active: list[RequestState], names: list[str]) -> None:
        """Routed requests: every few steps one other candidate drafts too, for the router to
        score once the target's tokens are known. Not for a request that does not draft this
        step (names[i] "none": the gate sat its drafter out, or it is on its last token): under
        a load where its own drafter does not pay, a contender's draft would not either (at 16
        in flight they were most of what `auto`'s drafting cost over `ngram`'s). A request whose
        drafter sits out step after step among others in flight loses its costly contenders
        (Router.sat_out). Not alone: one request's drafter sits out for its content, not for the
        load, and a contender's shadow drafts on the drafter's probe steps may switch it."""
        e, due = self.engine, {}
        crowd = len(active) > 1
        for i, (s, own) in enumerate(zip(active, names)):
            if s.route is None:
                continue
            for name in e.router.sat_out(s.route, s.drafter, crowd and own == "none"):
                e.drafters[name].release(s.view(name))
            if own != "none":
                name = e.router.shadow_due(s.route, s.drafter, e.available, self.curve)
                if name:
                    due[i] = name
        if due:
            idx = list(due)
            props, _ = propose(ctx, [active[i] for i in idx], [due[i] for i in idx], shadow=True)
            for i, p in zip(idx, props):
                e.router.record(active[i].route, due[i], len(active[i].tokens), p)

    def forwarded(self, batch: int, n_tokens: int, seconds: float) -> None:
        """A verification forward's time against the profile: the governor and the offset."""
        if self.curve is None:
            return
        profiled = self.curve(n_tokens)
        if self.engine.governor is not None:
            self.engine.governor.observe(seconds, profiled)
        off, old = seconds - profiled, self.fwd_offset.get(batch)
        self.fwd_offset[batch] = off if old is None else 0.8 * old + 0.2 * off

    def committed(self, s: RequestState, accepted: int, drafted: int) -> None:
        """A routed request's verdict: the router may switch its drafter."""
        if s.route is not None:
            s.route.used[s.drafter] = s.route.used.get(s.drafter, 0) + 1
            s.drafter = self.engine.router.observe(s.route, s.drafter, accepted, drafted, s.tokens,
                                                   self.curve)

    def finished(self, r: StepRecord) -> None:
        """The step's end: the gate learns what each drafter cost (its proposals, r.drafting, and
        the step's handling of its drafts, r.book: step.bookkeeping; not timed where a request
        proposed for the first time, r.fresh) and brought; T_fixed (the rest of the step outside
        the forward) and the router's step costs move."""
        if self.gate is not None:
            for name, seconds in r.drafting.items():
                mine = [(len(p.tokens), v[0]) for n, p, v in zip(r.names, r.props, r.verdicts) if n == name]
                self.gate.observe(name, len(mine), seconds + r.book.get(name, 0.0),
                                  sum(k for k, _ in mine), sum(a for _, a in mine), timed=name not in r.fresh)
        stats, t = self.engine.stats, r.times
        stats.draft_time += t["draft"]
        stats.forward_time += t["forward"]
        spent = t["step"] - t["draft"] - sum(r.book.values()) - t["forward"]
        first = stats.steps == 1
        self.t_fixed_ema = spent if first else 0.9 * self.t_fixed_ema + 0.1 * spent
        if self.engine.router is not None:
            self.engine.router.add_step(t["step"], sum(len(c) for _, c in r.committed), r.verified)
