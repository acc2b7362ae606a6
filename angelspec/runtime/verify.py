"""Acceptance of one request's draft against the target (ALGORITHMS.md section 0).

Both rules return (accepted, tokens): `accepted` draft tokens were kept and `tokens` is what the
step commits, i.e. the accepted prefix plus one token of the target's own (the bonus token).
"""
from __future__ import annotations

import torch

from angelspec.runtime.sampling import sample


def verify_greedy(target_logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, list[int]]:
    """target_logits [k+1, vocab] at the anchor and each draft position, draft [k]."""
    best = target_logits.argmax(dim=-1)
    k = draft.numel()
    match = (best[:k] == draft).int()
    accepted = int(match.cumprod(0).sum()) if k else 0
    return accepted, best[: accepted + 1].tolist()


def verify_rejection(target_probs: torch.Tensor, draft: torch.Tensor, draft_q: torch.Tensor | None,
                     generator: torch.Generator | None) -> tuple[int, list[int]]:
    """Speculative rejection sampling; the committed tokens are distributed exactly as the target's.

    target_probs [k+1, vocab] (after temperature/top-k/top-p), draft [k], draft_q [k, vocab] = the
    distributions the draft tokens were drawn from, or None for a deterministic proposal (one-hot q).
    """
    k = draft.numel()
    out: list[int] = []
    for t in range(k):
        x = int(draft[t])
        p = target_probs[t]
        qx = 1.0 if draft_q is None else float(draft_q[t, x])
        r = float(torch.rand((), generator=generator))
        if qx > 0 and r < min(1.0, float(p[x]) / qx):
            out.append(x)
            continue
        if draft_q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_q[t]).clamp_min(0.0)
        total = float(residual.sum())
        residual = p if total <= 0 else residual / total
        out.append(int(sample(residual[None], generator)))
        return t, out
    out.append(int(sample(target_probs[k][None], generator)))
    return k, out
