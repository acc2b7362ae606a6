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
KEY_TILE = 16  # keys per tile of the key cache (attention_tile.h's kKeyTile)


def kv_cache(slots: int, kv_heads: int, head_dim: int, max_len: int,
             dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed caches for `cached_attention`, room for max_len keys rounded up to whole tiles:
    k [slots, kv_heads, max_len / 16, head_dim, 16] (tiles of 16 keys, each transposed, so
    attention scores a vector of keys per instruction reading contiguous memory) and
    v [slots, kv_heads, max_len, head_dim]; float32, or bfloat16 (each key and value rounded
    as it is written, widened exactly as it is read)."""
    m = -(-max_len // KEY_TILE) * KEY_TILE
    return (torch.zeros(slots, kv_heads, m // KEY_TILE, head_dim, KEY_TILE, dtype=dtype),
            torch.zeros(slots, kv_heads, m, head_dim, dtype=dtype))


def keys(k_cache: torch.Tensor) -> torch.Tensor:
    """A key cache as [slots, kv_heads, head_dim, positions] (a copy)."""
    s, h, t, d, w = k_cache.shape
    return k_cache.permute(0, 1, 3, 2, 4).reshape(s, h, d, t * w)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     window: int | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D]; k_cache, v_cache as `kv_cache` makes them; slots,
    positions [N].

    Writes k/v into the caches at (slot, position), then returns [N, H, D]: row n attends to its
    slot's keys at positions <= positions[n] (and > positions[n] - window). With `parents` [N]
    (token trees: the row of each row's parent in this call, -1 for a root), a root attends to
    positions <= its own, any other row to its parent's keys and its own.
    """
    return _attend(q, k, v, k_cache, v_cache, slots, positions,
                   CHAIN if parents is None else parents, window or 0)
