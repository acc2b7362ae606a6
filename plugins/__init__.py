"""AngelSpec's custom ops, registered with torch.library in the `angelspec` namespace.

Model kernels (C++, csrc/; compiled when AngelSpec is installed, see build.py): skinny_linear
(float32 or bf16 weights),
quant_linear (int8 / int4 weight-only), quant_dot_linear (w8a8 / w4a8), amx_linear (+ amx_pack),
cached_attention, rms_norm, rope_, silu_mul, the class DecoderStack (every layer of a model
through those kernels, its weights taken apart once, a forward in one call) and the class
MTPDraft (an MTP draft's greedy proposal, catch-up and rollout, in one call).
System ops (one implementation of each rule): verify_greedy and accept_paths (C++, csrc/verify.cpp),
verify_rejection, dcut_select, dfly_draft_head (PyTorch; the engine calls the functions behind the
first two, verify_rejection_eager and dcut_choose, without the dispatcher's round trip). Every op
has a fake implementation (torch.compile / torch.export); DecoderStack runs only outside compiled
graphs.
"""
from angelspec.plugins import fakes  # noqa: F401  (registers the fake kernels)
from angelspec.plugins.attention import cached_attention, keys, kv_cache
from angelspec.plugins.dcut import RATIOS, dcut_choose, dcut_select, interpolate_cost, survival
from angelspec.plugins.dfly_head import dfly_draft_head
from angelspec.plugins.layer_ops import rms_norm, rope_, silu_mul
from angelspec.plugins.linear import (
                                      SKINNY_MAX_ROWS,
                                      Bf16Weight,
                                      QuantWeight,
                                      amx_available,
                                      can_pack,
                                      can_quantize,
                                      linear,
                                      pack_bf16,
                                      quantize,
                                      served,
)
from angelspec.plugins.verify import verify_greedy, verify_rejection, verify_rejection_eager

__all__ = ["cached_attention", "kv_cache", "keys", "linear", "rms_norm", "rope_", "silu_mul", "SKINNY_MAX_ROWS",
           "verify_greedy", "verify_rejection", "verify_rejection_eager", "dcut_select", "dcut_choose",
           "dfly_draft_head", "RATIOS",
           "interpolate_cost", "survival", "amx_available", "can_pack", "pack_bf16",
           "Bf16Weight", "QuantWeight", "can_quantize", "quantize", "served"]
