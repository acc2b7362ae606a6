"""`angelspec build`: target + drafts -> `engines/<name>/` (docs/architecture.md, docs/engines.md).

Steps, each shown on a progress bar: check that every draft belongs to the target (hidden size,
vocabulary, tokenizer hash, layer ids), copy the parts, train the `auto` router's domain
classifier on the data step's prompts (held-out accuracy recorded), measure the backends (eager
and torch.compile) and keep the fastest lossless one, profile D-cut's verification cost C(n) on
this machine, and write the manifest with the SHA-256 of every file (last, so a folder without
it is a build that did not finish).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import time

from safetensors.torch import save_file
from tqdm import tqdm

from angelspec.builders.backend import choose
from angelspec.builders.export_env import export_python, export_tensorrt
from angelspec.builders.trtllm import export as export_trtllm
from angelspec.checkpoint import CheckpointError, load_target
from angelspec.drafters import TRAINED, Datastore, make_drafter, parse_spec, parts
from angelspec.model import KV_CACHES
from angelspec.plugins import RATIOS, SKINNY_MAX_ROWS
from angelspec.prompts import CALIBRATION_PROMPTS, DEFAULT_PROMPTS, DOMAINS, load_prompts
from angelspec.record import add_record_option, record_run
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.backend import WEIGHTS, choose_weights, fidelity, use_backend
from angelspec.runtime.cost import fingerprint, profile
from angelspec.runtime.manifest import (
    BackendChoice,
    DcutSpec,
    Defaults,
    DraftSpec,
    EngineManifest,
    TargetInfo,
    WeightsChoice,
    read_manifest,
)
from angelspec.runtime.router import CANDIDATES, DEFAULT_ROUTES, DomainClassifier, Router, contenders
from angelspec.synthetic_target import is_synthetic
from angelspec.weights import serve, served_as

DRAFT_FILES = ("config.json", "model.safetensors")


def _place(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Hard link when possible (engines are large and read-only), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _domain_rows(path: pathlib.Path) -> list[dict]:
    return [r for r in load_prompts(path) if r.get("domain") in DOMAINS]


def train_router(target, data: pathlib.Path) -> tuple[DomainClassifier, dict]:
    """Naive Bayes domain classifier on the data step's prompts; accuracy on its held-out split
    and on the bundled benchmark prompts (neither is trained on)."""
    train = _domain_rows(data / "prompts.jsonl")
    enc = lambda rows: [target.encode_chat(r["prompt"]) for r in rows]  # noqa: E731
    clf = DomainClassifier.fit(enc(train), [r["domain"] for r in train], target.config.vocab_size)
    acc = {"trained_on": len(train)}
    for name, path in (("heldout", data / "heldout.jsonl"), ("bundled_prompts", DEFAULT_PROMPTS)):
        if path.exists():
            rows = _domain_rows(path)
            acc[name] = {"n": len(rows), "accuracy": round(clf.accuracy(enc(rows), [r["domain"] for r in rows]), 4)}
    return clf, acc


NGRAM_LENGTHS = (3, 5, 7)  # ngram draft lengths the build measures (the fastest is served)
# a trained drafter takes a domain's route from ngram only when faster by more than this: three
# prompts of 64 tokens a domain measure a drafter's speed within a few percent on a noisy machine,
# and a near tie once routed chat to a drafter that served it far slower than ngram
# (docs/results/design-measurements.md); the router's shadow scoring settles near ties
ROUTE_MARGIN = 0.05


def draft_lengths(kind: str, trained: int | None) -> tuple[int, ...]:
    """The draft lengths the build measures for a drafter kind (the fastest is served): ngram's
    NGRAM_LENGTHS; MTP's 1 up to the rollout it was trained for (each draft token is one more pass
    of its layer and lm_head, which D-cut cannot take back, and where a verified token costs much a
    shorter chain wins); none for DFly and DFlash, whose one block forward drafts the whole block at once and
    whose drafts D-cut trims to what pays."""
    if kind == "ngram":
        return NGRAM_LENGTHS
    if kind == "mtp" and trained:
        return tuple(range(1, trained + 1))
    return ()


def tune_length(kind: str, lengths: tuple[int, ...], target, drafts_dir: pathlib.Path,
                cost=None) -> tuple[int, dict, dict]:
    """A drafter's draft length: the fastest of `lengths` (tokens/s over all domains, the same
    prompts and turns as calibrate_routes, two rounds, with D-cut over `cost` as the engine
    serves). Cheap verification pays for longer drafts; a compute-bound forward does not.
    Returns (length, tokens/s by length, the domains whose own fastest length beat that one
    there by more than ROUTE_MARGIN: {domain: length})."""
    names = {f"{kind}:draft_len={n}": n for n in lengths}
    _, speed = calibrate_routes(target, drafts_dir, list(names), cost, rounds=2)
    mean = {str(n): round(sum(s[c] for s in speed.values()) / len(speed), 2)
            for c, n in names.items()}
    best = int(max(mean, key=mean.get))
    own = {}
    for d, s in speed.items():
        c = max(s, key=s.get)
        if names[c] != best and s[c] > (1 + ROUTE_MARGIN) * s[f"{kind}:draft_len={best}"]:
            own[d] = names[c]
    return best, mean, own


def calibrate_routes(target, drafts_dir: pathlib.Path, candidates: list[str], cost=None,
                     per_domain: int = 3, max_tokens: int = 64, rounds: int = 4,
                     draft_lens: dict | None = None) -> tuple[dict, dict]:
    """Each domain's starting drafter for `auto`: the candidate with the most tokens/s on the first
    `per_domain` calibration prompts of that domain (angelspec/data/calibration.jsonl: neither
    the bundled benchmark prompts the docs report on nor the data step's), drafters taking turns
    prompt by prompt on this machine, `rounds` times (each round in the other order); with D-cut
    (and its gate) over the cost table `cost` when given, as the engine serves. Where ngram is a
    candidate, a domain's route compares each drafter's runs with ngram's run of the same prompt
    moments apart, each prompt's ratios averaged over its rounds, then the median over prompts:
    the machine's speed drifts by more than the drafters differ (docs/engines.md).
    Returns (routes, tokens/s per domain and candidate)."""
    rows = [r for r in load_prompts(CALIBRATION_PROMPTS, per_domain) if r["domain"] in DOMAINS]
    ids = [target.encode_chat(r["prompt"]) for r in rows]
    engine = Engine(target, max_batch=1, max_len=max(map(len, ids)) + max_tokens + 1,
                    drafts=str(drafts_dir), draft_lens=draft_lens, dcut=cost is not None, cost=cost)
    params = SamplingParams(max_tokens=max_tokens)
    engine.warm_up(candidates)  # loading a draft or a datastore is no decoding step
    runs = {(d, c): [] for d in DOMAINS for c in candidates}  # (tokens, seconds) per prompt and round
    for k in range(rounds):
        for i, (r, x) in enumerate(zip(rows, ids)):
            for c in candidates if (i + k) % 2 == 0 else candidates[::-1]:
                t0 = time.perf_counter()
                out = engine.generate([Request(x, params, c)])[0]
                runs[(r["domain"], c)].append((len(out.tokens), time.perf_counter() - t0))
    return routes_from_runs(runs, candidates, rounds)


def routes_from_runs(runs: dict, candidates: list[str], rounds: int = 1) -> tuple[dict, dict]:
    """calibrate_routes' verdict from its runs {(domain, drafter): [(tokens, seconds)] in the same
    order for every drafter, round after round}: (routes, tokens/s per domain and drafter)."""
    domains = list(dict.fromkeys(d for d, _ in runs))
    rate = lambda t, s: t / max(s, 1e-9)  # noqa: E731
    speed = {d: {c: round(rate(sum(t for t, _ in runs[(d, c)]), sum(s for _, s in runs[(d, c)])), 2)
                 for c in candidates} for d in domains}
    if "ngram" not in candidates:
        return {d: route(s) for d, s in speed.items()}, speed
    def per_prompt(d: str, c: str) -> list[float]:  # each prompt's paired ratio, geometric mean over rounds
        ratios = [math.log(rate(*a) / rate(*b)) for a, b in zip(runs[(d, c)], runs[(d, "ngram")])]
        n = len(ratios) // rounds
        return [math.exp(statistics.fmean(ratios[p::n])) for p in range(n)]

    paired = {d: {c: statistics.median(per_prompt(d, c)) for c in candidates} for d in domains}
    return {d: route(p) for d, p in paired.items()}, speed


def own_lengths(routes: dict, rivals: dict, specs: dict) -> tuple[dict, dict]:
    """Routes and contenders with a drafter named at its domain's own draft length where the
    build found one (DraftSpec.draft_len_by_domain: `mtp:draft_len=1` for chat, say)."""
    def named(kind: str, domain: str) -> str:
        spec = specs.get(kind)
        k = (spec.draft_len_by_domain or {}).get(domain) if spec else None
        return f"{kind}:draft_len={k}" if k else kind
    return ({d: named(c, d) for d, c in routes.items()},
            {d: [named(c, d) for c in cs] for d, cs in rivals.items()})


def route(speed: dict) -> str:
    """The fastest drafter of a domain's measured speeds (tokens/s, or each drafter's paired ratio
    to ngram's), ngram unless beaten by ROUTE_MARGIN."""
    best = max(speed, key=speed.get)
    if "ngram" in speed and speed[best] <= (1 + ROUTE_MARGIN) * speed["ngram"]:
        return "ngram"
    return best


def build(target_dir: str, drafts_dir: str, out: str, data_dir: str | None = None,
          drafters: list[str] | None = None, backends: tuple = ("eager", "inductor"),
          min_gain: float = 1.2, dcut: bool = True, max_tokens: int = SKINNY_MAX_ROWS,
          export: str | None = None, weights: str = "auto", kv_cache: str = "auto") -> EngineManifest:
    """Build the engine folder `out`. It is written as a hidden `.<name>.partial` beside it and
    renamed to `out` only when complete: a failed or stopped build leaves any earlier engine of
    that name as it was."""
    final = pathlib.Path(out)
    partial = final.parent / f".{final.name}.partial"
    if export == "tensorrt":
        export_python()  # before a long build: the export environment must exist
    try:
        manifest = _build(pathlib.Path(target_dir), pathlib.Path(drafts_dir), partial, final, data_dir,
                          drafters, backends, min_gain, dcut, max_tokens, export, weights, kv_cache)
        if export == "tensorrt":  # in its own environment, from the finished folder
            export_tensorrt(partial)
            manifest = read_manifest(partial, verify=False)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def _build(target_dir: pathlib.Path, drafts_dir: pathlib.Path, out: pathlib.Path,
           final: pathlib.Path, data_dir, drafters, backends, min_gain, dcut, max_tokens, export,
           weights, kv_cache) -> EngineManifest:
    data = pathlib.Path(data_dir) if data_dir else None
    # every input is checked before the first expensive step
    if data is not None and not (data / "prompts.jsonl").exists():
        raise FileNotFoundError(f"{data}/prompts.jsonl not found: the router's classifier trains on "
                                "the data step's prompts (run `make data`, or pass --data '' to "
                                "build without a router)")
    if drafters and not drafts_dir.is_dir():
        raise FileNotFoundError(f"{drafts_dir}: no such drafts folder (run `make drafts`)")
    unknown = [k for k in drafters or [] if k not in (*TRAINED, "ngram")]
    if unknown:
        raise ValueError(f"unknown draft kind(s) {', '.join(unknown)}: {', '.join(TRAINED)} or ngram")
    if kv_cache not in ("auto", *KV_CACHES):
        raise ValueError(f"unknown KV cache {kv_cache!r} (auto, {', '.join(KV_CACHES)})")
    target = load_target(target_dir)
    weights = choose_weights(target.model, weights)
    if kv_cache == "auto":  # where activations are rounded already (bf16 tiles, w8a8 / w4a8), keys too
        kv_cache = "float32" if weights["own_outputs"] else "bfloat16"
    if not (weights["own_outputs"] and kv_cache == "float32") and not is_synthetic(target_dir):
        # lossless against the served weights, not the checkpoint: say what that costs
        served = served_as(target.model, weights["dtype"])
        served.kv_dtype = KV_CACHES[kv_cache]
        weights["fidelity"] = fidelity(target.model, served, [target.encode_chat(p["prompt"])
                                                              for p in load_prompts(DEFAULT_PROMPTS)])
        del served
    target.model.kv_dtype = KV_CACHES[kv_cache]
    serve(target.model, weights["dtype"])  # everything below is measured as it will serve
    kinds = [k for k in drafters if k != "ngram"] if drafters else \
        [k for k in TRAINED if (drafts_dir / k / "config.json").exists()]  # ngram: always
    bar = tqdm(total=6, desc="build", unit="step", file=sys.stderr)

    bar.set_postfix_str("checking drafts")
    specs = {}
    for kind in kinds:  # each load checks that the draft was trained for this target
        d = make_drafter(kind, None, target, drafts_dir)
        specs[kind] = DraftSpec(kind, f"drafts/{kind}", d.draft_len, list(d.cfg.target_layers),
                                len(d.frozen.vocab_ids))
    specs["ngram"] = DraftSpec("ngram")
    store = drafts_dir / "ngram"
    if (store / Datastore.FILE).exists():  # the datastore of the target's own responses
        if not Datastore.fits(store, target):
            raise CheckpointError(f"{store} was built with another tokenizer than {target_dir}'s")
        specs["ngram"].path = "drafts/ngram"
    # the cost profile first: ngram's draft length is tuned as the engine serves (D-cut on it)
    bar.set_postfix_str("backends")
    backend = choose(target.model, backends, min_gain)
    use_backend(target.model, backend["chosen"])  # profiled and measured as it will serve
    bar.update()

    bar.set_postfix_str("profiling D-cut cost")
    cost = profile(target.model, max_tokens=max_tokens, backend=backend["chosen"])
    bar.update()

    served = cost if dcut else None
    for kind, spec in specs.items():
        lengths = draft_lengths(kind, spec.draft_len)
        if len(lengths) > 1:
            bar.set_postfix_str(f"{kind} draft length")
            spec.draft_len, spec.tokens_per_s_by_draft_len, own = tune_length(kind, lengths, target,
                                                                              drafts_dir, served)
            spec.draft_len_by_domain = (own or None) if kind in TRAINED else None  # ngram: one length
    bar.update()

    bar.set_postfix_str("copying parts")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    for f in sorted(target_dir.iterdir()):
        if f.is_file():
            _place(f, out / "target" / f.name)
    for kind in kinds:
        for f in DRAFT_FILES:
            _place(drafts_dir / kind / f, out / "drafts" / kind / f)
    if specs["ngram"].path:
        for f in ("config.json", Datastore.FILE):
            _place(store / f, out / "drafts" / "ngram" / f)
    bar.update()

    bar.set_postfix_str("router")
    router = None
    if data is not None:
        clf, accuracy = train_router(target, data)
        save_file(clf.state_dict(), str(out / "router.safetensors"))
        have = set(kinds) | {"ngram"}
        candidates = [c for c in CANDIDATES if all(parse_spec(p)[0] in have for p in parts(c))]
        bar.set_postfix_str("router: measuring drafters per domain")
        # as the engine serves them: with D-cut, if it is on (at fixed lengths a long ngram draft
        # pays for verifying all of it, and where each verified token costs much, as on a CPU
        # without AMX, a trained drafter with a shorter draft won domains it loses served). Near
        # ties (a losing drafter gated to `none` by chance) become contenders, which the
        # router's shadow scoring settles at run time.
        routes, speed = calibrate_routes(target, drafts_dir, candidates, served,
                                         draft_lens={k: s.draft_len for k, s in specs.items() if s.draft_len})
        routes, rivals = own_lengths(routes, contenders(speed), specs)
        router = {**Router(None, routes, tuple(candidates), contenders=rivals).settings(),
                  "domains": list(DOMAINS),
                  "classifier": "router.safetensors", "accuracy": accuracy,
                  "calibration_tokens_per_s": speed, "design_routes": DEFAULT_ROUTES}
    bar.update()

    bar.set_postfix_str("manifest")
    manifest = EngineManifest(
        name=final.name, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        target=TargetInfo("target", str(target_dir), target.config.architecture, target.config.hidden_size,
                          target.config.vocab_size, target.config.num_layers, target.tokenizer_hash()),
        drafters=specs,
        defaults=Defaults("auto" if router else (kinds[0] if kinds else "ngram"), dcut),
        router=router, backend=BackendChoice(**backend), weights=WeightsChoice(**weights),
        dcut=DcutSpec(list(RATIOS), cost.to_json()),
        fingerprint=fingerprint(backend["chosen"], target.model.weights), kv_cache=kv_cache)
    if export == "trtllm":
        manifest.exported["trtllm"] = export_trtllm(out, out / "trtllm", manifest, final=final / "trtllm")
    manifest.write(out)
    bar.update()
    bar.close()
    return manifest


def add_arguments(p) -> None:
    p.add_argument("--target", default="build/targets/smollm2-135m-instruct",
                   help="target checkpoint folder (Hugging Face Llama family)")
    p.add_argument("--drafts", default="build/drafts", help="folder of trained drafts (<drafts>/<kind>/)")
    p.add_argument("--drafters", default=None,
                   help="comma-separated trained draft kinds to include (mtp, dfly, dflash; default: "
                        "every one found in --drafts); ngram is always in")
    p.add_argument("--data", default="build/data",
                   help="output of `angelspec data`: its prompts train the auto router's classifier; "
                        "'' builds without a router")
    p.add_argument("--out", default="engines/default", help="engine folder to write")
    p.add_argument("--backends", default="eager,inductor",
                   help="target-forward backends to measure (eager, inductor = torch.compile)")
    p.add_argument("--min-gain", type=float, default=1.2,
                   help="a compiled backend must be this much faster than eager (and bit-identical) "
                        "to be chosen: it costs minutes of compilation at every start")
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="the matmul weights: bfloat16 halves float32's bytes, on the AMX tile "
                        "unit where the CPU has it (weights and the activations entering each "
                        "matmul in bf16, sums in float32), elsewhere read as bf16 by the float32 "
                        "kernels (activations float32); auto measures a decoding step of "
                        "float32, bfloat16 (with AMX-BF16 tiles, or for a checkpoint whose weights "
                        "are bf16 values) and int8 / int4 (and w8a8 / w4a8) where they give back "
                        "the checkpoint's weights exactly (the default target: int4) and serves "
                        "the fastest, "
                        "saying why; exact: the same among only the options that compute the "
                        "checkpoint's own outputs (no w8a8 / w4a8, no AMX tiles, float32 KV cache). "
                        "int8 / int4: weight-only quantized in groups of 32 as "
                        "llama.cpp's Q8_0 / Q4_1, 3.6x / 5.3x fewer bytes per token than "
                        "float32, any AVX2 CPU; w8a8 / w4a8: the same weights, each matmul's "
                        "input rounded to int8 in blocks of 32 and integer dot products, as "
                        "llama.cpp computes. Outputs may differ from float32's (bench reports "
                        "the agreement; a checkpoint converted from such a GGUF, as the default "
                        "target, comes back exactly), and speculative output equals the same "
                        "engine's own autoregressive output")
    p.add_argument("--kv-cache", choices=["auto", *KV_CACHES], default="auto",
                   help="the values of the KV cache: bfloat16 halves the bytes attention reads (at "
                        "16 requests in flight after 256 tokens, 189 MB a step for the default "
                        "target in float32, twice its w4a8 weights), each key and value rounded "
                        "once as it is written; speculative output still equals the same engine's "
                        "own autoregressive output. auto: float32 where the weights are the "
                        "checkpoint's own values computed exactly (float32, exact int8 / int4, bf16 "
                        "values without AMX tiles), else bfloat16 (bf16 on AMX tiles, w8a8 / w4a8, "
                        "which round the activations already)")
    p.add_argument("--no-dcut", action="store_true", help="serve with a fixed draft length by default")
    add_record_option(p)
    p.add_argument("--export", choices=["trtllm", "tensorrt"], default=None,
                   help="also write <out>/trtllm/ (the drafts and an LLM-API YAML for TensorRT-LLM) "
                        "or <out>/tensorrt/ (target, DFly/DFlash drafts and D-cut as ONNX graphs "
                        "with plugin ops for TensorRT Edge-LLM; needs `make export-env`)")


def quality_line(w, kv_cache: str) -> str:
    """What the engine's greedy output equals: the checkpoint's own, or its served weights' (then
    with their measured fidelity to float32)."""
    if w.own_outputs and kv_cache == "float32":
        return "outputs: the checkpoint's own (float32 numbers); speculation lossless against them"
    f = w.fidelity
    return ("outputs: lossless against the served weights, not the checkpoint's own" +
            ("" if not f else f" (against float32 on the bundled prompts, {f['tokens']} tokens "
             f"teacher-forced: top-1 agreement {100 * f['top1_agreement']:.1f}%, perplexity "
             f"{f['perplexity_served']} vs {f['perplexity_float32']}); --weights exact serves the checkpoint's own"))


def run(args) -> int:
    m = build(args.target, args.drafts, args.out, args.data or None,
              args.drafters.split(",") if args.drafters else None,
              tuple(b.strip() for b in args.backends.split(",") if b.strip()), args.min_gain,
              not args.no_dcut, export=args.export, weights=args.weights, kv_cache=args.kv_cache)
    out = pathlib.Path(args.out)
    for kind, paths in m.exported.items():
        print(f"{kind} export: {', '.join(paths)}")
    be = m.backend
    speeds = ", ".join(f"{b} {r['speedup_vs_eager']}x" for b, r in be.measured.items())
    print(f"{out}: drafters {', '.join(m.drafters)}; default {m.defaults.drafter}, "
          f"D-cut {'on' if m.defaults.dcut else 'off'}; backend {be.chosen} ({speeds}); "
          f"{m.weights.dtype} weights ({m.weights.why}); {m.kv_cache} KV cache")
    print("  " + quality_line(m.weights, m.kv_cache))
    if be.why_eager:
        print(f"  eager kept: {be.why_eager}")
    for kind, d in m.drafters.items():
        if d.tokens_per_s_by_draft_len:
            print(f"  {kind} draft length {d.draft_len} (tokens/s by length: "
                  f"{json.dumps(d.tokens_per_s_by_draft_len)})"
                  + (f"; its own in {json.dumps(d.draft_len_by_domain)}" if d.draft_len_by_domain else ""))
    if m.router:
        r = m.router
        print(f"  router: classifier accuracy {json.dumps(r['accuracy'])}; routes {r['routes']} "
              f"(tokens/s measured per domain: {json.dumps(r['calibration_tokens_per_s'])})")
    prof = m.dcut.profile
    print("  verification cost C(n): " + ", ".join(f"{n}:{ms:.1f}ms" for n, ms in zip(prof["n"], prof["ms"])))
    for b, c in prof.get("by_batch", {}).items():
        print(f"    with {b} requests: " + ", ".join(f"{n}:{ms:.1f}ms" for n, ms in zip(c["n"], c["ms"])))
    if prof.get("per_key_ns"):
        print(f"    measured after {prof['context']} keys a request; each key beyond (or short of) that "
              f"adds (or saves) {prof['per_key_ns']:.0f} ns a verified token")
    record_run(args, "build", json.loads((out / "engine.json").read_text()),
               f"angelspec build of {args.target} into {args.out}: weights {args.weights}, backends {args.backends}")
    return 0
