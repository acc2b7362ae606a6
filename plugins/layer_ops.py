"""Fused per-row ops of a decoder layer: RMSNorm, RoPE (in place), SiLU-gated product."""
import torch

from angelspec.plugins.build import load_kernels

load_kernels()
_ops = torch.ops.angelspec


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., h], w [h] -> x / rms(x) * w."""
    if x.requires_grad or w.requires_grad:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
    return _ops.rms_norm(x, w, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          heads: int) -> None:
    """Rotate the first `heads` heads of x [N, all_heads, D] in place; tables [max_len, D]."""
    _ops.rope_(x, cos, sin, positions, heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2m] (gate ; up) -> silu(gate) * up [..., m]."""
    return _ops.silu_mul(gate_up)
