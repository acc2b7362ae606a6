"""`angelspec bench`: every drafter on the same prompts, side by side in one process.

Reports per drafter and domain: tokens/s, mean accept length (tokens per target forward), the
first draft token's acceptance (`acc1`: of the steps that verified a draft token), speedup
over `ar` (this engine, autoregressive), the weight bandwidth achieved next to the machine's own,
and `lossless` (output identical to batch-1 `ar`; a divergence where the target's top-2 logit
margin is below `eps` is a near-tie, counted in `near_ties` instead of failing). Greedy by
default; with a temperature every prompt is sampled with its own seed (its index), and a seeded
speculative sample must equal the seeded `ar` sample token for token (sampling.py: the target's
own token at each position is drawn with a uniform keyed by seed and position).

This module holds the measuring (bench, its Options, and its phases); the other concerns are
runs.py (a runner's record, the batches, an engine's batch), references.py and peers.py (the
runners timed beside the engine), machine.py (the machine's figures), compare.py (outputs and
rates against ar's) and report.py (the result's rows and the printed table, format_table).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from angelspec.bench.compare import NEAR_TIE_EPS
from angelspec.bench.machine import MachineSamples, resident_mb, verify_cost
from angelspec.bench.peers import llama_bench
from angelspec.bench.references import REFERENCES, gguf_of, open_references
from angelspec.bench.report import result_rows
from angelspec.bench.runs import Run, chunks, run_engine_chunk
from angelspec.checkpoint import Target, load_target
from angelspec.pages import huge_page_mb
from angelspec.runtime import Engine, SamplingParams, settle_heap
from angelspec.runtime.backend import fidelity
from angelspec.runtime.cost import cpu_model, profile
from angelspec.runtime.engine_dir import load_engine
from angelspec.runtime.manifest import read_manifest
from angelspec.synthetic_target import is_synthetic
from angelspec.weights import weight_bytes

__all__ = ["Options", "bench"]

DCUT_MODES = {"off": (False,), "on": (True,), "both": (False, True)}  # a drafter's runs: D-cut off / on


@dataclass
class Options:
    """bench's keywords. batch_size: requests in flight (the engine's concurrency); dcut: off,
    on, both (every drafter runs with and without D-cut, side by side) or engine (what is
    served: the engine's own setting with engine_dir, on without); engine_dir: serve a built
    engine (its target, drafts, router, backend and cost profile) instead of `target` + `drafts`;
    rounds: every batch runs that many times, drafters taking turns each time, and times add up
    (at high concurrency all prompts are one batch, so one round would time each drafter once,
    at a different moment of a noisy machine); temperature > 0: seeded sampling (top_p too);
    ignore_eos: every request makes max_tokens (a synthetic target's, whose end is noise)."""
    max_tokens: int = 128
    batch_size: int = 1
    draft_len: int | None = None
    eps: float = NEAR_TIE_EPS
    with_verify_cost: bool = False
    drafts: str | None = None
    engine_dir: str | None = None
    dcut: str = "engine"
    rounds: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False

    def resolved(self, names: list[str]) -> Options:
        """These options as run with the drafters `names`: dcut "engine" made the served
        setting; sampling checked, and without near-ties (a sampled token follows the uniform,
        not the top-2 margin)."""
        dcut, eps = self.dcut, self.eps
        if dcut == "engine":
            dcut = "on" if not self.engine_dir or read_manifest(self.engine_dir, verify=False).defaults.dcut else "off"
        if dcut not in DCUT_MODES:
            raise ValueError(f"dcut {dcut!r}: one of engine, {', '.join(DCUT_MODES)}")
        if self.temperature:
            SamplingParams(**self.sampling).validate()
            if any(r in names for r in REFERENCES):
                raise ValueError(f"{', '.join(REFERENCES)} are greedy references: drop them from "
                                 "--drafters when sampling")
            eps = 0.0
        return dataclasses.replace(self, dcut=dcut, eps=eps)

    @property
    def sampling(self) -> dict | None:
        """temperature and top_p for run_engine_chunk; None: greedy."""
        return dict(temperature=self.temperature, top_p=self.top_p) if self.temperature else None


def bench(target: Target | None, prompts: list[dict], drafters: list[str], **options) -> dict:
    """Every one of `drafters` (and ar, the speed and lossless reference, first) on `prompts`,
    decoded by `target`'s engine or a built one's (options: Options' fields): the result's
    config and rows (report.py), which format_table prints."""
    names = [d.strip() for d in drafters if d.strip()]
    names = ["ar"] + [d for d in names if d != "ar"]
    opts = Options(**options).resolved(names)
    if opts.engine_dir:
        target = load_target(pathlib.Path(opts.engine_dir) / "target")
    ids = [target.encode_chat(p["prompt"]) for p in prompts]
    max_len = max(len(x) for x in ids) + opts.max_tokens + 1
    engine = ready_engine(target, names, ids, max_len, opts)
    resident = resident_mb()  # the engine's, before any reference loads beside it
    machine = MachineSamples(target)
    outside = open_references(names, target, opts.batch_size, max_len)
    runs = [Run(d, len(prompts), dcut=m) for d in names
            for m in ((False,) if d in ("ar", *REFERENCES) else DCUT_MODES[opts.dcut])]
    measure(runs, engine, outside, machine, prompts, ids, opts)
    # the lossless reference is always batch-1 autoregressive decoding
    ref = runs[0].outputs if opts.batch_size == 1 else batch1_ar(target, engine, prompts, ids, opts)
    figures = machine.figures(target)  # its buffers freed, then the served weights' huge pages
    huge = huge_page_mb()
    served = weight_bytes(target.model)
    rows = result_rows(runs, prompts, ids, ref, target, opts.eps, opts.batch_size, opts.rounds, served)
    measured = {"weight_mb": round(served / 1e6, 1), "huge_page_mb": None if huge is None else round(huge, 1),
                **figures}
    result = {"config": config(target, prompts, names, opts, engine, resident, measured), "results": rows}
    for runner in outside.values():
        getattr(runner, "close", lambda: None)()
    cfg = result["config"]
    if "llamacpp" in outside:  # llama.cpp's own decode figure, beside its served one
        cfg["llama_bench_tg"] = {"tokens": opts.max_tokens, "tokens_per_s": llama_bench(
            gguf_of(target), torch.get_num_threads(), opts.max_tokens)}
        cfg["llamacpp_server"] = outside["llamacpp"].server.cmd
    if target.model.weights != "float32" and not opts.temperature and not cfg["synthetic"]:
        # the served weights' quality against the checkpoint's, on the prompts and ar's text
        reference = load_target(target.path, max_len=max_len).model
        cfg["fidelity"] = fidelity(reference, target.model, [x + out for x, out in zip(ids, ref)])
    if opts.with_verify_cost:
        result["verify_cost"] = verify_cost(target)
    return result


def ready_engine(target: Target, names: list[str], ids: list[list[int]], max_len: int,
                 opts: Options) -> Engine:
    """The engine the drafters run on, warmed up: the built one (opts.engine_dir) or one on
    `target` and opts.drafts, with D-cut's cost table where a drafter runs with D-cut."""
    if opts.engine_dir:
        engine = load_engine(opts.engine_dir, max_batch=opts.batch_size, max_len=max_len, dcut=False,
                             target=target)
    else:
        drafting = any(d not in ("ar", *REFERENCES) for d in names)  # D-cut's cost table: only for them
        engine = Engine(target, max_batch=opts.batch_size, draft_len=opts.draft_len, max_len=max_len,
                        drafts=opts.drafts,
                        cost=profile(target.model) if True in DCUT_MODES[opts.dcut] and drafting else None)
    for d in names:
        if d not in REFERENCES:
            engine.drafter_key(d)  # unknown drafters and unfit drafts fail before any work
    run_engine_chunk(engine, Run("ar", len(ids)), ids, [0], "warm-up", 8)
    settle_heap()
    return engine


def measure(runs: list[Run], engine: Engine, outside: dict, machine: MachineSamples,
            prompts: list[dict], ids: list[list[int]], opts: Options) -> None:
    """Every run over every batch, opts.rounds times, the machine's figures sampled before each
    batch. Runners take turns on each batch, each batch starting with the next one: a slow phase
    of a noisy machine hits all of them alike, and none always runs first or last."""
    for k, (domain, chunk) in enumerate(tqdm(chunks(prompts, opts.batch_size) * opts.rounds,
                                             desc=f"bench {','.join(r.label for r in runs)}",
                                             unit="batch", file=sys.stderr)):
        machine.sample()
        for run in runs[k % len(runs):] + runs[:k % len(runs)]:
            mark = run.mark()
            if run.drafter in outside:
                outside[run.drafter](run, ids, chunk, domain, opts.max_tokens, opts.ignore_eos)
            else:
                run_engine_chunk(engine, run, ids, chunk, domain, opts.max_tokens, opts.sampling,
                                 ignore_eos=opts.ignore_eos)
            run.close_batch(chunk, mark)


def batch1_ar(target: Target, engine: Engine, prompts: list[dict], ids: list[list[int]],
              opts: Options) -> list[list[int]]:
    """ar's outputs one request at a time, on an engine like `engine` (the lossless reference
    where the runs had many in flight)."""
    ref_run = Run("ar", len(ids))
    single = Engine(target, max_batch=1, max_len=engine.max_len, prompt_prefix=engine.prompt_prefix)
    for domain, chunk in tqdm(chunks(prompts, 1), desc="reference (ar, batch 1)", file=sys.stderr):
        run_engine_chunk(single, ref_run, ids, chunk, domain, opts.max_tokens, opts.sampling,
                         ignore_eos=opts.ignore_eos)
    return ref_run.outputs


def config(target: Target, prompts: list[dict], names: list[str], opts: Options, engine: Engine,
           resident: float | None, measured: dict) -> dict:
    """The result's config: the settings as run, the machine, and `measured` (the weights' size
    and huge pages, then MachineSamples.figures)."""
    return {
        "target": str(target.path), "engine": opts.engine_dir, "prompts": len(prompts),
        "domains": list(dict.fromkeys(p["domain"] for p in prompts)), "max_tokens": opts.max_tokens,
        "concurrency": opts.batch_size, "hf_batch_size": 1, "dcut": opts.dcut, "rounds": opts.rounds,
        "ignore_eos": opts.ignore_eos, "synthetic": is_synthetic(target.path),
        "draft_len": engine.drafter("ngram").draft_len if "ngram" in names else opts.draft_len,
        "greedy": not opts.temperature, "temperature": opts.temperature, "top_p": opts.top_p,
        "dtype": "float32", "weights": target.model.weights,
        "threads": torch.get_num_threads(), "resident_mb": resident,
        "near_tie_eps": opts.eps, "cpu": cpu_model(), "cores": os.cpu_count(),
        "kernel_isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
        **measured,
        "dcut_kept_fraction": round(engine.stats.dcut_kept / engine.stats.dcut_drafted, 3)
        if engine.stats.dcut_drafted else None,
    }
