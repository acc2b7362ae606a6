"""Random-weight targets of the shapes users serve, for speed only.

Decoding speed depends on a model's shapes, not on its weights' values, and no 1B-class
Llama-family checkpoint can be downloaded here. A synthetic target is a Hugging Face checkpoint
folder of a published model's shape (its vocabulary replaced by the default target's tokenizer, so
prompts encode as usual) with seeded random weights, in bfloat16 as such checkpoints ship. Its
output is noise: no quality or acceptance figure may come from one.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import torch

# name -> (published model whose shape it takes, config fields)
SHAPES = {
    "llama-1b": ("Llama-3.2-1B", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen2-1.5b": ("Qwen2.5-1.5B", dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=False)),
    "llama-3b": ("Llama-3.2-3B", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=3072,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
SEED = 0
GGUF = "model.Q4_1.gguf"  # the same weights for llama.cpp and OpenVINO (angelspec_source.json names it)


def write_synthetic_target(name: str, out: str | pathlib.Path, tokenizer_from: pathlib.Path) -> pathlib.Path:
    """Write checkpoint folder `out` of shape `name` (SHAPES) with the tokenizer of the checkpoint
    folder `tokenizer_from`; reused when already written with the same shape."""
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic target {name!r} ({', '.join(SHAPES)})")
    model, fields = SHAPES[name]
    out = pathlib.Path(out)
    base = json.loads((tokenizer_from / "config.json").read_text())
    cfg = dict(fields, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096,
               vocab_size=base["vocab_size"], bos_token_id=base.get("bos_token_id"),
               eos_token_id=base.get("eos_token_id"), torch_dtype="bfloat16",
               angelspec_synthetic={"name": name, "shape_of": model, "seed": SEED,
                                    "note": "random weights: for speed only"})
    if (out / "model.safetensors").exists() and \
            json.loads((out / "config.json").read_text()) == cfg:
        return out
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    bias = cfg["model_type"] == "qwen2"

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).bfloat16()

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
              p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
              p + "mlp.down_proj.weight": rand(h, f)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                  p + "self_attn.v_proj.bias": rand(kv)}
    save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "angelspec_source.json").write_text(json.dumps({"synthetic": name, "gguf": GGUF}, indent=2) + "\n")
    for fname in TOKENIZER_FILES:
        if (tokenizer_from / fname).exists():
            shutil.copy(tokenizer_from / fname, tmp / fname)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # a half-written folder is never mistaken for a finished one
    return out


def is_synthetic(path: str | pathlib.Path) -> bool:
    """Whether the checkpoint folder holds a synthetic (random-weight) target."""
    f = pathlib.Path(path) / "config.json"
    return f.exists() and "angelspec_synthetic" in json.loads(f.read_text())
