"""One speculative step for every request in flight: draft -> D-cut -> verify -> commit.

The gate, the router and the timing statistics are hooks around it (hooks.py); the engine
(engine.py) keeps slots, admission, prefill and streaming. Autoregressive decoding is this step
with empty drafts."""
from __future__ import annotations

import time
from collections import Counter

import torch

from angelspec.drafters import Proposal
from angelspec.model import Segment
from angelspec.plugins import RATIOS, SKINNY_MAX_ROWS, dcut_choose, survival
from angelspec.runtime.request import RequestState
from angelspec.runtime.verify import verify_batch

Committed = list[tuple[RequestState, list[int]]]


def speculative_step(engine, active: list[RequestState]) -> Committed:
    """Every active request drafts, the batch's drafts are cut to what pays, one packed target
    forward verifies them all, and each request commits its accepted prefix + the bonus token.
    Returns each request with the tokens it committed."""
    hooks, t_start = engine.hooks, time.perf_counter()
    engine.stats.steps += 1
    # 1. draft (a request on its last token does not); the gate may sit a drafter out
    names = hooks.plan(active, [s.drafter if room(engine, s) else "none" for s in active])
    # a request's first proposal catches its drafter up on the whole prompt: a prefill's work
    fresh = {n for s, n in zip(active, names) if n != "none" and not s.view(n).proposed}
    props, drafting = propose(engine, active, names)
    failed = [(s, []) for s in active if s.finish_reason == "error"]  # its drafter raised
    if failed:  # those requests end with its error; the others step on
        active, names, props, drafting = without_failed(active, names, props, drafting)
        if not active:
            return failed
    hooks.shadow(active, names)
    t_draft = time.perf_counter() - t_start
    # 2. D-cut: the batch's likeliest draft tokens (by calibrated survival), against the
    # verification cost
    t0 = time.perf_counter()
    props = cut(engine, props, names, t_draft, hooks.t_fixed(len(active)))
    book = bookkeeping(names, time.perf_counter() - t0)
    # 3. verify: one forward over every request's [anchor + kept drafts] (chains or trees), packed
    tokens = torch.tensor([t for s, p in zip(active, props)
                           for t in (s.tokens[-1], *p.tokens.tolist())])
    segments = [Segment(s.slot, s.cache_len, 1 + len(p.tokens),
                        None if p.parents is None else torch.cat([torch.tensor([-1]), p.parents + 1]))
                for s, p in zip(active, props)]
    batch = engine.model.batch(segments)
    t0 = time.perf_counter()
    logits, hidden = engine.model.forward(tokens, batch, engine.cache, capture=engine.capture(active))
    t_fwd = time.perf_counter() - t0
    hooks.forwarded(len(active), len(tokens), t_fwd)
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
        t0 = time.perf_counter()
        if engine.dcut:
            engine.calibration.observe(name, p, path)
        t_book = time.perf_counter() - t0
        if path != list(range(accepted)):
            engine.cache.move(s.slot, [s.cache_len + 1 + i for i in path],
                              [s.cache_len + 1 + d for d in range(accepted)])
        committed = engine.commit(s, new)
        s.stats.add(len(p.tokens), accepted, len(committed))
        t0 = time.perf_counter()
        engine.feed_drafters(s, hidden, slice(row, row + len(mine)))
        if name in book:
            book[name] += t_book + time.perf_counter() - t0
        hooks.committed(s, accepted, len(p.tokens))
        out.append((s, committed))
        row += len(mine)
    hooks.finished(names, props, verdicts, drafting, book, fresh, time.perf_counter() - t_start, t_draft,
                   t_fwd, sum(len(c) for _, c in out), len(tokens))
    return out + failed


def bookkeeping(names: list[str], t_cut: float) -> dict[str, float]:
    """Each drafter's share of what its drafts cost the step besides proposing them: D-cut's
    cut (calibration included; split by requests), then (added while committing) calibrating
    on the verdicts and feeding the drafter the committed tokens. The gate prices a drafter by
    its proposals plus this, so a drafter whose tokens barely pay sits out."""
    drafting = Counter(n for n in names if n != "none")
    total = sum(drafting.values())
    return {n: t_cut * k / total for n, k in drafting.items()}


def uniforms(s: RequestState, depths: torch.Tensor) -> torch.Tensor:
    """A sampling request's uniform for each verified row: its position's (rows at one depth of a
    tree share it)."""
    return s.uniforms(int(depths.max()) + 1)[depths]


def without_failed(active, names, props, drafting):
    keep = [i for i, s in enumerate(active) if s.finish_reason != "error"]
    names = [names[i] for i in keep]
    return ([active[i] for i in keep], names, [props[i] for i in keep],
            {n: t for n, t in drafting.items() if n in names})


def room(engine, s: RequestState) -> int:
    """Draft tokens request s can still use: never past its token budget or the cache (the
    bonus token always comes)."""
    return max(min(s.params.max_tokens - len(s.output), engine.max_len - len(s.tokens)) - 1, 0)


def propose(engine, active: list[RequestState], names: list[str],
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
            for i, p in zip(idx, engine.drafter(name).propose(views), strict=True):
                props[i] = p
            for v in views:
                v.proposed = True
        except Exception as exc:  # noqa: BLE001 - these requests fail, the batch goes on
            for i in idx:
                if not shadow:
                    active[i].fail(name, exc)
                props[i] = Proposal.empty()
        spent[name] = time.perf_counter() - t0
        if engine.router is not None:
            engine.router.note_draft_time(name, spent[name] / len(idx))
    # a sliding-window target verifies chains only (the tree kernel needs full attention)
    trees = engine.model.cfg.sliding_window is None
    return [(p if trees else p.chain()).clip(room(engine, s)) for s, p in zip(active, props)], spent


def cut(engine, props: list[Proposal], names: list[str], t_draft: float, t_fixed: float) -> list[Proposal]:
    """D-cut over the batch's drafts (chains or trees; names[i]: request i's drafter, whose
    confidences it reads calibrated); without it, only the row limit of the lossless kernels,
    which drops the tokens least likely to survive. In Python numbers: a step's tens of tokens
    do not pay for tensor ops."""
    lengths = [len(p.tokens) for p in props]
    total = sum(lengths)
    if not total:
        return props
    parents = [q for p in props for q in p.parent_list()]
    if engine.dcut:
        confidence = [c for n, p in zip(names, props) for c in engine.calibration.apply(n, p)]
        cost_n, cost_t = engine.curve(len(props))[0]  # as profiled, then at this step's context
        _, kept = dcut_choose(confidence, lengths, parents, t_draft, t_fixed, cost_n.tolist(),
                              (cost_t + engine.hooks.shift * cost_n).tolist(), RATIOS)
        engine.stats.dcut_drafted += total
        engine.stats.dcut_kept += len(kept)
    else:
        kept = range(total)
    # one forward verifies at most SKINNY_MAX_ROWS tokens (row-exact kernels: lossless); D-cut's
    # choice comes best first
    room = SKINNY_MAX_ROWS - len(props)
    if len(kept) > room:
        if not engine.dcut:
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
