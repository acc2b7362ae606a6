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


def _accept(own: Tensor, draft: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """own [N]: the target's own token at every row. Keep each draft token while it equals the
    target's own token at its position; the step ends with the target's own token after them."""
    lengths, row0, req, local, row = _segments(lengths)
    accepted = _leading(own[row] == draft, lengths, req, local)
    return accepted, own[row0 + accepted]


@torch.library.custom_op("angelspec::verify_greedy", mutates_args=())
def verify_greedy(logits: Tensor, draft: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] (N = sum(lengths + 1)), draft [sum(lengths)], lengths [B]: keep each draft
    token while it is the target's argmax at its position."""
    # max's indices are argmax's (the first maximum), at a third of the time on CPU
    return _accept(logits.max(-1).indices, draft, lengths)


@verify_greedy.register_fake
def _(logits, draft, lengths):
    return lengths.new_empty(lengths.shape, dtype=torch.long), lengths.new_empty(lengths.shape, dtype=torch.long)


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [n, V] (need not be normalised), u [n] in [0, 1) -> token ids [n]."""
    cdf = probs.double().cumsum(-1)
    x = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


@torch.library.custom_op("angelspec::verify_rejection", mutates_args=())
def verify_rejection(probs: Tensor, draft: Tensor, lengths: Tensor,
                     uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling of deterministic proposals: the committed tokens are
    distributed exactly as the target's.

    probs [N, V]: the target's distribution at every row (after temperature/top-k/top-p);
    uniforms [N]: one per row. With q one-hot at the draft token, the rule of docs/algorithms.md (section 0)
    (accept with probability min(1, p/q), else sample max(p - q, 0)) is "accept iff the target's
    own sample equals the draft"; here the target's own sample at row r is the inverse-CDF draw
    of probs[r] at uniforms[r]. So the committed tokens are exactly those of sampling the target
    one token at a time with the same uniforms, whatever was drafted: keyed by position, a seed
    repeats its output under any drafter, draft length or batch.
    """
    return _accept(sample_inverse_cdf(probs, uniforms), draft, lengths)


@verify_rejection.register_fake
def _(probs, draft, lengths, uniforms):
    return lengths.new_empty(lengths.shape, dtype=torch.long), lengths.new_empty(lengths.shape, dtype=torch.long)
