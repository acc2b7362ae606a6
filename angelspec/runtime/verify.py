"""Acceptance of drafts against the target (docs/algorithms.md, section 0), through the batched ops
`angelspec::verify_greedy` and `angelspec::verify_rejection` (plugins/verify.py: the one
implementation of each rule).

Every function returns, per request, (accepted, tokens, path): `accepted` draft tokens were kept,
`tokens` is what the step commits, i.e. the accepted path's tokens plus one token of the target's
own, and `path` lists the accepted draft tokens' indices in the proposal (a chain: 0..accepted-1).
"""
from __future__ import annotations

import itertools

import torch

from angelspec.drafters import Proposal
from angelspec.plugins import verify_greedy as _greedy_op
from angelspec.plugins import verify_rejection_eager as _rejection_op
from angelspec.plugins.attention import CHAIN
from angelspec.sampling import probs_from_logits


def _result(prop: Proposal, accepted: int, last: int, leaf: int) -> tuple[int, list[int], list[int]]:
    if not accepted:
        return 0, [last], []
    if prop.parents is None:  # a chain: its first `accepted` tokens
        return accepted, prop.tokens[:accepted].tolist() + [last], list(range(accepted))
    path = prop.path(leaf)
    return accepted, prop.tokens[path].tolist() + [last], path


def verify_batch(logits: torch.Tensor, props: list[Proposal], params: list,
                 uniforms: list) -> list[tuple[int, list[int], list[int]]]:
    """logits [sum(k_i + 1), vocab] packed request by request (anchor row, then one per draft
    token); props: each request's proposal (k_i tokens, a chain or a tree); params: each
    request's SamplingParams; uniforms: for a sampling request the [k_i + 1] uniforms of its rows'
    positions (sampling.position_uniforms), else None. The greedy requests (most often all)
    take one op call, the sampling ones another."""
    lengths = [len(p.tokens) for p in props]
    starts = [0, *itertools.accumulate(k + 1 for k in lengths)]
    out: list = [None] * len(props)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    for group in (greedy, sampled):
        if not group:
            continue
        part = logits if len(group) == len(props) else logits[torch.cat(
            [torch.arange(starts[i], starts[i + 1]) for i in group])]
        draft = props[group[0]].tokens if len(group) == 1 else torch.cat([props[i].tokens for i in group])
        parents = CHAIN if all(props[i].parents is None for i in group) else torch.cat(
            [props[i].parent_index() for i in group])
        lens = torch.tensor([lengths[i] for i in group])
        if group is greedy:
            verdict = _greedy_op(part, draft, lens, parents)
        else:
            probs, a = [], 0
            for i in group:
                probs.append(probs_from_logits(part[a: a + lengths[i] + 1], params[i]))
                a += lengths[i] + 1
            verdict = _rejection_op(torch.cat(probs), draft, lens, parents,
                                    torch.cat([uniforms[i] for i in group]))
        accepted, last, leaf = (t.tolist() for t in verdict)
        for j, i in enumerate(group):
            out[i] = _result(props[i], accepted[j], last[j], leaf[j])
    return out


def verify_greedy(target_logits: torch.Tensor, draft: torch.Tensor) -> tuple[int, list[int]]:
    """One request's chain: target_logits [k+1, vocab] at the anchor and each draft position,
    draft [k] -> (accepted, committed tokens)."""
    accepted, last, _ = _greedy_op(target_logits, draft.long(), torch.tensor([len(draft)]),
                                   torch.arange(len(draft)) - 1)
    return int(accepted[0]), draft[:int(accepted[0])].tolist() + [int(last[0])]


def verify_rejection(target_probs: torch.Tensor, draft: torch.Tensor,
                     uniforms: torch.Tensor) -> tuple[int, list[int]]:
    """One request's chain: target_probs [k+1, vocab] (after temperature/top-k/top-p), draft [k]
    (a deterministic proposal), uniforms [k+1]: one per row -> (accepted, committed tokens)."""
    accepted, last, _ = _rejection_op(target_probs, draft.long(), torch.tensor([len(draft)]),
                                      torch.arange(len(draft)) - 1, uniforms)
    return int(accepted[0]), draft[:int(accepted[0])].tolist() + [int(last[0])]
