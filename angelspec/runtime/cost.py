"""C(n): the measured time of one packed verification forward over n tokens in total, which
D-cut weighs draft tokens against. Profiled on the machine that serves (the build stores it in
the engine with the machine's fingerprint; a different machine re-profiles at start-up)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from angelspec.model import Segment
from angelspec.plugins import SKINNY_MAX_ROWS


def fingerprint(backend: str = "eager", weights: str = "float32") -> dict:
    """What the cost of a forward depends on: CPU model, cores, torch version and threads,
    backend, and the dtype of the matmul weights."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        cpu += " + " + torch.cuda.get_device_name(0)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "backend": backend,
            "weights": weights}


@dataclass
class CostTable:
    n: list[int]  # total verified tokens per forward (sorted)
    seconds: list[float]  # median time of that forward
    fingerprint: dict

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.n, dtype=torch.float64), torch.tensor(self.seconds, dtype=torch.float64)

    def to_json(self) -> dict:
        return {"n": self.n, "ms": [round(s * 1000, 3) for s in self.seconds],
                "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(list(d["n"]), [m / 1000 for m in d["ms"]], dict(d["fingerprint"]))


def profile(model, max_tokens: int = SKINNY_MAX_ROWS, context: int = 256, per_request: int = 4,
            reps: int = 5, backend: str = "eager", progress=None) -> CostTable:
    """Time packed forwards of n tokens (requests of `per_request` tokens each, every one after
    `context` cached tokens), sizes measured in interleaved rounds so machine drift hits all alike."""
    sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n <= max_tokens}
                   | {max_tokens})
    slots = -(-max_tokens // per_request)
    context = max(1, min(context, model.max_len - per_request - 1))
    cache = model.new_cache(slots, context + per_request + 1)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.cfg.vocab_size, (context + per_request,), generator=g)
    for s in range(slots):
        model.forward(toks[:context], model.batch([Segment(s, 0, context)]), cache,
                      logit_rows=torch.tensor([context - 1]))
    batches = {}
    for n in sizes:
        segs = [Segment(i, context, min(per_request, n - i * per_request))
                for i in range(-(-n // per_request))]
        batches[n] = (toks[context:context + per_request].repeat(len(segs))[:n], model.batch(segs))
    times = {n: [] for n in sizes}
    with torch.inference_mode():
        for _ in range(reps):
            for n in sizes:
                x, b = batches[n]
                t0 = time.perf_counter()
                model.forward(x, b, cache)
                times[n].append(time.perf_counter() - t0)
            if progress:
                progress()
    return CostTable(sizes, [statistics.median(times[n]) for n in sizes],
                     fingerprint(backend, model.weights))
