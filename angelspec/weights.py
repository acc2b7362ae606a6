"""How a model's matmul weights are served: float32 as loaded, bf16, or quantized (SCHEMES).

A `Llama` holds its weights as plain tensors; these functions convert them in place (serve) or on
a copy (served_as), and answer what the conversion keeps (bf16_exact, gives_back) and costs
(weight_bytes). The embedding and `lm_head` stay float32 for the drafters; the matmuls' served
form is what `head_w` and each layer's MATMULS hold.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from angelspec.pages import on_huge_pages
from angelspec.plugins import served
from angelspec.plugins.linear import SCHEMES

if TYPE_CHECKING:
    from angelspec.model import Llama

MATMULS = ("qkv", "o", "gate_up", "down")


def bf16_exact(model: Llama) -> bool:
    """Whether every matmul weight is a bf16 value (a bf16 checkpoint's are): then pack_bf16
    serves exactly the checkpoint's weights."""
    ws = [model.head_w] + [l[k] for l in model.layers for k in MATMULS]
    return all(torch.equal(w.bfloat16().float(), w) for w in ws if w.dtype == torch.float32)


def gives_back(model: Llama, quantized: Llama) -> bool:
    """Whether `quantized` (served_as(model, one of SCHEMES)) dequantizes to exactly the float32
    `model`'s weights: a checkpoint converted from such blocks (the default target's GGUF) comes
    back bit for bit, so int8 / int4 compute this very model (w8a8 / w4a8 this model on
    int8-rounded activations)."""
    pairs = [(quantized.head_w, model.head_w)] + [(q[k], l[k]) for q, l in zip(quantized.layers, model.layers)
                                                   for k in MATMULS]
    return all(torch.equal(q.dequantized(), w) if hasattr(q, "dequantized") else torch.equal(q, w)
               for q, w in pairs)


def pack_bf16(model: Llama) -> None:
    """Serve the matmuls from bf16 weights (plugins.served): half the bytes per forward. With
    AMX-BF16 tiles they are packed for the tile unit (matrix-unit speed for many rows; the
    activations entering each matmul are rounded to bf16); without, they stay in row order and
    the float32 kernels widen them as they load them (the float32 model on the bf16 weights,
    activations float32). Weights whose shape the tiles do not fit stay float32."""
    if model.weights == "bfloat16":
        return
    if model.weights != "float32":
        raise RuntimeError(f"cannot serve {model.weights} weights as bf16: start from float32")
    _convert(model, "bfloat16")


def quantize(model: Llama, scheme: str) -> None:
    """Serve the matmuls from quantized weights (plugins.quantize, groups of 32: `int8` as
    llama.cpp's Q8_0, `int4` as its Q4_1, the logits' matmul then int8 as llama.cpp keeps its
    output matrix): a quarter / a fifth of the float32 bytes per forward. int8 / int4
    (weight-only) serve the float32 model on the dequantized weights; w8a8 / w4a8 the same
    weights with each matmul's input rounded to int8 in blocks of 32 (integer dot products, as
    llama.cpp computes). Both are row-exact (plugins.linear), so speculative output equals this
    model's own batch-1 output."""
    if model.weights == scheme:
        return
    if scheme not in SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r} ({', '.join(SCHEMES)})")
    if model.weights != "float32":
        raise RuntimeError(f"cannot quantize {model.weights} weights: start from float32")
    _convert(model, scheme)


def _convert(model: Llama, scheme: str) -> None:
    model.head_w = served(model.lm_head, scheme, logits=True)
    for layer in model.layers:
        for k in MATMULS:
            layer[k] = served(layer[k], scheme)
    model.weights = scheme
    model.invalidate()


def serve(model: Llama, weights: str) -> None:
    """Serve `model`'s matmuls as `weights` says: float32 (as loaded), bfloat16 (pack_bf16), int8
    / int4 / w8a8 / w4a8 (quantize). Converted weights are then copied, in the order a forward
    reads them, into one buffer on huge pages (angelspec.pages); float32 ones stay as loaded."""
    if weights == "float32":
        if model.weights != "float32":
            raise ValueError(f"this model serves {model.weights} weights: load it again for float32")
        return
    if weights == model.weights:
        return
    if weights == "bfloat16":
        pack_bf16(model)
    else:
        quantize(model, weights)
    order = [(layer, k) for layer in model.layers for k in layer]  # a layer's dict: in forward order
    moved = on_huge_pages([layer[k] for layer, k in order] + [model.norm, model.head_w])
    for (layer, k), w in zip(order, moved):
        layer[k] = w
    model.norm, model.head_w = moved[-2:]
    model.invalidate()


def served_as(model: Llama, weights: str) -> Llama:
    """The float32 `model` serving `weights` (serve), sharing every other tensor; `model` is left
    as it is."""
    if weights == model.weights:
        return model
    if model.weights != "float32":
        raise ValueError(f"this model already serves {model.weights} weights: pass a float32 one")
    m = copy.copy(model)
    m.layers = [dict(l) for l in model.layers]
    m.invalidate()
    serve(m, weights)
    return m


def weight_bytes(model: Llama, head: bool = True) -> int:
    """Bytes of weights one forward reads (the embedding lookup reads only a few rows); without
    `head`, its layers' alone."""
    tensors = [t for l in model.layers for t in l.values() if t is not None]
    return sum(t.nbytes for t in tensors + ([model.norm, model.head_w] if head else []))
