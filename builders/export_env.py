"""The export environment (`make export-env`: .venv-export) from the serving one: TensorRT
Edge-LLM's exporter pins torch, transformers 5.x and numpy 2, which serving (numpy<2) cannot
share, so the TensorRT export and its ONNX Runtime proof run there, as subprocesses.

`angelspec verify-export`: the engine's greedy tokens on held-out-style prompts (here), then the
proof in the export environment (builders/verify_export.py)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

from angelspec.prompts import load_prompts
from angelspec.runtime import Request, SamplingParams
from angelspec.runtime.engine_dir import load_engine

ROOT = pathlib.Path(__file__).resolve().parent.parent


def export_python() -> pathlib.Path:
    """The export environment's interpreter ($ANGELSPEC_EXPORT_PYTHON, else .venv-export)."""
    py = pathlib.Path(os.environ.get("ANGELSPEC_EXPORT_PYTHON") or ROOT / ".venv-export" / "bin" / "python")
    if not py.exists():
        raise RuntimeError(f"no export environment at {py}: run `make export-env` (TensorRT Edge-LLM's "
                           "exporter, ONNX Runtime; ~1 min), or set ANGELSPEC_EXPORT_PYTHON")
    return py


def run_module(module: str, *args: str) -> int:
    """python -m `module` args... in the export environment; its return code."""
    return subprocess.run([str(export_python()), "-m", module, *args]).returncode


def export_tensorrt(engine: str | pathlib.Path) -> None:
    if run_module("angelspec.builders.tensorrt", "--engine", str(engine)) != 0:
        raise RuntimeError(f"the TensorRT export of {engine} failed (see above)")


def add_arguments(p) -> None:
    p.add_argument("--engine", default="engines/default", help="engine folder exported with --export tensorrt")
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: the bundled chat/code/math prompts)")
    p.add_argument("--limit", type=int, default=2, help="prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafter", default="dfly", help="the engine's drafter whose greedy tokens are the reference")
    p.add_argument("--near-tie", type=float, default=0.05,
                   help="top-2 logit margin under which the float16 export may pick the other token")
    p.add_argument("--out", default="build/verify-export", help="folder for the reference tokens and the report")


def run(args) -> int:
    rows = []
    for p in load_prompts(args.prompts, args.limit):
        # a fresh engine per prompt: its drafter gate remembers earlier requests, the proof's loop has
        # none; float32 weights whatever the engine serves: the export carries the checkpoint's
        engine = load_engine(args.engine, max_batch=1, weights="float32")
        target = engine.target
        ids = target.encode_chat(p["prompt"])
        res = engine.generate([Request(ids, SamplingParams(max_tokens=args.max_tokens), args.drafter)])[0]
        rows.append({"domain": p["domain"], "ids": ids, "tokens": res.tokens,
                     "accept_len": round(res.stats.accept_len, 2)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = out / "reference.json"
    ref.write_text(json.dumps({"engine": str(args.engine), "drafter": args.drafter, "max_tokens": args.max_tokens,
                               "eos": list(target.eos_ids), "prompts": rows}) + "\n")
    print(f"reference: {len(rows)} prompts, the engine's greedy tokens with {args.drafter} -> {ref}")
    return run_module("angelspec.builders.verify_export", "--engine", str(args.engine), "--reference", str(ref),
                      "--near-tie", str(args.near_tie), "--report", str(out / "report.json"))
