"""D-cut (`angelspec::dcut_select`): which of a batch's draft tokens one step verifies
(docs/algorithms.md, section 3).

Drafts are chains or token trees (each token's parent given, -1 for a child of the anchor).
Survival s_n = prod of the confidences c on the path to token n estimates P(token n is accepted);
along a path it never grows. For each keep ratio rho (0, 0.25, 0.5, 0.75, 1),
K = ceil(rho * sum_i D_i) and the GLOBAL top-K survivals of the batch are kept (ties in draft
order, so a token is never kept without its parent: for a chain, a prefix); the utility is

    U(rho) = (bs + sum of the kept survivals) / (T_draft + C(bs + K) + T_fixed)

with C(n) the measured time of one packed verification forward over n tokens. The largest U
wins, ties to the smaller rho; the anchor of every request is always verified (bs tokens).
The sum of the kept survivals is the expected number of accepted tokens: a tree accepts at most
one child per parent, so its tokens' acceptances add up like a chain's.
"""
import bisect
import math
from collections.abc import Sequence

import torch
from torch import Tensor

# the paper's ratios, plus 0 (under heavy load verifying no drafts at all can be the best step)
# and finer steps below a half: with 16 requests drafting 3 tokens each, 0.25 keeps 12 tokens at
# once, and on a CPU where a verified token costs nearly what it brings the 12th did not pay for
# itself while the first few did
RATIOS = (0.0, 0.0625, 0.125, 0.1875, 0.25, 0.375, 0.5, 0.75, 1.0)


def interpolate_cost(n: Tensor, cost_n: Tensor, cost_t: Tensor) -> Tensor:
    """C(n) from a profiled table (sorted cost_n): linear between points, linear extrapolation
    from the last two points above the table, the first point's time below it (float64, n's
    shape)."""
    cn, ct = cost_n.double().tolist(), cost_t.double().tolist()
    return torch.tensor([_interpolate(x, cn, ct) for x in n.double().flatten().tolist()],
                        dtype=torch.float64).view(n.shape)


def survival(conf: list[float], parents: list[int], lengths: list[int]) -> list[float]:
    """Per draft token, the product of the confidences (each clamped to [1e-30, 1]) on its path
    (request by request; parents index within the request, -1 for a child of the anchor, parents
    first)."""
    out, tok = [], 0
    for k in lengths:
        for i in range(k):
            p = parents[tok + i]
            out.append(min(max(conf[tok + i], 1e-30), 1.0) * (out[tok + p] if p >= 0 else 1.0))
        tok += k
    return out


def _interpolate(x: float, cost_n: list[float], cost_t: list[float]) -> float:
    """interpolate_cost at one point, in Python numbers."""
    if len(cost_n) == 1:
        return cost_t[0] * x / cost_n[0]
    if x <= cost_n[0]:
        return cost_t[0]
    i = min(max(bisect.bisect_left(cost_n, x), 1), len(cost_n) - 1)
    x0, x1, y0, y1 = cost_n[i - 1], cost_n[i], cost_t[i - 1], cost_t[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def dcut_choose(confidence: list[float], lengths: list[int], parents: list[int], t_draft: float, t_fixed: float,
                cost_n: list[float], cost_t: list[float], ratios: Sequence[float]) -> tuple[float, list[int]]:
    """dcut_select in Python numbers: (the ratio chosen, the indices of the tokens kept, best
    first). The engine calls it every step: a step offers tens of tokens, too few to pay for a
    chain of small tensor ops, or for a Python op's round trip through the dispatcher (a real
    part of a one-row forward)."""
    bs, total = len(lengths), sum(lengths)
    if total == 0:
        return 1.0, []
    surv = survival(confidence, parents, lengths)
    # a stable sort keeps draft order among equal survivals: parents before their children
    order = sorted(range(total), key=surv.__getitem__, reverse=True)
    prefix = [0.0]
    for i in order:
        prefix.append(prefix[-1] + surv[i])
    ks = [math.ceil(r * total - 1e-9) for r in ratios]
    utility = [(bs + prefix[k]) / (t_draft + _interpolate(float(bs + k), cost_n, cost_t) + t_fixed) for k in ks]
    top = max(utility)
    best = next(j for j, u in enumerate(utility) if u >= top * (1 - 1e-12))  # ties: the smaller ratio
    return ratios[best], order[: ks[best]]


@torch.library.custom_op("angelspec::dcut_select", mutates_args=())
def dcut_select(confidence: Tensor, lengths: Tensor, parents: Tensor, t_draft: float,
                t_fixed: float, cost_n: Tensor, cost_t: Tensor, ratios: Tensor) -> tuple[Tensor, Tensor]:
    """confidence and parents [sum(lengths)] (request by request, in draft order), lengths [B],
    times in seconds, cost table (cost_n [P] total verified tokens, cost_t [P] seconds), ratios
    [R] ascending -> (chosen ratio [] float64, keep [sum(lengths)] bool: the tokens verified).
    Computed by `dcut_choose`."""
    ratio, kept = dcut_choose(confidence.double().tolist(), lengths.tolist(), parents.tolist(), t_draft, t_fixed,
                              cost_n.double().tolist(), cost_t.double().tolist(), ratios.double().tolist())
    keep = torch.zeros(len(confidence), dtype=torch.bool)
    keep[kept] = True
    return torch.tensor(ratio, dtype=torch.float64), keep


@dcut_select.register_fake
def _(confidence, lengths, parents, t_draft, t_fixed, cost_n, cost_t, ratios):
    return (torch.empty((), dtype=torch.float64, device=confidence.device),
            confidence.new_empty(confidence.shape, dtype=torch.bool))
