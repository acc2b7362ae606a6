"""C(n): the measured time of one packed verification forward over n tokens in total, which
D-cut weighs draft tokens against. Profiled on the machine that serves (the build stores it in
the engine with the machine's fingerprint; a different machine re-profiles at start-up)."""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from angelspec.model import Segment
from angelspec.plugins import SKINNY_MAX_ROWS
from angelspec.plugins.build import sources_hash
from angelspec.record import read_cpuinfo


def cpu_model() -> str:
    return read_cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them."""
    return read_cpuinfo()[1]


def fingerprint(backend: str = "eager", weights: str = "float32") -> dict:
    """What the cost of a forward depends on: CPU model, cores, torch version and threads,
    backend, the dtype of the matmul weights, and the kernels' sources (a kernel that changed,
    fused layers for one, changes the cost of a verified token: a profile made with the old ones
    misleads D-cut)."""
    cpu = cpu_model()
    if torch.cuda.is_available():
        cpu += " + " + torch.cuda.get_device_name(0)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "backend": backend,
            "weights": weights, "kernels": sources_hash()[:16]}


def rising(seconds: list[float]) -> list[float]:
    """Each time at least the one before it (times in order of more tokens)."""
    out, top = [], -math.inf
    for t in seconds:
        top = max(top, t)
        out.append(top)
    return out


BATCHES = (1, 2, 4, 8, 16)  # requests per forward with a curve of their own
ROWS = (1, 2, 3, 4, 6, 8)  # tokens per request on those curves (anchor + drafts)


@dataclass
class CostTable:
    """C(n), and C_B(n) per number of requests B.

    The main curve packs 4 tokens per request, so from n to n + 4 it adds a request, and with it
    attention over another KV cache. A draft token added to a request already in the forward
    costs less: its request's cache is already being read. D-cut decides the latter, so it
    reads the curve measured with its step's number of requests (`batches`: B -> 1..8 tokens
    per request)."""
    n: list[int]  # total verified tokens per forward (sorted)
    seconds: list[float]  # median time of that forward
    fingerprint: dict
    batches: dict = field(default_factory=dict)  # B -> (n [B * rows], seconds)
    context: int = 0  # cached tokens per request the curves were measured after
    per_key: float = 0.0  # seconds a verified token's attention adds per cached key past `context`

    def __post_init__(self):
        # a forward over more tokens is never cheaper: where a curve dips (the machine's noise, seen
        # in short start-up profiles: docs/results/design-measurements.md), it stays level, so no
        # draft token looks free to D-cut and the gate
        self.seconds = rising(self.seconds)
        self.batches = {b: (n, rising(t)) for b, (n, t) in self.batches.items()}

    def shift(self, context: float) -> float:
        """Seconds to add to C_B(n) per verified token for requests of `context` cached tokens
        (negative below the profile's context): every verified token attends to all of its
        request's keys, so a multi-token forward grows with the context faster than a one-token
        one (measured: docs/results/design-measurements.md)."""
        return self.per_key * (context - self.context)

    def tensors(self, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, seconds) as float64: the curve for `batch` requests (the measured B nearest to it),
        or the main curve."""
        n, t = self.n, self.seconds
        if batch is not None and self.batches:
            n, t = self.batches[min(self.batches, key=lambda b: abs(math.log(b / batch)))]
        return torch.tensor(n, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)

    def to_json(self) -> dict:
        return {"n": self.n, "ms": [round(s * 1000, 3) for s in self.seconds],
                "by_batch": {str(b): {"n": n, "ms": [round(s * 1000, 3) for s in t]}
                             for b, (n, t) in self.batches.items()},
                "context": self.context, "per_key_ns": round(self.per_key * 1e9, 3),
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        batches = {int(b): (list(c["n"]), [m / 1000 for m in c["ms"]])
                   for b, c in d.get("by_batch", {}).items()}
        return cls(list(d["n"]), [m / 1000 for m in d["ms"]], dict(d["fingerprint"]), batches,
                   int(d.get("context", 0)), float(d.get("per_key_ns", 0.0)) / 1e9)


def profile(model, max_tokens: int = SKINNY_MAX_ROWS, context: int = 256, per_request: int = 4,
            reps: int = 5, backend: str = "eager", progress=None) -> CostTable:
    """Time packed forwards of n tokens (requests of `per_request` tokens each, every one after
    `context` cached tokens), and of B requests x 1..8 tokens for the per-batch curves; all shapes
    measured in interleaved rounds so machine drift hits all alike. One request's 1..8 tokens
    are timed after 4 x `context` keys as well: what a verified token's attention adds per key
    (`per_key`, for D-cut at other contexts: CostTable.shift). Each timed forward follows an
    untimed one of its own shape, as decoding steps follow each other: right after a much larger
    shape a one-row forward runs slower, which made a second to fourth verified token look
    nearly free (docs/results/design-measurements.md)."""
    sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n <= max_tokens}
                   | {max_tokens})
    per_batch = [(b, r) for b in BATCHES for r in ROWS if b * r <= max_tokens]
    slots = max(-(-max_tokens // per_request), max(b for b, _ in per_batch))
    width = max(per_request, max(ROWS))
    context = max(1, min(context, model.max_len - width - 1))
    far = min(4 * context, model.max_len - width - 1)  # one request's context for the per-key slope
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.cfg.vocab_size, (max(context, far) + width,), generator=g)

    def filled(slots: int, n: int):
        cache = model.new_cache(slots, n + width + 1)
        for s in range(slots):
            model.forward(toks[:n], model.batch([Segment(s, 0, n)]), cache, logit_rows=torch.tensor([n - 1]))
        return cache
    cache = filled(slots, context)
    shapes = {}  # ("n", n) for the main curve, (B, rows) for the per-batch curves: (x, batch, cache)
    for n in sizes:
        segs = [Segment(i, context, min(per_request, n - i * per_request))
                for i in range(-(-n // per_request))]
        shapes["n", n] = (toks[context:context + per_request].repeat(len(segs))[:n],
                          model.batch(segs), cache)
    for b, r in per_batch:
        shapes[b, r] = (toks[context:context + r].repeat(b),
                        model.batch([Segment(i, context, r) for i in range(b)]), cache)
    near = [r for r in ROWS if (1, r) in shapes]  # one request's rows on the batch-1 curve
    if far > context:
        far_cache = filled(1, far)
        for r in near:
            shapes["far", r] = (toks[far:far + r], model.batch([Segment(0, far, r)]), far_cache)
    times = {k: [] for k in shapes}
    with torch.inference_mode():
        for _ in range(reps):
            for k, (x, batch, cache) in shapes.items():
                model.forward(x, batch, cache)
                t0 = time.perf_counter()
                model.forward(x, batch, cache)
                times[k].append(time.perf_counter() - t0)
            if progress:
                progress()
    med = {k: statistics.median(t) for k, t in times.items()}
    curves = {}
    for b, r in per_batch:
        n, t = curves.setdefault(b, ([], []))
        n.append(b * r)
        t.append(med[b, r])
    per_key = 0.0
    if far > context:  # the time per token and key over 1..8 tokens (the most tokens weigh most)
        per_key = max(0.0, sum(med["far", r] - med[1, r] for r in near) / (sum(near) * (far - context)))
    return CostTable(sizes, [med["n", n] for n in sizes], fingerprint(backend, model.weights),
                     curves, context, per_key)
