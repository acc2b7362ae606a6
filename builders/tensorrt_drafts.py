"""DFly and DFlash drafts as ONNX graphs in TensorRT Edge-LLM's cached-DFlash contract.

The graph reads what Edge-LLM's DFlash runtime feeds its draft engine (the ragged token-major
layout: `inputs_embeds` of every request's [anchor, MASK, ...] block, the target's hidden states
of the newly committed tokens as `dflash_target_hidden_concat`, a paged KV pool per draft layer,
RoPE rows, the page table and the packed block mask) and runs our draft's own layers through
Edge-LLM's two plugins: `DFlashTargetKVCacheUpdate` writes the context keys and values of the new
target features into the draft's cache; `AttentionPlugin` (tree mode) lets each block attend to
its request's whole context and to itself (bidirectionally, by the mask).

Where our drafts differ from Edge-LLM's DFlash model, the graph follows ours:
- no q/k norms (ours have none; Edge-LLM's model always has them);
- DFly's per-layer mixture of target layers: context of draft layer l is
  norm_l(fc(F) + sum_j softmax(mix_l)_j F_j); folded at export into a per-layer projection
  fc_l = fc + [w_l0 I, w_l1 I, ...], so it is one MatMul (no plugin needed);
- DFly's AR head: `angelspec::DflyDraftHeadPlugin` over each block's k draft positions, which
  outputs `draft_tokens` / `draft_confidence` [B, k, 1] (target ids, the draft's probability)
  instead of logits; DFlash outputs `logits` over its reduced vocabulary (`draft_vocab_map`).
- our learned MASK embedding: the runtime embeds MASK positions with `mask_embedding.safetensors`
  (Edge-LLM's runtime embeds `mask_token_id` from the target's table; see docs/tensorrt.md).
The layers compute in float32; only the plugins' tensors are float16, as their contract says.
Runs in the export environment (`make export-env`).
"""
from __future__ import annotations

import json
import pathlib
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tensorrt_edgellm.models.ops import KV_PAGE_SIZE, attention_plugin, dflash_target_kv_cache_update

from angelspec.drafters.draft_checkpoint import load_draft

INPUTS = ["inputs_embeds", "dflash_target_hidden_concat"]
METADATA = ["rope_rotary_cos_sin", "positions", "query_start_offsets", "query_lengths", "past_lengths",
            "attention_sequence_lengths", "state_indices", "execution_phase_marker",
            "context_sequence_count_carrier", "kv_page_table", "dflash_delta_rope_cos_sin",
            "dflash_delta_positions", "dflash_delta_token_to_sequence", "attention_position_ids",
            "packed_attention_mask"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DraftGraph(nn.Module):
    """One draft (DFly or DFlash) over the ragged DFlash inputs; every weight float32."""

    def __init__(self, cfg, state: dict, target: dict):
        super().__init__()
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        h, n = cfg.hidden_size, len(cfg.target_layers)
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        fc = state["fc.weight"].float()
        if cfg.hybrid:  # fold the mixture: one projection per draft layer
            w = torch.softmax(state["mix"].float(), dim=-1)  # [Ld, n]
            eye = torch.eye(h)
            fcs = [fc + torch.cat([w[l, j] * eye for j in range(n)], dim=1) for l in range(cfg.num_layers)]
            norms = [state[f"ctx_norms.{l}.weight"] for l in range(cfg.num_layers)]
        else:
            fcs, norms = [fc] * cfg.num_layers, [state["ctx_norms.0.weight"]] * cfg.num_layers
        p = lambda t: nn.Parameter(t.float().contiguous(), requires_grad=False)  # noqa: E731
        self.fc = nn.ParameterList(p(f) for f in fcs)
        self.ctx_norm = nn.ParameterList(p(x) for x in norms)
        names = ("in_norm", "q_proj", "k_proj", "v_proj", "o_proj", "post_norm", "mlp.gate", "mlp.up", "mlp.down")
        self.layer = nn.ModuleList()
        for l in range(cfg.num_layers):
            m = nn.Module()
            for name in names:
                setattr(m, name.replace(".", "_"), p(state[f"layers.{l}.{name}.weight"]))
            self.layer.append(m)
        self.final_norm = p(target["model.norm.weight"])
        vocab = state["vocab_ids"].long()
        head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
        self.lm_head = p(head[vocab])
        self.register_buffer("vocab_ids", vocab)
        if cfg.ar_head:
            self.embed = p(target["model.embed_tokens.weight"])
            self.head_norm, self.prev_norm = p(state["head_norm.weight"]), p(state["prev_norm.weight"])
            self.ar_gate, self.ar_up, self.ar_down = (p(state[f"ar.{n}.weight"]) for n in ("gate", "up", "down"))

    def forward(self, inputs_embeds, target_hidden, past_key_values, anchor_ids, m: dict):
        x = inputs_embeds.float()
        feats = target_hidden.float()
        t, td = x.shape[0], feats.shape[0]
        present = []
        for l, L in enumerate(self.layer):
            ctx = _rms(feats @ self.fc[l].t(), self.ctx_norm[l], self.eps)
            k_delta = (ctx @ L.k_proj.t()).reshape(td, self.nkv, self.hd).half()
            v_delta = (ctx @ L.v_proj.t()).reshape(td, self.nkv, self.hd).half()
            kv = dflash_target_kv_cache_update(k_delta, v_delta, past_key_values[l], m["dflash_delta_rope_cos_sin"],
                                               m["dflash_delta_positions"], m["dflash_delta_token_to_sequence"],
                                               m["kv_page_table"])
            xn = _rms(x, L.in_norm, self.eps)
            qkv = torch.cat([xn @ L.q_proj.t(), xn @ L.k_proj.t(), xn @ L.v_proj.t()], dim=-1).half()
            attn, kv = attention_plugin(
                qkv, kv, m["query_lengths"], m["rope_rotary_cos_sin"], m["past_lengths"], m["kv_page_table"],
                num_q_heads=self.nq, num_kv_heads=self.nkv, head_size=self.hd, sliding_window_size=-1,
                enable_tree_attention=True, enable_fp8_kv_cache=False, attention_scale=self.hd ** -0.5,
                enable_context_mask_selector=False, enable_vision_block_attention=False,
                skip_softmax_scale_factor=0.0, attention_mask=m["packed_attention_mask"],
                attention_pos_id=m["attention_position_ids"], qkv_scales=[1.0, 1.0, 1.0],
                query_start_offsets=m["query_start_offsets"],
                attention_sequence_lengths=m["attention_sequence_lengths"],
                execution_phase_marker=m["execution_phase_marker"],
                context_sequence_count_carrier=m["context_sequence_count_carrier"])
            present.append(kv)
            x = x + attn.reshape(t, self.nq * self.hd).float() @ L.o_proj.t()
            xn = _rms(x, L.post_norm, self.eps)
            x = x + (F.silu(xn @ L.mlp_gate.t()) * (xn @ L.mlp_up.t())) @ L.mlp_down.t()
        b = self.cfg.block_size
        hidden = x.reshape(-1, b, x.shape[-1])[:, 1:]  # the k draft positions of each block
        if not self.cfg.ar_head:
            return (_rms(hidden, self.final_norm, self.eps) @ self.lm_head.t(), *present)
        tokens, conf = torch.ops.angelspec.dfly_draft_head(
            hidden.contiguous(), anchor_ids, self.embed, self.head_norm, self.prev_norm, self.ar_gate,
            self.ar_up, self.ar_down, self.final_norm, self.lm_head, self.vocab_ids, self.eps, None, 1)
        return (tokens, conf, *present)


def _input_names(cfg) -> list[str]:
    kv = [f"past_key_values_{i}" for i in range(cfg.num_layers)]
    return INPUTS + kv + (["anchor_ids"] if cfg.ar_head else []) + METADATA


def _example(cfg, batch: int = 2, delta: int = 3) -> tuple[dict, dict]:
    """Example inputs for tracing (two requests, three new context tokens each) and their
    dynamic dimensions, by input name."""
    h, n, b = cfg.hidden_size, len(cfg.target_layers), cfg.block_size
    rot, t, td = cfg.head_dim, batch * b, batch * delta
    i32 = dict(dtype=torch.int32)
    x = {"inputs_embeds": torch.zeros(t, h, dtype=torch.float16),
         "dflash_target_hidden_concat": torch.zeros(td, n * h, dtype=torch.float16),
         **{f"past_key_values_{i}": torch.zeros(2, 1, KV_PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim,
                                                dtype=torch.float16) for i in range(cfg.num_layers)},
         "anchor_ids": torch.zeros(batch, dtype=torch.long),
         "rope_rotary_cos_sin": torch.zeros(t, rot), "positions": torch.arange(b, **i32).repeat(batch),
         "query_start_offsets": torch.arange(0, t + 1, b, **i32), "query_lengths": torch.full((batch,), b, **i32),
         "past_lengths": torch.full((batch,), delta, **i32),
         "attention_sequence_lengths": torch.full((batch,), delta + b, **i32),
         "state_indices": torch.arange(batch, **i32), "execution_phase_marker": torch.zeros(4, **i32),
         "context_sequence_count_carrier": torch.zeros(0, **i32), "kv_page_table": torch.zeros(batch, 2, 1, **i32),
         "dflash_delta_rope_cos_sin": torch.zeros(td, rot),
         "dflash_delta_positions": torch.arange(delta, **i32).repeat(batch),
         "dflash_delta_token_to_sequence": torch.arange(batch, **i32).repeat_interleave(delta),
         "attention_position_ids": torch.arange(b, **i32).repeat(batch),
         "packed_attention_mask": torch.zeros(t, (b + 31) // 32, **i32)}
    D = torch.export.Dim
    tok, delta_, seq = (D("physical_tokens", min=1, max=1 << 20), D("delta_tokens", min=1, max=1 << 20),
                        D("num_sequences", min=1, max=256))
    pages = D("num_pages", min=1, max=1 << 20)
    dims = {"inputs_embeds": {0: tok}, "dflash_target_hidden_concat": {0: delta_}, "anchor_ids": {0: seq},
            **{f"past_key_values_{i}": {1: pages} for i in range(cfg.num_layers)},
            "rope_rotary_cos_sin": {0: tok}, "positions": {0: tok}, "query_start_offsets": {0: seq + 1},
            **{k: {0: seq} for k in ("query_lengths", "past_lengths", "attention_sequence_lengths",
                                     "state_indices")},
            "execution_phase_marker": {0: D("execution_phase_extent", min=1, max=8)},
            "context_sequence_count_carrier": {},
            "kv_page_table": {0: seq, 2: D("max_pages_per_seq", min=1, max=32768)},
            **{k: {0: delta_} for k in ("dflash_delta_rope_cos_sin", "dflash_delta_positions",
                                        "dflash_delta_token_to_sequence")},
            "attention_position_ids": {0: tok}, "packed_attention_mask": {0: tok}}
    return x, dims


def _wrapper(model: DraftGraph, names: list[str]) -> nn.Module:
    """A module whose forward takes every input by name (torch.export names graph inputs so)."""
    kv = [n for n in names if n.startswith("past_key_values_")]
    anchor = "anchor_ids" if "anchor_ids" in names else "None"
    body = (f"    return self.m(inputs_embeds, dflash_target_hidden_concat, [{', '.join(kv)}], {anchor},\n"
            f"                  dict({', '.join(f'{k}={k}' for k in METADATA)}))\n")
    scope: dict = {}
    exec(f"def forward(self, {', '.join(names)}):\n{body}", scope)  # noqa: S102

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

    Wrapped.forward = scope["forward"]
    return Wrapped().eval()


def export_draft(draft_dir: pathlib.Path, target_dir: pathlib.Path, out: pathlib.Path,
                 translation: dict, mask_token_id: int) -> dict:
    """Write out/model.onnx (+ .data), config.json (the DFlash contract, ours added) and the
    runtime sidecars; return the config."""
    from tensorrt_edgellm.onnx.export import (
        _OPSET_VERSION,
        _permissive_inline_opset,
        _strip_attention_plugin_optional_inputs,
    )

    cfg, state = load_draft(draft_dir)
    target = load_file(str(target_dir / "model.safetensors"))
    model = DraftGraph(cfg, state, target).eval()
    names = _input_names(cfg)
    example, dims = _example(cfg)
    args, shapes = tuple(example[n] for n in names), [dims[n] for n in names]
    outputs = (["draft_tokens", "draft_confidence"] if cfg.ar_head else ["logits"]) + \
        [f"present_key_values_{i}" for i in range(cfg.num_layers)]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"
    with torch.no_grad(), _permissive_inline_opset(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and deprecations
        prog = torch.onnx.export(_wrapper(model, names), args, dynamo=True, input_names=names,
                                 output_names=outputs, dynamic_shapes=shapes, opset_version=_OPSET_VERSION,
                                 custom_translation_table=translation, external_data=True, optimize=True,
                                 verbose=False)
    prog.save(str(path), external_data=True)
    _strip_attention_plugin_optional_inputs(str(path))
    save_file({"mask_embedding": state["mask_embed"].float()[None].contiguous()},
              str(out / "mask_embedding.safetensors"))
    save_file({"vocab_map": state["vocab_ids"].to(torch.int32).contiguous()}, str(out / "draft_vocab_map.safetensors"))
    config = contract(cfg, mask_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return config


def contract(cfg, mask_token_id: int) -> dict:
    """The DFlash contract's config (Edge-LLM reads `dflash_config`), with what is ours.
    `mask_token_id`: the id Edge-LLM's runtime would embed at MASK positions; our runtime uses
    the learned `mask_embedding` instead."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "llama", "engine_role": "draft",
        "angelspec_kind": cfg.kind, "block_size": cfg.block_size, "draft_len": cfg.block_size - 1,
        "dflash_config": {"target_layer_ids": [l - 1 for l in cfg.target_layers], "block_size": cfg.block_size,
                          "is_causal": False, "mask_token_id": mask_token_id},
        "mask_embedding": "mask_embedding.safetensors", "draft_vocab_map": "draft_vocab_map.safetensors",
        "outputs": ["draft_tokens", "draft_confidence"] if cfg.ar_head else ["logits"],
        "extra_inputs": ["anchor_ids"] if cfg.ar_head else [],
        "layer_mixture": "folded into a projection per draft layer" if cfg.hybrid else None,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab or cfg.vocab_size,
    }
