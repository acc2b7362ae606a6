"""D-cut (`angelspec::dcut_select`): how many of a batch's draft tokens one step verifies
(docs/algorithms.md, section 3).

Survival s_{i,k} = prod_{t<=k} c_{i,t} estimates P(request i's first k drafts are all accepted).
For each keep ratio rho (0, 0.25, 0.5, 0.75, 1), K = ceil(rho * sum_i D_i) and the GLOBAL top-K survivals are kept
(a prefix of every request's draft, since s is non-increasing in k); the utility is

    U(rho) = (bs + sum of the kept survivals) / (T_draft + C(bs + K) + T_fixed)

with C(n) the measured time of one packed verification forward over n tokens. The largest U
wins, ties to the smaller rho; the anchor of every request is always verified (bs tokens).
"""
import math

import torch
from torch import Tensor

# the paper's ratios, plus 0: under heavy load verifying no drafts at all can be the best step
RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


def interpolate_cost(n: Tensor, cost_n: Tensor, cost_t: Tensor) -> Tensor:
    """C(n) from a profiled table (sorted cost_n): linear between points, linear extrapolation
    from the last two points above the table, the first point's time below it."""
    n, cost_n, cost_t = n.double(), cost_n.double(), cost_t.double()
    if len(cost_n) == 1:
        return cost_t.expand(n.shape) * n / cost_n
    i = torch.searchsorted(cost_n, n).clamp(1, len(cost_n) - 1)
    x0, x1, y0, y1 = cost_n[i - 1], cost_n[i], cost_t[i - 1], cost_t[i]
    y = y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return torch.where(n <= cost_n[0], cost_t[0], y)


@torch.library.custom_op("angelspec::dcut_select", mutates_args=())
def dcut_select(confidence: Tensor, lengths: Tensor, t_draft: float, t_fixed: float,
                cost_n: Tensor, cost_t: Tensor, ratios: Tensor) -> tuple[Tensor, Tensor]:
    """confidence [sum(lengths)] (request by request, in draft order), lengths [B], times in
    seconds, cost table (cost_n [P] total verified tokens, cost_t [P] seconds), ratios [R]
    ascending -> (chosen ratio [] float64, kept prefix length per request [B] long)."""
    lengths = lengths.long()
    bs, total = len(lengths), int(lengths.sum())
    if total == 0:
        return torch.tensor(1.0, dtype=torch.float64), lengths.clone()
    req = torch.repeat_interleave(torch.arange(bs), lengths)
    # survival = cumulative product within each request, through cumulative log sums
    logc = confidence.double().clamp_min(1e-30).log()
    cum = logc.cumsum(0)
    start = lengths.cumsum(0) - lengths
    before = torch.where(start > 0, cum[(start - 1).clamp_min(0)], torch.zeros_like(start, dtype=cum.dtype))
    survival = (cum - before[req]).exp()
    # a stable sort keeps each request's entries in draft order among equal survivals
    order = torch.sort(survival, descending=True, stable=True).indices
    prefix = torch.cat([survival.new_zeros(1), survival[order].cumsum(0)])
    ks = torch.tensor([math.ceil(float(r) * total - 1e-9) for r in ratios], dtype=torch.long)
    cost = interpolate_cost((bs + ks).double(), cost_n, cost_t)
    utility = (bs + prefix[ks]) / (t_draft + cost + t_fixed)
    best = int(torch.nonzero(utility >= utility.max() * (1 - 1e-12))[0])  # ties: the smaller ratio
    keep = torch.zeros(bs, dtype=torch.long).scatter_add_(
        0, req[order[: ks[best]]], torch.ones(int(ks[best]), dtype=torch.long))
    return torch.tensor(float(ratios[best]), dtype=torch.float64), keep


@dcut_select.register_fake
def _(confidence, lengths, t_draft, t_fixed, cost_n, cost_t, ratios):
    return (torch.empty((), dtype=torch.float64, device=confidence.device),
            lengths.new_empty(lengths.shape, dtype=torch.long))
