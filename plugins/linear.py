"""y = x @ w.T for the target's weight matrices, with row-count-independent numerics.

Weights packed by `pack_bf16` (bf16, any row count) use `angelspec::amx_linear` on the AMX tile
unit, row-exact too. Float32 weights, up to SKINNY_MAX_ROWS rows (decoding and verification
forwards), use `angelspec::skinny_linear`: weights are streamed once for all rows, and each row
rounds exactly as it would alone, so a k-token verification forward gives bit-identical logits
to k one-token forwards. Longer inputs (prompt prefill) are compute-bound and go to the BLAS
routine.
"""
import torch
import torch.nn.functional as F

from angelspec.plugins.build import load_kernels

SKINNY_MAX_ROWS = 128

load_kernels()
_skinny = torch.ops.angelspec.skinny_linear
_amx = torch.ops.angelspec.amx_linear


def amx_available() -> bool:
    """This CPU has AMX-BF16 tiles and Linux lets this process use them."""
    return bool(torch.ops.angelspec.amx_available())


def can_pack(w: torch.Tensor) -> bool:
    """Whether `pack_bf16` takes this weight: [out, in] with out % 16 == 0 and in % 32 == 0."""
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> its bf16 values (round to nearest even) in the AMX tile layout, same
    shape; `linear` recognises the result by its dtype."""
    return torch.ops.angelspec.amx_pack(w.float().contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], w [out, in] (float32, or packed by pack_bf16), b [out] or None -> [..., out]."""
    rows = x.numel() // x.shape[-1]
    if w.dtype == torch.bfloat16:
        y = _amx(x.reshape(rows, x.shape[-1]).float(), w).reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    if rows > SKINNY_MAX_ROWS or x.dtype != torch.float32 or x.requires_grad or w.requires_grad:
        return F.linear(x, w, b)
    y = _skinny(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b
