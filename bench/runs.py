"""What bench keeps of one runner's pass over the prompts (Run: outputs, times, accept counts),
how the prompts are cut into batches (chunks), and a batch decoded by an engine
(run_engine_chunk)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from angelspec.runtime import Engine, Request, SamplingParams


@dataclass
class Run:
    """One drafter's outputs and timings over all prompts."""
    drafter: str
    n: int
    outputs: list = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per domain, end to end
    prefill: dict[str, float] = field(default_factory=dict)  # per domain, prompt forwards
    forwards: dict[str, int] = field(default_factory=dict)  # per domain, target weight reads
    draft_time: float = 0.0  # seconds drafting in steps, all domains
    forward_time: float = 0.0  # seconds in verification forwards, all domains
    steps: list[int] = field(default_factory=list)  # verification forwards per prompt
    committed: list[int] = field(default_factory=list)  # tokens from those forwards
    drafted: list[int] = field(default_factory=list)  # draft tokens (chain or tree) verified
    tried: list[int] = field(default_factory=list)  # steps that verified a draft token
    first: list[int] = field(default_factory=list)  # ... and accepted its first
    dcut: bool = False
    used: list = field(default_factory=list)  # the drafter each prompt used (auto routes)
    # many in flight: tokens and seconds while every slot was busy (run_engine_chunk)
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    rates: list = field(default_factory=list)  # tokens/s of each batch, in the order they ran
    decoded: dict[str, list] = field(default_factory=dict)  # per domain, a peer's own decode timings

    def decode(self, domain: str, tokens: int, seconds: float) -> None:
        """A peer's own account of its decoding (prompt processing excluded)."""
        t = self.decoded.setdefault(domain, [0, 0.0])
        t[0], t[1] = t[0] + tokens, t[1] + seconds

    def mark(self) -> tuple:
        return sum(self.seconds.values()), self.steady_tokens, self.steady_seconds

    def close_batch(self, chunk: list[int], mark: tuple) -> None:
        """Keeps the rate of the batch run since `mark` (one request: its tokens over its time;
        several: over the time every slot was busy, as for the whole run)."""
        secs, tokens, busy = (now - then for now, then in zip(self.mark(), mark))
        self.rates.append(tokens / busy if len(chunk) > 1 and busy > 0 else
                          sum(len(self.outputs[i]) for i in chunk) / secs)

    def __post_init__(self):
        self.outputs, self.steps, self.committed = [None] * self.n, [0] * self.n, [0] * self.n
        self.drafted, self.tried, self.first = [0] * self.n, [0] * self.n, [0] * self.n
        self.used = [None] * self.n

    @property
    def label(self) -> str:
        return self.drafter + ("+dcut" if self.dcut else "")

    def add(self, domain: str, seconds: float, prefill: float, forwards: int) -> None:
        self.seconds[domain] = self.seconds.get(domain, 0.0) + seconds
        self.prefill[domain] = self.prefill.get(domain, 0.0) + prefill
        self.forwards[domain] = self.forwards.get(domain, 0) + forwards


def chunks(prompts: list[dict], batch_size: int) -> list[tuple[str, list[int]]]:
    """Batches of prompt indices. At batch 1 they never mix domains (time per domain is
    measurable); with many requests in flight a chunk holds 2x that many prompts of all domains
    interleaved, so finished requests are replaced while others run (continuous batching)."""
    if batch_size == 1:
        return [(p["domain"], [i]) for i, p in enumerate(prompts)]
    by_domain = [[i for i, p in enumerate(prompts) if p["domain"] == d]
                 for d in dict.fromkeys(p["domain"] for p in prompts)]
    mixed = [i for group in itertools.zip_longest(*by_domain) for i in group if i is not None]
    size = 2 * batch_size
    return [("all", mixed[c: c + size]) for c in range(0, len(mixed), size)]


def run_engine_chunk(engine: Engine, run: Run, ids: list[list[int]], chunk: list[int],
                     domain: str, max_tokens: int, sampling: dict | None = None,
                     drafter: str | None = None, ignore_eos: bool = False) -> None:
    """sampling: temperature and top_p (each prompt sampled with its index as seed); None: greedy.
    drafter: the one to request (default: the run's); ignore_eos: every request makes max_tokens.
    The chunk runs with continuous batching; the tokens committed while every slot was busy, and
    the time they took, are kept apart (Run.steady_*): once the queue is empty the batch drains,
    and how fast it drains depends on the slowest request left, not on the load the engine serves."""
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                             **(dict(sampling, seed=i) if sampling else {}))
              for i in chunk]
    engine.dcut = run.dcut
    st = engine.stats
    t0, p0, s0, d0, f0 = time.perf_counter(), st.prefill_time, st.steps, st.draft_time, st.forward_time
    for i, p in zip(chunk, params):
        engine.submit(Request(ids[i], p, drafter or run.drafter), i)
    tokens, ends, full, steady = {i: [] for i in chunk}, {}, min(engine.max_batch, len(chunk)), True
    while engine.busy:
        events = engine.step()
        for ev in events:
            tokens[ev.index] += ev.tokens
            if ev.finish_reason:
                ends[ev.index] = ev
        if steady:
            run.steady_tokens += sum(len(ev.tokens) for ev in events)
            if not engine.pending and len(engine.active) < full:  # a slot stays free from now on
                run.steady_seconds += time.perf_counter() - t0
                steady = False
    run.add(domain, time.perf_counter() - t0, st.prefill_time - p0, st.steps - s0)
    run.draft_time += st.draft_time - d0
    run.forward_time += st.forward_time - f0
    for i in chunk:
        ev = ends[i]
        run.outputs[i], run.steps[i], run.committed[i] = tokens[i], ev.stats.steps, ev.stats.committed
        run.drafted[i], run.used[i] = ev.stats.drafted, ev.drafter
        run.tried[i], run.first[i] = ev.stats.tried, ev.stats.first
