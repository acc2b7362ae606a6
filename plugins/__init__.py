"""AngelSpec's custom ops, registered with torch.library in the `angelspec` namespace.

The C++ sources in csrc/ are compiled on first import (torch's cpp_extension + ninja, ~1 min
once) into a per-user cache and reused afterwards.
"""
from angelspec.plugins.attention import cached_attention
from angelspec.plugins.layer_ops import rms_norm, rope_, silu_mul
from angelspec.plugins.linear import SKINNY_MAX_ROWS, linear

__all__ = ["cached_attention", "linear", "rms_norm", "rope_", "silu_mul", "SKINNY_MAX_ROWS"]
