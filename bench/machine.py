"""bench's figures of the machine beside the decoding it times: its streaming read bandwidth,
the layers of a one-row forward as served and with their weights in cache (LayerTimes, on
repeating_first_layer), sampled before every batch (MachineSamples); one forward's cost over 1..16
new tokens (verify_cost); and the process's resident memory (resident_mb)."""
from __future__ import annotations

import copy
import statistics
import time

import torch

from angelspec.checkpoint import Target
from angelspec.model import Llama, Segment
from angelspec.pages import zeros_on_huge_pages
from angelspec.runtime.backend import DecodeStep
from angelspec.weights import weight_bytes


def stream_buffer(mb: int = 1024) -> torch.Tensor:
    """float32 ones to stream, on huge pages as the served weights are (angelspec.pages), where
    reads run faster."""
    return zeros_on_huge_pages([((mb * 2**20 // 4,), torch.float32)])[0].fill_(1.0)


def stream_bandwidth(buf: torch.Tensor, reps: int = 3) -> float:
    """Machine's streaming read bandwidth in GB/s (best of `reps` sums over `buf`)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def repeating_first_layer(model: Llama) -> Llama:
    """`model` with every layer its first (the same tensors), run eagerly: its forward does the
    work of `model`'s on the weights of one layer, which stay in cache from layer to layer (what
    a forward's compute costs apart from streaming its weights). `model` is left as it was."""
    m = copy.copy(model)
    m.layers = [model.layers[0]] * len(model.layers)
    m.compiled, m.backend = None, "eager"
    m.invalidate()
    return m


class LayerTimes:
    """The layers of a one-row forward after CONTEXT cached tokens: as served (their weights
    streamed from memory), and on the model repeating its first layer (repeating_first_layer: the
    same compute, its weights in cache). A forward that overlapped its compute with reading its
    weights would take the larger of the second and the weights' streaming time, one that did
    not, their sum."""
    CONTEXT = 256

    def __init__(self, target: Target):
        self.steps = [DecodeStep(m, self.CONTEXT) for m in (target.model, repeating_first_layer(target.model))]

    def ms(self, reps: int = 5) -> tuple[float, float]:
        """Median ms of `reps` such forwards: as served, with the weights in cache."""
        return tuple(s.ms(reps, head=False) for s in self.steps)


class MachineSamples:
    """The streaming bandwidth and LayerTimes, sampled before every batch, under the same
    conditions as the decoding they are compared with (a machine's speed drifts); their medians
    are reported."""

    def __init__(self, target: Target):
        self.buf, self.bandwidths, self.layer_ms = stream_buffer(), [], []
        self.layers = LayerTimes(target)

    def sample(self) -> None:
        self.bandwidths.append(stream_bandwidth(buf=self.buf))
        self.layer_ms.append(self.layers.ms())

    def figures(self, target: Target) -> dict:
        """The medians, as bench's config reports them, after which the stream buffer and the
        layers' caches are freed (before huge_page_mb counts the served weights' huge pages)."""
        bandwidth = statistics.median(self.bandwidths)
        del self.buf, self.layers
        return {
            "stream_bandwidth_gb_per_s": round(bandwidth, 2),
            # the layers of a one-row forward (LayerTimes), medians over the batches: as served,
            # with their weights in cache, and their weights' streaming time at the machine's rate
            "layers_context": LayerTimes.CONTEXT,
            "layers_served_ms": round(statistics.median(a for a, _ in self.layer_ms), 3),
            "layers_in_cache_ms": round(statistics.median(b for _, b in self.layer_ms), 3),
            "layers_stream_ms": round(weight_bytes(target.model, head=False) / bandwidth / 1e6, 3),
        }


def verify_cost(target: Target, context: int = 256, sizes=tuple(range(1, 17)), reps: int = 15) -> dict:
    """Median ms of one target forward over n new tokens after `context` cached tokens.

    Sizes are measured in interleaved rounds, so a slow phase of a noisy machine hits all alike.
    """
    model = target.model
    cache = model.new_cache(1, context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, target.config.vocab_size, (context + max(sizes),), generator=g)
    model.forward(toks[:context], model.batch([Segment(0, 0, context)]), cache,
                  logit_rows=torch.tensor([context - 1]))
    batches = {n: model.batch([Segment(0, context, n)]) for n in sizes}
    times = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            t0 = time.perf_counter()
            model.forward(toks[context: context + n], batches[n], cache)
            times[n].append(time.perf_counter() - t0)
    ms = {n: statistics.median(t) * 1000 for n, t in times.items()}
    return {"context": context, "ms": ms, "ratio_vs_1": {n: ms[n] / ms[1] for n in sizes}}


def resident_mb() -> float | None:
    """This process's resident memory (VmRSS), MB; None where /proc does not say."""
    try:
        kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return round(kb / 1e3, 1)
