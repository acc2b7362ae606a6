"""ONNX Runtime implementations of the plugin ops in our TensorRT graphs, for proving an export
on a CPU (`angelspec verify-export`): Edge-LLM's `AttentionPlugin` and
`DFlashTargetKVCacheUpdate` written from their documented semantics, and our two angelspec ops
calling their torch.library reference implementations.

They run as onnxruntime-extensions Python ops. Those live in one domain (`ai.onnx.contrib`) and
take no float16 tensors, so `prepare()` rewrites a loaded graph for ONNX Runtime: each plugin
node moves to that domain (tree-mode attention under its own name, since a Python op has one
input count) and its float16 inputs and outputs pass through Cast nodes. The graph on disk, the
one TensorRT builds, is not touched.

Semantics implemented (Edge-LLM 0.11, paged KV, token-major ragged batch):
- KV pool [2, pages, 128, Hkv, D]: viewed as 2 * pages pages of 128 slots; `kv_page_table`
  [B, 2, max_pages] holds each sequence's K pages (row 0) and V pages (row 1, ids offset by
  `pages`); position p of a sequence lives in slot p % 128 of its page p // 128.
- RoPE rows [T, rot]: cos in the first rot/2 values, sin in the last (rotate-half pairs i,
  i + rot/2), already at each token's position.
- AttentionPlugin: sequence s owns query rows [offsets[s], offsets[s] + query_lengths[s]); their
  roped keys and values are written at positions past_lengths[s] + i; query i attends to
  positions [0, past_lengths[s]) and, causally (i' <= i), to its own sequence's queries; in
  tree mode to the queries j whose bit j % 32 of word j // 32 is set in its row of
  `packed_attention_mask` instead. Softmax in float32, scale `attention_scale`.
- DFlashTargetKVCacheUpdate: ropes k_delta with its rows' cos/sin and writes k_delta and v_delta
  at `delta_positions` of sequence `delta_token_to_sequence` (-1: padding, skipped).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from onnxruntime_extensions import PyCustomOpDef as P
from onnxruntime_extensions import get_library_path, onnx_op

import angelspec.plugins  # noqa: F401  (the reference ops)

CONTRIB = "ai.onnx.contrib"
F32, I32, I64 = P.dt_float, P.dt_int32, P.dt_int64
_ATTN_ATTRS = {"num_q_heads": I64, "num_kv_heads": I64, "head_size": I64, "attention_scale": F32}
# (domain, op) -> (name of its Python op, float16 input positions, float16 output positions)
PLUGINS = {
    ("trt_edgellm", "AttentionPlugin"): ("AttentionPlugin", (0, 1), (0, 1)),
    ("trt_edgellm", "DFlashTargetKVCacheUpdate"): ("DFlashTargetKVCacheUpdate", (0, 1, 2), (0,)),
    ("angelspec", "DflyDraftHeadPlugin"): ("DflyDraftHeadPlugin", (), ()),
    ("angelspec", "DcutSelectPlugin"): ("DcutSelectPlugin", (), ()),
}


def _rope(x: np.ndarray, cos_sin: np.ndarray) -> np.ndarray:
    """x [T, H, D] float32, cos_sin [T, rot] -> x with its first rot dims rotated (rotate-half)."""
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    out = x.copy()
    a, b = x[..., :half], x[..., half:2 * half]
    out[..., :half] = a * cos - b * sin
    out[..., half:2 * half] = b * cos + a * sin
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    """Round to float16, as the plugins store keys, values and outputs."""
    return x.astype(np.float16).astype(np.float32)


def _pages(pool: np.ndarray) -> np.ndarray:
    return pool.reshape(2 * pool.shape[1], pool.shape[2], *pool.shape[3:])


def _attention(qkv, pool, qlens, cos_sin, past, table, offsets, hq, hkv, d, scale, tree_mask=None):
    t = qkv.shape[0]
    x = qkv.reshape(t, hq + 2 * hkv, d)
    q, k, v = _f16(_rope(x[:, :hq], cos_sin)), _f16(_rope(x[:, hq:hq + hkv], cos_sin)), x[:, hq + hkv:]
    present = pool.copy()
    flat, slots = _pages(present), pool.shape[2]
    out = np.zeros((t, hq, d), np.float32)
    for s in range(len(qlens)):
        st, n, p = int(offsets[s]), int(qlens[s]), int(past[s])
        pos = np.arange(p, p + n)
        flat[table[s, 0, pos // slots], pos % slots] = k[st:st + n]
        flat[table[s, 1, pos // slots], pos % slots] = v[st:st + n]
        seen = np.arange(p + n)
        keys = np.repeat(flat[table[s, 0, seen // slots], seen % slots], hq // hkv, axis=1)
        vals = np.repeat(flat[table[s, 1, seen // slots], seen % slots], hq // hkv, axis=1)
        scores = np.einsum("nhd,lhd->hnl", q[st:st + n], keys) * scale
        if tree_mask is None:
            hidden = seen[None, :] > pos[:, None]
        else:
            j = np.arange(n)
            bits = (tree_mask[st:st + n][:, j // 32] >> (j % 32)) & 1  # [n, n]
            hidden = np.concatenate([np.zeros((n, p), bool), bits == 0], axis=1)
        scores[:, hidden] = -np.inf
        scores -= scores.max(-1, keepdims=True)
        w = np.exp(scores)
        w /= w.sum(-1, keepdims=True)
        out[st:st + n] = np.einsum("hnl,lhd->nhd", w, vals)
    return _f16(out), present


@onnx_op(op_type="AttentionPlugin", inputs=[F32, F32, I32, F32, I32, I32, I32, I32, I32, I32],
         outputs=[F32, F32], attrs=_ATTN_ATTRS)
def attention_plugin(qkv, pool, qlens, cos_sin, past, table, offsets, seqlens, phase, ctx, **a):
    return _attention(qkv, pool, qlens, cos_sin, past, table, offsets, a["num_q_heads"], a["num_kv_heads"],
                      a["head_size"], a["attention_scale"])


@onnx_op(op_type="AttentionPluginTree", inputs=[F32, F32, I32, F32, I32, I32, I32, I32, I32, I32, I32, I32],
         outputs=[F32, F32], attrs=_ATTN_ATTRS)
def attention_plugin_tree(qkv, pool, qlens, cos_sin, past, table, mask, pos_ids, offsets, seqlens, phase, ctx, **a):
    return _attention(qkv, pool, qlens, cos_sin, past, table, offsets, a["num_q_heads"], a["num_kv_heads"],
                      a["head_size"], a["attention_scale"], tree_mask=mask.astype(np.int64) & 0xFFFFFFFF)


@onnx_op(op_type="DFlashTargetKVCacheUpdate", inputs=[F32, F32, F32, F32, I32, I32, I32], outputs=[F32])
def dflash_target_kv_cache_update(k_delta, v_delta, pool, cos_sin, positions, owners, table):
    present = pool.copy()
    flat, slots = _pages(present), pool.shape[2]
    k = _f16(_rope(k_delta, cos_sin))
    for i, (p, s) in enumerate(zip(positions.tolist(), owners.tolist())):
        if p >= 0 and s >= 0:
            flat[table[s, 0, p // slots], p % slots] = k[i]
            flat[table[s, 1, p // slots], p % slots] = v_delta[i]
    return present


@onnx_op(op_type="DflyDraftHeadPlugin", inputs=[F32, I64, F32, F32, F32, F32, F32, F32, F32, F32, I64],
         outputs=[I64, F32], attrs={"eps": F32, "width": I64})
def dfly_draft_head(hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm, lm_head,
                    vocab_ids, eps, width):
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in
         (hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm, lm_head, vocab_ids)]
    tokens, conf = torch.ops.angelspec.dfly_draft_head(*t, float(eps), None, int(width))
    return tokens.numpy(), conf.float().numpy()


@onnx_op(op_type="DcutSelectPlugin", inputs=[F32, I64, I64, F32, F32, F32, F32, F32],
         outputs=[P.dt_bool, P.dt_float])
def dcut_select(confidence, lengths, parents, draft_time, fixed_time, cost_n, cost_t, ratios):
    t = torch.from_numpy
    ratio, keep = torch.ops.angelspec.dcut_select(
        t(confidence), t(lengths), t(parents), float(draft_time), float(fixed_time), t(cost_n), t(cost_t),
        t(ratios))
    return keep.numpy(), ratio.float().numpy()


def prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite a loaded graph (in place) so ONNX Runtime runs its plugin nodes as the Python ops above."""
    nodes = []
    for n in model.graph.node:
        spec = PLUGINS.get((n.domain, n.op_type))
        if spec is None:
            nodes.append(n)
            continue
        name, half_in, half_out = spec
        tree = any(a.name == "enable_tree_attention" and a.i for a in n.attribute)
        n.domain, n.op_type = CONTRIB, name + ("Tree" if tree else "")
        for j in half_in:
            cast = f"{n.input[j]}__f32_{n.name}"
            nodes.append(helper.make_node("Cast", [n.input[j]], [cast], to=TensorProto.FLOAT))
            n.input[j] = cast
        after = []
        for j in half_out:
            wide = f"{n.output[j]}__f32"
            after.append(helper.make_node("Cast", [wide], [n.output[j]], to=TensorProto.FLOAT16))
            n.output[j] = wide
        keep = {"num_q_heads", "num_kv_heads", "head_size", "attention_scale", "eps", "width"}
        kept = [a for a in n.attribute if a.name in keep]
        del n.attribute[:]
        n.attribute.extend(kept)
        nodes += [n, *after]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == CONTRIB for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB, 1))
    return model


def session(model: str | onnx.ModelProto, threads: int = 0) -> ort.InferenceSession:
    """An ONNX Runtime session of a graph (a path: loaded with its external data; a model: a
    copy) with the ops above."""
    copy = onnx.ModelProto()
    if isinstance(model, onnx.ModelProto):
        copy.CopyFrom(model)
    model = prepare(onnx.load(model) if isinstance(model, str) else copy)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only (D-cut's cost curve is an input with a default, by design)
    opts.register_custom_ops_library(get_library_path())
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
