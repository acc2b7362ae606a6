"""Prompt-lookup (n-gram) drafting: copy what followed the last earlier occurrence of the context's
most recent n-gram. Training-free; strong where outputs repeat their input (code edits, quotes)."""
from __future__ import annotations

import torch

from angelspec.drafters.base import Drafter, Proposal


def lookup(tokens: list[int], k: int, max_ngram: int = 3,
           min_ngram: int = 1) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram,
    and that n (0: no match)."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        first = suffix[0]
        for j in range(n_tok - n - 1, -1, -1):  # most recent occurrence first
            if tokens[j] == first and tokens[j:j + n] == suffix:
                return tokens[j + n: j + n + k], n
    return [], 0


class NgramDrafter(Drafter):
    """Confidence: no logits here, so token k of a draft gets the request's running rate of
    acceptance at depth k given the k-1 before it were accepted, measured by scoring each draft
    against the tokens committed after it, and kept apart by the length n of the n-gram that
    matched. Copies come in runs: once the first token matches, the next ones usually do too,
    which one overall rate per token misses (D-cut's survival products would then cut the long
    matches). And a 3-gram match copies far better than a 1-gram one. The rate for (n, k) starts
    from the request's rate at depth k over all n (worth 2 observations), which starts from 1/2
    (Laplace)."""
    name = "ngram"

    def __init__(self, draft_len: int = 3, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(draft_len)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, states: list) -> list[Proposal]:
        out = []
        for s in states:
            st = s.drafter_state
            # [reached, accepted] per depth k, over all matches ("all") and per matched n
            seen_at = st.setdefault("seen", {})
            if "last" in st:  # score the previous draft against what was committed after it
                start, n, prev = st.pop("last")
                seen = s.tokens[start: start + len(prev)]
                m = 0
                while m < len(seen) and seen[m] == prev[m]:
                    m += 1
                for key in ("all", n):
                    rows = seen_at.setdefault(key, [])
                    for k in range(min(m + 1, len(seen))):
                        if k == len(rows):
                            rows.append([0, 0])
                        rows[k][0] += 1
                        rows[k][1] += k < m
            draft, n = lookup(s.tokens, self.draft_len, self.max_ngram, self.min_ngram)
            st["last"] = (len(s.tokens), n, draft)
            overall, mine = seen_at.get("all", []), seen_at.get(n, [])
            conf = []
            for k in range(len(draft)):
                prior = (overall[k][1] + 1) / (overall[k][0] + 2) if k < len(overall) else 0.5
                conf.append((mine[k][1] + 2 * prior) / (mine[k][0] + 2) if k < len(mine) else prior)
            out.append(Proposal(torch.tensor(draft, dtype=torch.long),
                                torch.tensor(conf, dtype=torch.float32)))
        return out
