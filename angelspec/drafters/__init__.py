"""Drafter registry. `none` (shown as `ar`) is plain autoregressive decoding."""
from angelspec.drafters.base import Drafter, Proposal
from angelspec.drafters.ngram import NgramDrafter

ALIASES = {"ar": "none"}
DRAFTERS = {"none": Drafter, "ngram": NgramDrafter}


def canonical(name: str) -> str:
    """Map a user-facing drafter name to its registry name; unknown names raise ValueError."""
    if not isinstance(name, str):
        raise ValueError(f"drafter must be a string, got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in DRAFTERS:
        known = sorted(set(DRAFTERS) | set(ALIASES))
        raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(known)}")
    return key


def make_drafter(name: str, draft_len: int | None = None) -> Drafter:
    cls = DRAFTERS[canonical(name)]
    return cls() if draft_len is None else cls(draft_len=draft_len)


__all__ = ["ALIASES", "Drafter", "Proposal", "NgramDrafter", "canonical", "make_drafter", "DRAFTERS"]
