"""The C++ kernels: correct, and each row rounds the same whatever else shares the call."""
import os
import subprocess
import sys

import torch

import angelspec.plugins as ops

CHECK = r"""
import torch, angelspec.plugins as ops
g = torch.Generator().manual_seed(0)
for out_f, in_f in [(3072, 576), (577, 100), (7, 13), (50, 1536)]:
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(11, in_f, generator=g)
    y = ops.linear(x, w)
    ref = (x.double() @ w.double().t()).float()
    assert (y - ref).abs().max() < 1e-3 * in_f ** 0.5, (out_f, in_f)
    for n in (1, 2, 3, 5, 7, 8):
        assert torch.equal(ops.linear(x[:n], w), y[:n]), (out_f, in_f, n)
    assert torch.equal(ops.linear(x[4:5], w), y[4:5])
# attention: a row's result is the same alone or with others, and matches SDPA
S, Hkv, M, D, H = 1, 3, 64, 64, 9
kc, vc = torch.zeros(S, Hkv, D, M), torch.zeros(S, Hkv, M, D)
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
print("ok", torch.backends.cpu.get_cpu_capability())
"""


def test_kernels_on_avx2_and_native_paths_are_correct_and_row_exact():
    for env in ({}, {"ANGELSPEC_NO_AVX512": "1"}):
        proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=600)
        assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_cached_attention_matches_reference_and_masks_by_position():
    g = torch.Generator().manual_seed(1)
    S, Hkv, M, D, H = 2, 2, 32, 16, 6
    kc, vc = torch.zeros(S, Hkv, D, M), torch.zeros(S, Hkv, M, D)
    kc[1, :, :, 20:] = 1e4  # stale entries past a request's length must never be seen
    k, v = torch.randn(12, Hkv, D, generator=g), torch.randn(12, Hkv, D, generator=g)
    q = torch.randn(12, H, D, generator=g)
    slots, pos = torch.ones(12, dtype=torch.long), torch.arange(12)
    out = ops.cached_attention(q, k, v, kc, vc, slots, pos)
    kk, vv = k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv,
                                                           is_causal=True).transpose(0, 1)
    assert (out - ref).abs().max() < 1e-5
    assert torch.equal(kc[1, :, :, :12], k.permute(1, 2, 0)) and kc[0].abs().sum() == 0
    assert torch.equal(vc[1, :, :12], v.transpose(0, 1))
    win = ops.cached_attention(q[-1:], k[-1:], v[-1:], kc, vc, slots[-1:], pos[-1:], window=4)
    ref4 = torch.nn.functional.scaled_dot_product_attention(q[-1:].transpose(0, 1), kk[:, 8:12],
                                                            vv[:, 8:12])  # the last 4 keys only
    assert (win - ref4.transpose(0, 1)).abs().max() < 1e-5
