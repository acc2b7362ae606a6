"""Sampling parameters and their validation: one set of rules for the engine, the CLI, the
server and the OpenAI frontend (this module imports no torch, so the frontend stays light)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
