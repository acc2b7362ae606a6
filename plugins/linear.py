"""y = x @ w.T for the target's weight matrices, with row-count-independent numerics.

Up to SKINNY_MAX_ROWS rows (decoding and verification forwards) use `angelspec::skinny_linear`:
weights are streamed once for all rows, and each row rounds exactly as it would alone, so a
k-token verification forward gives bit-identical logits to k one-token forwards. Longer inputs
(prompt prefill) are compute-bound and go to the BLAS routine.
"""
import torch
import torch.nn.functional as F

from angelspec.plugins.build import load_kernels

SKINNY_MAX_ROWS = 128

load_kernels()
_skinny = torch.ops.angelspec.skinny_linear


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], w [out, in], b [out] or None -> [..., out]."""
    rows = x.numel() // x.shape[-1]
    if rows > SKINNY_MAX_ROWS or x.dtype != torch.float32 or x.requires_grad or w.requires_grad:
        return F.linear(x, w, b)
    y = _skinny(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b
