"""`angelspec aiperf` / `make aiperf`: NVIDIA's AIPerf against the OpenAI frontend. A fresh
tritonserver with the engine and the frontend in front of it (free ports); AIPerf (its own venv,
make aiperf installs it) streams /v1/chat/completions at each concurrency, with `ar` (plain
autoregressive decoding: AIPerf reads the string "none" as null) and the engine's own drafter, on the
bundled prompts or synthetic ones. For each point: time to first token, inter-token latency,
output tokens/s, requests/s and errors -> aiperf.csv, aiperf.png and each run's own artifacts in
the output folder."""
from __future__ import annotations

import csv
import json
import os
import pathlib
import subprocess

from tqdm import tqdm

from angelspec.prompts import load_prompts
from angelspec.record import add_record_option, record_run
from angelspec.serving import triton
from angelspec.serving.repo import write_repo

TURNS = 4  # requests per point: this many per client (at least 8)
FIELDS = ["drafter", "concurrency", "requests", "errors", "output_tok_s", "requests_s", "ttft_p50_ms",
          "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "accepted_tokens", "rejected_tokens"]


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: str, concurrency: int, drafter: str,
                   max_tokens: int, prompts: pathlib.Path | None, out: pathlib.Path) -> list[str]:
    """One AIPerf run: streaming chat, greedy, the server's own token counts; its load generator
    kept small (one worker, one record processor), as it shares the machine with the engine."""
    cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--concurrency", str(concurrency), "--request-count", str(max(8, TURNS * concurrency)),
           "--warmup-request-count", str(concurrency), "--tokenizer", tokenizer,
           "--prompt-output-tokens-mean", str(max_tokens),
           "--extra-inputs", json.dumps({"temperature": 0, "drafter": drafter}),
           "--use-server-token-count", "--output-artifact-dir", str(out), "--no-auto-plot",
           "--workers-max", "1", "--record-processors", "1", "--ui", "none", "--no-server-metrics",
           "--random-seed", "0"]
    if prompts is None:
        cmd += ["--prompt-input-tokens-mean", "128", "--prompt-input-tokens-stddev", "0"]
    else:
        cmd += ["--input-file", str(prompts), "--custom-dataset-type", "single_turn"]
    return cmd


def point(artifacts: pathlib.Path, drafter: str, concurrency: int) -> dict:
    """A row of aiperf.csv from one run's profile_export_aiperf.json."""
    d = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    get = lambda name, stat="avg": (d.get(name) or {}).get(stat)  # noqa: E731
    return {"drafter": drafter, "concurrency": concurrency, "requests": int(get("request_count") or 0),
            "errors": int(get("error_request_count") or 0) + len(d.get("error_summary") or []),
            "output_tok_s": round(get("output_token_throughput"), 2),
            "requests_s": round(get("request_throughput"), 3),
            "ttft_p50_ms": round(get("time_to_first_token", "p50"), 1),
            "ttft_p99_ms": round(get("time_to_first_token", "p99"), 1),
            "itl_p50_ms": round(get("inter_token_latency", "p50"), 2),
            "itl_p99_ms": round(get("inter_token_latency", "p99"), 2),
            "accepted_tokens": get("total_usage_accepted_prediction_tokens"),
            "rejected_tokens": get("total_usage_rejected_prediction_tokens")}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for (key, title), ax in zip((("output_tok_s", "output tokens/s"), ("ttft_p50_ms", "time to first token p50 (ms)"),
                                 ("itl_p50_ms", "inter-token latency p50 (ms)")), axes):
        for drafter in dict.fromkeys(r["drafter"] for r in rows):
            mine = [r for r in rows if r["drafter"] == drafter]
            ax.plot([r["concurrency"] for r in mine], [r[key] for r in mine], marker="o", label=drafter)
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("AIPerf against the OpenAI frontend (streaming chat, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--engine", default="engines/default", help="engine folder (angelspec build)")
    p.add_argument("--aiperf", default="build/aiperf-venv/bin/aiperf", help="the aiperf program (make aiperf)")
    p.add_argument("--concurrency", default="1,4,8", help="requests in flight, comma-separated")
    p.add_argument("--drafters", default="ar,engine",
                   help="comma-separated; `engine`: the engine's default drafter; `ar`: no drafts")
    p.add_argument("--prompts", default="bundled",
                   help="bundled (the 30 bundled prompts), synthetic (AIPerf's, 128 tokens), or a JSONL file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="build/aiperf")
    add_record_option(p)


def run(args) -> int:
    aiperf = pathlib.Path(args.aiperf)
    if not aiperf.exists():
        raise SystemExit(f"angelspec aiperf: {aiperf} not found: `make aiperf` installs AIPerf 0.13 in its own venv")
    engine = pathlib.Path(args.engine)
    manifest = json.loads((engine / "engine.json").read_text())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = None
    if args.prompts != "synthetic":
        rows = load_prompts(None if args.prompts == "bundled" else args.prompts)
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": r["prompt"]}) + "\n" for r in rows))
    levels = [int(c) for c in args.concurrency.split(",")]
    drafters = [manifest["defaults"]["drafter"] if d == "engine" else d for d in args.drafters.split(",")]
    ports = {k: triton.free_port() for k in ("http", "grpc", "metrics", "openai")}
    repo = write_repo(engine, out / "repo", max_batch=max(levels), max_queue=max(levels))
    server = triton.start(repo, "build/triton", ports["http"], ports["grpc"], ports["metrics"],
                          log=out / "server.log", record=False)
    api, rows = None, []
    try:
        api = triton.start_openai(ports["grpc"], ports["openai"], [manifest["name"]], "build/triton",
                                  log=out / "openai.log", record=False)
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # AIPerf reads the local tokenizer
        for drafter in tqdm(drafters, desc="aiperf", unit="drafter"):
            for c in levels:
                artifacts = out / f"{drafter}-c{c}"
                cmd = aiperf_command(str(aiperf.resolve()), f"http://127.0.0.1:{ports['openai']}", manifest["name"],
                                     str((engine / "target").resolve()), c, drafter, args.max_tokens, prompts,
                                     artifacts)
                with open(out / f"{drafter}-c{c}.log", "w") as log:  # niced: the engine goes first
                    rc = subprocess.run(["nice", "-n", "19", *cmd], stdout=log, stderr=subprocess.STDOUT,
                                        env=env).returncode
                if rc != 0:
                    raise RuntimeError(f"aiperf failed ({rc}); see {out}/{drafter}-c{c}.log")
                rows.append(point(artifacts, drafter, c))
    finally:
        for proc in (api, server):
            triton.shutdown(proc)
    with open(out / "aiperf.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "aiperf.png")
    print(" | ".join(FIELDS))
    for r in rows:
        print(" | ".join(str(r[k]) for k in FIELDS))
    errors = sum(r["errors"] for r in rows)
    print(f"{len(rows)} points, {errors} errors; wrote {out}/aiperf.csv, {out}/aiperf.png")
    record_run(args, "aiperf", {"points": rows}, f"AIPerf against the OpenAI API serving {args.engine}: "
               f"{args.drafters} at concurrency {args.concurrency}, {args.prompts} prompts")
    return 1 if errors else 0
