"""Synthetic targets (random weights of a published shape) and their GGUFs, at a tiny scale."""
import json

import pytest
import torch
from conftest import make_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from angelspec.builders.gguf import write_gguf
from angelspec.checkpoint import load_target, read_config
from angelspec.model import Segment
from angelspec.synthetic_target import GGUF, SHAPES, is_synthetic, write_synthetic_target
from angelspec.weights import bf16_exact


@pytest.fixture
def tokenizer_folder(tmp_path):
    path = tmp_path / "tok"
    make_checkpoint(path)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_synthetic_target_loads_decodes_and_writes_its_gguf(arch, tokenizer_folder, tmp_path, monkeypatch):
    """The shape's config with the tokenizer of another folder, bf16 weights seeded (the same
    twice), qkv biases for Qwen2; it loads and decodes as any target, is marked synthetic, and its
    GGUF is llama.cpp's `llama` (q / k rows permuted) or `qwen2` layout (rows kept, biases F32)."""
    name, fields = SHAPES["qwen2-1.5b" if arch == "qwen2" else "llama-1b"]
    tiny = dict(fields, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96)
    monkeypatch.setitem(SHAPES, "tiny", (name, tiny))
    a = write_synthetic_target("tiny", tmp_path / "a", tokenizer_folder)
    b = write_synthetic_target("tiny", tmp_path / "b", tokenizer_folder)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert is_synthetic(a) and not is_synthetic(tokenizer_folder)
    assert json.loads((a / "angelspec_source.json").read_text())["gguf"] == GGUF
    cfg = read_config(a)
    assert cfg.architecture == fields["architectures"][0] and cfg.qkv_bias == (arch == "qwen2")
    assert cfg.vocab_size == 97 and cfg.num_layers == 2 and cfg.eos_token_ids == [96]
    t = load_target(a, max_len=64)
    assert bf16_exact(t.model)  # bf16 values, as such checkpoints ship
    logits, _ = t.model.forward(torch.tensor([5, 6, 7]), t.model.batch([Segment(0, 0, 3)]),
                                t.model.new_cache(1, 8))
    assert torch.isfinite(logits).all()
    f = write_gguf(t, "w4a8", a / GGUF)
    r = GGUFReader(str(f))
    types = {x.name: x.tensor_type for x in r.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q4_1 and types["token_embd.weight"] == Q.Q8_0
    arch_key = "qwen2" if arch == "qwen2" else "llama"
    assert int(r.fields[f"{arch_key}.block_count"].parts[-1][0]) == 2
    assert ("blk.1.attn_k.bias" in types) == (arch == "qwen2")
    assert write_synthetic_target("tiny", a, tokenizer_folder) == a  # reused, GGUF kept
    assert (a / GGUF).exists()


def test_unknown_synthetic_shape_is_refused(tokenizer_folder, tmp_path):
    with pytest.raises(ValueError, match="llama-1b"):
        write_synthetic_target("llama-70b", tmp_path / "x", tokenizer_folder)


def test_the_projection_weighs_accepted_tokens_against_verification_and_drafting():
    """1 + a + ... + a^k tokens a step for C(k + 1)/C(1) plus drafting: with flat C(k) (a GPU) and
    free drafts the longest draft wins; nothing accepted costs exactly the extra rows; MTP pays
    its pass per token, DFly one pass per block, each capped at what it serves."""
    from angelspec.bench.projection import MAX_DRAFT, best, expected_tokens

    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 5) == 1.0
    flat = {k: 1.0 for k in range(1, 17)}
    assert best(flat, 0.5, "ngram", 0.0) == (MAX_DRAFT["ngram"], expected_tokens(0.5, 8))
    steep = {1: 1.0, 2: 1.1, 3: 1.6, 4: 2.0}
    k, s = best(steep, 0.0, "ngram", 0.0)
    assert (k, round(s, 6)) == (1, round(1 / 1.1, 6))
    assert best(flat, 0.5, "mtp", 0.1) == (2, 1.75 / 1.2)  # two passes of 0.1
    assert best(flat, 0.5, "dfly", 0.1) == (3, expected_tokens(0.5, 3) / 1.1)  # one block pass
