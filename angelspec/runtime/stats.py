"""Acceptance statistics: per request (what its client sees) and per engine (what benchmarks and
the served metrics read)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    """One request's speculative steps: draft tokens verified and accepted, tokens committed."""
    steps: int = 0  # target verification forwards after prefill
    drafted: int = 0
    accepted: int = 0
    committed: int = 0  # tokens committed by those steps (accepted + bonus)
    tried: int = 0  # steps that verified at least one draft token
    first: int = 0  # ... and accepted the first (a first draft token's acceptance: first / tried)

    @property
    def accept_len(self) -> float:
        """Mean tokens committed per verification step (tau)."""
        return self.committed / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, committed: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.committed += committed
        self.tried += drafted > 0
        self.first += accepted > 0


@dataclass
class EngineStats:
    """The engine's counters since it started."""
    steps: int = 0  # verification forwards (one serves every active request)
    prefill_time: float = 0.0  # seconds in prompt forwards (benchmarks separate decoding)
    prefix_hits: int = 0  # prompts whose cached prefix (the engine's prompt_prefix) was not prefilled
    dcut_drafted: int = 0  # draft tokens D-cut was offered
    dcut_kept: int = 0  # ... and kept
    draft_time: float = 0.0  # seconds drafting in steps (shadow drafts and the gate's plan too)
    forward_time: float = 0.0  # seconds in verification forwards
