"""Quantized engines: the weight-only int8 / int4 kernel computes the float32 kernel on the
dequantized weights, row-exact; the w8a8 / w4a8 kernel those weights times int8-rounded
activations, row-exact; a quantized model serves losslessly against itself; a build serves them."""
import pytest
import torch
from conftest import check_on_each_isa, run_on_each_isa, tiny_target

import angelspec.plugins as ops
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.weights import quantize, weight_bytes

CHECK = r"""
import torch, angelspec.plugins as ops
g = torch.Generator().manual_seed(0)
for scheme in ("int8", "int4"):
    for out_f, in_f in [(577, 64), (48, 576), (7, 1536)]:
        w = ops.quantize(torch.randn(out_f, in_f, generator=g), scheme)
        x = torch.randn(19, in_f, generator=g)
        y = ops.linear(x, w)
        assert torch.equal(y, torch.ops.angelspec.skinny_linear(x, w.dequantized())), (scheme, out_f)
        for a, b in ((0, 1), (0, 4), (3, 10), (18, 19)):
            assert torch.equal(ops.linear(x[a:b], w), y[a:b]), (scheme, out_f, a, b)
# int8 groups of any size: a tail after the last 8 weights
q = torch.randint(-127, 128, (10, 100), generator=g, dtype=torch.int8)
s, x = torch.rand(10, 2, generator=g) + 0.1, torch.randn(5, 100, generator=g)
w = (q.float().view(10, 2, 50) * s[..., None]).view(10, 100)
y = torch.ops.angelspec.quant_linear(x, q, s, None, 8)
assert torch.equal(y, torch.ops.angelspec.skinny_linear(x, w))
print("ok", torch.backends.cpu.get_cpu_capability())
"""


def test_quant_linear_is_the_float32_kernel_on_dequantized_weights_row_exact():
    """On the AVX2 path and the native one (AVX-512 where the CPU has it)."""
    check_on_each_isa(CHECK)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as quant_dot_linear rounds it: int8 levels in blocks of 32, scale max |x| / 127."""
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # (127 / t is 127 * (1 / t))
    return ((b * inv).round() * (amax / 127)).view_as(x)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_quant_dot_linear_is_int8_activations_times_the_weights_row_exact(scheme):
    """Integer dot products on int8-rounded activations: the exact product of the rounded x and
    the dequantized weights up to float32 accumulation, and each row rounds alike whatever the
    rows around it (1, 2, odd counts, more than SKINNY_MAX_ROWS)."""
    g = torch.Generator().manual_seed(2)
    for out_f, in_f in [(576, 64), (48, 576), (16, 1536), (32, 96)]:  # 96: an odd number of blocks
        w = ops.quantize(torch.randn(out_f, in_f, generator=g), scheme)
        assert w.int8_activations and w.bits == (8 if scheme == "w8a8" else 4)
        x = torch.randn(133, in_f, generator=g) * torch.rand(133, 1, generator=g) * 4
        x[5] = 0.0  # an all-zero row
        y = ops.linear(x, w)
        ref = int8_activations(x).double() @ w.dequantized().double().T
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item()), (scheme, out_f)
        assert torch.equal(y[5], torch.zeros(out_f))
        for a, b in ((0, 1), (0, 2), (3, 10), (18, 19), (20, 26), (1, 133)):
            assert torch.equal(ops.linear(x[a:b], w), y[a:b]), (scheme, out_f, a, b)
    weight_only = scheme.replace("w8a8", "int8").replace("w4a8", "int4")
    assert not ops.quantize(torch.randn(8, 64, generator=g), weight_only).int8_activations
    # the kernel takes tiles of 16 rows: other matrices are served weight-only
    odd = ops.quantize(torch.randn(24, 64, generator=g), scheme)
    assert not odd.int8_activations and odd.bits == w.bits
    # the tiled layout gives back a GGUF block's weights (float16 scales and minima) exactly
    lo, hi = (-127, 127) if w.bits == 8 else (0, 15)
    levels = torch.randint(lo, hi + 1, (32, 4, 32), generator=g)
    levels[..., 0], levels[..., 1] = lo, hi
    gguf = levels * (torch.rand(32, 4, 1, generator=g) / 50).half().float()
    if w.bits == 4:
        gguf = gguf + (torch.randn(32, 4, 1, generator=g) / 10).half().float()
    assert torch.equal(ops.quantize(gguf.view(32, 128), scheme).dequantized(), gguf.view(32, 128))
    small = ops.quantize(torch.randn(16, 64, generator=g), scheme)
    args = (torch.randn(3, 64), small.q, small.scale, small.offset, small.bits)
    torch.library.opcheck(torch.ops.angelspec.quant_dot_linear, args)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        torch.ops.angelspec.quant_dot_linear(*args[:4], 2)
    with pytest.raises(RuntimeError, match="in / 32"):
        torch.ops.angelspec.quant_dot_linear(args[0], args[1], args[2][:, :1], args[3], w.bits)
    with pytest.raises(RuntimeError, match="tiles of 16 rows"):
        torch.ops.angelspec.quant_dot_linear(args[0], args[1][:8], args[2][:8],
                                             None if args[3] is None else args[3][:8], w.bits)


SAME = r"""
import hashlib, torch, angelspec.plugins as ops
g, h = torch.Generator().manual_seed(4), hashlib.sha256()
for scheme in ("w8a8", "w4a8"):
    for out_f, in_f in [(576, 64), (48, 576), (32, 96), (48, 1536)]:
        w = ops.quantize(torch.randn(out_f, in_f, generator=g), scheme)
        assert w.int8_activations
        x = torch.randn(40, in_f, generator=g)
        for n in (1, 2, 5, 6, 7, 11, 16, 40):
            h.update(ops.linear(x[:n], w).numpy().tobytes())
print(h.hexdigest())
"""


def test_int8_activation_schemes_give_the_same_bits_on_every_isa():
    """The integer dot kernel: AVX2's, AVX512-VNNI's where the CPU has it (a tile of 16 outputs
    per vector, one instruction for the integer step) and, from 8 (int8) or 16 (int4) rows,
    AMX-INT8's where it has tiles (a block of 16 rows per tile product), compute the same
    numbers, so an engine decodes alike on all of them."""
    native, avx2 = run_on_each_isa(SAME)
    assert native == avx2 and len(native.strip()) == 64


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_rounds_each_weight_to_its_groups_nearest_level(scheme):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, 128, generator=g)
    w[3] = 0.0  # an all-zero row keeps a usable scale
    q = ops.quantize(w, scheme)
    assert q.shape == w.shape and q.scale.shape == (33, 4)
    assert q.nbytes < w.numel() * 4 / (3.5 if scheme == "int8" else 5)  # int4: 6 bits a weight
    d = q.dequantized()
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((d - w).abs() <= step / 2 * (1 + 1e-5)).all() and torch.equal(d[3], w[3])
    ends = w.view(33, 4, 32)  # each group's extreme weights are levels of their own
    top = ends.abs().amax(2) if scheme == "int8" else ends.amax(2)
    assert torch.allclose(d.view(33, 4, 32).abs().amax(2) if scheme == "int8"
                          else d.view(33, 4, 32).amax(2), top, rtol=1e-6, atol=0)
    # a checkpoint converted from a Q8_0 / Q4_1 GGUF (fp16 scales and minima) comes back exactly
    lo, hi = (-127, 127) if scheme == "int8" else (0, 15)
    levels = torch.randint(lo, hi + 1, (33, 4, 32), generator=g).float()
    levels[..., 0], levels[..., 1] = lo, hi
    fp16 = lambda t: t.half().float()  # noqa: E731
    gguf = levels * fp16(torch.rand(33, 4, 1, generator=g) / 50)
    if scheme == "int4":
        gguf = gguf + fp16(torch.randn(33, 4, 1, generator=g) / 10)
    gguf = gguf.view(33, 128)
    assert torch.equal(ops.quantize(gguf, scheme).dequantized(), gguf)
    args = (torch.randn(3, 128), q.q, q.scale, q.offset, q.bits)
    torch.library.opcheck(torch.ops.angelspec.quant_linear, args)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        torch.ops.angelspec.quant_linear(*args[:4], 2)
    with pytest.raises(RuntimeError, match="offset goes with 4 bits"):
        torch.ops.angelspec.quant_linear(*args[:3], None if scheme == "int4" else q.scale, q.bits)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize(torch.randn(4, 100), scheme)


@pytest.mark.parametrize("scheme,kv_cache", [("int8", "float32"), ("int4", "float32"), ("w8a8", "float32"),
                                              ("w4a8", "float32"), ("w4a8", "bfloat16")])
def test_quantized_model_serves_losslessly_against_itself(tmp_path, scheme, kv_cache):
    """Greedy speculative decoding (chains, trees, D-cut on and off, batch 1 and 3) equals the
    quantized model's own batch-1 decoding, a prompt longer than the row-exact kernels (int8 /
    int4: BLAS on the dequantized weights) included; seeded samples repeat; a quarter / a fifth
    of the bytes. Also with keys and values rounded to bf16 as they are cached (`--kv-cache`)."""
    target = tiny_target(tmp_path, vocab_size=96, eos_token_id=95)
    m = target.model
    m.kv_dtype = getattr(torch, kv_cache)
    assert m.new_cache(2, 64).k[0].dtype == m.kv_dtype
    bytes32 = weight_bytes(m)
    quantize(m, scheme)
    assert m.weights == scheme and m.head_w.bits == 8  # the logits' matmul: int8 under int4 too
    assert m.head_w.int8_activations == (scheme in ("w8a8", "w4a8"))
    assert m.lm_head.dtype == torch.float32  # the drafters' copy
    assert weight_bytes(m) < (0.3 if scheme in ("int8", "w8a8") else 0.25) * bytes32
    p = SamplingParams(max_tokens=24)
    ps = [[5, 9, 14, 5, 9], [3] * 12, list(range(1, 90)) + list(range(1, 70))]
    ar = Engine(target, max_batch=1, max_len=256)
    ref = [ar.generate([Request(x, p, "ar")])[0].tokens for x in ps]
    for batch in (1, 3):
        for name in ("ngram", "ngram:branches=3"):
            for dcut in (False, True):
                eng = Engine(target, max_batch=batch, max_len=256, draft_len=4, dcut=dcut)
                out = eng.generate([Request(x, p, name) for x in ps])
                assert [r.tokens for r in out] == ref, (batch, name, dcut)
                assert dcut or sum(r.stats.accepted for r in out) > 0  # D-cut may cut all
    s = SamplingParams(max_tokens=24, temperature=0.9, seed=4)
    sampled = ar.generate([Request(ps[0], s, "ar")])[0].tokens
    eng = Engine(target, max_batch=3, max_len=256, draft_len=4)
    assert eng.generate([Request(ps[0], s, "ngram")])[0].tokens == sampled
    with pytest.raises(RuntimeError, match="start from float32"):
        quantize(m, "int8" if scheme == "int4" else "int4")

