"""The runtime: batched prefill + speculative steps over a static KV cache.

One step for all active requests: each request's drafter proposes up to D tokens -> the target
verifies every request's [anchor + drafts] in ONE packed forward -> the longest accepted prefix +
one bonus token are committed -> the cache keeps every committed token except the newest (the
next step's anchor); positions written for rejected drafts are simply overwritten later.
Autoregressive decoding is the same step with empty drafts.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from angelspec.checkpoint import Target
from angelspec.drafters import ALIASES, Drafter, Proposal, canonical, make_drafter
from angelspec.model import Segment
from angelspec.plugins import SKINNY_MAX_ROWS
from angelspec.runtime.sampling import SamplingParams, probs_from_logits, sample
from angelspec.runtime.verify import verify_greedy, verify_rejection


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    drafter: str = "none"


@dataclass
class Stats:
    steps: int = 0  # target verification forwards after prefill
    drafted: int = 0
    accepted: int = 0
    committed: int = 0  # tokens committed by those steps (accepted + bonus)

    @property
    def accept_len(self) -> float:
        """Mean tokens committed per verification step (tau)."""
        return self.committed / self.steps if self.steps else 0.0


@dataclass
class RequestState:
    index: int
    tokens: list[int]
    n_prompt: int
    params: SamplingParams
    drafter: str
    generator: torch.Generator | None
    stats: Stats = field(default_factory=Stats)
    slot: int = -1
    finish_reason: str | None = None
    drafter_state: dict = field(default_factory=dict)

    @property
    def cache_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def output(self) -> list[int]:
        return self.tokens[self.n_prompt:]


@dataclass
class Event:
    """Tokens committed for request `index`; its last event has `finish_reason` and `stats`."""
    index: int
    tokens: list[int]
    finish_reason: str | None = None
    stats: Stats | None = None


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    stats: Stats
    drafter: str


class Engine:
    """Serves many requests on one target; every request picks its drafter by name."""

    def __init__(self, target: Target, max_batch: int = 8, max_len: int = 2048,
                 draft_len: int | None = None, drafters: dict[str, Drafter] | None = None,
                 drafts: str | None = None):
        self.target, self.model = target, target.model
        self.max_batch = max_batch
        self.max_len = min(max_len, self.model.max_len)
        self.cache = self.model.new_cache(max_batch, self.max_len)
        self.draft_len = draft_len
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        self.drafts = drafts  # folder of trained drafts (<drafts>/mtp, /dfly, /dflash)
        self.prefill_time = 0.0  # seconds spent in prompt forwards (benchmarks separate decoding)
        self.steps = 0  # verification forwards run (one serves every active request)

    # -- requests ---------------------------------------------------------------------------
    def drafter_key(self, name: str) -> str:
        """Registry name of a request's drafter (built on first use); unknown: ValueError."""
        key = ALIASES.get(name, name) if isinstance(name, str) else name
        if key not in self.drafters:
            key = canonical(key)
            self.drafters[key] = make_drafter(key, self.draft_len, self.target, self.drafts)
        return key

    def drafter(self, name: str) -> Drafter:
        return self.drafters[self.drafter_key(name)]

    def _admit(self, index: int, req: Request) -> RequestState:
        """Validate a request up front, so a bad one fails before any work is done."""
        if not isinstance(req.prompt_ids, (list, tuple)) or not req.prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.target.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(req.prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of "
                             f"{self.max_len} tokens (room for at least one new token is needed)")
        params = req.params.validate()
        name = self.drafter_key(req.drafter)
        gen = None
        if not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(params.seed if params.seed is not None else
                            int(torch.randint(0, 2**62, ()).item()))
        return RequestState(index, list(req.prompt_ids), len(req.prompt_ids), params, name, gen)

    def generate(self, requests: list[Request]) -> list[Result]:
        tokens: list[list[int]] = [[] for _ in requests]
        results: list[Result | None] = [None] * len(requests)
        for ev in self.stream(requests):
            tokens[ev.index] += ev.tokens
            if ev.finish_reason:
                results[ev.index] = Result(tokens[ev.index], ev.finish_reason, ev.stats,
                                           self.drafter_key(requests[ev.index].drafter))
        return results

    def stream(self, requests: list[Request]) -> Iterator[Event]:
        """Run requests to completion with continuous batching, yielding tokens as committed.

        Every request is validated before any work starts (ValueError names the problem).
        """
        states = [self._admit(i, r) for i, r in enumerate(requests)]
        pending, active = deque(states), []
        free = list(range(self.max_batch - 1, -1, -1))
        while pending or active:
            while pending and free:
                group = self._prefill_group(pending, free)
                for s, new in zip(group, self._prefill(group)):
                    yield self._event(s, new)
                    if s.finish_reason:
                        self._release(s, free)
                    else:
                        active.append(s)
            if not active:
                continue
            for s, new in self._step(active):
                yield self._event(s, new)
            for s in [s for s in active if s.finish_reason]:
                active.remove(s)
                self._release(s, free)

    def _event(self, s: RequestState, new: list[int]) -> Event:
        return Event(s.index, new, s.finish_reason, s.stats if s.finish_reason else None)

    def _release(self, s: RequestState, free: list[int]) -> None:
        self.drafters[s.drafter].release(s)
        free.append(s.slot)
        s.slot = -1

    # -- the work -----------------------------------------------------------------------------
    def _capture(self, names) -> tuple[int, ...]:
        return tuple(sorted({i for n in names for i in self.drafters[n].capture}))

    def _prefill_group(self, pending: deque, free: list[int]) -> list[RequestState]:
        """Next prompts to prefill in one packed forward. Packing stays within the row-exact
        kernels (SKINNY_MAX_ROWS rows); a longer prompt goes alone, exactly as at batch 1."""
        group, rows = [], 0
        while pending and free:
            n = len(pending[0].tokens)
            if group and rows + n > SKINNY_MAX_ROWS:
                break
            s = pending.popleft()
            s.slot = free.pop()
            group.append(s)
            rows += n
            if rows > SKINNY_MAX_ROWS:
                break
        return group

    def _prefill(self, group: list[RequestState]) -> list[list[int]]:
        """Prompt forward for a group of requests; each samples its first token."""
        lengths = [len(s.tokens) for s in group]
        batch = self.model.batch([Segment(s.slot, 0, n) for s, n in zip(group, lengths)])
        last = torch.tensor(lengths).cumsum(0) - 1
        t0 = time.perf_counter()
        logits, hidden = self.model.forward(torch.tensor([t for s in group for t in s.tokens]),
                                            batch, self.cache, logit_rows=last,
                                            capture=self._capture({s.drafter for s in group}))
        self.prefill_time += time.perf_counter() - t0
        out, start = [], 0
        for i, (s, n) in enumerate(zip(group, lengths)):
            new = self._commit(s, [self._sample_one(logits[i], s)])
            self.drafters[s.drafter].on_commit(s, {l: h[start: start + n] for l, h in hidden.items()})
            out.append(new)
            start += n
        return out

    def _sample_one(self, logits: torch.Tensor, s: RequestState) -> int:
        if s.params.greedy:
            return int(logits.argmax())
        return int(sample(probs_from_logits(logits[None], s.params), s.generator))

    def _propose(self, active: list[RequestState]) -> list[Proposal]:
        props: list[Proposal | None] = [None] * len(active)
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(active):
            groups.setdefault(s.drafter, []).append(i)
        for name, idx in groups.items():
            for i, p in zip(idx, self.drafters[name].propose([active[i] for i in idx])):
                props[i] = p
        out = []
        for s, p in zip(active, props):
            # never draft past the token budget or the cache (the bonus token always comes)
            room = min(s.params.max_new_tokens - len(s.output), self.max_len - len(s.tokens)) - 1
            out.append(p.clip(max(room, 0)))
        return out

    def _step(self, active: list[RequestState]) -> list[tuple[RequestState, list[int]]]:
        self.steps += 1
        props = self._propose(active)
        tokens, segments = [], []
        for s, p in zip(active, props):
            tokens.append(torch.tensor([s.tokens[-1]]))
            tokens.append(p.tokens)
            segments.append(Segment(s.slot, s.cache_len, 1 + len(p.tokens)))
        logits, hidden = self.model.forward(torch.cat(tokens), self.model.batch(segments),
                                            self.cache,
                                            capture=self._capture({s.drafter for s in active}))
        out, row = [], 0
        for s, p in zip(active, props):
            k = len(p.tokens)
            rows = logits[row: row + k + 1]
            if s.params.greedy:
                accepted, new = verify_greedy(rows, p.tokens)
            else:
                accepted, new = verify_rejection(probs_from_logits(rows, s.params), p.tokens, p.q,
                                                 s.generator)
            s.stats.steps += 1
            s.stats.drafted += k
            s.stats.accepted += accepted
            committed = self._commit(s, new)
            s.stats.committed += len(committed)
            self.drafters[s.drafter].on_commit(
                s, {l: h[row: row + accepted + 1] for l, h in hidden.items()})
            out.append((s, committed))
            row += k + 1
        return out

    def _commit(self, s: RequestState, new: list[int]) -> list[int]:
        """Append tokens, cut at the first stop token or the length limit; set finish_reason."""
        p = s.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.target.eos_ids))
        kept = []
        for t in new:
            kept.append(t)
            if t in stops:
                s.finish_reason = "stop"
                break
            if len(s.output) + len(kept) >= p.max_new_tokens or \
                    len(s.tokens) + len(kept) >= self.max_len:
                s.finish_reason = "length"
                break
        s.tokens.extend(kept)
        return kept
