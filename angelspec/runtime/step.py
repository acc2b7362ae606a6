"""One speculative step for every request in flight: draft -> D-cut -> verify -> commit.

The gate, the router and the timing statistics are hooks around it (hooks.py); the engine
(engine.py) keeps slots, admission, prefill and streaming. Autoregressive decoding is this step
with empty drafts."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from angelspec.drafters import Drafter, Proposal
from angelspec.model import KVCache, Llama, Segment
from angelspec.plugins import RATIOS, SKINNY_MAX_ROWS, dcut_choose, survival
from angelspec.runtime.calibration import Calibration
from angelspec.runtime.request import RequestState
from angelspec.runtime.router import Router
from angelspec.runtime.stats import EngineStats
from angelspec.runtime.verify import verify_batch

if TYPE_CHECKING:
    from angelspec.runtime.hooks import StepHooks

Committed = list[tuple[RequestState, list[int]]]


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a step reads of its engine. Engine.step_context builds one for every step, so what
    changes on the engine between steps (a benchmark switching D-cut) holds from the next."""
    model: Llama
    cache: KVCache
    max_len: int  # a request's context, prompt included
    dcut: bool
    calibration: Calibration  # each drafter's confidences, as D-cut reads them
    stats: EngineStats
    hooks: StepHooks
    router: Router | None
    drafter: Callable[[str], Drafter]  # a drafter by name (Engine.drafter)
    curve: Callable[[int], tuple]  # C_B(n) of a forward over B requests (Engine.curve)
    capture: Callable[[list[RequestState]], tuple[int, ...]]  # hidden states the drafters read
    commit: Callable[[RequestState, list[int]], list[int]]  # append, cut at a stop (Engine.commit)
    feed: Callable[[RequestState, dict, slice], None]  # the drafters' view of a commit


class Clock:
    """The step's one timer: `with clock(key):` adds the block's seconds to spent[key]; blocks do
    not nest. elapsed(): seconds since the step began."""
    __slots__ = ("start", "spent", "_key", "_t0")

    def __init__(self):
        self.start = time.perf_counter()
        self.spent: dict = {}

    def __call__(self, key) -> Clock:
        self._key = key
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.spent[self._key] = self.spent.get(self._key, 0.0) + time.perf_counter() - self._t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass(slots=True)
class StepRecord:
    """What one step did. The engine streams `committed` and `failed`; the hooks learn from the
    rest (StepHooks.finished)."""
    names: list[str]  # each request's drafter this step ("none": it did not draft)
    props: list[Proposal]  # each request's draft as verified (after D-cut)
    verdicts: list[tuple]  # verify_batch's (accepted, new tokens, path) for each request
    drafting: dict[str, float]  # seconds each drafter spent proposing
    book: dict[str, float]  # seconds of each drafter's other handling (bookkeeping)
    fresh: set[str]  # drafters that proposed a request's first draft (a prefill's work: untimed)
    times: dict  # seconds: "draft", "cut", "forward", "step" (the whole)
    verified: int  # tokens in the verification forward (0: none ran)
    committed: Committed  # each request with the tokens it committed
    failed: Committed  # requests whose drafter raised (they end with its error)


def speculative_step(ctx: StepContext, active: list[RequestState]) -> StepRecord:
    """Every active request drafts, the batch's drafts are cut to what pays, one packed target
    forward verifies them all, and each request commits its accepted prefix + the bonus token."""
    hooks, clock = ctx.hooks, Clock()
    ctx.stats.steps += 1
    with clock("draft"):
        # 1. draft (a request on its last token does not); the gate may sit a drafter out
        names = hooks.plan(active, [s.drafter if room(ctx, s) else "none" for s in active])
        # a request's first proposal catches its drafter up on the whole prompt: a prefill's work
        fresh = {n for s, n in zip(active, names) if n != "none" and not s.view(n).proposed}
        props, drafting = propose(ctx, active, names)
        failed = [(s, []) for s in active if s.finish_reason == "error"]  # its drafter raised
        if failed:  # those requests end with its error; the others step on
            active, names, props, drafting = without_failed(active, names, props, drafting)
        if active:
            hooks.shadow(ctx, active, names)
    if not active:
        return StepRecord(names, [], [], drafting, {}, fresh, clock.spent, 0, [], failed)
    # 2. D-cut: the batch's likeliest draft tokens (by calibrated survival), against the
    # verification cost
    with clock("cut"):
        props = cut(ctx, props, names, clock.spent["draft"], hooks.t_fixed(len(active)))
    # 3. verify: one forward over every request's [anchor + kept drafts] (chains or trees), packed
    tokens = torch.tensor([t for s, p in zip(active, props)
                           for t in (s.tokens[-1], *p.tokens.tolist())])
    segments = [Segment(s.slot, s.cache_len, 1 + len(p.tokens),
                        None if p.parents is None else torch.cat([torch.tensor([-1]), p.parents + 1]))
                for s, p in zip(active, props)]
    batch = ctx.model.batch(segments)
    with clock("forward"):
        logits, hidden = ctx.model.forward(tokens, batch, ctx.cache, capture=ctx.capture(active))
    hooks.forwarded(len(active), len(tokens), clock.spent["forward"])
    verdicts = verify_batch(logits, props, [s.params for s in active],
                            [None if s.params.greedy else uniforms(s, seg.depths())
                             for s, seg in zip(active, segments)])
    # 4. commit the accepted path + the bonus token (its KV entries moved into place, for a
    # tree); drafters see the target's hidden states of the path, gathered once for the batch
    rows, row = [], 0
    for p, (_, _, path) in zip(props, verdicts):
        rows.append([row] + [row + 1 + i for i in path])
        row += len(p.tokens) + 1
    if hidden:
        flat = torch.tensor([r for rs in rows for r in rs])
        hidden = {l: h[flat] for l, h in hidden.items()}
    out, row = [], 0
    for s, name, p, (accepted, new, path), mine in zip(active, names, props, verdicts, rows):
        if ctx.dcut:
            with clock(("book", name)):
                ctx.calibration.observe(name, p, path)
        if path != list(range(accepted)):
            ctx.cache.move(s.slot, [s.cache_len + 1 + i for i in path],
                           [s.cache_len + 1 + d for d in range(accepted)])
        committed = ctx.commit(s, new)
        s.stats.add(len(p.tokens), accepted, len(committed))
        with clock(("book", name)):
            ctx.feed(s, hidden, slice(row, row + len(mine)))
        hooks.committed(s, accepted, len(p.tokens))
        out.append((s, committed))
        row += len(mine)
    book = bookkeeping(names, clock.spent)
    clock.spent["step"] = clock.elapsed()
    return StepRecord(names, props, verdicts, drafting, book, fresh, clock.spent, len(tokens), out, failed)


def bookkeeping(names: list[str], spent: dict) -> dict[str, float]:
    """Each drafter's share of what its drafts cost the step besides proposing them: D-cut's
    cut (calibration included; split by requests), then calibrating on the verdicts and feeding
    the drafter the committed tokens (the clock's ("book", name)). The gate prices a drafter by
    its proposals plus this, so a drafter whose tokens barely pay sits out."""
    drafting = Counter(n for n in names if n != "none")
    total = sum(drafting.values())
    return {n: spent["cut"] * k / total + spent.get(("book", n), 0.0) for n, k in drafting.items()}


def uniforms(s: RequestState, depths: torch.Tensor) -> torch.Tensor:
    """A sampling request's uniform for each verified row: its position's (rows at one depth of a
    tree share it)."""
    return s.uniforms(int(depths.max()) + 1)[depths]


def without_failed(active, names, props, drafting):
    keep = [i for i, s in enumerate(active) if s.finish_reason != "error"]
    names = [names[i] for i in keep]
    return ([active[i] for i in keep], names, [props[i] for i in keep],
            {n: t for n, t in drafting.items() if n in names})


def room(ctx: StepContext, s: RequestState) -> int:
    """Draft tokens request s can still use: never past its token budget or the cache (the
    bonus token always comes)."""
    return max(min(s.params.max_tokens - len(s.output), ctx.max_len - len(s.tokens)) - 1, 0)


def propose(ctx: StepContext, active: list[RequestState], names: list[str],
            shadow: bool = False) -> tuple[list[Proposal], dict[str, float]]:
    """One proposal per request from drafter names[i] (one call per drafter), and the seconds
    each drafter took. A drafter that raises fails its requests (a shadow draft, drafted for
    routing only, just loses its say)."""
    props: list[Proposal | None] = [None] * len(active)
    spent: dict[str, float] = {}
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name, []).append(i)
    for name, idx in groups.items():
        t0 = time.perf_counter()
        views = [active[i].view(name) for i in idx]
        try:
            for i, p in zip(idx, ctx.drafter(name).propose(views), strict=True):
                props[i] = p
            for v in views:
                v.proposed = True
        except Exception as exc:  # noqa: BLE001 - these requests fail, the batch goes on
            for i in idx:
                if not shadow:
                    active[i].fail(name, exc)
                props[i] = Proposal.empty()
        spent[name] = time.perf_counter() - t0
        if ctx.router is not None:
            ctx.router.note_draft_time(name, spent[name] / len(idx))
    # a sliding-window target verifies chains only (the tree kernel needs full attention)
    trees = ctx.model.cfg.sliding_window is None
    return [(p if trees else p.chain()).clip(room(ctx, s)) for s, p in zip(active, props)], spent


def cut(ctx: StepContext, props: list[Proposal], names: list[str], t_draft: float, t_fixed: float) -> list[Proposal]:
    """D-cut over the batch's drafts (chains or trees; names[i]: request i's drafter, whose
    confidences it reads calibrated); without it, only the row limit of the lossless kernels,
    which drops the tokens least likely to survive. In Python numbers: a step's tens of tokens
    do not pay for tensor ops."""
    lengths = [len(p.tokens) for p in props]
    total = sum(lengths)
    if not total:
        return props
    parents = [q for p in props for q in p.parent_list()]
    if ctx.dcut:
        confidence = [c for n, p in zip(names, props) for c in ctx.calibration.apply(n, p)]
        cost_n, cost_t = ctx.curve(len(props))[0]  # as profiled, then at this step's context
        _, kept = dcut_choose(confidence, lengths, parents, t_draft, t_fixed, cost_n.tolist(),
                              (cost_t + ctx.hooks.shift * cost_n).tolist(), RATIOS)
        ctx.stats.dcut_drafted += total
        ctx.stats.dcut_kept += len(kept)
    else:
        kept = range(total)
    # one forward verifies at most SKINNY_MAX_ROWS tokens (row-exact kernels: lossless); D-cut's
    # choice comes best first
    room = SKINNY_MAX_ROWS - len(props)
    if len(kept) > room:
        if not ctx.dcut:
            surv = survival([c for p in props for c in p.confidence.tolist()], parents, lengths)
            kept = sorted(kept, key=surv.__getitem__, reverse=True)
        kept = kept[:room]
    mask = [False] * total
    for i in kept:
        mask[i] = True
    out, start = [], 0
    for p, k in zip(props, lengths):
        out.append(p.keep(mask[start: start + k]))
        start += k
    return out
