"""A GGUF of a target for bench's peers (llama.cpp, OpenVINO GenAI), so they run on any Llama,
Mistral or Qwen2 target, not only on one converted from a GGUF (the default target is; bench runs
that file).

llama.cpp's `llama` architecture, q and k rows permuted to its rotary layout (as llama.cpp's
convert_hf_to_gguf.py does), or its `qwen2` one (rows as they are, qkv biases in F32); the matmul
weights in the format matching the weights the engine serves (float32: F32; bfloat16: BF16; int8 /
w8a8: Q8_0; int4 / w4a8: Q4_1 with a Q8_0 token embedding and output matrix, the layout of the
default target's GGUF), norms in F32. The tokenizer's vocabulary, merges and special tokens go in
as a GPT-2-style BPE vocabulary; bench hands the peers token ids, so their text handling does not
matter to the comparison (a target without tokenizer.json gets placeholder tokens)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

from angelspec.checkpoint import Target, read_weights

Q = GGMLQuantizationType
FORMATS = {"float32": (Q.F32, Q.F32), "bfloat16": (Q.BF16, Q.BF16), "int8": (Q.Q8_0, Q.Q8_0),
           "w8a8": (Q.Q8_0, Q.Q8_0), "int4": (Q.Q4_1, Q.Q8_0), "w4a8": (Q.Q4_1, Q.Q8_0)}  # layers, embedding/output
F = LlamaFileType
FILE_TYPES = {"float32": F.ALL_F32, "bfloat16": F.MOSTLY_BF16, "int8": F.MOSTLY_Q8_0, "w8a8": F.MOSTLY_Q8_0,
              "int4": F.MOSTLY_Q4_1, "w4a8": F.MOSTLY_Q4_1}


def rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k projection rows from Hugging Face's rotate-half order to llama.cpp's interleaved one."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _arch(target: Target) -> str:
    """llama.cpp's architecture for the target (`llama` or `qwen2`); raises where neither fits."""
    cfg = target.config
    qwen = cfg.architecture == "Qwen2ForCausalLM"
    unsupported = [name for name, on in (("o/mlp biases" if qwen else "qkv/o/mlp biases",
                                          cfg.o_bias or cfg.mlp_bias or (cfg.qkv_bias and not qwen)),
                                         ("a sliding window", cfg.sliding_window),
                                         ("rope scaling", cfg.rope_scaling)) if on]
    if cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM") or unsupported:
        raise ValueError(f"writing a GGUF for {target.path}: llama.cpp's `llama` and `qwen2` architectures "
                         f"do not cover {cfg.architecture} with {', '.join(unsupported) or 'this layout'}; "
                         "convert it with llama.cpp's convert_hf_to_gguf.py instead")
    return "qwen2" if qwen else "llama"


def _vocab(target: Target) -> tuple[list[str], list[int], list[str]]:
    """Tokens (by id), their types and the BPE merges of the target's tokenizer.json."""
    n = target.config.vocab_size
    tokens, types = [f"[PAD{i}]" for i in range(n)], [int(TokenType.UNUSED)] * n
    f = target.path / "tokenizer.json"
    if not f.exists():
        return [f"[{i}]" for i in range(n)], [int(TokenType.NORMAL)] * n, []
    tok = json.loads(f.read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"writing a GGUF for {target.path}: only BPE tokenizers (tokenizer.json "
                         f"model.type BPE), not {model.get('type')!r}")
    for text, i in model["vocab"].items():
        if i < n:
            tokens[i], types[i] = text, int(TokenType.NORMAL)
    for t in tok.get("added_tokens", []):
        if t["id"] < n:
            tokens[t["id"]] = t["content"]
            types[t["id"]] = int(TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def write_gguf(target: Target, weights: str, out: pathlib.Path) -> pathlib.Path:
    """Write `target` as a GGUF for llama.cpp with matmul weights in the format of `weights` (an
    engine's served weights); returns `out`."""
    arch = _arch(target)
    if weights not in FORMATS:
        raise ValueError(f"no GGUF format for weights {weights!r} ({', '.join(FORMATS)})")
    layer_type, edge_type = FORMATS[weights]
    cfg = target.config
    w = read_weights(target.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    writer = GGUFWriter(str(tmp), arch)
    writer.add_name(target.path.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = _vocab(target)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    # what readers other than llama.cpp's (OpenVINO GenAI) look up, as the default target's GGUF has it
    writer.add_file_type(FILE_TYPES[weights])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    tok_cfg = target.path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg.read_text()) if tok_cfg.exists() else {}
    special = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos_token", writer.add_bos_token_id), ("unk_token", writer.add_unk_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        name = tok_cfg.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        if name in special:
            add(special[name])
    writer.add_add_bos_token(False)
    if isinstance(tok_cfg.get("chat_template"), str):
        writer.add_chat_template(tok_cfg["chat_template"])

    def put(name: str, t: torch.Tensor, qtype: GGMLQuantizationType) -> None:
        a = t.float().numpy()
        if qtype == Q.F32 or a.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    put("token_embd.weight", w["model.embed_tokens.weight"], edge_type)
    put("output_norm.weight", w["model.norm.weight"], Q.F32)
    if not cfg.tie_word_embeddings and "lm_head.weight" in w:
        put("output.weight", w["lm_head.weight"], edge_type)
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", w[p + "input_layernorm.weight"], Q.F32)
        q, k = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # qwen2 keeps Hugging Face's rotate-half order (llama.cpp's NEOX rope)
            q, k = rotary_rows(q, cfg.num_heads), rotary_rows(k, cfg.num_kv_heads)
        put(b + "attn_q.weight", q, layer_type)
        put(b + "attn_k.weight", k, layer_type)
        if cfg.qkv_bias:
            for n in "qkv":
                put(b + f"attn_{n}.bias", w[p + f"self_attn.{n}_proj.bias"], Q.F32)
        put(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"], layer_type)
        put(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"], layer_type)
        put(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"], Q.F32)
        put(b + "ffn_gate.weight", w[p + "mlp.gate_proj.weight"], layer_type)
        put(b + "ffn_up.weight", w[p + "mlp.up_proj.weight"], layer_type)
        put(b + "ffn_down.weight", w[p + "mlp.down_proj.weight"], layer_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out
