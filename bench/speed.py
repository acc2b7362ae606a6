"""`angelspec bench`: every drafter on the same prompts, side by side in one process.

Reports per drafter and domain: tokens/s, mean accept length (tokens per target forward), the
first draft token's acceptance (`acc1`: of the steps that verified a draft token), speedup
over `ar` (this engine, autoregressive), the weight bandwidth achieved next to the machine's own,
and `lossless` (output identical to batch-1 `ar`; a divergence where the target's top-2 logit
margin is below `eps` is a near-tie, counted in `near_ties` instead of failing). Greedy by
default; with a temperature every prompt is sampled with its own seed (its index), and a seeded
speculative sample must equal the seeded `ar` sample token for token (sampling.py: the target's
own token at each position is drawn with a uniform keyed by seed and position).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from angelspec.bench.peers import PEERS, SPECULATING, llama_bench, make_peer
from angelspec.builders.gguf import FORMATS, write_gguf
from angelspec.checkpoint import Target, load_target
from angelspec.default_target import gguf_folder
from angelspec.model import Segment
from angelspec.pages import huge_page_mb, zeros_on_huge_pages
from angelspec.runtime import Engine, Request, SamplingParams, settle_heap
from angelspec.runtime.backend import DecodeStep, fidelity
from angelspec.runtime.cost import cpu_model, profile
from angelspec.runtime.engine_dir import load_engine
from angelspec.runtime.manifest import read_manifest
from angelspec.synthetic_target import is_synthetic

NEAR_TIE_EPS = 1e-4


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


class LayerTimes:
    """The layers of a one-row forward after CONTEXT cached tokens, sampled before every batch
    beside the streaming figure: as served (their weights streamed from memory), and on the model
    repeating its first layer (Llama.repeating_first_layer: the same compute, its weights in
    cache). A forward that overlapped its compute with reading its weights would take the larger
    of the second and the weights' streaming time, one that did not, their sum."""
    CONTEXT = 256

    def __init__(self, target: Target):
        self.steps = [DecodeStep(m, self.CONTEXT) for m in (target.model, target.model.repeating_first_layer())]

    def ms(self, reps: int = 5) -> tuple[float, float]:
        """Median ms of `reps` such forwards: as served, with the weights in cache."""
        return tuple(s.ms(reps, head=False) for s in self.steps)


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


class HFRunner:
    """transformers `generate()` (greedy, batch 1) on the same checkpoint: the outside reference."""

    def __init__(self, target: Target):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target.path),
                                                          dtype=torch.float32).eval()
        self.eos = target.eos_ids or None

    def __call__(self, run: Run, ids: list[list[int]], chunk: list[int], domain: str,
                 max_tokens: int, ignore_eos: bool = False) -> None:
        eos = None if ignore_eos else self.eos
        for i in chunk:
            x = torch.tensor([ids[i]])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=torch.ones_like(x),
                                          max_new_tokens=max_tokens, do_sample=False,
                                          eos_token_id=eos,
                                          pad_token_id=self.eos[0] if self.eos else 0)
            run.outputs[i] = out[0, x.shape[1]:].tolist()
            run.add(domain, time.perf_counter() - t0, 0.0, len(run.outputs[i]))


class Float32Runner:
    """The same target with float32 weights, decoding autoregressively with as many requests in
    flight as the engine (eager, this engine's kernels): what the engine's served weights (bf16,
    int8 / int4, w8a8 / w4a8) gain over float32 on this machine."""

    def __init__(self, target: Target, batch_size: int, max_len: int):
        ref = target if target.model.weights == "float32" else load_target(target.path, max_len=max_len)
        self.engine = Engine(ref, max_batch=batch_size, max_len=max_len)
        run_engine_chunk(self.engine, Run("ar", 1), [[1, 2, 3]], [0], "warm-up", 8)

    def __call__(self, run: Run, ids: list[list[int]], chunk: list[int], domain: str,
                 max_tokens: int, ignore_eos: bool = False) -> None:
        run_engine_chunk(self.engine, run, ids, chunk, domain, max_tokens, drafter="ar",
                         ignore_eos=ignore_eos)


GGUF_DIR = pathlib.Path("build/gguf")  # GGUFs bench writes for targets not converted from one


def gguf_of(target: Target) -> pathlib.Path:
    """The GGUF a converted target came from (angelspec_source.json: the default target's), or
    else the target written as one (builders/gguf.py) in the format of the weights its engine
    serves, once, under build/gguf/ (keyed by the checkpoint's path, files and weights)."""
    src = target.path / "angelspec_source.json"
    name = json.loads(src.read_text()).get("gguf") if src.exists() else None
    if name:  # the default target's lies in its package; a synthetic target's in its folder
        return target.path / name if (target.path / name).exists() else gguf_folder() / name
    weights = target.model.weights
    files = sorted(target.path.glob("*.safetensors")) + sorted(target.path.glob("*.json"))
    key = hashlib.sha256(str(target.path.resolve()).encode())
    for f in files:
        key.update(f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}".encode())
    out = GGUF_DIR / f"{target.path.resolve().name}-{key.hexdigest()[:12]}-{weights}.gguf"
    if not out.exists():
        print(f"angelspec bench: writing {out} for llama.cpp ({weights} weights as "
              f"{FORMATS.get(weights, ('?',))[0].name})", file=sys.stderr)
        write_gguf(target, weights, out)
    return out


def first_difference(ref: list[int], out: list[int]) -> int:
    """The first position where two token lists differ (the shorter's length if one is a prefix)."""
    return next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))


def agreement(ref: list[int], out: list[int]) -> float:
    """Share of `ref`'s tokens that `out` reproduces before it first differs."""
    return first_difference(ref, out) / max(len(ref), 1)


# timed beside ours, greedy: outside runtimes, and our float32 weights; no drafts, no accept length
REFERENCES = ("hf", "float32", *PEERS)
OTHER_NUMERICS = ("float32", *PEERS)  # their greedy text is compared with ar's, not required to match


def top2_margin(target: Target, tokens: list[int]) -> float:
    """Target's top-2 logit margin for the token after `tokens` (batch 1, this engine)."""
    model = target.model
    cache = model.new_cache(1, len(tokens) + 1)
    logits, _ = model.forward(torch.tensor(tokens), model.batch([Segment(0, 0, len(tokens))]),
                              cache, logit_rows=torch.tensor([len(tokens) - 1]))
    top = logits[0].topk(2).values
    return float(top[0] - top[1])


def compare(target: Target, ids: list[int], ref: list[int], out: list[int], eps: float) -> str:
    """'same', 'near_tie' (first divergence at a near-tie of the target) or 'diverged'."""
    if out == ref:
        return "same"
    j = first_difference(ref, out)
    if j >= min(len(ref), len(out)):  # one stopped where the other went on
        return "diverged"
    return "near_tie" if top2_margin(target, ids + ref[:j]) < eps else "diverged"


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


def bench(target: Target | None, prompts: list[dict], drafters: list[str], max_tokens: int = 128,
          batch_size: int = 1, draft_len: int | None = None, eps: float = NEAR_TIE_EPS,
          with_verify_cost: bool = False, drafts: str | None = None, engine_dir: str | None = None,
          dcut: str = "engine", rounds: int = 1, temperature: float = 0.0, top_p: float = 1.0,
          ignore_eos: bool = False) -> dict:
    """batch_size: requests in flight (the engine's concurrency); dcut: off, on, both (every
    drafter runs with and without D-cut, side by side) or engine (what is served: the engine's
    own setting with engine_dir, on without); engine_dir: serve a built engine (its
    target, drafts, router, backend and cost profile) instead of `target` + `drafts`; rounds:
    every batch runs that many times, drafters taking turns each time, and times add up (at high
    concurrency all prompts are one batch, so one round would time each drafter once, at a
    different moment of a noisy machine); temperature > 0: seeded sampling (top_p too);
    ignore_eos: every request makes max_tokens (a synthetic target's, whose end is noise)."""
    names = [d.strip() for d in drafters if d.strip()]
    names = ["ar"] + [d for d in names if d != "ar"]  # ar is the speed and lossless reference
    if dcut == "engine":
        dcut = "on" if not engine_dir or read_manifest(engine_dir, verify=False).defaults.dcut else "off"
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[dcut]
    sampling = None
    if temperature:
        sampling = dict(temperature=temperature, top_p=top_p)
        SamplingParams(**sampling).validate()
        if any(r in names for r in REFERENCES):
            raise ValueError(f"{', '.join(REFERENCES)} are greedy references: drop them from "
                             "--drafters when sampling")
        eps = 0.0  # a sampled token follows the uniform, not the top-2 margin: no near-ties
    if engine_dir:
        target = load_target(pathlib.Path(engine_dir) / "target")
    ids = [target.encode_chat(p["prompt"]) for p in prompts]
    max_len = max(len(x) for x in ids) + max_tokens + 1
    if engine_dir:
        engine = load_engine(engine_dir, max_batch=batch_size, max_len=max_len, dcut=False,
                             target=target)
    else:
        drafting = any(d not in ("ar", *REFERENCES) for d in names)  # D-cut's cost table: only for them
        engine = Engine(target, max_batch=batch_size, draft_len=draft_len, max_len=max_len,
                        drafts=drafts, cost=profile(target.model) if True in modes and drafting else None)
    for d in names:
        if d not in REFERENCES:
            engine.drafter_key(d)  # unknown drafters and unfit drafts fail before any work
    run_engine_chunk(engine, Run("ar", len(ids)), ids, [0], "warm-up", 8)
    settle_heap()
    resident = resident_mb()  # the engine's, before any reference loads beside it
    # the bandwidth reference (and the layers' times) are sampled before every batch, under the
    # same conditions as the decoding they are compared with (this machine's speed drifts), and
    # their medians reported
    stream_buf, samples, layer_ms = stream_buffer(), [], []
    layers = LayerTimes(target)
    outside = {d: HFRunner(target) if d == "hf" else Float32Runner(target, batch_size, max_len)
               if d == "float32" else make_peer(d, gguf_of(target), torch.get_num_threads(), batch_size, max_len)
               for d in names if d in REFERENCES}
    runs = [Run(d, len(prompts), dcut=m) for d in names
            for m in ((False,) if d in ("ar", *REFERENCES) else modes)]
    # drafters take turns on each batch, each batch starting with the next one: a slow phase of
    # a noisy machine hits all of them alike, and none always runs first or last
    for k, (domain, chunk) in enumerate(tqdm(chunks(prompts, batch_size) * rounds,
                                             desc=f"bench {','.join(r.label for r in runs)}",
                                             unit="batch", file=sys.stderr)):
        samples.append(stream_bandwidth(buf=stream_buf))
        layer_ms.append(layers.ms())
        for run in runs[k % len(runs):] + runs[:k % len(runs)]:
            mark = run.mark()
            if run.drafter in outside:
                outside[run.drafter](run, ids, chunk, domain, max_tokens, ignore_eos)
            else:
                run_engine_chunk(engine, run, ids, chunk, domain, max_tokens, sampling,
                                 ignore_eos=ignore_eos)
            run.close_batch(chunk, mark)
    ref = runs[0].outputs
    if batch_size > 1:  # the lossless reference is always batch-1 autoregressive decoding
        ref_run = Run("ar", len(ids))
        single = Engine(target, max_batch=1, max_len=engine.max_len, prompt_prefix=engine.prompt_prefix)
        for domain, chunk in tqdm(chunks(prompts, 1), desc="reference (ar, batch 1)",
                                  file=sys.stderr):
            run_engine_chunk(single, ref_run, ids, chunk, domain, max_tokens, sampling,
                             ignore_eos=ignore_eos)
        ref = ref_run.outputs
    bandwidth = statistics.median(samples)
    del stream_buf, layers
    huge = huge_page_mb()  # the served weights', where the system granted huge pages
    weight_bytes = target.model.weight_bytes()
    rows = []
    domains = list(dict.fromkeys(p["domain"] for p in prompts))
    ar_tps = {}
    for run in runs:
        verdicts = [compare(target, ids[i], ref[i], run.outputs[i], eps)
                    for i in range(len(prompts))]
        for dom in domains + ["all"]:
            idx = [i for i, p in enumerate(prompts) if dom in ("all", p["domain"])]
            timed = dom == "all" or dom in run.seconds  # mixed batches: time only for "all"
            pick = (lambda m: sum(m.values())) if dom == "all" else (lambda m: m[dom])  # noqa: E731
            new = sum(len(run.outputs[i]) for i in idx)  # per round
            steps = sum(run.steps[i] for i in idx)
            row = {"drafter": run.drafter, "dcut": run.dcut, "concurrency": batch_size,
                   "domain": dom, "n_prompts": len(idx), "new_tokens": new,
                   "seconds": None, "tokens_per_s": None,
                   "mean_accept_len": None if run.drafter in REFERENCES else
                   round(sum(run.committed[i] for i in idx) / max(steps, 1), 3),
                   "verified_per_step": None if run.drafter in REFERENCES else
                   round(sum(run.drafted[i] for i in idx) / max(steps, 1), 2),
                   # of the steps that verified a draft token, the share that accepted the first
                   "first_accept": None if run.drafter in REFERENCES or not sum(run.tried[i] for i in idx)
                   else round(sum(run.first[i] for i in idx) / sum(run.tried[i] for i in idx), 3),
                   "speedup_vs_ar": None,
                   "lossless": all(verdicts[i] != "diverged" for i in idx),
                   "near_ties": sum(verdicts[i] == "near_tie" for i in idx),
                   "weight_gb_per_s": None}
            if run.drafter in OTHER_NUMERICS:  # how far its greedy text follows ours
                row.update(lossless=None, near_ties=0,
                           same_as_ar=sum(run.outputs[i] == ref[i] for i in idx),
                           token_agreement=round(statistics.mean(agreement(ref[i], run.outputs[i])
                                                                 for i in idx), 3))
                own = next((r for r in runs if r.drafter == SPECULATING.get(run.drafter)), None)
                if own:  # a peer's speculation against its own greedy output
                    row["same_as_own_greedy"] = sum(run.outputs[i] == own.outputs[i] for i in idx)
                dec = [run.decoded[d] for d in run.decoded if dom in ("all", d)]
                if dec and sum(s for _, s in dec):
                    row["decode_tokens_per_s"] = round(sum(n for n, _ in dec) / sum(s for _, s in dec), 2)
            if timed:
                secs, pre, forwards = pick(run.seconds), pick(run.prefill), pick(run.forwards)
                tps = new * rounds / secs
                if batch_size > 1 and run.steady_seconds:  # the load asked for, not the drain
                    row.update(drained_tokens_per_s=round(tps, 2), busy_tokens=run.steady_tokens,
                               busy_seconds=round(run.steady_seconds, 6))
                    tps = run.steady_tokens / run.steady_seconds
                if run.drafter == "ar":
                    ar_tps[dom] = tps
                # weights read per second while decoding: one read per verification forward
                # (hf: one per token, prefill included as it cannot be separated)
                row.update(seconds=round(secs, 3), tokens_per_s=round(tps, 2),
                           speedup_vs_ar=round(tps / ar_tps[dom], 3),
                           weight_gb_per_s=None if run.drafter in OTHER_NUMERICS else  # their own bytes
                           round(forwards * weight_bytes / (secs - pre) / 1e9, 2))
            if dom == "all" and run is not runs[0]:  # each batch against ar's, back to back
                row["paired_vs_ar"] = paired(run.rates, runs[0].rates)
            if dom == "all" and run.drafter not in REFERENCES:
                # drafting time per step against the verification forward's (the same steps)
                row["draft_per_forward"] = round(run.draft_time / run.forward_time, 3) \
                    if run.forward_time else None
            if run.drafter == "auto":
                used = [run.used[i] for i in idx]
                row["drafter_used"] = {d: used.count(d) for d in sorted(set(used))}
            rows.append(row)
    result = {
        "config": {
            "target": str(target.path), "engine": engine_dir, "prompts": len(prompts),
            "domains": domains, "max_tokens": max_tokens, "concurrency": batch_size,
            "hf_batch_size": 1, "dcut": dcut, "rounds": rounds, "ignore_eos": ignore_eos,
            "synthetic": is_synthetic(target.path),
            "draft_len": engine.drafter("ngram").draft_len if "ngram" in names else draft_len,
            "greedy": not temperature, "temperature": temperature, "top_p": top_p,
            "dtype": "float32", "weights": target.model.weights,
            "threads": torch.get_num_threads(), "resident_mb": resident,
            "near_tie_eps": eps, "cpu": cpu_model(), "cores": os.cpu_count(),
            "kernel_isa": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "weight_mb": round(weight_bytes / 1e6, 1),
            "huge_page_mb": None if huge is None else round(huge, 1),
            "stream_bandwidth_gb_per_s": round(bandwidth, 2),
            # the layers of a one-row forward (LayerTimes), medians over the batches: as served,
            # with their weights in cache, and their weights' streaming time at the machine's rate
            "layers_context": LayerTimes.CONTEXT,
            "layers_served_ms": round(statistics.median(a for a, _ in layer_ms), 3),
            "layers_in_cache_ms": round(statistics.median(b for _, b in layer_ms), 3),
            "layers_stream_ms": round(target.model.weight_bytes(head=False) / bandwidth / 1e6, 3),
            "dcut_kept_fraction": round(engine.stats.dcut_kept / engine.stats.dcut_drafted, 3)
            if engine.stats.dcut_drafted else None,
        },
        "results": rows,
    }
    for runner in outside.values():
        getattr(runner, "close", lambda: None)()
    if "llamacpp" in outside:  # llama.cpp's own decode figure, beside its served one
        result["config"]["llama_bench_tg"] = {"tokens": max_tokens, "tokens_per_s": llama_bench(
            gguf_of(target), torch.get_num_threads(), max_tokens)}
        result["config"]["llamacpp_server"] = outside["llamacpp"].server.cmd
    if target.model.weights != "float32" and not temperature and not result["config"]["synthetic"]:
        # the served weights' quality against the checkpoint's, on the prompts and ar's text
        reference = load_target(target.path, max_len=max_len).model
        result["config"]["fidelity"] = fidelity(reference, target.model, [x + out for x, out in zip(ids, ref)])
    if with_verify_cost:
        result["verify_cost"] = verify_cost(target)
    return result


def resident_mb() -> float | None:
    """This process's resident memory (VmRSS), MB; None where /proc does not say."""
    try:
        kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return round(kb / 1e3, 1)


def paired(rates: list[float], ar_rates: list[float]) -> dict:
    """A runner's tokens/s on each batch over ar's on the same batch, run moments apart: on a
    machine whose speed drifts, their spread says whether a ratio of totals is above or below
    1 by more than the drift (the median, the extremes, and in how many batches it was >= 1)."""
    r = sorted(a / b for a, b in zip(rates, ar_rates))
    return {"batches": len(r), "median": round(statistics.median(r), 3), "min": round(r[0], 3),
            "max": round(r[-1], 3), "at_least_ar": sum(x >= 1 for x in r)}


def format_table(result: dict) -> str:
    cfg = result["config"]
    synthetic = " (synthetic: random weights, speed only)" if cfg.get("synthetic") else ""
    lines = [f"target {cfg['target']}{synthetic}  |  {cfg['prompts']} prompts, {cfg['max_tokens']} new "
             f"tokens{' (EOS ignored)' if cfg.get('ignore_eos') else ''}, {cfg['concurrency']} in flight, "
             f"{'greedy' if cfg['greedy'] else 'sampled at T=%g top_p=%g' % (cfg['temperature'], cfg['top_p'])}, "
             f"{cfg['threads']} threads, D-cut {cfg.get('dcut', 'off')}  |  "
             f"weights {cfg['weight_mb']} MB {cfg.get('weights', 'float32')}"
             f"{'' if cfg.get('resident_mb') is None else ' (engine process resident: %g MB)' % cfg['resident_mb']}"
             f"{'' if cfg.get('huge_page_mb') is None else ' (%g MB on huge pages)' % cfg['huge_page_mb']}, "
             f"machine streams {cfg['stream_bandwidth_gb_per_s']} GB/s",
             f"{'drafter':<22} {'domain':<6} {'tok/s':>8} {'accept':>7} {'acc1':>5} {'verify':>6} {'speedup':>8} "
             f"{'GB/s':>6} {'%bw':>5} {'lossless':>9} {'near_ties':>9} {'draft/fwd':>9}  used"]
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in result["results"]:
        pct = None if r["weight_gb_per_s"] is None else \
            100 * r["weight_gb_per_s"] / cfg["stream_bandwidth_gb_per_s"]
        name = r["drafter"] + ("+dcut" if r.get("dcut") else "")
        used = " ".join(f"{d}:{n}" for d, n in r.get("drafter_used", {}).items())
        lines.append(f"{name:<22} {r['domain']:<6} {num(r['tokens_per_s'], '8.2f'):>8} "
                     f"{num(r['mean_accept_len'], '.2f'):>7} {num(r.get('first_accept'), '.2f'):>5} "
                     f"{num(r.get('verified_per_step'), '.1f'):>6} "
                     f"{num(r['speedup_vs_ar'], '7.2f'):>7}x "
                     f"{num(r['weight_gb_per_s'], '6.1f'):>6} {num(pct, '4.0f'):>4}% "
                     f"{str(r['lossless']).lower():>9} {r['near_ties']:>9} "
                     f"{num(r.get('draft_per_forward'), '.3f'):>9}  {used}")
        if r["drafter"] in OTHER_NUMERICS and r["domain"] == "all":
            lines.append(f"{'':<22} {r['drafter']}'s greedy tokens: {r['same_as_ar']} of {r['n_prompts']} prompts "
                         f"identical to ar's, {100 * r['token_agreement']:.1f}% of tokens before they differ"
                         + ("" if "same_as_own_greedy" not in r else
                            f"; identical to {SPECULATING[r['drafter']]}'s own greedy output on "
                            f"{r['same_as_own_greedy']} of {r['n_prompts']}")
                         + ("" if "decode_tokens_per_s" not in r else
                            f"; its own decode timings: {r['decode_tokens_per_s']:.2f} tok/s"
                            + (" a request" if cfg["concurrency"] > 1 else "")))
    drained = [(r["drafter"] + ("+dcut" if r.get("dcut") else ""), r["drained_tokens_per_s"])
               for r in result["results"] if "drained_tokens_per_s" in r]
    if drained:
        lines.append(f"tok/s at {cfg['concurrency']} in flight: while every slot was busy; whole runs, the "
                     "drain at the end included: " + ", ".join(f"{d} {v:.2f}" for d, v in drained))
    pairs = [(r["drafter"] + ("+dcut" if r.get("dcut") else ""), r["paired_vs_ar"])
             for r in result["results"] if "paired_vs_ar" in r]
    if pairs and pairs[0][1]["batches"] > 1:
        lines.append(f"each batch against ar's run of it (x ar: median [min-max], batches >= ar of "
                     f"{pairs[0][1]['batches']}): " + ", ".join(
                         f"{d} {p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}] {p['at_least_ar']}"
                         for d, p in pairs))
    if "layers_in_cache_ms" in cfg:
        lines.append(f"a one-row forward's layers after {cfg['layers_context']} tokens: {cfg['layers_served_ms']:.2f} "
                     f"ms as served; {cfg['layers_in_cache_ms']:.2f} ms of compute with their weights in "
                     f"cache and {cfg['layers_stream_ms']:.2f} ms to stream their weights at the machine's "
                     "rate (a forward overlapping the two takes the larger, one that does not their sum)")
    if "llama_bench_tg" in cfg:
        lines.append(f"llama-bench tg{cfg['llama_bench_tg']['tokens']} (llama.cpp's decode figure, same GGUF "
                     f"and threads): {cfg['llama_bench_tg']['tokens_per_s']:.2f} tok/s; llamacpp served by "
                     f"`{cfg['llamacpp_server']}`")
    if "fidelity" in cfg:
        f = cfg["fidelity"]
        lines.append(f"{cfg['weights']} weights against the float32 checkpoint, teacher-forced over the prompts "
                     f"and ar's text ({f['tokens']} tokens): top-1 agreement {100 * f['top1_agreement']:.1f}%, "
                     f"perplexity {f['perplexity_served']} against {f['perplexity_float32']} (lossless is "
                     "against the served weights)")
    vc = result.get("verify_cost")
    if vc:
        ms, ratio = ({int(k): v for k, v in vc[key].items()} for key in ("ms", "ratio_vs_1"))
        lines.append(f"verification cost after {vc['context']} cached tokens: one forward over 1 token "
                     f"{ms[1]:.2f} ms; over k tokens, C(k)/C(1): " +
                     " ".join(f"{k}:{r:.2f}" for k, r in ratio.items() if k > 1))
    return "\n".join(lines)
