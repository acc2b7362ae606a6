"""Sampling parameters (validated) and the target/draft distribution after temperature, top-k, top-p."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# the smallest temperature that samples: below it, logits / T overflow float32 (a subnormal T
# turned the distribution into NaN); 0 means greedy
MIN_TEMPERATURE = 1e-3


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        """Raise ValueError with a precise message for any out-of-range value."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0 \
                or math.isinf(t) or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE:g}, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    top 4096, then all (sorting a 50k vocabulary costs ~1.4 ms a row, the top 64 a thirtieth);
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
