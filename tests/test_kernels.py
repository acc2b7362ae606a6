"""The C++ kernels: correct, and each row rounds the same whatever else shares the call."""
import pytest
import torch
from conftest import check_on_each_isa, rerun_without_amx

import angelspec.plugins as ops
from angelspec.weights import MATMULS, bf16_exact, pack_bf16, weight_bytes

CHECK = r"""
import torch, angelspec.plugins as ops
g = torch.Generator().manual_seed(0)
for out_f, in_f in [(3072, 576), (577, 100), (7, 13), (50, 1536), (25, 120)]:
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(11, in_f, generator=g)
    y = ops.linear(x, w)
    ref = (x.double() @ w.double().t()).float()
    assert (y - ref).abs().max() < 1e-3 * in_f ** 0.5, (out_f, in_f)
    for n in (1, 2, 3, 5, 7, 8):
        assert torch.equal(ops.linear(x[:n], w), y[:n]), (out_f, in_f, n)
    assert torch.equal(ops.linear(x[4:5], w), y[4:5])
    # bf16 weights in chunked rows (CPUs without AMX tiles): the float32 kernel on their values
    wb = ops.Bf16Weight.of(w)
    assert torch.equal(wb.dequantized(), w.bfloat16().float())
    yb = ops.linear(x, wb)
    assert torch.equal(yb, ops.linear(x, w.bfloat16().float())), (out_f, in_f)
    for n in (1, 2, 3, 5):
        assert torch.equal(ops.linear(x[n:2 * n], wb), yb[n:2 * n]), (out_f, in_f, n)
# attention: a row's result is the same alone or with others, and matches SDPA
S, Hkv, M, D, H = 1, 3, 64, 64, 9
kc, vc = ops.kv_cache(S, Hkv, D, M)
k, v = torch.randn(40, Hkv, D, generator=g), torch.randn(40, Hkv, D, generator=g)
q = torch.randn(40, H, D, generator=g)
slots, pos = torch.zeros(40, dtype=torch.long), torch.arange(40)
full = ops.cached_attention(q, k, v, kc, vc, slots, pos)
for a, b in [(39, 40), (30, 38), (0, 1)]:
    assert torch.equal(ops.cached_attention(q[a:b], k[a:b], v[a:b], kc, vc, slots[a:b], pos[a:b]),
                       full[a:b])
kk, vv = k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1)
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
assert (full - ref.transpose(0, 1)).abs().max() < 1e-5
# a bf16 cache: each key and value rounded once as written, then exactly the float32 kernel's
# numbers on those values, row-exact
kb, vb = ops.kv_cache(S, Hkv, D, M, torch.bfloat16)
half = ops.cached_attention(q, k, v, kb, vb, slots, pos)
rounded = lambda t: t.bfloat16().float()  # noqa: E731
assert torch.equal(half, ops.cached_attention(q, rounded(k), rounded(v), *ops.kv_cache(S, Hkv, D, M), slots, pos))
assert torch.equal(vb[0, :, :40].float(), rounded(v).transpose(0, 1))
for a, b in [(39, 40), (30, 38), (0, 1)]:
    assert torch.equal(ops.cached_attention(q[a:b], k[a:b], v[a:b], kb, vb, slots[a:b], pos[a:b]), half[a:b])
# a token tree: each node's row equals the one-token row at its depth once its path is committed
L, parents = 37, [-1, 0, 1, 0, 3, 2, 1, 4]
N, one = len(parents), torch.ones(1, dtype=torch.long)
q, k, v = torch.randn(N, H, D, generator=g), torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
def cache():
    kc, vc = ops.kv_cache(2, Hkv, D, M)
    ops.cached_attention(torch.zeros(L, H, D), full[:L, :Hkv], full[:L, Hkv:2 * Hkv], kc, vc,
                         torch.ones(L, dtype=torch.long), torch.arange(L))
    return kc, vc
tree = ops.cached_attention(q, k, v, *cache(), torch.ones(N, dtype=torch.long), L + torch.arange(N),
                            parents=torch.tensor(parents))
for n in range(N):
    path = [n]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    kc, vc = cache()
    for depth, m in enumerate(reversed(path)):
        row = ops.cached_attention(q[m:m + 1], k[m:m + 1], v[m:m + 1], kc, vc, one, one * (L + depth))
    assert torch.equal(row, tree[n:n + 1]), n
print("ok", torch.backends.cpu.get_cpu_capability())
"""


def test_kernels_on_avx2_and_native_paths_are_correct_and_row_exact():
    check_on_each_isa(CHECK)


def test_row_argmax_is_torchs_first_maximum():
    """Verification's greedy token of a row: the first maximum (the first NaN where there is
    one), exactly torch's max(-1).indices, rows alone or together."""
    g = torch.Generator().manual_seed(3)
    for v in (1, 5, 8, 9, 23, 49152):
        x = torch.randn(13, v, generator=g)
        x[1] = 0.5  # every value ties
        x[2, v // 2:] = x[2].max()  # ties after the first maximum
        x[3, -1] = float("inf")
        x[4] = float("-inf")
        x[5, v // 3] = float("nan")
        x[6, (2 * v) // 3:] = float("nan")
        x[7, 0] = -0.0
        got = torch.ops.angelspec.row_argmax(x)
        assert torch.equal(got, x.max(-1).indices), v
        assert all(int(torch.ops.angelspec.row_argmax(x[i:i + 1])) == int(got[i]) for i in range(13))
    assert torch.equal(torch.ops.angelspec.row_argmax(x[::2]), x[::2].max(-1).indices)  # not contiguous


def test_cached_attention_matches_reference_and_masks_by_position():
    g = torch.Generator().manual_seed(1)
    S, Hkv, M, D, H = 2, 2, 32, 16, 6
    kc, vc = ops.kv_cache(S, Hkv, D, M)
    kc[1, :, 1, :, 4:] = 1e4  # stale keys past a request's length (positions 20-31) never count
    k, v = torch.randn(12, Hkv, D, generator=g), torch.randn(12, Hkv, D, generator=g)
    q = torch.randn(12, H, D, generator=g)
    slots, pos = torch.ones(12, dtype=torch.long), torch.arange(12)
    out = ops.cached_attention(q, k, v, kc, vc, slots, pos)
    kk, vv = k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv,
                                                           is_causal=True).transpose(0, 1)
    assert (out - ref).abs().max() < 1e-5
    assert torch.equal(ops.keys(kc)[1, :, :, :12], k.permute(1, 2, 0)) and kc[0].abs().sum() == 0
    assert torch.equal(vc[1, :, :12], v.transpose(0, 1))
    win = ops.cached_attention(q[-1:], k[-1:], v[-1:], kc, vc, slots[-1:], pos[-1:], window=4)
    ref4 = torch.nn.functional.scaled_dot_product_attention(q[-1:].transpose(0, 1), kk[:, 8:12],
                                                            vv[:, 8:12])  # the last 4 keys only
    assert (win - ref4.transpose(0, 1)).abs().max() < 1e-5
    # a window that starts inside a vector of keys: the lanes before it are computed and ignored
    kc[1, :, 0, :, :7] = 1e4
    win5 = ops.cached_attention(q[-1:], k[-1:], v[-1:], kc, vc, slots[-1:], pos[-1:], window=5)
    ref5 = torch.nn.functional.scaled_dot_product_attention(q[-1:].transpose(0, 1), kk[:, 7:12],
                                                            vv[:, 7:12])
    assert (win5 - ref5.transpose(0, 1)).abs().max() < 1e-5


AMX = pytest.mark.skipif(not ops.amx_available(), reason="no AMX-BF16 tiles on this CPU")


@AMX
def test_amx_linear_is_row_exact_and_sums_bf16_products_in_float32():
    g = torch.Generator().manual_seed(2)
    for out_f, in_f in [(960, 576), (48, 1536), (16, 32)]:
        w = torch.randn(out_f, in_f, generator=g).bfloat16().float()  # a bf16 checkpoint's weights
        packed = ops.pack_bf16(w)
        x = torch.randn(70, in_f, generator=g)
        y = ops.linear(x, packed)
        ref = (x.bfloat16().double() @ w.double().t()).float()  # bf16 inputs, exact products
        assert (y - ref).abs().max() < 1e-5 * in_f ** 0.5, (out_f, in_f)
        # inside one tile, a full tile, across tiles, pairs of row tiles (whole, and one short)
        for n in (1, 2, 3, 15, 16, 17, 32, 33, 48, 64):
            assert torch.equal(ops.linear(x[:n], packed), y[:n]), (out_f, in_f, n)
        assert torch.equal(ops.linear(x[20:21], packed), y[20:21])
    torch.library.opcheck(torch.ops.angelspec.amx_linear, (x[:5], packed))
    with pytest.raises(RuntimeError, match="out % 16"):
        ops.pack_bf16(torch.randn(17, 32))


def test_bf16_weights_serve_losslessly_and_the_checkpoint_unchanged(tmp_path):
    """A model whose weights are bf16 values serves them exactly (pack_bf16 rounds nothing), and
    greedy speculative decoding with bf16 weights equals bf16 batch-1 decoding: on AMX tiles,
    or (without them) read in row order by the float32 kernels, which then give exactly the
    float32 model's output."""
    from conftest import tiny_target

    from angelspec.runtime import Engine, Request, SamplingParams
    from angelspec.runtime.backend import choose_weights

    target = tiny_target(tmp_path, vocab_size=96, eos_token_id=95)
    m = target.model
    for layer in m.layers:  # round the random weights to bf16 values, as a bf16 checkpoint's
        for k in MATMULS:
            layer[k] = layer[k].bfloat16().float()
    m.embed = m.lm_head = m.head_w = m.embed.bfloat16().float()
    assert bf16_exact(m)
    p = SamplingParams(max_tokens=24)
    ps = [[5, 9, 14, 5, 9], [3] * 12, list(range(1, 40))]
    tiles = ops.amx_available()
    w = choose_weights(m, "auto")  # bf16 values: served as bf16 with tiles, measured without
    assert w["exact"] and w["checkpoint_is_bf16"] and w["amx_tiles"] == (w["dtype"] == "bfloat16" and tiles)
    assert w["dtype"] == "bfloat16" if tiles else "bfloat16 gives back the checkpoint's weights" in w["why"]
    bytes32 = weight_bytes(m)
    float32 = [Engine(target, max_batch=1, max_len=128).generate([Request(x, p, "ar")])[0].tokens
               for x in ps]
    pack_bf16(m)
    assert m.weights == "bfloat16" and weight_bytes(m) < 0.6 * bytes32
    assert isinstance(m.head_w, torch.Tensor) == tiles and m.lm_head.dtype == torch.float32
    assert all(isinstance(layer[k], torch.Tensor if tiles else ops.Bf16Weight) for layer in m.layers
               for k in MATMULS)
    ref = [Engine(target, max_batch=1, max_len=128).generate([Request(x, p, "ar")])[0].tokens
           for x in ps]
    if not tiles:
        assert ref == float32
    for batch in (1, 3):
        eng = Engine(target, max_batch=batch, max_len=128, draft_len=4)
        out = eng.generate([Request(x, p, "ngram") for x in ps])
        assert [r.tokens for r in out] == ref
        assert sum(r.stats.accepted for r in out) > 0


def test_bf16_weights_serve_losslessly_without_amx_tiles_too():
    rerun_without_amx("tests/test_kernels.py::test_bf16_weights_serve_losslessly_and_the_checkpoint_unchanged")
