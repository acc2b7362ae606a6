"""The drafter interface: how any drafter plugs into the one speculative step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Up to D draft tokens for one request.

    tokens [k] (long): the drafter's best guesses (an argmax or a lookup, for sampling requests
    too: verification accepts a token iff it equals the target's own sample there, so a guess
    drawn at random would only match less often); confidence [k]: the drafter's probability that
    each token is right (D-cut reads it).
    """
    tokens: torch.Tensor
    confidence: torch.Tensor

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(torch.zeros(0, dtype=torch.long), torch.zeros(0))

    def clip(self, k: int) -> "Proposal":
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], self.confidence[:k])


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
