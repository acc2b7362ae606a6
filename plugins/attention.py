"""Attention of packed query rows against the static KV cache (`angelspec::cached_attention`).

Each row is computed alone in a fixed order, so results do not depend on how many rows share the
forward (torch's SDPA blocks by shape and rounds differently for 1 and k query rows). Rows may form
token trees: each node then attends to the committed keys and its own ancestors only.
"""
import torch

from angelspec.plugins.build import load_kernels

load_kernels()
_attend = torch.ops.angelspec.cached_attention
CHAIN = torch.zeros(0, dtype=torch.long)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     window: int | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D]; k_cache [slots, Hkv, D, max_len] (transposed), v_cache
    [slots, Hkv, max_len, D]; slots, positions [N].

    Writes k/v into the caches at (slot, position), then returns [N, H, D]: row n attends to its
    slot's keys at positions <= positions[n] (and > positions[n] - window). With `parents` [N]
    (token trees: the row of each row's parent in this call, -1 for a root), a root attends to
    positions <= its own, any other row to its parent's keys and its own.
    """
    return _attend(q, k, v, k_cache, v_cache, slots, positions,
                   CHAIN if parents is None else parents, window or 0)
