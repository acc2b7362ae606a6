"""Prompt-lookup (n-gram) drafting: copy what followed the last earlier occurrence of the context's
most recent n-gram. Training-free; strong where outputs repeat their input (code edits, quotes)."""
from __future__ import annotations

import torch

from angelspec.drafters.base import Drafter, Proposal


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        first = suffix[0]
        for j in range(n_tok - n - 1, -1, -1):  # most recent occurrence first
            if tokens[j] == first and tokens[j:j + n] == suffix:
                return tokens[j + n: j + n + k]
    return []


class NgramDrafter(Drafter):
    """Confidence: no logits here, so each token gets the request's running acceptance rate
    (Laplace-smoothed accepted / drafted), a calibrated estimate of P(token accepted)."""
    name = "ngram"

    def __init__(self, draft_len: int = 3, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(draft_len)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, states: list) -> list[Proposal]:
        out = []
        for s in states:
            draft = lookup(s.tokens, self.draft_len, self.max_ngram, self.min_ngram)
            rate = (s.stats.accepted + 1) / (s.stats.drafted + 2)
            out.append(Proposal(torch.tensor(draft, dtype=torch.long),
                                torch.full((len(draft),), rate)))
        return out
