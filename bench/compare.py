"""How bench judges a runner's output and speed against ar's: token lists compared
(first_difference, agreement), a divergence at a near-tie of the target told from a real one
(top2_margin, compare), and per-batch speed ratios (paired)."""
from __future__ import annotations

import statistics

import torch

from angelspec.checkpoint import Target
from angelspec.model import Segment

NEAR_TIE_EPS = 1e-4


def first_difference(ref: list[int], out: list[int]) -> int:
    """The first position where two token lists differ (the shorter's length if one is a prefix)."""
    return next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))


def agreement(ref: list[int], out: list[int]) -> float:
    """Share of `ref`'s tokens that `out` reproduces before it first differs."""
    return first_difference(ref, out) / max(len(ref), 1)


def top2_margin(target: Target, tokens: list[int]) -> float:
    """Target's top-2 logit margin for the token after `tokens` (batch 1, this engine)."""
    model = target.model
    cache = model.new_cache(1, len(tokens) + 1)
    logits, _ = model.forward(torch.tensor(tokens), model.batch([Segment(0, 0, len(tokens))]),
                              cache, logit_rows=torch.tensor([len(tokens) - 1]))
    top = logits[0].topk(2).values
    return float(top[0] - top[1])


def compare(target: Target, ids: list[int], ref: list[int], out: list[int], eps: float) -> str:
    """'same', 'near_tie' (first divergence at a near-tie of the target) or 'diverged'."""
    if out == ref:
        return "same"
    j = first_difference(ref, out)
    if j >= min(len(ref), len(out)):  # one stopped where the other went on
        return "diverged"
    return "near_tie" if top2_margin(target, ids + ref[:j]) < eps else "diverged"


def paired(rates: list[float], ar_rates: list[float]) -> dict:
    """A runner's tokens/s on each batch over ar's on the same batch, run moments apart: on a
    machine whose speed drifts, their spread says whether a ratio of totals is above or below
    1 by more than the drift (the median, the extremes, and in how many batches it was >= 1)."""
    r = sorted(a / b for a, b in zip(rates, ar_rates))
    return {"batches": len(r), "median": round(statistics.median(r), 3), "min": round(r[0], 3),
            "max": round(r[-1], 3), "at_least_ar": sum(x >= 1 for x in r)}
