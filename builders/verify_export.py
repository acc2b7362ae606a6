"""Proof of a TensorRT export on a CPU (`angelspec verify-export`, `make verify-export`): every graph
passes the ONNX checker and strict shape inference, and a greedy speculative decode through ONNX
Runtime - the exported target, the exported DFly draft and the exported D-cut node, with the
plugins run by plugins/ort_ops.py - returns the engine's own greedy tokens.

The decode is batch 1 and follows Edge-LLM's DFlash loop: prefill the prompt (the target writes
its paged KV cache and returns the hidden states of the draft's target layers); then each step
the draft writes the new context features into its own cache and drafts one block after the
newest token, D-cut picks how many of its tokens to verify, and one tree-mode target forward
checks [newest token, kept drafts] (a chain: each attends to those before it). The target's own
token at each row decides: the longest agreeing prefix is accepted, plus the target's token
after it. The target's graph computes in float16 on the checkpoint's weights, and the reference
(the engine's decode) in float32 on the same weights, whatever the engine serves (bf16 on AMX
tiles rounds every matmul's input too, w4a8 its activations), so a different token is counted
as a near-tie when the target's top-2 logit margin there is below `--near-tie` (both tokens are
then right answers of their own numerics); the prompt stops being compared there. Any other difference fails.

Runs in the export environment; reads <engine>/tensorrt and a reference file of prompts and the
engine's tokens (written by `angelspec verify-export` in the serving environment, which then
runs this).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import onnx
from safetensors.numpy import load_file

from angelspec.builders import onnx_ops, ort_ops
from angelspec.builders.tensorrt import dcut_graph

PAGE = 128


def check_graph(path: pathlib.Path) -> dict:
    """Full checker and strict shape inference (model in memory: the checker cannot read small
    external constants from a path); returns the op counts by domain."""
    import tensorrt_edgellm.onnx.onnx_custom_schemas  # noqa: F401  (registers trt_edgellm's schemas)

    onnx_ops.register_schemas()
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    ops: dict = {}
    for n in model.graph.node:
        key = f"{n.domain or 'onnx'}::{n.op_type}"
        ops[key] = ops.get(key, 0) + 1
    return {"nodes": len(model.graph.node), "plugin_ops": {k: v for k, v in ops.items() if not k.startswith("onnx::")},
            "inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output]}


def _rope_rows(positions: np.ndarray, theta: float, rot: int) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    f = np.outer(positions, inv)
    return np.concatenate([np.cos(f), np.sin(f)], -1).astype(np.float32)


def _mask(n: int, bidirectional: bool) -> np.ndarray:
    """Packed rows [n, ceil(n/32)]: bit j of row i set when query i sees query j."""
    words = np.zeros((n, (n + 31) // 32), np.int64)
    for i in range(n):
        for j in range(n if bidirectional else i + 1):
            words[i, j // 32] |= 1 << (j % 32)
    return words.astype(np.uint32).view(np.int32)


class Decoder:
    """Target + DFly draft + D-cut through ONNX Runtime, one request at a time."""

    def __init__(self, folder: pathlib.Path, max_len: int = 1024, sessions: dict | None = None):
        """`sessions`: graph name -> anything with ONNX Runtime's run()/get_inputs() (TensorRT
        engines, builders/tensorrt_gpu.py); default: ONNX Runtime sessions of the graphs."""
        info = json.loads((folder / "export.json").read_text())
        self.cfg = json.loads((folder / "target/llm/config.json").read_text())
        sessions = sessions or {name: ort_ops.session(str(folder / rel)) for name, rel in info["graphs"].items()}
        self.target, self.draft, self.dcut = sessions["target"], sessions.get("dfly"), sessions["dcut"]
        self.embed = load_file(str(folder / "target/llm/embedding.safetensors"))["embedding"]
        c = self.cfg
        self.layers, self.kvh, self.hd = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]
        self.rot = int(self.hd * c.get("partial_rotary_factor", 1.0))
        self.pages = (max_len + PAGE - 1) // PAGE
        if self.draft is not None:
            d = json.loads((folder / "dfly/config.json").read_text())
            self.block, self.draft_layers = d["block_size"], d["num_hidden_layers"]
            self.mask_row = load_file(str(folder / "dfly/mask_embedding.safetensors"))["mask_embedding"][0]

    def _pool(self, layers: int) -> list[np.ndarray]:
        return [np.zeros((2, self.pages, PAGE, self.kvh, self.hd), np.float16) for _ in range(layers)]

    def _table(self) -> np.ndarray:
        return np.array([[np.arange(self.pages), self.pages + np.arange(self.pages)]], np.int32)

    def _meta(self, n: int, past: int, positions: np.ndarray) -> dict:
        i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
        return {"rope_rotary_cos_sin": _rope_rows(positions, self.cfg["rope_theta"], self.rot),
                "positions": positions.astype(np.int32), "query_start_offsets": i32(0, n),
                "query_lengths": i32(n), "past_lengths": i32(past), "attention_sequence_lengths": i32(past + n),
                "state_indices": i32(0), "execution_phase_marker": np.zeros(2, np.int32),
                "kv_page_table": self._table()}

    def verify(self, tokens: list[int], past: int, kv: list) -> tuple[np.ndarray, np.ndarray, list]:
        """One tree-mode target forward of a chain `tokens` after `past` cached tokens: logits
        and target-layer hidden states of every row, and the new KV pools."""
        n = len(tokens)
        pos = np.arange(past, past + n)
        feed = {"inputs_embeds": self.embed[np.array(tokens)], **self._meta(n, past, pos),
                "context_sequence_count_carrier": np.zeros(1, np.int32),
                "logits_indices": np.arange(n, dtype=np.int64), "attention_position_ids": pos.astype(np.int32),
                "packed_attention_mask": _mask(n, bidirectional=False),
                "tree_parent_ids": (np.arange(n) - 1).astype(np.int32), "tree_depths": np.arange(n, dtype=np.int32),
                "valid_tree_counts": np.array([n], np.int32)}
        names = {i.name for i in self.target.get_inputs()}
        feed = {k: v for k, v in feed.items() if k in names}
        feed.update({f"past_key_values_{i}": kv[i] for i in range(self.layers)})
        out = self.target.run(None, feed)
        return out[0], out[1], out[2:]

    def propose(self, anchor: int, feats: np.ndarray, ctx_start: int, kv: list):
        """The draft's block after `anchor` (at position ctx_start + len(feats)), having written
        the context features `feats` (positions ctx_start...) into its cache."""
        td, b = len(feats), self.block
        n = ctx_start + td
        pos = np.arange(n, n + b)
        emb = np.concatenate([self.embed[anchor][None], np.repeat(self.mask_row[None], b - 1, 0)]).astype(np.float16)
        dpos = np.arange(ctx_start, n)
        feed = {"inputs_embeds": emb, "dflash_target_hidden_concat": feats, "anchor_ids": np.array([anchor], np.int64),
                **self._meta(b, n, pos), "context_sequence_count_carrier": np.zeros(0, np.int32),
                "dflash_delta_rope_cos_sin": _rope_rows(dpos, self.cfg["rope_theta"], self.rot),
                "dflash_delta_positions": dpos.astype(np.int32),
                "dflash_delta_token_to_sequence": np.zeros(td, np.int32),
                "attention_position_ids": pos.astype(np.int32), "packed_attention_mask": _mask(b, bidirectional=True)}
        feed.update({f"past_key_values_{i}": kv[i] for i in range(self.draft_layers)})
        names = {i.name for i in self.draft.get_inputs()}
        tokens, conf, *kv = self.draft.run(None, {k: v for k, v in feed.items() if k in names})
        return tokens[0, :, 0], conf[0, :, 0], kv

    def keep(self, conf: np.ndarray, draft_time: float) -> int:
        """D-cut's node: how many of the chain's tokens to verify (its kept tokens are a prefix)."""
        k = len(conf)
        keep, _ = self.dcut.run(None, {"confidence": conf.astype(np.float32), "lengths": np.array([k], np.int64),
                                       "parents": np.arange(-1, k - 1, dtype=np.int64),
                                       "draft_time": np.array(draft_time, np.float32),
                                       "fixed_time": np.array(0.0, np.float32)})
        return int(keep.sum())

    def generate(self, ids: list[int], max_tokens: int, eos: set[int], oracle: list[int] | None = None):
        """Greedy tokens, with per-token target logits' top-2 margin, and (steps, accepted).
        `oracle`: draft from these tokens instead of the DFly graph (the next few, the last one
        wrong every other step), which makes the verification path accept long chains."""
        kv_t = self._pool(self.layers)
        logits, hidden, kv_t = self.verify(ids, 0, kv_t)
        out, margins = [int(logits[-1].argmax())], [_margin(logits[-1])]
        past, pending, ctx = len(ids), hidden, 0
        kv_d = self._pool(self.draft_layers) if oracle is None else None
        steps = accepted = 0
        while len(out) < max_tokens and out[-1] not in eos:
            anchor, chain = out[-1], []
            if oracle is not None:
                chain = oracle[len(out): len(out) + 5]
                if chain and steps % 2:
                    chain[-1] = (chain[-1] + 1) % len(self.embed)
            else:
                t0 = time.perf_counter()
                drafts, conf, kv_d = self.propose(anchor, pending, ctx, kv_d)
                ctx += len(pending)
                chain = drafts[: self.keep(conf, time.perf_counter() - t0)].tolist()
            logits, hidden, kv_t = self.verify([anchor] + chain, past, kv_t)
            own = logits.argmax(-1)
            a = 0
            while a < len(chain) and chain[a] == own[a]:
                a += 1
            new = chain[:a] + [int(own[a])]
            end = next((i + 1 for i, tok in enumerate(new) if tok in eos), len(new))  # a request ends at eos
            new = new[:end]
            margins += [_margin(logits[i]) for i in range(len(new))]
            out += new
            past += a + 1
            pending = hidden[: a + 1]
            steps, accepted = steps + 1, accepted + a
        return out[:max_tokens], margins[:max_tokens], (steps, accepted)


def _margin(row: np.ndarray) -> float:
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def compare(ours: list[int], theirs: list[int], margins: list[float], near_tie: float) -> dict:
    """Where the two decodes first differ, and whether the exported target was at a near-tie."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return {"equal": False, "at": i, "margin": margins[i], "near_tie": margins[i] < near_tie}
    same = len(ours) == len(theirs)
    return {"equal": same, "at": None if same else min(len(ours), len(theirs)), "margin": None, "near_tie": False}


def run(engine: pathlib.Path, reference: pathlib.Path, near_tie: float, report_path: pathlib.Path,
        log=print) -> dict:
    folder = engine / "tensorrt"
    info = json.loads((folder / "export.json").read_text())
    report = {"graphs": {}, "prompts": []}
    for name, rel in info["graphs"].items():
        t0 = time.perf_counter()
        report["graphs"][name] = check_graph(folder / rel)
        log(f"{name}: checker and strict shape inference passed ({report['graphs'][name]['nodes']} nodes, "
            f"plugins {report['graphs'][name]['plugin_ops']}, {time.perf_counter() - t0:.1f} s)")
    if "dfly" not in info["graphs"]:
        raise SystemExit("no DFly draft in this export: the decode proof needs one (make drafts, make engines)")
    ref = json.loads(reference.read_text())
    dec = Decoder(folder, max_len=max(len(r["ids"]) for r in ref["prompts"]) + ref["max_tokens"] + 16)
    eos = set(ref["eos"])
    for r in ref["prompts"]:
        for drafts in ("dfly", "oracle"):
            t0 = time.perf_counter()
            tokens, margins, (steps, acc) = dec.generate(r["ids"], ref["max_tokens"], eos,
                                                         r["tokens"] if drafts == "oracle" else None)
            row = {"domain": r["domain"], "drafts": drafts, "tokens": len(tokens), "steps": steps,
                   "accept_len": round((acc + steps) / max(steps, 1), 2), "seconds": round(time.perf_counter() - t0, 1),
                   **compare(r["tokens"], tokens, margins, near_tie)}
            report["prompts"].append(row)
            verdict = "equal" if row["equal"] else (f"near-tie at token {row['at']} (margin {row['margin']:.4f})"
                                                    if row["near_tie"] else f"DIFFERENT at token {row['at']}")
            log(f"[{r['domain']}, {drafts} drafts] {len(tokens)} tokens in {steps} steps "
                f"(accept length {row['accept_len']}, engine's {r.get('accept_len', '-')}): {verdict}")
    rows = report["prompts"]
    report["equal"] = sum(r["equal"] for r in rows)
    report["near_ties"] = sum(r["near_tie"] for r in rows)
    report["different"] = sum(not r["equal"] and not r["near_tie"] for r in rows)
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _node_model(op: str, domain: str, inputs: dict, outputs: dict, **attrs) -> onnx.ModelProto:
    """A one-node graph over numpy inputs (their shapes made symbolic); outputs: name -> dtype."""
    from onnx import helper

    def vi(name, dtype, ndim=None):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                             None if ndim is None else [None] * ndim)

    out = [vi(k, t) for k, t in outputs.items()]
    vi = [vi(k, v.dtype, v.ndim) for k, v in inputs.items()]
    node = helper.make_node(op, list(inputs), outputs, domain=domain, **attrs)
    return helper.make_model(helper.make_graph([node], op, vi, out),
                             opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(domain, 1)])


def _torch_rope(t, cos_sin: np.ndarray):
    """Rotate-half RoPE in torch (Llama's convention) of t [T, H, D], stored as float16."""
    import torch

    cs = torch.from_numpy(cos_sin)
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half].repeat(1, 1, 2), cs[:, None, half:].repeat(1, 1, 2)
    a, b = t.chunk(2, dim=-1)
    return (t * cos + torch.cat([-b, a], -1) * sin).half().float()


def _dense_attention(qkv, past_k, past_v, cos_sin, hq, hkv, d, scale, visible):
    """Attention written out densely in torch: queries over [past keys ; new keys] (float16
    storage of keys, values and output, as the plugin)."""
    import torch

    x = torch.from_numpy(qkv.astype(np.float32)).view(len(qkv), hq + 2 * hkv, d)
    q, k, v = _torch_rope(x[:, :hq], cos_sin), _torch_rope(x[:, hq:hq + hkv], cos_sin), x[:, hq + hkv:]
    keys = torch.cat([torch.from_numpy(past_k), k]).repeat_interleave(hq // hkv, 1)
    vals = torch.cat([torch.from_numpy(past_v), v]).repeat_interleave(hq // hkv, 1)
    s = torch.einsum("nhd,lhd->hnl", q, keys) * scale
    s = s.masked_fill(~torch.from_numpy(visible)[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vals).half().float().numpy()


def self_test(log=print) -> int:
    """Each plugin's ONNX Runtime op against its reference on random inputs; 0 when all agree."""
    import torch

    g, bad = np.random.default_rng(0), []
    # D-cut: the torch op is the reference
    lengths = np.array([5, 0, 7, 3])
    parents = np.concatenate([np.arange(-1, k - 1) for k in lengths]).astype(np.int64)
    conf = g.uniform(0.05, 1, lengths.sum()).astype(np.float32)
    prof = {"n": [1, 8, 16, 32], "ms": [10.0, 12.0, 15.0, 24.0]}
    for t_draft, t_fixed in ((0.001, 0.0), (0.02, 0.004)):
        keep, ratio = ort_ops.session(dcut_graph(prof, [0, 0.25, 0.5, 0.75, 1.0])).run(None, {
            "confidence": conf, "lengths": lengths, "parents": parents, "draft_time": np.array(t_draft, np.float32),
            "fixed_time": np.array(t_fixed, np.float32)})
        r_ref, k_ref = torch.ops.angelspec.dcut_select(
            torch.from_numpy(conf), torch.from_numpy(lengths), torch.from_numpy(parents), t_draft, t_fixed,
            torch.tensor(prof["n"], dtype=torch.float64), torch.tensor(prof["ms"], dtype=torch.float64) / 1000,
            torch.tensor([0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64))
        if not (np.array_equal(keep, k_ref.numpy()) and float(ratio) == float(r_ref)):
            bad.append(f"DcutSelectPlugin (t_draft {t_draft})")
    # DFly's AR head: the torch op is the reference
    r, k, h, v, vd = 3, 4, 16, 50, 20
    f = lambda *s: g.normal(0, 0.5, s).astype(np.float32)  # noqa: E731
    head = {"hidden": f(r, k, h), "anchor": g.integers(0, v, r), "embed": f(v, h), "head_norm": f(h),
            "prev_norm": f(h), "gate": f(h, 2 * h), "up": f(h, 2 * h), "down": f(h, h), "final_norm": f(h),
            "lm_head": f(vd, h), "vocab_ids": np.sort(g.choice(v, vd, replace=False))}
    tok, cf = ort_ops.session(_node_model("DflyDraftHeadPlugin", onnx_ops.DOMAIN, head,
                                          {"tokens": np.int64, "confidence": np.float32},
                                          eps=1e-5, width=2, plugin_version="1")).run(None, head)
    t_ref, c_ref = torch.ops.angelspec.dfly_draft_head(*(torch.from_numpy(x) for x in head.values()), 1e-5, None, 2)
    if not (np.array_equal(tok, t_ref.numpy()) and np.allclose(cf, c_ref.numpy(), atol=1e-6)):
        bad.append("DflyDraftHeadPlugin")
    # AttentionPlugin (vanilla and tree) and DFlashTargetKVCacheUpdate against dense attention
    hq, hkv, d, pages = 4, 2, 16, 3
    past, qlens = np.array([130, 5], np.int32), np.array([3, 4], np.int32)
    table = np.array([[[2, 0], [pages + 2, pages + 0]], [[1, 1], [pages + 1, pages + 1]]], np.int32)
    pool = g.normal(0, 1, (2, pages, PAGE, hkv, d)).astype(np.float16)
    t = int(qlens.sum())
    qkv = g.normal(0, 1, (t, (hq + 2 * hkv) * d)).astype(np.float16)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(past, qlens)])
    cos_sin = _rope_rows(pos, 10000.0, d)
    offsets = np.array([0, 3, 7], np.int32)
    tree = np.zeros((t, 1), np.int32)
    tree[0:3, 0] = [1, 0b11, 0b101]  # sequence 0: a tree (query 2 sees query 0, not query 1)
    tree[3:7, 0] = [1, 0b11, 0b111, 0b1111]  # sequence 1: a chain
    ins = {"qkv": qkv, "pool": pool, "qlens": qlens, "cos_sin": cos_sin, "past": past, "table": table}
    meta = {"offsets": offsets, "seqlens": past + qlens, "phase": np.zeros(2, np.int32), "ctx": np.zeros(1, np.int32)}
    attrs = dict(num_q_heads=hq, num_kv_heads=hkv, head_size=d, attention_scale=d ** -0.5,
                 enable_tree_attention=0, plugin_version="1")
    for mode, feed in (("vanilla", {**ins, **meta}),
                       ("tree", {**ins, "mask": tree, "pos_ids": pos.astype(np.int32), **meta})):
        attrs["enable_tree_attention"] = int(mode == "tree")
        out, present = ort_ops.session(_node_model("AttentionPlugin", "trt_edgellm", feed,
                                                   {"out": np.float16, "present": np.float16},
                                                   **attrs)).run(None, feed)
        flat = pool.reshape(2 * pages, PAGE, hkv, d).astype(np.float32)
        for s in range(2):
            p, n, st = int(past[s]), int(qlens[s]), int(offsets[s])
            slot = lambda row, q: flat[table[s, row, q // PAGE], q % PAGE]  # noqa: E731
            pk = np.stack([slot(0, q) for q in range(p)])
            pv = np.stack([slot(1, q) for q in range(p)])
            bits = (tree[st:st + n, :1] >> np.arange(n)) & 1 if mode == "tree" else np.tri(n, dtype=int)
            visible = np.concatenate([np.ones((n, p), bool), bits.astype(bool)], 1)
            ref = _dense_attention(qkv[st:st + n], pk, pv, cos_sin[st:st + n], hq, hkv, d, d ** -0.5, visible)
            if not np.allclose(out[st:st + n], ref, atol=2e-3):
                bad.append(f"AttentionPlugin ({mode}, sequence {s})")
            pres = present.reshape(2 * pages, PAGE, hkv, d)
            stored = np.stack([pres[table[s, 1, q // PAGE], q % PAGE] for q in range(p, p + n)])
            if not np.array_equal(stored, qkv[st:st + n].reshape(n, hq + 2 * hkv, d)[:, hq + hkv:]):
                bad.append(f"AttentionPlugin ({mode}): values not written in place")
    kd, vd_ = (g.normal(0, 1, (4, hkv, d)).astype(np.float16) for _ in range(2))
    upd = {"k": kd, "v": vd_, "pool": pool, "cs": _rope_rows(np.array([7, 8, 0, 131]), 10000.0, d),
           "positions": np.array([7, 8, -1, 131], np.int32), "owners": np.array([1, 1, 0, 0], np.int32),
           "table": table}
    (present,) = ort_ops.session(_node_model("DFlashTargetKVCacheUpdate", "trt_edgellm", upd,
                                             {"present": np.float16})).run(None, upd)
    pres, flat = present.reshape(2 * pages, PAGE, hkv, d), pool.reshape(2 * pages, PAGE, hkv, d)
    changed = {(int(a), int(b)) for a, b, *_ in zip(*np.nonzero(pres != flat))}
    want = {(table[1, r, 0], q) for r in (0, 1) for q in (7, 8)} | {(table[0, r, 1], 3) for r in (0, 1)}
    k_ref = _torch_rope(torch.from_numpy(kd.astype(np.float32)), upd["cs"]).numpy()
    if changed != want or not np.array_equal(pres[table[1, 1, 0], 7], vd_[0]) or \
            not np.allclose(pres[table[0, 0, 1], 3], k_ref[3], atol=1e-3):
        bad.append("DFlashTargetKVCacheUpdate")
    for name in bad:
        log(f"MISMATCH: {name}")
    log("plugin ops: " + ("all agree with their references" if not bad else f"{len(bad)} mismatches"))
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--self-test", action="store_true",
                   help="only check each plugin's ONNX Runtime op against its reference, on random inputs")
    p.add_argument("--engine")
    p.add_argument("--reference", help="prompts and the engine's greedy tokens (JSON)")
    p.add_argument("--near-tie", type=float, default=0.05,
                   help="top-2 logit margin under which a float16 target may pick the other token")
    p.add_argument("--report", default="build/verify-export/report.json")
    args = p.parse_args(argv)
    if args.self_test:
        return self_test()
    if not (args.engine and args.reference):
        p.error("--engine and --reference are needed (or --self-test)")
    report = run(pathlib.Path(args.engine), pathlib.Path(args.reference), args.near_tie, pathlib.Path(args.report))
    print(f"{report['equal']} of {len(report['prompts'])} decodes equal the engine's tokens, "
          f"{report['near_ties']} near-ties, {report['different']} different")
    return 1 if report["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
