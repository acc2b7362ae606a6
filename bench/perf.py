"""`angelspec perf` / `make perf`: load-test the served ensemble with perf_analyzer.

For each D-cut setting a tritonserver is started on free ports with the engine; perf_analyzer
(from tritonclient[all]==2.51.0) drives the ensemble over gRPC with streaming at each concurrency,
with held-out prompts as input data, and exports every request's timestamps and streamed outputs.
From those: output tokens/s (the streamed text re-tokenized), time to first token and inter-token
latency p50/p99. Every point's load is then replayed in this process with the same engine, for the
mean engine step both ways; at concurrency 1 the same prompts also run one at a time served and
in-process, taking turns prompt by prompt, so the server's own overhead is measured in the same
run. Writes perf.csv, perf.png and perf.json.
"""
from __future__ import annotations

import csv
import itertools
import json
import pathlib
import subprocess
import time

import numpy as np
from tqdm import tqdm

from angelspec.prompts import load_prompts
from angelspec.record import add_record_option, record_run
from angelspec.runtime import Request, SamplingParams, load_engine
from angelspec.serving import triton
from angelspec.serving.client import inputs
from angelspec.serving.repo import write_repo

# requests per point: at least TURNS per client. The first wave's prefills queue (every client
# starts at once) and the last wave drains below the concurrency; with fewer turns those edges
# were a large part of a point, and its speedup moved from run to run
TURNS = 4
FIELDS = ["dcut", "drafter", "concurrency", "requests", "output_tok_s", "ttft_p50_ms",
          "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "step_ms", "in_process_step_ms", "accept_rate"]


def perf_analyzer_env(folder: pathlib.Path) -> dict:
    """perf_analyzer needs libb64.so.0d and libcudart.so.12, which nvidia-pytriton ships under
    hashed names: link them into `folder` and put it on LD_LIBRARY_PATH."""
    import os

    libs = triton.pytriton_dir().parent / "nvidia_pytriton.libs"
    folder.mkdir(parents=True, exist_ok=True)
    for stem, name in (("libb64-", "libb64.so.0d"), ("libcudart-", "libcudart.so.12")):
        found = sorted(libs.glob(stem + "*"))
        if not found:
            raise FileNotFoundError(f"{stem}* not found in {libs}: reinstall nvidia-pytriton==0.7.0")
        link = folder / name
        if not link.exists():
            link.symlink_to(found[0])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([str(folder), env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    return env


def perf_analyzer_bin() -> str:
    import shutil
    import sys

    exe = pathlib.Path(sys.executable).parent / "perf_analyzer"
    found = str(exe) if exe.exists() else shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError("perf_analyzer not found: pip install 'tritonclient[all]==2.51.0'")
    return found


def write_inputs(path: pathlib.Path, prompts: list[str], drafter: str, max_tokens: int) -> None:
    rows = [{"text_input": [p], "max_tokens": [max_tokens], "stream": [True], "drafter": [drafter]}
            for p in prompts]
    path.write_text(json.dumps({"data": rows}))


def summarize(export: pathlib.Path, count_tokens) -> dict:
    """perf_analyzer's profile export -> throughput and latency percentiles of one experiment."""
    exp = json.loads(export.read_text())["experiments"][-1]
    reqs = [r for r in exp["requests"] if r.get("response_timestamps")]
    if not reqs:
        raise RuntimeError(f"{export}: no request got a response")
    tokens, ttft, itl, ends = 0, [], [], []
    for r in reqs:
        ts = r["response_timestamps"]
        text = "".join(o.get("text_output", "") for o in r.get("response_outputs", []))
        n = count_tokens(text)
        tokens += n
        ttft.append((ts[0] - r["timestamp"]) / 1e6)
        if n > 1 and len(ts) > 1:
            itl.append((ts[-1] - ts[0]) / 1e6 / (n - 1))
        ends.append(ts[-1])
    span = (max(ends) - min(r["timestamp"] for r in reqs)) / 1e9
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2) if xs else None  # noqa: E731
    return {"requests": len(reqs), "output_tok_s": round(tokens / span, 2),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def run_point(grpc_port: int, metrics_port: int, inputs: pathlib.Path, concurrency: int,
              export: pathlib.Path, requests: int, env: dict, count_tokens, log) -> dict:
    """One perf_analyzer measurement: `requests` requests (a fixed count: time windows rarely
    stabilise on this noisy 2-core machine when a request takes seconds) at `concurrency`."""
    before = triton.server_counters(metrics_port)
    export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
    cmd = [perf_analyzer_bin(), "-m", "ensemble", "-i", "grpc", "--streaming",
           "-u", f"127.0.0.1:{grpc_port}", "--input-data", str(inputs),
           "--concurrency-range", f"{concurrency}:{concurrency}",
           "--request-count", str(requests), "--profile-export-file", str(export)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write(" ".join(cmd) + "\n" + done.stdout + done.stderr + "\n")
    log.flush()
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    after = triton.server_counters(metrics_port)
    d = {k: after[k] - before[k] for k in after}
    row = summarize(export, count_tokens)
    row["step_ms"] = round(1e3 * d["step_s"] / d["steps"], 2) if d["steps"] else None
    row["accept_rate"] = round(d["accepted"] / d["drafted"], 3) if d["drafted"] else None
    return row


def in_process(engine, prompt_ids: list[list[int]], drafter: str, max_tokens: int,
               concurrency: int = 1, requests: int | None = None) -> dict:
    """Requests through the engine in this process, stepped as the served model's worker steps
    them: `requests` of them (default: one per prompt, in turn) with `concurrency` in flight, the
    next one admitted before the step after one finishes (a served point's load, replayed).
    -> the output token ids, seconds, steps and step time."""
    requests = len(prompt_ids) if requests is None else requests
    sent = open_ = steps = 0
    step_s, out, t0 = 0.0, [], time.perf_counter()
    while sent < requests or engine.busy:
        while open_ < concurrency and sent < requests:
            ids = prompt_ids[sent % len(prompt_ids)]
            engine.submit(Request(ids, SamplingParams(max_tokens=max_tokens), drafter), sent)
            sent, open_ = sent + 1, open_ + 1
        t = time.perf_counter()
        events = engine.step()
        step_s += time.perf_counter() - t
        steps += 1
        out += [tok for e in events for tok in e.tokens]
        open_ -= sum(1 for e in events if e.finish_reason)
    return {"ids": out, "seconds": time.perf_counter() - t0, "steps": steps, "step_s": step_s}


def one_in_process(engine, ids: list[int], drafter: str, max_tokens: int, count_tokens) -> dict:
    """One request in process, its output tokens counted as the served text's are."""
    r = in_process(engine, [ids], drafter, max_tokens)
    return {**r, "tokens": count_tokens(engine.target.decode(r.pop("ids")))}


def served(client, results, metrics_port: int, prompt: str, drafter: str, max_tokens: int,
           count_tokens) -> dict:
    """One streamed request through the ensemble over gRPC (`client` streaming into the queue
    `results`): output tokens, seconds to the last response, and the engine's steps for it."""
    import tritonclient.grpc as grpcclient

    before = triton.server_counters(metrics_port)
    text, t0 = [], time.perf_counter()
    client.async_stream_infer("ensemble", inputs(grpcclient, prompt, max_tokens, True, drafter, 0.0, None))
    while True:
        result, error = results.get(timeout=600)
        if error is not None:
            raise RuntimeError(f"served request failed: {error}")
        text.append(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"))
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    seconds = time.perf_counter() - t0
    after = triton.server_counters(metrics_port)
    return {"tokens": count_tokens("".join(text)), "seconds": seconds,
            "steps": after["steps"] - before["steps"], "step_s": after["step_s"] - before["step_s"]}


def overhead(engine, grpc_port: int, metrics_port: int, prompts: list[str], prompt_ids: list[list[int]],
             drafter: str, max_tokens: int, count_tokens) -> dict:
    """What serving through Triton costs: each prompt runs served (one streamed gRPC request, the
    server otherwise idle) and in-process (the same engine settings in this process), back to
    back, the order alternating from prompt to prompt, so this machine's drift hits both alike.
    -> output tokens/s end to end and the mean engine step, both ways."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    runs = {"served": [], "in_process": []}
    try:
        for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            pair = [("served", lambda: served(client, results, metrics_port, prompt, drafter,
                                              max_tokens, count_tokens)),
                    ("in_process", lambda: one_in_process(engine, ids, drafter, max_tokens, count_tokens))]
            for way, fn in pair[::1 if i % 2 == 0 else -1]:
                runs[way].append(fn())
    finally:
        client.stop_stream()
        client.close()
    out = {}
    for way, rs in runs.items():
        total = {k: sum(r[k] for r in rs) for k in ("tokens", "seconds", "steps", "step_s")}
        out[f"{way}_tok_s"] = round(total["tokens"] / total["seconds"], 2)
        out[f"{way}_step_ms"] = round(1e3 * total["step_s"] / max(total["steps"], 1), 2)
    return out


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("output_tok_s", None, "output tokens/s"), ("ttft_p50_ms", "ttft_p99_ms", "time to first token (ms)"),
              ("itl_p50_ms", "itl_p99_ms", "inter-token latency (ms)")]
    series = sorted({(r["drafter"], r["dcut"]) for r in rows if r["concurrency"]})
    for ax, (p50, p99, title) in zip(axes, panels):
        for drafter, dcut in series:
            pts = sorted((r["concurrency"], r[p50], r[p99] if p99 else None) for r in rows
                         if r["drafter"] == drafter and r["dcut"] == dcut and r["concurrency"])
            label = drafter if drafter == "none" else f"{drafter}, D-cut {dcut}"
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=f"{label} p50" if p99 else label)
            if p99:
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=line.get_color(),
                        label=f"{label} p99")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def speedup_table(rows: list[dict]) -> str:
    """Markdown: output tokens/s per configuration and the speedup over `none` per concurrency."""
    by = {(r["drafter"], r["dcut"], r["concurrency"]): r for r in rows if r["concurrency"]}
    levels = sorted({k[2] for k in by})
    configs = sorted({(d, c) for d, c, _ in by if d != "none"})
    head = "| concurrency | none tok/s | " + " | ".join(f"{d} D-cut {c}" for d, c in configs) + " |"
    lines = [head, "|" + "---:|" * (2 + len(configs))]
    for n in levels:
        base = by.get(("none", "on", n)) or by.get(("none", "off", n))
        cells = []
        for d, c in configs:
            r = by.get((d, c, n))
            if r is None or base is None:
                cells.append("-")
            else:
                cells.append(f"{r['output_tok_s']:.1f} ({r['output_tok_s'] / base['output_tok_s']:.2f}x)")
        lines.append(f"| {n} | {base['output_tok_s']:.1f} | " + " | ".join(cells) + " |" if base else f"| {n} | - |")
    return "\n".join(lines)


def sweep(engine_dir: str, prompts: list[str], drafters: list[str], dcuts: list[str],
          concurrencies: list[int], max_tokens: int, out: pathlib.Path, min_requests: int,
          server_dir: str = "build/triton") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = perf_analyzer_env(out / "libs")
    target = None  # the first engine's; later engines share it
    served_by = {dcut: [d for d in drafters if d != "none" or dcut == dcuts[0]] for dcut in dcuts}
    rows, costs = [], {}
    log = (out / "perf_analyzer.log").open("w")
    bar = tqdm(total=sum(len(v) for v in served_by.values()) * len(concurrencies), desc="perf", unit="point")
    for dcut, mine in served_by.items():
        ports = {"http": triton.free_port(), "grpc": triton.free_port(), "metrics": triton.free_port()}
        repo = write_repo(engine_dir, out / f"repo-dcut-{dcut}", max_batch=max(concurrencies),
                                 max_queue=max(concurrencies), dcut=dcut == "on")
        proc = triton.start(repo, server_dir, ports["http"], ports["grpc"], ports["metrics"],
                            log=out / f"server-dcut-{dcut}.log", record=False)
        try:
            engine = load_engine(engine_dir, max_batch=max(concurrencies), dcut=dcut == "on",
                                 target=target)
            engine.warm_up(mine)  # as the server did before it said it was ready
            if target is None:  # the served model's encoding; its tokenizer counts output
                target = engine.target
                tok = target.tokenizer
                count = lambda text: len(tok.encode(text, add_special_tokens=False)) if text else 0  # noqa: E731
                prompt_ids = [target.encode_chat(p) for p in prompts]
            for n in concurrencies:  # drafters take turns at each level: drift hits both alike
                for d in mine:
                    inputs = out / f"inputs-{d}.json"
                    write_inputs(inputs, prompts, d, max_tokens)
                    count_req = max(min_requests, TURNS * n)
                    row = run_point(ports["grpc"], ports["metrics"], inputs, n,
                                    out / f"export-{dcut}-{d}-{n}.json", count_req, env, count, log)
                    # the same load in this process, right after: what the step costs without Triton
                    replay = in_process(engine, prompt_ids, d, max_tokens, n, count_req)
                    row["in_process_step_ms"] = round(1e3 * replay["step_s"] / replay["steps"], 2)
                    rows.append({"dcut": dcut, "drafter": d, "concurrency": n, **row})
                    if n == 1:  # the server's own overhead, served and in-process interleaved
                        costs[f"{d}, D-cut {dcut}"] = overhead(
                            engine, ports["grpc"], ports["metrics"], prompts[:min_requests],
                            prompt_ids[:min_requests], d, max_tokens, count)
                    bar.update(1)
            del engine
        finally:
            triton.shutdown(proc)
    bar.close()
    with (out / "perf.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in FIELDS})
    plot(rows, out / "perf.png")
    result = {"engine": engine_dir, "max_tokens": max_tokens, "prompts": len(prompts),
              "min_requests": min_requests, "rows": rows, "overhead": costs}
    (out / "perf.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p) -> None:
    p.add_argument("--engine", default="engines/default", help="engine folder (angelspec build)")
    p.add_argument("--prompts", default="build/data/heldout.jsonl",
                   help="held-out prompts (JSONL with 'prompt'; the data step writes them)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of each domain")
    p.add_argument("--drafters", default="auto,none", help="comma-separated; none = autoregressive")
    p.add_argument("--dcut", default="on,off", help="comma-separated D-cut settings to serve (on, off)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=12,
                   help="requests measured per point (at least four times the concurrency)")
    p.add_argument("--out", default="build/perf", help="folder for perf.csv, perf.png, perf.json, logs")
    add_record_option(p)


def run(args) -> int:
    rows = load_prompts(args.prompts, args.limit)
    by_domain: dict[str, list[str]] = {}
    for r in rows:
        by_domain.setdefault(r.get("domain", ""), []).append(r["prompt"])
    # domains take turns, so any prefix of the list (what a point measures) mixes them evenly
    prompts = [p for group in itertools.zip_longest(*by_domain.values()) for p in group if p]
    levels = [int(x) for x in args.concurrency.split(",")]
    if 1 not in levels:
        levels = [1] + levels  # the overhead comparison runs at concurrency 1
    result = sweep(args.engine, prompts, args.drafters.split(","), args.dcut.split(","), levels,
                   args.max_tokens, pathlib.Path(args.out), args.requests)
    print(speedup_table(result["rows"]))
    print("\nmean engine step, served vs the same load replayed in process:")
    for r in result["rows"]:
        if r["step_ms"] and r["in_process_step_ms"]:
            print(f"  {r['drafter']}, D-cut {r['dcut']}, {r['concurrency']} in flight: {r['step_ms']} vs "
                  f"{r['in_process_step_ms']} ms ({r['step_ms'] / r['in_process_step_ms']:.2f}x)")
    print("\nserved vs in-process, one request at a time:")
    for name, o in result["overhead"].items():
        print(f"  {name}: {o['served_tok_s']} vs {o['in_process_tok_s']} tok/s "
              f"({o['in_process_tok_s'] / o['served_tok_s'] - 1:+.1%} cost through Triton); step "
              f"{o['served_step_ms']} vs {o['in_process_step_ms']} ms "
              f"({o['served_step_ms'] / o['in_process_step_ms'] - 1:+.1%})")
    print(f"wrote {args.out}/perf.csv, perf.png, perf.json")
    record_run(args, "perf", result, f"perf_analyzer against tritonserver serving {args.engine}: {args.drafters}, "
               f"D-cut {args.dcut}, concurrency {args.concurrency}, {args.max_tokens} tokens, {args.prompts}")
    return 0
