"""Hybrid drafting: one request's proposal merges the candidates of several drafters into one
token tree (shared prefixes merged), for example `ngram`'s copies where the context repeats and a
trained draft's tree where it does not. Verification, D-cut and the router treat it like any
drafter's tree."""
from __future__ import annotations

import torch

from angelspec.drafters.base import Drafter, Proposal


class PartView:
    """A part drafter's view of a request: the request's fields, and a state of the part's own
    inside the hybrid's."""

    def __init__(self, view, key: str):
        self.view, self.drafter_state = view, view.drafter_state.setdefault(key, {})

    def __getattr__(self, name):
        return getattr(self.view, name)


class HybridDrafter(Drafter):
    """parts: drafters, the cheap one first (`ngram`). Where the first part's best guess is at
    least `sure` likely, the others do not draft that step (their caches catch up later, as after
    any step they sat out); elsewhere every part's candidates join the tree, the part whose first
    guess is likelier first."""

    def __init__(self, parts: list[Drafter], sure: float = 0.8):
        super().__init__(max(p.draft_len for p in parts))
        self.parts, self.sure = parts, sure
        self.name = "+".join(p.name for p in parts)
        self.capture = tuple(sorted({i for p in parts for i in p.capture}))

    def views(self, states: list, i: int) -> list[PartView]:
        return [PartView(s, str(i)) for s in states]

    def propose(self, states: list) -> list[Proposal]:
        first = self.parts[0].propose(self.views(states, 0))
        props = [[p] for p in first]
        unsure = [j for j, p in enumerate(first) if not len(p.tokens) or float(p.confidence[0]) < self.sure]
        for i, part in enumerate(self.parts[1:], 1):
            if unsure:
                for j, p in zip(unsure, part.propose(self.views([states[j] for j in unsure], i))):
                    props[j].append(p)
        return [merge(ps) for ps in props]

    def on_commit(self, state, hidden: dict[int, torch.Tensor]) -> None:
        for i, part in enumerate(self.parts):
            part.on_commit(PartView(state, str(i)), {l: hidden[l] for l in part.capture})

    def release(self, state) -> None:
        for i, part in enumerate(self.parts):
            part.release(PartView(state, str(i)))


def merge(props: list[Proposal]) -> Proposal:
    """One tree of several proposals: the one whose first guess is likeliest first."""
    props = [p for p in props if len(p.tokens)]
    if len(props) <= 1:
        return props[0] if props else Proposal.empty()
    props.sort(key=lambda p: -float(p.confidence[0]))
    return Proposal.tree([path for p in props for path in p.paths()])
