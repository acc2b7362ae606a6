"""The target/draft distribution after temperature, top-k, top-p (the parameters: angelspec.params)."""
from __future__ import annotations

import torch

from angelspec.params import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, vocab] -> probabilities [n, vocab] after temperature, top-k and top-p.

    Verification applies the same function to the target and (for sampling drafters) the draft,
    which is what keeps rejection sampling exact for the *processed* distribution.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep each row's smallest most-probable prefix whose mass reaches top_p (the first token
    always stays), renormalised. A row's nucleus is looked for among its top 64 tokens, then its
    top 4096, then all (sorting a whole vocabulary costs far more than finding its top 64);
    each row by itself, so a row's result never depends on the others in its batch."""
    out, rows, k, vocab = torch.zeros_like(probs), torch.arange(len(probs)), 64, probs.shape[-1]
    while len(rows):
        k = min(k, vocab)
        top, idx = probs[rows].topk(k, dim=-1)
        before = top.cumsum(-1) - top  # mass of the more probable tokens
        done = (before[:, -1] >= top_p) | (k == vocab)  # the nucleus ends inside the top k
        kept = top[done].masked_fill(before[done] >= top_p, 0.0)
        out[rows[done]] = torch.zeros(int(done.sum()), vocab).scatter(-1, idx[done], kept)
        rows, k = rows[~done], 64 * k
    return out / out.sum(-1, keepdim=True)


_MASK = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_uniforms(seed: int, start: int, n: int) -> torch.Tensor:
    """The uniforms in [0, 1) that sample positions start..start+n-1 of a request [n] (float64).

    Each is a function of (seed, position) alone - splitmix64's output at that position of the
    seed's stream - never of how many numbers were drawn before, so drafts, D-cut and routing
    (which change how many positions one step verifies) cannot change a seeded output.
    """
    base = _mix64(seed & _MASK)
    return torch.tensor([(_mix64((base + (p + 1) * 0x9E3779B97F4A7C15) & _MASK) >> 11) * 2.0**-53
                         for p in range(start, start + n)], dtype=torch.float64)
