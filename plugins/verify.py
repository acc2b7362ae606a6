"""Batched verification of ragged drafts (`angelspec::verify_greedy`, `angelspec::verify_rejection`).

Layout shared by both ops (PACKED, as the verification forward runs): request b owns
`lengths[b] + 1` consecutive rows - its anchor row, then one row per draft token - and its draft
tokens are `lengths[b]` consecutive entries of `draft`. Both return (accepted [B], last [B]): the
number of draft tokens kept, and the one token of the target's own that ends the step (the bonus
token after a full accept, else the correction at the first rejected position).
"""
import torch
from torch import Tensor


def _segments(lengths: Tensor):
    """Per draft token: its request and its row; per request: its first row and first token."""
    lengths = lengths.long()
    rows = lengths + 1
    row0 = rows.cumsum(0) - rows
    tok0 = lengths.cumsum(0) - lengths
    req = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    local = torch.arange(int(lengths.sum())) - tok0[req]
    return lengths, row0, req, local, row0[req] + local


def _leading(ok: Tensor, lengths: Tensor, req: Tensor, local: Tensor) -> Tensor:
    """Per request, how many of its entries in `ok` are True before the first False."""
    first_bad = torch.where(ok, lengths[req], local)
    return lengths.clone().scatter_reduce_(0, req, first_bad, "amin", include_self=True)


@torch.library.custom_op("angelspec::verify_greedy", mutates_args=())
def verify_greedy(logits: Tensor, draft: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] (N = sum(lengths + 1)), draft [sum(lengths)], lengths [B]: keep each draft
    token while it is the target's argmax at its position."""
    lengths, row0, req, local, row = _segments(lengths)
    # max's indices are argmax's (the first maximum), at a third of the time on CPU
    best = logits.max(-1).indices
    accepted = _leading(best[row] == draft, lengths, req, local)
    return accepted, best[row0 + accepted]


@verify_greedy.register_fake
def _(logits, draft, lengths):
    return lengths.new_empty(lengths.shape, dtype=torch.long), lengths.new_empty(lengths.shape, dtype=torch.long)


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [n, V] (need not be normalised), u [n] in [0, 1) -> token ids [n]."""
    cdf = probs.double().cumsum(-1)
    x = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


@torch.library.custom_op("angelspec::verify_rejection", mutates_args=())
def verify_rejection(probs: Tensor, draft: Tensor, q: Tensor, lengths: Tensor,
                     uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling: the committed tokens are distributed exactly as the target's.

    probs [N, V]: the target's distribution at every row (after temperature/top-k/top-p);
    q [sum(lengths), V]: the distribution each draft token was drawn from (one-hot rows for a
    deterministic proposal); uniforms [N, 2]: column 0 for the accept test of a row's draft
    token, column 1 for drawing the row's replacement or bonus token.
    """
    lengths, row0, req, local, row = _segments(lengths)
    p_x = probs[row].gather(-1, draft[:, None])[:, 0]
    q_x = q.gather(-1, draft[:, None])[:, 0]
    ok = (q_x > 0) & (uniforms[row, 0] * q_x < p_x)  # u < min(1, p/q)
    accepted = _leading(ok, lengths, req, local)
    end = row0 + accepted
    dist = probs[end].clone()
    rejected = (accepted < lengths).nonzero().squeeze(-1)
    if len(rejected):  # residual max(p - q, 0), renormalised by sampling; p itself if it is empty
        tok = row0[rejected] - rejected + accepted[rejected]  # draft index of the rejected token
        residual = (dist[rejected] - q[tok]).clamp_min(0.0)
        empty = residual.sum(-1) <= 0
        dist[rejected] = torch.where(empty[:, None], dist[rejected], residual)
    return accepted, sample_inverse_cdf(dist, uniforms[end, 1])


@verify_rejection.register_fake
def _(probs, draft, q, lengths, uniforms):
    return lengths.new_empty(lengths.shape, dtype=torch.long), lengths.new_empty(lengths.shape, dtype=torch.long)
