"""`angelspec build --export trtllm`: the engine's drafts in the layouts TensorRT-LLM's PyTorch
backend reads, plus an LLM-API YAML (`trtllm-serve <target> --config speculative.yaml`).

What maps and what does not (formats as documented by TensorRT-LLM 1.3/1.4; TensorRT-LLM cannot
be installed on these CPU machines, so the files are checked against that documentation only):
- **dflash** -> `decoding_type: DFlash`: `fc`, `hidden_norm`, `layers.{i}.*` (Llama layers),
  `norm` (= the target's final norm, which our drafts share), embedding and lm_head shared with
  the target; `dflash_config.target_layer_ids` are 0-based decoder-layer outputs (ours are
  Hugging Face hidden-state indices, one higher). Two gaps: TensorRT-LLM embeds the mask
  position with the target's embedding of `mask_token_id`, while our drafts learn their own
  mask embedding (written to `mask_embedding.safetensors`; for identical drafts, that row of the
  target's embedding would have to equal it); and our reduced draft vocabulary is not expressible
  (TensorRT-LLM's DFlash scores the full vocabulary), which only changes speed, not the tokens.
- **dfly**: DFly's two additions (the layer mixture and the AR head) have no counterpart in
  TensorRT-LLM's DFlash mode; it is not exported.
- **mtp**: TensorRT-LLM runs MTP only for targets whose checkpoint carries MTP layers (DeepSeek-V3
  family, GLM, Qwen3-Next, ...), not for a Llama target. The weights are written in the DeepSeek-V3
  layout (`model.layers.{N}.enorm/hnorm/eh_proj/...`) for such targets; no YAML is written for it.
- `draft_len_schedule` comes from the engine's D-cut cost profile: for each batch size, the draft
  length that maximises expected tokens per second, (1 + a + ... + a^d) / C(b * (1 + d)), with a
  per-token acceptance `a`. Keys are upper bounds of batch size (TensorRT-LLM >= 1.3 semantics);
  the smallest key is 1 and maps to max_draft_len, so older versions accept the file too.
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

from angelspec.plugins import interpolate_cost
from angelspec.runtime.manifest import EngineManifest, read_manifest

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def draft_len_schedule(profile: dict, max_draft_len: int, acceptance: float = 0.7) -> dict[int, int]:
    n = torch.tensor(profile["n"], dtype=torch.float64)
    t = torch.tensor(profile["ms"], dtype=torch.float64)
    best = {}
    for b in BATCH_SIZES:
        def rate(d):
            tokens = sum(acceptance ** j for j in range(d + 1))
            return tokens / float(interpolate_cost(torch.tensor([float(b * (1 + d))]), n, t)[0])
        best[b] = max(range(max_draft_len + 1), key=lambda d: (rate(d), -d))
    first = best[1]
    schedule = {1: first}
    for b in BATCH_SIZES[1:]:
        schedule[b] = min(best[b], first)
    return schedule


def _layer(prefix: str, state: dict, src: str) -> dict:
    """Our DecoderLayer parameters -> Hugging Face Llama layer names."""
    names = {"in_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
             "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
             "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight"}
    return {prefix + dst: state[src + k].contiguous() for k, dst in names.items()}


def export_dflash(engine: pathlib.Path, out: pathlib.Path) -> dict:
    cfg = json.loads((engine / "drafts/dflash/config.json").read_text())
    state = load_file(str(engine / "drafts/dflash/model.safetensors"))
    target_cfg = json.loads((engine / "target/config.json").read_text())
    target = load_file(str(engine / "target/model.safetensors"))
    weights = {"fc.weight": state["fc.weight"], "hidden_norm.weight": state["ctx_norms.0.weight"],
               "norm.weight": target["model.norm.weight"].float()}
    for i in range(cfg["num_layers"]):
        weights.update(_layer(f"layers.{i}.", state, f"layers.{i}."))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    save_file({"mask_embedding": state["mask_embed"][None]}, str(out / "mask_embedding.safetensors"))
    layer_ids = [l - 1 for l in cfg["target_layers"]]
    mask_id = target_cfg.get("pad_token_id") or target_cfg.get("eos_token_id")
    mask_id = mask_id[0] if isinstance(mask_id, list) else mask_id
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "llama",
        "block_size": cfg["block_size"],
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids,
                          "block_size": cfg["block_size"]},
        "num_target_layers": target_cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_heads"], "num_key_value_heads": cfg["num_kv_heads"],
        "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": target_cfg.get("rope_theta", 10000.0),
        "rope_scaling": target_cfg.get("rope_scaling"), "hidden_act": "silu",
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "vocab_size": target_cfg["vocab_size"], "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return config


def export_mtp(engine: pathlib.Path, out: pathlib.Path) -> None:
    cfg = json.loads((engine / "drafts/mtp/config.json").read_text())
    state = load_file(str(engine / "drafts/mtp/model.safetensors"))
    target = load_file(str(engine / "target/model.safetensors"))
    p = f"model.layers.{cfg['target_num_layers']}."
    weights = {p + "enorm.weight": state["enorm.weight"], p + "hnorm.weight": state["hnorm.weight"],
               p + "eh_proj.weight": state["fuse.weight"],
               p + "shared_head.norm.weight": target["model.norm.weight"].float(),
               **_layer(p, state, "layer.")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 1,
                                                 "layout": "DeepSeek-V3 MTP layer"}, indent=1) + "\n")


def export(engine: str | pathlib.Path, out: str | pathlib.Path, manifest: EngineManifest | None = None,
           acceptance: float = 0.7, final: str | pathlib.Path | None = None) -> list[str]:
    """Write <out>/dflash/, <out>/mtp-deepseek-layout/ and <out>/speculative.yaml; return paths.
    `manifest`: the engine's (read from the folder when not given); `final`: where `out` will
    live once the build renames it (the YAML names the draft there)."""
    engine, out = pathlib.Path(engine), pathlib.Path(out)
    final = pathlib.Path(final or out)
    manifest = manifest or read_manifest(engine, verify=False)
    written = []
    if "dflash" in manifest.drafters:
        config = export_dflash(engine, out / "dflash")
        max_len = manifest.drafters["dflash"].draft_len
        schedule = draft_len_schedule(manifest.dcut.profile, max_len, acceptance)
        lines = ["# TensorRT-LLM LLM-API options (trtllm-serve <target> --config speculative.yaml)",
                 "# written by angelspec build --export trtllm; draft_len_schedule from the D-cut "
                 "profile of the build machine", "speculative_config:", "  decoding_type: DFlash",
                 f"  max_draft_len: {schedule[1]}", f"  speculative_model: {(final / 'dflash').resolve()}",
                 f"  mask_token_id: {config['dflash_config']['mask_token_id']}",
                 f"  target_layer_ids: {json.dumps(config['dflash_config']['target_layer_ids'])}",
                 "  draft_len_schedule: {" + ", ".join(f"{b}: {d}" for b, d in schedule.items()) + "}"]
        (out / "speculative.yaml").write_text("\n".join(lines) + "\n")
        written += [str(final / "dflash"), str(final / "speculative.yaml")]
    if "mtp" in manifest.drafters:
        export_mtp(engine, out / "mtp-deepseek-layout")
        written.append(str(final / "mtp-deepseek-layout"))
    return written
