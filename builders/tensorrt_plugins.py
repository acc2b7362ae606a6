"""Our two angelspec ONNX ops as TensorRT plugins, through TensorRT's Python plugin API
(`tensorrt.plugin`, TensorRT 10.7 or newer): importing this module registers
`angelspec::DflyDraftHeadPlugin` and `angelspec::DcutSelectPlugin` in TensorRT's plugin
registry, so its ONNX parser builds the nodes of builders/tensorrt.py's graphs (matched by op
type, `plugin_namespace` and `plugin_version`).

The implementations are JIT ones: at run time TensorRT hands the plugin its device buffers, and
the plugin runs the torch.library reference op on them, on TensorRT's stream (the AR head's
products through torch's CUDA kernels; D-cut's selection, a few dozen scores, on the host as the
serving loop runs it). The engine then needs Python at run time; an AOT kernel (a CUDA or
Triton kernel compiled into the engine) is the step after this one.

NOT RUN ON THESE MACHINES: no TensorRT library (libnvinfer) installs here and no GPU was lent;
this module follows TensorRT's documented API and is exercised by `make tensorrt-engines`
(builders/tensorrt_gpu.py) on a host that has both.
"""
from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

import angelspec.plugins  # noqa: F401  (the reference ops)

D = trtp.TensorDesc


def _torch(t) -> torch.Tensor:
    return torch.as_tensor(t, device="cuda")


@trtp.register("angelspec::DflyDraftHeadPlugin")
def _head_desc(hidden: D, anchor: D, embed: D, head_norm: D, prev_norm: D, gate: D, up: D, down: D,
               final_norm: D, lm_head: D, vocab_ids: D, eps: float, width: int) -> Tuple[D, D]:
    shape = trtp.ShapeExprs.from_tuple((hidden.shape_expr[0], hidden.shape_expr[1], width))
    return trtp.from_shape_expr(shape, dtype=trt.int64), trtp.from_shape_expr(shape, dtype=trt.float32)


@trtp.impl("angelspec::DflyDraftHeadPlugin")
def _head_impl(hidden: trtp.Tensor, anchor: trtp.Tensor, embed: trtp.Tensor, head_norm: trtp.Tensor,
               prev_norm: trtp.Tensor, gate: trtp.Tensor, up: trtp.Tensor, down: trtp.Tensor,
               final_norm: trtp.Tensor, lm_head: trtp.Tensor, vocab_ids: trtp.Tensor, eps: float, width: int,
               outputs: Tuple[trtp.Tensor], stream: int) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        args = [_torch(x) for x in (hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm,
                                    lm_head, vocab_ids)]
        tokens, conf = torch.ops.angelspec.dfly_draft_head(*args, eps, None, width)
        _torch(outputs[0]).copy_(tokens)
        _torch(outputs[1]).copy_(conf.float())


@trtp.register("angelspec::DcutSelectPlugin")
def _dcut_desc(confidence: D, lengths: D, parents: D, draft_time: D, fixed_time: D, cost_n: D, cost_t: D,
               ratios: D) -> Tuple[D, D]:
    return (trtp.from_shape_expr(confidence.shape_expr, dtype=trt.bool),
            trtp.from_shape_expr(trtp.ShapeExprs.from_tuple(()), dtype=trt.float32))


@trtp.impl("angelspec::DcutSelectPlugin")
def _dcut_impl(confidence: trtp.Tensor, lengths: trtp.Tensor, parents: trtp.Tensor, draft_time: trtp.Tensor,
               fixed_time: trtp.Tensor, cost_n: trtp.Tensor, cost_t: trtp.Tensor, ratios: trtp.Tensor,
               outputs: Tuple[trtp.Tensor], stream: int) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        host = [_torch(x).cpu() for x in (confidence, lengths, parents, draft_time, fixed_time, cost_n, cost_t,
                                          ratios)]
        ratio, keep = torch.ops.angelspec.dcut_select(host[0], host[1], host[2], float(host[3]), float(host[4]),
                                                      host[5], host[6], host[7])
        _torch(outputs[0]).copy_(keep)
        _torch(outputs[1]).fill_(float(ratio))
