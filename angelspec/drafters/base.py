"""The drafter interface: how any drafter plugs into the one speculative step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_NO_TOKENS, _NO_CONFIDENCE = torch.zeros(0, dtype=torch.long), torch.zeros(0)


@dataclass
class Proposal:
    """Draft tokens for one request: a chain, or a token tree.

    tokens [k] (long): the drafter's guesses (an argmax or a lookup, for sampling requests too:
    verification accepts a token iff it equals the target's own sample there, so a guess drawn at
    random would only match less often); confidence [k]: the drafter's probability that each token
    is right given that its parent is (D-cut reads it); parents [k]: the index of each token's
    parent, -1 for a child of the anchor (None: a chain, token i's parent is i - 1). Parents come
    before their children, siblings differ, and the best child comes first, so the best path is
    stored as a chain (its KV stays in place when it is accepted).
    """
    tokens: torch.Tensor
    confidence: torch.Tensor
    parents: torch.Tensor | None = None

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(_NO_TOKENS, _NO_CONFIDENCE)  # shared: nothing can be written into them

    @staticmethod
    def tree(paths: list[tuple[list[int], list[float]]]) -> "Proposal":
        """Merge candidate continuations, best first, into one tree: each (tokens, confidences)
        path shares the nodes of its longest common prefix with the earlier ones (whose
        confidences stay); the tree lists each path's new nodes in order, so the first path is
        the chain 0..n-1."""
        tokens, conf, parents, children = [], [], [], {}
        for toks, confs in paths:
            at = -1
            for t, c in zip(toks, confs):
                node = children.get((at, t))
                if node is None:
                    node = children[(at, t)] = len(tokens)
                    tokens.append(t)
                    conf.append(c)
                    parents.append(at)
                at = node
        return Proposal.of(torch.tensor(tokens, dtype=torch.long),
                           torch.tensor(conf, dtype=torch.float32), torch.tensor(parents, dtype=torch.long))

    @staticmethod
    def of(tokens: torch.Tensor, confidence: torch.Tensor, parents: torch.Tensor) -> "Proposal":
        """A proposal with these parents, stored as a chain (parents None) when it is one."""
        chain = bool((parents == torch.arange(len(parents)) - 1).all())
        return Proposal(tokens, confidence, None if chain else parents)

    def parent_index(self) -> torch.Tensor:
        """parents, filled in for a chain."""
        return torch.arange(len(self.tokens)) - 1 if self.parents is None else self.parents

    def parent_list(self) -> list[int]:
        """parent_index as Python numbers."""
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else self.parents.tolist()

    def clip(self, k: int) -> "Proposal":
        """The first k tokens (a prefix keeps every kept token's parent)."""
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], self.confidence[:k],
                        None if self.parents is None else self.parents[:k])

    def chain(self) -> "Proposal":
        """The stored best path alone: the tokens before the first branch."""
        if self.parents is None:
            return self
        k = 0
        while k < len(self.parents) and int(self.parents[k]) == k - 1:
            k += 1
        return Proposal(self.tokens[:k], self.confidence[:k])

    def keep(self, mask: list[bool]) -> "Proposal":
        """The tokens where mask is True (their parents must be kept too), re-indexed."""
        kept = sum(mask)
        if kept == len(self.tokens):
            return self
        if self.parents is None:  # a chain keeps a prefix
            return self.clip(kept)
        mask = torch.tensor(mask, dtype=torch.bool)
        new_index = mask.long().cumsum(0) - 1
        parents = self.parents[mask]
        parents = torch.where(parents >= 0, new_index[parents.clamp_min(0)], -1)
        return Proposal.of(self.tokens[mask], self.confidence[mask], parents)

    def depth(self) -> int:
        """Tokens on the longest path (a chain: its length)."""
        return len(self.tokens) if self.parents is None else max(self.depths(), default=0)

    def depths(self) -> list[int]:
        """Each token's depth: 1 for a child of the anchor."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        depth: list[int] = []
        for p in self.parents.tolist():
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return depth

    def matched(self, continuation: list[int]) -> int:
        """The accept length had the target continued with `continuation`: the depth of the
        deepest token whose path equals its start."""
        depth, best = [], 0
        for t, p in zip(self.tokens.tolist(), self.parent_index().tolist()):
            up = 0 if p < 0 else depth[p]
            ok = (p < 0 or up > 0) and up < len(continuation) and t == continuation[up]
            depth.append(up + 1 if ok else 0)
            best = max(best, depth[-1])
        return best

    def paths(self) -> list[tuple[list[int], list[float]]]:
        """(tokens, confidences) of every path from the anchor to a leaf, in the order of the
        leaves (what Proposal.tree merges back into a tree)."""
        parents = self.parent_index().tolist()
        inner = set(parents)
        tokens, conf = self.tokens.tolist(), self.confidence.tolist()
        return [([tokens[i] for i in path], [conf[i] for i in path])
                for path in (self.path(leaf) for leaf in range(len(tokens)) if leaf not in inner)]

    def path(self, leaf: int) -> list[int]:
        """Token indices from the anchor's child down to `leaf` (empty for -1)."""
        if self.parents is None:
            return list(range(leaf + 1))
        out, parents = [], self.parents.tolist()
        while leaf >= 0:
            out.append(leaf)
            leaf = parents[leaf]
        return out[::-1]


class Drafter:
    """Proposes tokens; knows nothing about verification or other drafters.

    `capture` names the target hidden states (Hugging Face indices) the drafter consumes; the
    runtime returns them for committed tokens through `on_commit`.
    """
    name = "none"
    capture: tuple[int, ...] = ()

    def __init__(self, draft_len: int = 0):
        self.draft_len = draft_len

    def propose(self, states: list) -> list[Proposal]:
        """states: RequestState list (tokens, params, stats, drafter_state) -> one Proposal each."""
        return [Proposal.empty() for _ in states]

    def on_commit(self, state, hidden: dict[int, torch.Tensor]) -> None:
        """Called after prefill and each step with the target's hidden rows of the new tokens."""

    def release(self, state) -> None:
        """The request finished: drop whatever the drafter keeps for it."""
