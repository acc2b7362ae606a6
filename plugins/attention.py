"""Attention of packed query rows against the static KV cache (`angelspec::cached_attention`).

Each row is computed alone in a fixed order, so results do not depend on how many rows share the
forward (torch's SDPA blocks by shape and rounds differently for 1 and k query rows).
"""
import torch

from angelspec.plugins.build import load_kernels

load_kernels()
_attend = torch.ops.angelspec.cached_attention


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D]; k_cache [slots, Hkv, D, max_len] (transposed), v_cache
    [slots, Hkv, max_len, D]; slots, positions [N].

    Writes k/v into the caches at (slot, position), then returns [N, H, D]: row n attends to its
    slot's keys at positions <= positions[n] (and > positions[n] - window).
    """
    return _attend(q, k, v, k_cache, v_cache, slots, positions, window or 0)
