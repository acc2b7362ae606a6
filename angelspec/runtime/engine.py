"""The runtime: batched prefill + speculative steps over a static KV cache.

One step for all active requests: each request's drafter proposes up to D tokens -> D-cut
(optional) trims the batch's drafts against the measured verification cost -> the target
verifies every request's [anchor + kept drafts] in ONE packed forward -> the longest accepted
prefix + one bonus token are committed -> the cache keeps every committed token except the newest
(the next step's anchor); positions written for rejected drafts are simply overwritten later.
Autoregressive decoding is the same step with empty drafts. A request whose drafter is `auto` is
routed by the engine's Router (router.py), which may switch its drafter while it runs.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from angelspec.checkpoint import Target
from angelspec.drafters import Drafter, Proposal, canonical, make_drafter, parse_spec
from angelspec.model import Segment
from angelspec.plugins import RATIOS, SKINNY_MAX_ROWS, dcut_select
from angelspec.plugins.verify import sample_inverse_cdf
from angelspec.runtime.cost import CostTable, profile
from angelspec.runtime.gate import DraftGate
from angelspec.runtime.router import RouteState, Router, route_cost
from angelspec.runtime.sampling import SamplingParams, position_uniforms, probs_from_logits
from angelspec.runtime.threads import ThreadGovernor
from angelspec.runtime.verify import verify_batch


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    drafter: str = "none"


@dataclass
class Stats:
    steps: int = 0  # target verification forwards after prefill
    drafted: int = 0
    accepted: int = 0
    committed: int = 0  # tokens committed by those steps (accepted + bonus)

    @property
    def accept_len(self) -> float:
        """Mean tokens committed per verification step (tau)."""
        return self.committed / self.steps if self.steps else 0.0


@dataclass
class RequestState:
    index: int
    tokens: list[int]
    n_prompt: int
    params: SamplingParams
    drafter: str  # the drafter drafting now (for `auto`, the router's current choice)
    seed: int | None  # sampling: the request's seed (drawn at random when it gave none)
    stats: Stats = field(default_factory=Stats)
    slot: int = -1
    finish_reason: str | None = None  # stop, length, or error (then `error` says why)
    error: str | None = None
    route: RouteState | None = None  # set when the request asked for `auto`
    views: dict = field(default_factory=dict)  # drafter name -> DrafterView

    @property
    def cache_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def output(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    def view(self, name: str) -> "DrafterView":
        if name not in self.views:
            self.views[name] = DrafterView(self)
        return self.views[name]

    def uniforms(self, n: int) -> torch.Tensor:
        """Sampling: the uniforms of the next n positions (a function of seed and position)."""
        return position_uniforms(self.seed, len(self.tokens), n)


class DrafterView:
    """What a drafter sees of a request: its tokens, params and stats, and a state of its own
    (a routed request keeps one per candidate drafter)."""

    def __init__(self, req: RequestState):
        self.req, self.drafter_state = req, {}

    def __getattr__(self, name):  # tokens, params, stats, n_prompt, ... of the request
        return getattr(self.req, name)


@dataclass
class Event:
    """Tokens committed for request `index` and its running `stats`; its last event has
    `finish_reason`, the drafter used (for `auto`: the one that drafted most steps) and the
    router's switches; `error` when finish_reason is "error" (that request failed alone)."""
    index: int
    tokens: list[int]
    finish_reason: str | None = None
    stats: Stats | None = None
    drafter: str | None = None
    switches: list | None = None
    error: str | None = None


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    stats: Stats
    drafter: str  # for `auto`: the drafter that drafted most of its steps
    switches: list = field(default_factory=list)  # `auto`: (step, from, to)
    error: str | None = None  # finish_reason "error": what failed


class Engine:
    """Serves many requests on one target; every request picks its drafter by name (or `auto`).

    dcut: trim each step's drafts with D-cut against `cost` (C(n), profiled now if not given).
    draft_lens: draft length per drafter kind (an engine's tuned ngram length), below draft_len.
    """

    def __init__(self, target: Target, max_batch: int = 8, max_len: int = 2048,
                 draft_len: int | None = None, drafters: dict[str, Drafter] | None = None,
                 drafts: str | None = None, dcut: bool = False, cost: CostTable | None = None,
                 router: Router | None = None, draft_lens: dict[str, int] | None = None,
                 kinds: set[str] | None = None, max_drafters: int = 16, adapt_threads: bool = True):
        self.target, self.model = target, target.model
        self.max_batch = max_batch
        self.max_len = min(max_len, self.model.max_len)
        self.cache = self.model.new_cache(max_batch, self.max_len)
        self.draft_len = draft_len  # every drafter's draft length (None: each drafter's own)
        self.draft_lens = dict(draft_lens or {})  # drafter kind -> its draft length (an engine's)
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        self.drafts = drafts  # folder of trained drafts (<drafts>/mtp, /dfly, /dflash)
        self.kinds = kinds  # the drafter kinds this engine serves (None: any that can be built)
        self.max_drafters = max_drafters  # drafter instances (names with options) at most
        self.dcut = dcut
        if dcut and cost is None:
            cost = profile(self.model, max_tokens=SKINNY_MAX_ROWS)
        self.cost = cost
        self._curves: dict = {}  # requests in a forward -> (C_B(n) tensors, C_B(n) function)
        # with D-cut, drafters whose drafting costs more than it brings sit steps out
        self.gate = DraftGate(route_cost(cost)) if cost else None
        # with a cost profile to compare against, the step's thread count follows the cores the
        # engine really gets (threads.py)
        self.governor = ThreadGovernor() if cost is not None and adapt_threads else None
        self.router = router
        self.prefill_time = 0.0  # seconds spent in prompt forwards (benchmarks separate decoding)
        self.steps = 0  # verification forwards run (one serves every active request)
        self.t_fixed = 0.0  # EMA of a step's time outside drafting and the forward (D-cut's T_fixed)
        # requests in a forward -> EMA of (its measured time - C_B(its tokens)): the profile ran
        # at one context length and one moment, while requests' contexts differ and the machine
        # drifts; D-cut and the gate weigh draft tokens against C_B(n) + this offset
        self.fwd_offset: dict[int, float] = {}
        self.dcut_drafted = self.dcut_kept = 0  # draft tokens proposed / kept by D-cut
        self._available: dict[str, bool] = {}
        self.pending: deque[RequestState] = deque()  # admitted, waiting for a slot
        self.active: list[RequestState] = []  # holding a slot, decoding
        self.free = list(range(max_batch - 1, -1, -1))  # free cache slots (slot 0 first)

    # -- requests ---------------------------------------------------------------------------
    def drafter_key(self, name: str) -> str:
        """Registry name of a request's drafter (built on first use); unknown, not served by this
        engine, or one variant too many: ValueError. Names that mean the same drafter share one
        instance, and at most `max_drafters` instances exist (each may hold a draft's weights)."""
        if name == "auto":
            if self.router is None:
                raise ValueError("drafter 'auto' needs an engine with a router (angelspec build)")
            return "auto"
        if isinstance(name, str) and name in self.drafters:
            return name
        key = canonical(name)
        if key not in self.drafters:
            kind = parse_spec(key)[0]
            if self.kinds is not None and kind not in self.kinds:
                raise ValueError(f"drafter {kind!r} is not in this engine; it serves "
                                 + ", ".join(sorted(self.kinds | ({"auto"} if self.router else set()))))
            if len(self.drafters) >= self.max_drafters:
                raise ValueError(f"too many drafter variants in use ({self.max_drafters}); use one "
                                 f"of: {', '.join(sorted(self.drafters))}")
            length = self.draft_len or self.draft_lens.get(kind)
            self.drafters[key] = make_drafter(key, length, self.target, self.drafts)
        return key

    def drafter(self, name: str) -> Drafter:
        return self.drafters[self.drafter_key(name)]

    def available(self, name: str) -> bool:
        """Whether drafter `name` can be built (its draft exists and fits the target); asked
        once per name."""
        if name not in self._available:
            try:
                self.drafter_key(name)
                self._available[name] = True
            except (ValueError, OSError):
                self._available[name] = False
        return self._available[name]

    def _admit(self, index: int, req: Request) -> RequestState:
        """Validate a request up front, so a bad one fails before any work is done."""
        if not isinstance(req.prompt_ids, (list, tuple)) or not req.prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.target.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(req.prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of "
                             f"{self.max_len} tokens (room for at least one new token is needed)")
        params = req.params.validate()
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop token ids must be below the vocabulary size {vocab}")
        name, route = self.drafter_key(req.drafter), None
        if name == "auto":
            name, route = self.router.first(req.prompt_ids, self.available)
        seed = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        return RequestState(index, list(req.prompt_ids), len(req.prompt_ids), params, name, seed,
                            route=route)

    def attached(self, s: RequestState) -> list[str]:
        """Drafters that follow a request's commits: its own, and for `auto` its contenders."""
        if s.route is None:
            return [s.drafter]
        return list(dict.fromkeys([s.drafter] + list(s.route.candidates)))

    def warm_up(self, drafters: list[str] | None = None) -> None:
        """Pay every first-use cost now (drafts loaded, custom ops dispatched, kernels touched):
        a short greedy and a short sampled request with each drafter (default: the engine's
        default and none). A server does this before it says it is ready; a benchmark before it
        times anything."""
        ids = self.target.tokenizer.encode("Hello, world. Hello, world.", add_special_tokens=False) or [0]
        for name in drafters or dict.fromkeys([getattr(self, "default_drafter", "none"), "none"]):
            for params in (SamplingParams(max_new_tokens=8),
                           SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)):
                self.generate([Request(ids, params, name)])

    def generate(self, requests: list[Request]) -> list[Result]:
        tokens: list[list[int]] = [[] for _ in requests]
        results: list[Result | None] = [None] * len(requests)
        for ev in self.stream(requests):
            tokens[ev.index] += ev.tokens
            if ev.finish_reason:
                results[ev.index] = Result(tokens[ev.index], ev.finish_reason, ev.stats,
                                           ev.drafter, ev.switches, ev.error)
        return results

    def stream(self, requests: list[Request]) -> Iterator[Event]:
        """Run requests to completion with continuous batching, yielding tokens as committed.

        Every request is validated before any work starts (ValueError names the problem).
        Requests a caller abandons (stops iterating) are cancelled.
        """
        states = [self._admit(i, r) for i, r in enumerate(requests)]
        self.pending.extend(states)
        try:
            while self.busy:
                yield from self.step()
        finally:
            for s in states:
                self.cancel(s.index)

    # -- serving: requests join while others run ------------------------------------------------
    def submit(self, req: Request, index: int) -> None:
        """Queue a request under the caller's `index` (validated now: ValueError names the
        problem); it is admitted into a free slot at the next step."""
        self.pending.append(self._admit(index, req))

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.active)

    def cancel(self, index: int) -> bool:
        """Drop request `index` wherever it is (its client went away, its deadline passed),
        freeing its slot at once. True if it was there."""
        for s in list(self.pending):
            if s.index == index:
                self.pending.remove(s)
                return True
        for s in self.active:
            if s.index == index:
                self.active.remove(s)
                self._release(s)
                return True
        return False

    def step(self) -> list[Event]:
        """Admit pending requests into free slots (packed prefill), then run one speculative step
        for every active request. Returns the events of both. The step runs on the thread count
        the governor chose; the caller's count is restored after it."""
        if self.governor is None:
            return self._admit_and_step()
        outer = self.governor.enter()
        try:
            return self._admit_and_step()
        finally:
            torch.set_num_threads(outer)

    def _admit_and_step(self) -> list[Event]:
        events = []
        while self.pending and self.free:
            group = self._prefill_group(self.pending, self.free)
            for s, new in zip(group, self._prefill(group)):
                events.append(self._event(s, new))
                if s.finish_reason:
                    self._release(s)
                else:
                    self.active.append(s)
        if self.active:
            events += [self._event(s, new) for s, new in self._step(self.active)]
            for s in [s for s in self.active if s.finish_reason]:
                self.active.remove(s)
                self._release(s)
        return events

    def _event(self, s: RequestState, new: list[int]) -> Event:
        if not s.finish_reason:
            return Event(s.index, new, stats=s.stats)
        route = s.route
        return Event(s.index, new, s.finish_reason, s.stats,
                     route.main_drafter(s.drafter) if route else s.drafter,
                     route.switches if route else [], s.error)

    def _release(self, s: RequestState) -> None:
        if s.route is not None:
            self.router.finish(s.route)
        for name, view in s.views.items():
            self.drafters[name].release(view)
        self.free.append(s.slot)
        s.slot = -1

    # -- the work -----------------------------------------------------------------------------
    def _capture(self, states) -> tuple[int, ...]:
        return tuple(sorted({i for s in states for n in self.attached(s)
                             for i in self.drafters[n].capture}))

    def _on_commit(self, s: RequestState, hidden: dict, start: int, end: int) -> None:
        for name in self.attached(s):
            d = self.drafters[name]
            try:
                d.on_commit(s.view(name), {l: hidden[l][start:end] for l in d.capture})
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                self._fail(s, name, exc)

    @staticmethod
    def _fail(s: RequestState, drafter: str, exc: Exception) -> None:
        """End request s with an error of its drafter's; the other requests are not touched."""
        s.finish_reason, s.error = "error", f"drafter {drafter} failed: {type(exc).__name__}: {exc}"

    def _prefill_group(self, pending: deque, free: list[int]) -> list[RequestState]:
        """Next prompts to prefill in one packed forward. Packing stays within the row-exact
        kernels (SKINNY_MAX_ROWS rows); a longer prompt goes alone, exactly as at batch 1."""
        group, rows = [], 0
        while pending and free:
            n = len(pending[0].tokens)
            if group and rows + n > SKINNY_MAX_ROWS:
                break
            s = pending.popleft()
            s.slot = free.pop()
            group.append(s)
            rows += n
            if rows > SKINNY_MAX_ROWS:
                break
        return group

    def _prefill(self, group: list[RequestState]) -> list[list[int]]:
        """Prompt forward for a group of requests; each samples its first token."""
        lengths = [len(s.tokens) for s in group]
        batch = self.model.batch([Segment(s.slot, 0, n) for s, n in zip(group, lengths)])
        last = torch.tensor(lengths).cumsum(0) - 1
        t0 = time.perf_counter()
        logits, hidden = self.model.forward(torch.tensor([t for s in group for t in s.tokens]),
                                            batch, self.cache, logit_rows=last,
                                            capture=self._capture(group))
        self.prefill_time += time.perf_counter() - t0
        out, start = [], 0
        for i, (s, n) in enumerate(zip(group, lengths)):
            new = self._commit(s, [self._sample_one(logits[i], s)])
            self._on_commit(s, hidden, start, start + n)
            out.append(new)
            start += n
        return out

    def _sample_one(self, logits: torch.Tensor, s: RequestState) -> int:
        if s.params.greedy:
            return int(logits.argmax())
        return int(sample_inverse_cdf(probs_from_logits(logits[None], s.params), s.uniforms(1)))

    def _propose(self, active: list[RequestState], names: list[str],
                 shadow: bool = False) -> tuple[list[Proposal], dict]:
        """One proposal per request from drafter names[i] (grouped: one call per drafter), and
        the seconds each drafter took. A drafter that raises fails its requests (a shadow
        draft for routing only loses its say)."""
        props: list[Proposal | None] = [None] * len(active)
        spent: dict[str, float] = {}
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(name, []).append(i)
        for name, idx in groups.items():
            t0 = time.perf_counter()
            views = [active[i].view(name) for i in idx]
            try:
                for i, p in zip(idx, self.drafter(name).propose(views), strict=True):
                    props[i] = p
            except Exception as exc:  # noqa: BLE001 - these requests fail, the batch goes on
                for i in idx:
                    if not shadow:
                        self._fail(active[i], name, exc)
                    props[i] = Proposal.empty()
            spent[name] = time.perf_counter() - t0
            if self.router is not None:
                self.router.note_draft_time(name, spent[name] / len(idx))
        return [p.clip(self._room(s)) for s, p in zip(active, props)], spent

    def _room(self, s: RequestState) -> int:
        """Draft tokens request s can still use: never past its token budget or the cache (the
        bonus token always comes)."""
        return max(min(s.params.max_new_tokens - len(s.output), self.max_len - len(s.tokens)) - 1, 0)

    def _curve(self, batch: int):
        """C_B(n) for a forward over `batch` requests: (n, seconds) tensors and a function."""
        if batch not in self._curves:
            self._curves[batch] = (self.cost.tensors(batch), route_cost(self.cost, batch))
        return self._curves[batch]

    def _cut(self, props: list[Proposal], t_draft: float, t_fixed: float) -> list[Proposal]:
        """D-cut over the batch's drafts; without it, only the row limit of lossless kernels."""
        lengths = torch.tensor([len(p.tokens) for p in props], dtype=torch.long)
        total = int(lengths.sum())
        if self.dcut and total:
            _, keep = dcut_select(torch.cat([p.confidence for p in props]).double(), lengths,
                                  t_draft, t_fixed, *self._curve(len(props))[0],
                                  torch.tensor(RATIOS, dtype=torch.float64))
            self.dcut_drafted += total
            self.dcut_kept += int(keep.sum())
            props = [p.clip(int(k)) for p, k in zip(props, keep)]
            lengths = keep
        # one forward verifies at most SKINNY_MAX_ROWS tokens (row-exact kernels: lossless)
        while int(lengths.sum()) + len(props) > SKINNY_MAX_ROWS:
            i = int(lengths.argmax())
            lengths[i] -= 1
            props[i] = props[i].clip(int(lengths[i]))
        return props

    def _step(self, active: list[RequestState]) -> list[tuple[RequestState, list[int]]]:
        self.steps += 1
        t_step = time.perf_counter()
        # a request on its last token does not draft (nor tell the gate its drafter brought 0)
        names = [s.drafter if self._room(s) else "none" for s in active]
        gate = self.gate if self.dcut else None  # D-cut off: fixed draft lengths
        t_fixed = max(self.t_fixed + self.fwd_offset.get(len(active), 0.0), 0.0)
        # C_B(n) of this step's B requests, for the gate, the router and the calibration offset
        curve = self._curve(len(active))[1] if self.cost is not None else None
        if gate is not None:
            names = gate.plan(self.steps, names, t_fixed, curve)
        props, drafting = self._propose(active, names)
        failed = [(s, []) for s in active if s.finish_reason == "error"]
        if failed:  # a drafter raised: its requests end with that error, the others step on
            keep = [i for i, s in enumerate(active) if s.finish_reason != "error"]
            active, names, props = [active[i] for i in keep], [names[i] for i in keep], \
                [props[i] for i in keep]
            drafting = {n: t for n, t in drafting.items() if n in names}
            if not active:
                return failed
        shadow = {}  # routed requests: one other candidate drafts too, every few steps
        for i, s in enumerate(active):
            if s.route is not None:
                name = self.router.shadow_due(s.route, s.drafter, self.available, curve)
                if name:
                    shadow[i] = name
        if shadow:
            idx = list(shadow)
            for i, p in zip(idx, self._propose([active[i] for i in idx], [shadow[i] for i in idx],
                                               shadow=True)[0]):
                self.router.record(active[i].route, shadow[i], len(active[i].tokens), p.tokens.tolist())
        t_draft = time.perf_counter() - t_step
        props = self._cut(props, t_draft, t_fixed)
        tokens, segments = [], []
        for s, p in zip(active, props):
            tokens.append(torch.tensor([s.tokens[-1]]))
            tokens.append(p.tokens)
            segments.append(Segment(s.slot, s.cache_len, 1 + len(p.tokens)))
        tokens = torch.cat(tokens)
        t_fwd = time.perf_counter()
        logits, hidden = self.model.forward(tokens, self.model.batch(segments),
                                            self.cache, capture=self._capture(active))
        t_fwd = time.perf_counter() - t_fwd
        if curve is not None:
            profiled = curve(len(tokens))
            if self.governor is not None:
                self.governor.observe(t_fwd, profiled)
            off = t_fwd - profiled
            old = self.fwd_offset.get(len(active))
            self.fwd_offset[len(active)] = off if old is None else 0.8 * old + 0.2 * off
        verdicts = verify_batch(logits, [p.tokens for p in props], [s.params for s in active],
                                [None if s.params.greedy else s.uniforms(len(p.tokens) + 1)
                                 for s, p in zip(active, props)])
        out, row = [], 0
        for s, p, (accepted, new) in zip(active, props, verdicts):
            k = len(p.tokens)
            s.stats.steps += 1
            s.stats.drafted += k
            s.stats.accepted += accepted
            committed = self._commit(s, new)
            s.stats.committed += len(committed)
            self._on_commit(s, hidden, row, row + accepted + 1)
            if s.route is not None:
                s.route.used[s.drafter] = s.route.used.get(s.drafter, 0) + 1
                s.drafter = self.router.observe(s.route, s.drafter, accepted, k, s.tokens, curve)
            out.append((s, committed))
            row += k + 1
        out += failed
        if gate is not None:
            for name, seconds in drafting.items():
                mine = [(len(p.tokens), v[0]) for n, p, v in zip(names, props, verdicts) if n == name]
                gate.observe(name, len(mine), seconds, sum(k for k, _ in mine),
                                  sum(a for _, a in mine))
        total = time.perf_counter() - t_step
        spent = total - t_draft - t_fwd
        self.t_fixed = spent if self.steps == 1 else 0.9 * self.t_fixed + 0.1 * spent
        if self.router is not None:
            self.router.add_step(total, sum(len(c) for _, c in out), len(tokens))
        return out

    def _commit(self, s: RequestState, new: list[int]) -> list[int]:
        """Append tokens, cut at the first stop token or the length limit; set finish_reason."""
        p = s.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.target.eos_ids))
        kept = []
        for t in new:
            kept.append(t)
            if t in stops:
                s.finish_reason = "stop"
                break
            if len(s.output) + len(kept) >= p.max_new_tokens or \
                    len(s.tokens) + len(kept) >= self.max_len:
                s.finish_reason = "length"
                break
        s.tokens.extend(kept)
        return kept
