"""A request as the engine sees it: what a caller submits (Request), its state while it runs
(RequestState, and the DrafterView a drafter gets of it), and what comes back (Event, Result)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from angelspec.params import SamplingParams
from angelspec.runtime.router import RouteState
from angelspec.runtime.stats import Stats
from angelspec.sampling import position_uniforms


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    drafter: str = "none"


@dataclass
class RequestState:
    index: int
    tokens: list[int]
    n_prompt: int
    params: SamplingParams
    drafter: str  # the drafter drafting now (for `auto`, the router's current choice)
    seed: int | None  # sampling: the request's seed (drawn at random when it gave none)
    stats: Stats = field(default_factory=Stats)
    slot: int = -1
    finish_reason: str | None = None  # stop, length, or error (then `error` says why)
    error: str | None = None
    route: RouteState | None = None  # set when the request asked for `auto`
    views: dict = field(default_factory=dict)  # drafter name -> DrafterView

    @property
    def cache_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def output(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    def view(self, name: str) -> "DrafterView":
        if name not in self.views:
            self.views[name] = DrafterView(self)
        return self.views[name]

    def fail(self, drafter: str, exc: Exception) -> None:
        """End this request with an error of its drafter's; no other request is touched."""
        self.finish_reason, self.error = "error", f"drafter {drafter} failed: {type(exc).__name__}: {exc}"

    def uniforms(self, n: int) -> torch.Tensor:
        """Sampling: the uniforms of the next n positions (a function of seed and position)."""
        return position_uniforms(self.seed, len(self.tokens), n)


class DrafterView:
    """What a drafter sees of a request: its tokens, params and stats, and a state of its own
    (a routed request keeps one per candidate drafter)."""

    def __init__(self, req: RequestState):
        self.req, self.drafter_state = req, {}
        self.proposed = False  # whether the drafter proposed for it yet (the gate times steps)

    def __getattr__(self, name):  # tokens, params, stats, n_prompt, ... of the request
        return getattr(self.req, name)


@dataclass
class Event:
    """Tokens committed for request `index` and its running `stats`; its last event has
    `finish_reason`, the drafter used (for `auto`: the one that drafted most steps) and the
    router's switches; `error` when finish_reason is "error" (that request failed alone)."""
    index: int
    tokens: list[int]
    finish_reason: str | None = None
    stats: Stats | None = None
    drafter: str | None = None
    switches: list | None = None
    error: str | None = None


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    stats: Stats
    drafter: str  # for `auto`: the drafter that drafted most of its steps
    switches: list = field(default_factory=list)  # `auto`: (step, from, to)
    error: str | None = None  # finish_reason "error": what failed
