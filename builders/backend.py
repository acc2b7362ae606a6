"""Backends for the target forward: eager PyTorch, and `inductor` (torch.compile, with the C++
ops kept as opaque custom ops through their fake kernels). The build measures both on the
serving machine and keeps the compiled one only when its logits are bit-identical to eager
(lossless) and it is at least `min_gain` faster: it costs minutes of compilation at every start."""
from __future__ import annotations

import statistics
import time

import torch

from angelspec.model import Llama, Segment
from angelspec.runtime.backend import BACKENDS, use_backend


def measure(model: Llama, backends, sizes=(1, 8), context: int = 256, reps: int = 9) -> dict:
    """Per backend: median ms of a forward over n tokens after `context` cached ones (rounds
    interleaved across backends, so a slow phase of the machine hits all alike), the first
    call's time (compilation), and whether its logits are bit-identical to eager's."""
    cache = model.new_cache(1, context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.cfg.vocab_size, (context + max(sizes),), generator=g)
    use_backend(model, "eager")
    model.forward(toks[:context], model.batch([Segment(0, 0, context)]), cache,
                  logit_rows=torch.tensor([context - 1]))
    batches = {n: model.batch([Segment(0, context, n)]) for n in sizes}
    logits, first, times = {}, {}, {b: {n: [] for n in sizes} for b in backends}
    forwards = {}
    try:
        for b in backends:  # compile (first call) and keep each backend's forward
            use_backend(model, b)
            forwards[b] = torch.inference_mode()(model.compiled or model.eager_forward)
            t0 = time.perf_counter()
            logits[b] = {n: forwards[b](toks[context:context + n], batches[n], cache)[0]
                         for n in sizes}
            first[b] = time.perf_counter() - t0
        for _ in range(reps):
            for b in backends:
                for n in sizes:
                    t0 = time.perf_counter()
                    forwards[b](toks[context:context + n], batches[n], cache)
                    times[b][n].append(time.perf_counter() - t0)
    finally:
        use_backend(model, "eager")
    return {b: {"ms": {n: statistics.median(t) * 1000 for n, t in times[b].items()},
                "first_call_s": round(first[b], 1),
                "exact": all(torch.equal(logits[b][n], logits["eager"][n]) for n in sizes)}
            for b in backends}


def choose(model: Llama, candidates=BACKENDS, min_gain: float = 1.2) -> dict:
    """Measure every candidate; the compiled one wins only if lossless and >= min_gain faster."""
    runs = measure(model, tuple(dict.fromkeys(("eager",) + tuple(candidates))))
    base = runs["eager"]
    report, chosen, best_gain = {}, "eager", 1.0
    for b, r in runs.items():
        gain = statistics.mean(base["ms"][n] / r["ms"][n] for n in r["ms"])
        report[b] = {"ms": {str(n): round(v, 2) for n, v in r["ms"].items()},
                     "speedup_vs_eager": round(gain, 3), "bit_identical_to_eager": r["exact"],
                     "first_call_s": r["first_call_s"]}
        if b != "eager" and r["exact"] and gain >= min_gain and gain > best_gain:
            chosen, best_gain = b, gain
    reason = None
    if chosen == "eager" and len(runs) > 1:
        reason = (f"no compiled backend was both bit-identical to eager and >= {min_gain}x faster "
                  "on this machine (see measured): the forward is already custom C++ kernels, "
                  "compilation only fuses the glue between them")
    return {"chosen": chosen, "min_gain": min_gain, "measured": report, "why_eager": reason}
