"""Lean model code vs transformers, and row-count independence of the forward."""
import json

import pytest
import torch
from conftest import make_checkpoint, rerun_without_amx

from angelspec.bench.machine import repeating_first_layer
from angelspec.checkpoint import CheckpointError, load_target, read_config, read_weights
from angelspec.model import Llama, Segment
from angelspec.weights import served_as

VARIANTS = {
    "llama_tied": dict(arch="llama"),
    "llama_untied_llama3_rope": dict(arch="llama", tie_word_embeddings=False, rope_theta=50000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
    "llama_linear_rope_bias": dict(arch="llama", attention_bias=True, mlp_bias=True,
                                   rope_scaling={"type": "linear", "factor": 2.0}),
    "qwen2_qkv_bias": dict(arch="qwen2", tie_word_embeddings=False),
    "mistral": dict(arch="mistral", sliding_window=None, head_dim=16),
    "mistral_sliding_window": dict(arch="mistral", sliding_window=8),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers_prefill_and_cached_decode(tmp_path, name):
    hf = make_checkpoint(tmp_path, **VARIANTS[name])
    cfg = read_config(tmp_path)
    model = Llama(cfg, read_weights(tmp_path), max_len=512)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = model.new_cache(2, 128)
    # prefill 30 tokens into slot 1, then decode the last 10 one at a time from the cache
    pre, _ = model.forward(ids[:30], model.batch([Segment(1, 0, 30)]), cache)
    assert (pre - ref[:30]).abs().max() < 1e-4
    for t in range(30, 40):
        step, _ = model.forward(ids[t:t + 1], model.batch([Segment(1, t, 1)]), cache)
        assert (step[0] - ref[t]).abs().max() < 1e-4


def test_verification_forward_rounds_exactly_like_one_token_forwards(tiny):
    model = tiny.model
    ids = torch.randint(0, tiny.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(3, 64)
    model.forward(ids[:16], model.batch([Segment(0, 0, 16)]), cache)
    singles = [model.forward(ids[t:t + 1], model.batch([Segment(0, t, 1)]), cache)[0]
               for t in range(16, 24)]
    block, _ = model.forward(ids[16:24], model.batch([Segment(0, 16, 8)]), cache)
    assert torch.equal(torch.cat(singles), block)
    # packed with another request in the same forward: still bit-identical
    model.forward(ids[:5], model.batch([Segment(2, 0, 5)]), cache)
    packed, _ = model.forward(torch.cat([ids[5:8], ids[16:24]]),
                              model.batch([Segment(2, 5, 3), Segment(0, 16, 8)]), cache)
    assert torch.equal(packed[3:], block)


@pytest.mark.parametrize("name", ["llama_linear_rope_bias", "mistral", "mistral_sliding_window"])
def test_each_layer_as_one_op_computes_what_the_ops_one_by_one_compute(tmp_path, name):
    """plugins.decoder_layer (decoding and verification forwards: every layer in one
    decoder_stack call) against the model's op-by-op layer loop, bit for bit: prefill, decode
    steps, a token tree, captured hidden states, for every weight kind it dispatches (float32;
    bf16, on AMX tiles or in row order; weight-only and int8-activation quantized), with biases, a
    head_dim of its own and a sliding window."""
    make_checkpoint(tmp_path, **VARIANTS[name])
    cfg = read_config(tmp_path)
    base = Llama(cfg, read_weights(tmp_path), max_len=128)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    tree = torch.tensor([-1, 0, 0, 1, 2])
    for weights in ["float32", "bfloat16", "int8", "int4", "w8a8", "w4a8"]:
        fused = served_as(base, weights)
        ops = served_as(base, weights) if weights != "float32" else Llama(cfg, read_weights(tmp_path), max_len=128)
        ops.fused = False
        caches = [m.new_cache(2, 64) for m in (fused, ops)]
        steps = [(ids[:20], [Segment(1, 0, 20)]), (ids[20:21], [Segment(1, 20, 1)]),
                 (ids[21:25], [Segment(1, 21, 4)]), (ids[:3], [Segment(0, 0, 3)])]
        if not cfg.sliding_window:  # token trees need full attention
            steps.append((ids[25:30], [Segment(1, 25, 5, parents=tree)]))
        for toks, segs in steps:
            a, ha = fused.forward(toks, fused.batch(segs), caches[0], capture=(1, cfg.num_layers))
            b, hb = ops.forward(toks, ops.batch(segs), caches[1], capture=(1, cfg.num_layers))
            assert torch.equal(a, b) and all(torch.equal(ha[k], hb[k]) for k in hb), (weights, len(toks))
        assert all(torch.equal(x, y) for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


@pytest.mark.parametrize("vocab", [97, 112])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_one_region_forward_of_int8_dot_layers_computes_what_the_ops_compute(tmp_path, threads, vocab):
    """w8a8 / w4a8 forwards of up to 16 rows run every layer in one parallel region, the threads
    sharing each matmul's tiles and the attention's items (plugins/csrc/decoder_layer.cpp's
    run_region), and the head there too where its rows fill tiles of 16 (112; 97 runs it after
    the region): bit for bit the op-by-op loop's logits, hidden states and caches, at any thread
    count (3 threads split 2 kv heads' items unevenly), for 1 to 16 rows, several requests and a
    token tree; 17 rows take the per-op path and agree too."""
    # biases: added once, by one thread
    make_checkpoint(tmp_path, **VARIANTS["llama_linear_rope_bias"], vocab_size=vocab)
    cfg = read_config(tmp_path)
    base = Llama(cfg, read_weights(tmp_path), max_len=128)
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(5))
    outer = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for weights in ["w8a8", "w4a8"]:
            fused, ops = served_as(base, weights), served_as(base, weights)
            ops.fused = False
            caches = [m.new_cache(3, 64) for m in (fused, ops)]
            steps = [(ids[:20], [Segment(0, 0, 20)]), (ids[20:21], [Segment(0, 20, 1)]),
                     (ids[21:37], [Segment(0, 21, 16)]), (ids[:17], [Segment(1, 0, 17)]),
                     (ids[37:40], [Segment(0, 37, 1), Segment(1, 17, 2)]),
                     (ids[40:45], [Segment(0, 38, 5, parents=torch.tensor([-1, 0, 0, 1, 2]))])]
            for toks, segs in steps:
                a, ha = fused.forward(toks, fused.batch(segs), caches[0], capture=(1, cfg.num_layers))
                b, hb = ops.forward(toks, ops.batch(segs), caches[1], capture=(1, cfg.num_layers))
                assert torch.equal(a, b) and all(torch.equal(ha[k], hb[k]) for k in hb), (weights, len(toks))
            assert all(torch.equal(x, y) for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
    finally:
        torch.set_num_threads(outer)


def test_the_layer_stack_names_a_captured_layer_it_does_not_have(tmp_path):
    make_checkpoint(tmp_path)
    cfg = read_config(tmp_path)
    model = Llama(cfg, read_weights(tmp_path), max_len=64)
    with pytest.raises(RuntimeError, match=f"capture names layer {cfg.num_layers + 1}, not one of 1..{cfg.num_layers}"):
        model.forward(torch.arange(3), model.batch([Segment(0, 0, 3)]), model.new_cache(1, 64),
                      capture=(1, cfg.num_layers + 1))


def test_a_token_outside_the_vocabulary_is_a_clear_error(tmp_path):
    """The layer stack looks the token ids up itself (the embeddings in the same call)."""
    make_checkpoint(tmp_path)
    cfg = read_config(tmp_path)
    model = Llama(cfg, read_weights(tmp_path), max_len=64)
    bad = torch.tensor([1, cfg.vocab_size])
    with pytest.raises(RuntimeError, match=f"token id {cfg.vocab_size} outside the vocabulary"):
        model.forward(bad, model.batch([Segment(0, 0, 2)]), model.new_cache(1, 64))


def test_each_layer_as_one_op_with_bf16_rows_where_the_cpu_has_tiles():
    rerun_without_amx("tests/test_model.py::test_each_layer_as_one_op_computes_what_the_ops_one_by_one_compute"
                      "[llama_linear_rope_bias]")


def test_no_logits_rows_skip_the_head_and_the_repeating_model_runs_layer_one_throughout(tiny):
    """bench's layer times: a forward asked for no row's logits computes none (and writes the
    same keys and values); the model repeating its first layer shares that layer's tensors and
    leaves the model as it was."""
    model, ids = tiny.model, torch.arange(6)
    caches = [model.new_cache(1, 16) for _ in range(2)]
    logits, first = model.forward(ids, model.batch([Segment(0, 0, 6)]), caches[0], capture=(1,))
    none, _ = model.forward(ids, model.batch([Segment(0, 0, 6)]), caches[1],
                            logit_rows=torch.zeros(0, dtype=torch.long))
    assert logits.shape == (6, tiny.config.vocab_size) and none.shape == (0, tiny.config.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
    rep = repeating_first_layer(model)
    assert len(rep.layers) == len(model.layers) and all(layer is model.layers[0] for layer in rep.layers)
    assert model.layers[1] is not model.layers[0] and rep.backend == "eager"
    _, again = rep.forward(ids, rep.batch([Segment(0, 0, 6)]), rep.new_cache(1, 16), capture=(1,))
    assert torch.equal(again[1], first[1])


def test_hidden_states_of_chosen_layers(tmp_path):
    hf = make_checkpoint(tmp_path)
    cfg = read_config(tmp_path)
    model = Llama(cfg, read_weights(tmp_path), max_len=64)
    ids = torch.arange(10)
    _, hidden = model.forward(ids, model.batch([Segment(0, 0, 10)]), model.new_cache(1, 64),
                              capture=(0, 2, 3))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
    assert sorted(hidden) == [0, 2, 3]
    assert (hidden[2] - ref[2][0]).abs().max() < 1e-4
    # HF applies the final norm to its last entry; ours is the raw last layer output
    assert (hidden[0] - ref[0][0]).abs().max() == 0


def test_wrong_path_and_unsupported_architecture_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_target(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_target(tmp_path)


def test_missing_weights_are_a_clear_error(tmp_path):
    make_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_target(tmp_path)
