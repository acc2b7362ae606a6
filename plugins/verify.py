"""Batched verification of ragged drafts, chains or token trees (`angelspec::verify_greedy`,
`angelspec::verify_rejection`).

Layout shared by both ops (PACKED, as the verification forward runs): request b owns
`lengths[b] + 1` consecutive rows - its anchor row, then one row per draft token - and its draft
tokens are `lengths[b]` consecutive entries of `draft`, with `parents` (same layout): the index of
each token's parent among its request's tokens, -1 for a child of the anchor (a chain: -1, 0, 1,
...; parents come before their children; `parents` empty: every draft is a chain). Both return
(accepted [B], last [B], leaf [B]): the number of draft tokens kept (the depth of the deepest
accepted token), the one token of the target's own that ends the step (the bonus token after
it, or the correction where no child matches), and the index of that deepest accepted token
(-1: none).
"""
import torch
from torch import Tensor

from angelspec.plugins.build import load_kernels

load_kernels()


# Greedy verification and the walk both ops end with are C++ (csrc/verify.cpp: one call a step);
# their fakes are in fakes.py. verify_greedy(logits [N, V], draft, lengths, parents): a draft
# token is accepted when its parent is (the anchor always is) and it equals the target's argmax
# (the first maximum, as torch's max(-1).indices) at its parent's row; each request keeps its
# deepest accepted token's path (the first of equal depth) and ends with the target's own token
# after it. accept_paths(own [N], draft, lengths, parents): the same walk over any own tokens.
verify_greedy = torch.ops.angelspec.verify_greedy
accept_paths = torch.ops.angelspec.accept_paths


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [n, V] (need not be normalised), u [n] in [0, 1) -> token ids [n]."""
    cdf = probs.double().cumsum(-1)
    x = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def verify_rejection_eager(probs: Tensor, draft: Tensor, lengths: Tensor, parents: Tensor,
                           uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative rejection sampling of deterministic proposals: the committed tokens are
    distributed exactly as the target's.

    probs [N, V]: the target's distribution at every row (after temperature/top-k/top-p);
    uniforms [N]: one per row (a tree's rows at one depth share their position's). With q one-hot
    at the draft token, the rule of docs/algorithms.md (section 0) (accept with probability
    min(1, p/q), else sample max(p - q, 0)) is "accept iff the target's own sample equals the
    draft"; here the target's own sample at row r is the inverse-CDF draw
    of probs[r] at uniforms[r]. In a tree, the path followed descends at each depth into the child
    that equals the target's own sample there (siblings differ, so at most one does). So the
    committed tokens are exactly those of sampling the target one token at a time with the same
    uniforms, whatever was drafted: keyed by position, a seed repeats its output under any drafter,
    draft length, tree shape or batch.
    """
    return accept_paths(sample_inverse_cdf(probs, uniforms), draft, lengths, parents)


# the op runs this function; the engine calls it directly (see dcut.py: dcut_choose)
verify_rejection = torch.library.custom_op("angelspec::verify_rejection", verify_rejection_eager, mutates_args=())


@verify_rejection.register_fake
def _(probs, draft, lengths, parents, uniforms):
    return tuple(lengths.new_empty(lengths.shape, dtype=torch.long) for _ in range(3))
