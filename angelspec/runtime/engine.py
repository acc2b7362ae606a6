"""The engine: requests in, tokens out, many at once over one static KV cache. It keeps the
slots, admission (every request validated up front), packed prompt prefill and streaming; each
step runs step.py's speculative step for every active request (hooks.py: the gate, the router,
timing). A request whose drafter is `auto` is routed by the engine's Router (router.py), which
may switch its drafter while it runs."""
from __future__ import annotations

import gc
import time
from collections import deque
from typing import Iterator

import torch

from angelspec import DEFAULT_MAX_LEN
from angelspec.checkpoint import Target
from angelspec.drafters import Drafter, canonical, make_drafter, parse_spec, parts
from angelspec.model import Segment
from angelspec.params import SamplingParams
from angelspec.plugins import SKINNY_MAX_ROWS
from angelspec.plugins.verify import sample_inverse_cdf
from angelspec.runtime.calibration import Calibration
from angelspec.runtime.cost import CostTable, profile
from angelspec.runtime.gate import DraftGate
from angelspec.runtime.hooks import StepHooks
from angelspec.runtime.manifest import EngineManifest
from angelspec.runtime.request import DrafterView, Event, Request, RequestState, Result
from angelspec.runtime.router import Router, route_cost
from angelspec.runtime.stats import EngineStats, Stats
from angelspec.runtime.step import StepContext, speculative_step
from angelspec.runtime.threads import ThreadGovernor
from angelspec.sampling import probs_from_logits

__all__ = ["DrafterView", "Engine", "Event", "Request", "RequestState", "Result", "Stats", "settle_heap"]


class Engine:
    """Serves many requests on one target; every request picks its drafter by name (or `auto`).

    dcut: trim each step's drafts with D-cut against `cost` (C(n), profiled now if not given).
    draft_lens: draft length per drafter kind (an engine's tuned ngram length), below draft_len.
    prompt_prefix: tokens many prompts start with (a chat template's preamble, Target.chat_prefix):
    computed once, their keys, values and hidden states are copied into a prompt's slot instead of
    prefilled (where prefill is row-exact, the entries a whole prefill writes; above
    SKINNY_MAX_ROWS BLAS prefill of float32 / weight-only / bf16-without-AMX weights rounds by row
    count, and the entries are this engine's own, the same for every request and drafter).
    """

    def __init__(self, target: Target, max_batch: int = 8, max_len: int = DEFAULT_MAX_LEN,
                 draft_len: int | None = None, drafters: dict[str, Drafter] | None = None,
                 drafts: str | None = None, dcut: bool = False, cost: CostTable | None = None,
                 router: Router | None = None, draft_lens: dict[str, int] | None = None,
                 kinds: set[str] | None = None, max_drafters: int = 16, adapt_threads: bool = True,
                 default_drafter: str = "none", manifest: EngineManifest | None = None,
                 prompt_prefix: list[int] | None = None):
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
        self.default_drafter = default_drafter  # a request's drafter when it names none
        self.manifest = manifest  # the engine folder's, when loaded from one (engine_dir.py)
        self.dcut = dcut
        if dcut and cost is None:
            cost = profile(self.model, max_tokens=SKINNY_MAX_ROWS)
        self.cost = cost
        self._curves: dict = {}  # requests in a forward -> (C_B(n) tensors, C_B(n) function)
        # with D-cut, drafters whose drafting costs more than it brings sit steps out
        self.gate = DraftGate(route_cost(cost)) if cost else None
        self.calibration = Calibration()  # each drafter's confidences, as D-cut should read them
        # with a cost profile to compare against, the step's thread count follows the cores the
        # engine really gets (threads.py)
        self.governor = ThreadGovernor() if cost is not None and adapt_threads else None
        self.router = router
        self.stats = EngineStats()
        self.hooks = StepHooks(self)  # around every step: the gate, the router, timing
        self._available: dict[str, bool] = {}
        self.pending: deque[RequestState] = deque()  # admitted, waiting for a slot
        self.active: list[RequestState] = []  # holding a slot, decoding
        self.free = list(range(max_batch - 1, -1, -1))  # free cache slots (slot 0 first)
        self.prompt_prefix = list(prompt_prefix or [])
        self._prefix = None  # (saved KV entries, {layer: hidden [P, h]}) once computed

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
            kinds = [parse_spec(p)[0] for p in parts(key)]
            for kind in kinds:
                if self.kinds is not None and kind not in self.kinds:
                    raise ValueError(f"drafter {kind!r} is not in this engine; it serves "
                                     + ", ".join(sorted(self.kinds | ({"auto"} if self.router else set()))))
            if len(self.drafters) >= self.max_drafters:
                raise ValueError(f"too many drafter variants in use ({self.max_drafters}); use one "
                                 f"of: {', '.join(sorted(self.drafters))}")
            self.drafters[key] = make_drafter(key, self.draft_len or self.draft_lens, self.target,
                                              self.drafts)
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
        for name in drafters or dict.fromkeys([self.default_drafter, "none"]):
            for params in (SamplingParams(max_tokens=8),
                           SamplingParams(max_tokens=8, temperature=1.0, seed=0)):
                self.generate([Request(ids, params, name)])
        settle_heap()

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
            record = speculative_step(self.step_context(), self.active)
            if record.verified:
                self.hooks.finished(record)
            events += [self._event(s, new) for s, new in record.committed + record.failed]
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
    def step_context(self) -> StepContext:
        """What the step reads of this engine, as it stands now."""
        return StepContext(self.model, self.cache, self.max_len, self.dcut, self.calibration, self.stats,
                           self.hooks, self.router, self.drafter, self.curve, self.capture, self.commit,
                           self.feed_drafters)

    def capture(self, states) -> tuple[int, ...]:
        return tuple(sorted({i for s in states for n in self.attached(s)
                             for i in self.drafters[n].capture}))

    def feed_drafters(self, s: RequestState, hidden: dict, rows) -> None:
        """Hand each drafter of s the target's hidden states at `rows` (a slice or indices) of the
        forward: the newly cached positions, in order."""
        for name in self.attached(s):
            d = self.drafters[name]
            try:
                d.on_commit(s.view(name), {l: hidden[l][rows] for l in d.capture})
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                s.fail(name, exc)

    def _prefill_group(self, pending: deque, free: list[int]) -> list[RequestState]:
        """Next prompts to prefill in one packed forward. Packing stays within the row-exact
        kernels (SKINNY_MAX_ROWS rows); a longer prompt goes alone, exactly as at batch 1."""
        group, rows = [], 0
        while pending and free:
            n = len(pending[0].tokens) - self._cached(pending[0])
            if group and rows + n > SKINNY_MAX_ROWS:
                break
            s = pending.popleft()
            s.slot = free.pop()
            group.append(s)
            rows += n
            if rows > SKINNY_MAX_ROWS:
                break
        return group

    def _cached(self, s: RequestState) -> int:
        """Leading prompt positions of s that come from the prompt prefix cache (0: none)."""
        p = len(self.prompt_prefix)
        return p if p and len(s.tokens) > p and s.tokens[:p] == self.prompt_prefix else 0

    def _prefill(self, group: list[RequestState]) -> list[list[int]]:
        """Prompt forward for a group of requests (each from its cached prefix on); each samples
        its first token."""
        t0 = time.perf_counter()
        starts = [self._cached(s) for s in group]
        if any(starts):
            saved, prefix_hidden = self._prompt_prefix(next(s.slot for s, c in zip(group, starts) if c))
            for s, c in zip(group, starts):
                if c:
                    self.cache.restore(s.slot, saved, c)
            self.stats.prefix_hits += sum(1 for c in starts if c)
        lengths = [len(s.tokens) - c for s, c in zip(group, starts)]
        batch = self.model.batch([Segment(s.slot, c, n) for s, c, n in zip(group, starts, lengths)])
        last = torch.tensor(lengths).cumsum(0) - 1
        logits, hidden = self.model.forward(torch.tensor([t for s, c in zip(group, starts) for t in s.tokens[c:]]),
                                            batch, self.cache, logit_rows=last,
                                            capture=self.capture(group))
        self.stats.prefill_time += time.perf_counter() - t0
        out, row = [], 0
        for i, (s, c, n) in enumerate(zip(group, starts, lengths)):
            new = self.commit(s, [self._sample_one(logits[i], s)])
            mine = {l: h[row: row + n] for l, h in hidden.items()}
            if c:
                mine = {l: torch.cat([prefix_hidden[l], h]) for l, h in mine.items()}
            self.feed_drafters(s, mine, slice(None))
            out.append(new)
            row += n
        return out

    def _prompt_prefix(self, slot: int):
        """The prompt prefix's saved KV entries and hidden states (every layer's), computed on
        first use in `slot` (whose prompt starts with it)."""
        if self._prefix is None:
            p = len(self.prompt_prefix)
            _, hidden = self.model.forward(torch.tensor(self.prompt_prefix), self.model.batch([Segment(slot, 0, p)]),
                                           self.cache, logit_rows=torch.tensor([p - 1]),
                                           capture=tuple(range(self.model.cfg.num_layers + 1)))
            self._prefix = (self.cache.save(slot, p), {l: h.clone() for l, h in hidden.items()})
        return self._prefix

    def _sample_one(self, logits: torch.Tensor, s: RequestState) -> int:
        if s.params.greedy:
            return int(logits.argmax())
        return int(sample_inverse_cdf(probs_from_logits(logits[None], s.params), s.uniforms(1)))

    def curve(self, batch: int):
        """C_B(n) for a forward over `batch` requests: (n, seconds) tensors and a function."""
        if batch not in self._curves:
            self._curves[batch] = (self.cost.tensors(batch), route_cost(self.cost, batch))
        return self._curves[batch]

    def commit(self, s: RequestState, new: list[int]) -> list[int]:
        """Append tokens, cut at the first stop token or the length limit; set finish_reason."""
        p = s.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.target.eos_ids))
        kept = []
        for t in new:
            kept.append(t)
            if t in stops:
                s.finish_reason = "stop"
                break
            if len(s.output) + len(kept) >= p.max_tokens or \
                    len(s.tokens) + len(kept) >= self.max_len:
                s.finish_reason = "length"
                break
        s.tokens.extend(kept)
        return kept


def settle_heap() -> None:
    """Hide every object alive now from the garbage collector (gc.freeze): torch's own objects,
    the model and the drafters live as long as the process serves, and a full collection over
    them is a stall for every request in flight, a few times a minute while ngram drafts (its
    cost: docs/results/design-measurements.md). What is made later is collected as
    usual; what was hidden and has died since (an earlier engine of the same process) is
    collected here. Called once an engine is warm (a server's, a benchmark's, the data step's)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
