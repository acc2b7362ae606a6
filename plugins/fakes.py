"""Fake (meta) implementations of the C++ ops, so graphs that call them trace under
torch.compile / torch.export (shapes and dtypes only, no data)."""
import torch

from angelspec.plugins.build import load_kernels

load_kernels()


@torch.library.register_fake("angelspec::skinny_linear")
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("angelspec::amx_linear")
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("angelspec::quant_linear")
def _(x, q, scale, offset, bits):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("angelspec::quant_dot_linear")
def _(x, q, scale, offset, bits):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("angelspec::amx_pack")
def _(w):
    return w.new_empty(w.shape, dtype=torch.bfloat16)


@torch.library.register_fake("angelspec::cached_attention")
def _(q, k, v, k_cache, v_cache, slots, positions, parents, window):
    return torch.empty_like(q)


@torch.library.register_fake("angelspec::rms_norm")
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.register_fake("angelspec::rope_")
def _(x, cos, sin, positions, heads):
    return None


@torch.library.register_fake("angelspec::accept_paths")
def _(own, draft, lengths, parents):
    return tuple(lengths.new_empty(lengths.shape, dtype=torch.long) for _ in range(3))


@torch.library.register_fake("angelspec::verify_greedy")
def _(logits, draft, lengths, parents):
    return tuple(lengths.new_empty(lengths.shape, dtype=torch.long) for _ in range(3))


@torch.library.register_fake("angelspec::row_argmax")
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


@torch.library.register_fake("angelspec::silu_mul")
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
