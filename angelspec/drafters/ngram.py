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
    """Confidence: no logits here, so token k of a draft gets the request's running rate of
    acceptance at depth k given the k-1 before it were accepted (Laplace-smoothed), measured by
    scoring each draft against the tokens committed after it. Copies come in runs: once the
    first token matches, the next ones usually do too, which one overall rate per token misses
    (D-cut's survival products would then cut the long matches)."""
    name = "ngram"

    def __init__(self, draft_len: int = 3, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(draft_len)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, states: list) -> list[Proposal]:
        out = []
        for s in states:
            st = s.drafter_state
            hits, reached = st.setdefault("hits", []), st.setdefault("reached", [])
            if "last" in st:  # score the previous draft against what was committed after it
                start, prev = st.pop("last")
                seen = s.tokens[start: start + len(prev)]
                m = 0
                while m < len(seen) and seen[m] == prev[m]:
                    m += 1
                for k in range(min(m + 1, len(seen))):
                    if k == len(reached):
                        hits.append(0)
                        reached.append(0)
                    reached[k] += 1
                    hits[k] += k < m
            draft = lookup(s.tokens, self.draft_len, self.max_ngram, self.min_ngram)
            st["last"] = (len(s.tokens), draft)
            conf = [(hits[k] + 1) / (reached[k] + 2) if k < len(reached) else 0.5
                    for k in range(len(draft))]
            out.append(Proposal(torch.tensor(draft, dtype=torch.long),
                                torch.tensor(conf, dtype=torch.float32)))
        return out
