"""Trainable building blocks of the draft models (plain PyTorch, autograd-friendly), shared by
training and serving: RMSNorm, RoPE, a Llama-style attention + SwiGLU layer, and the frozen parts
borrowed from the target (embedding, final norm, lm_head restricted to the draft vocabulary)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from angelspec.plugins import linear, served


class Linear(nn.Linear):
    """nn.Linear that serves through the skinny kernel (a draft forward has a few rows, where
    the BLAS routine is slow on these CPUs) and trains through autograd as usual. `scheme`: the
    engine's weights, set when a draft is loaded for serving; `serving_weight` is the weight as
    the engine serves its own (plugins.served: bf16 tiles, a quantized scheme), converted on first
    use (a draft's one-call paths serve most layers from stacked copies of their own)."""
    scheme = "float32"
    _served = None

    @property
    def serving_weight(self):
        if self.scheme == "float32":
            return self.weight
        if self._served is None:
            self._served = served(self.weight.detach(), self.scheme)
        return self._served

    def forward(self, x):
        return linear(x, self.serving_weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):  # in float32 (a no-op at serving; under bf16 autocast, the fused kernel)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, T, D]; cos/sin [..., 1, T, D] (rotate-half convention, as Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SwiGLU(nn.Module):
    def __init__(self, h_in: int, width: int, h_out: int):
        super().__init__()
        self.gate = Linear(h_in, width, bias=False)
        self.up = Linear(h_in, width, bias=False)
        self.down = Linear(width, h_out, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """One layer of the target's architecture. Attention is split in two so callers can attend
    over whatever keys their masking scheme needs: `qkv` (normed, RoPE'd projections) and `finish`
    (output projection, residual, MLP)."""

    def __init__(self, cfg):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, hd
        self.in_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = Linear(h, self.nq * hd, bias=False)
        self.k_proj = Linear(h, self.nkv * hd, bias=False)
        self.v_proj = Linear(h, self.nkv * hd, bias=False)
        self.o_proj = Linear(self.nq * hd, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size, h)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:  # [..., T, n*hd] -> [..., n, T, hd]
        return x.unflatten(-1, (n, self.hd)).transpose(-3, -2)

    def kv(self, x: torch.Tensor, cos, sin):
        """Keys and values of already-normed inputs x [..., T, h] -> [..., Hkv, T, hd] each."""
        return rope(self.heads(self.k_proj(x), self.nkv), cos, sin), self.heads(self.v_proj(x), self.nkv)

    def q(self, xn: torch.Tensor, cos, sin) -> torch.Tensor:
        """Queries of already-normed inputs x [..., T, h] -> [..., H, T, hd]."""
        return rope(self.heads(self.q_proj(xn), self.nq), cos, sin)

    def qkv(self, x: torch.Tensor, cos, sin):
        xn = self.in_norm(x)
        return (self.q(xn, cos, sin), *self.kv(xn, cos, sin))

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [..., H, T, hd] -> the layer's output hidden state [..., T, h]."""
        x = x + self.o_proj(attn.transpose(-3, -2).flatten(-2))
        return x + self.mlp(self.post_norm(x))


def grouped(q: torch.Tensor, nkv: int) -> torch.Tensor:
    """[..., H, T, D] -> [..., Hkv, G, T, D]: query heads grouped by the KV head they share."""
    return q.unflatten(-3, (nkv, q.shape[-3] // nkv))


class Frozen:
    """The target's frozen parts a draft borrows (never saved with the draft, never trained):
    token embedding, final norm, and the lm_head rows of the draft vocabulary."""

    def __init__(self, model, vocab_ids: torch.Tensor):
        cfg = model.cfg
        self.embed = model.embed
        self.norm_w, self.eps = model.norm, cfg.rms_norm_eps
        self.cos, self.sin = model.cos, model.sin
        self.vocab_ids = vocab_ids.long()
        self.lm_head = model.lm_head[self.vocab_ids].contiguous()
        # the draft's logits in the engine's precision (bf16 tiles, a quantized scheme: a half to
        # a quarter of the bytes); over the whole vocabulary, the target's own served lm_head
        self.head_mm = self.lm_head
        if getattr(model, "weights", "float32") != "float32":
            full = torch.equal(self.vocab_ids, torch.arange(cfg.vocab_size))
            self.head_mm = model.head_w if full else served(self.lm_head, model.weights, logits=True)
        # target id -> draft vocabulary index (-1: outside the draft vocabulary)
        self.index = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        self.index[self.vocab_ids] = torch.arange(len(self.vocab_ids))

    def rope_tables(self, positions: torch.Tensor):
        """cos/sin [..., 1, T, D] for positions [..., T]."""
        return self.cos[positions].unsqueeze(-3), self.sin[positions].unsqueeze(-3)

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [..., h] -> logits over the draft vocabulary (the target's final norm and
        lm_head), or only over draft-vocabulary indices `rows` [..., k] (re-scoring candidates)."""
        hn = F.rms_norm(h.float(), (h.shape[-1],), self.norm_w, self.eps)
        if rows is None:
            return linear(hn, self.head_mm)
        return (self.lm_head[rows] @ hn.unsqueeze(-1)).squeeze(-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           extra: tuple = ()) -> torch.Tensor:
    """Grouped-query attention written out, so callers can add keys of their own.

    q [..., H, Tq, D]; k, v [..., Hkv, Tk, D]; mask broadcastable to [..., Hkv, G, Tq, Tk] (True =
    visible). `extra`: more (k, v) pairs [..., Hkv, Tq, D] whose i-th key is seen by query i only
    (the diagonal keys of a training-time rollout). Returns [..., H, Tq, D].
    """
    nkv = k.shape[-3]
    qg = grouped(q, nkv) * q.shape[-1] ** -0.5
    scores = qg @ k.unsqueeze(-3).transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    diag = [(qg * ek.unsqueeze(-3)).sum(-1, keepdim=True) for ek, _ in extra]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    tk = k.shape[-2]
    out = p[..., :tk] @ v.unsqueeze(-3)
    for j, (_, ev) in enumerate(extra):
        out = out + p[..., tk + j: tk + j + 1] * ev.unsqueeze(-3)
    return out.flatten(-4, -3)
