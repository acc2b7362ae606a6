"""`angelspec openai-bench`: what the OpenAI frontend costs. A fresh tritonserver with the engine
and the frontend in front of it (free ports); the same prompts, greedy, at N requests in flight,
streamed two ways in alternating rounds: Triton's own gRPC streaming (tritonclient's asyncio
client, the ensemble's text_input) and the frontend's /v1/chat/completions (server-sent events,
read with aiohttp). Output tokens/s of each way, their ratio, whether the texts are equal, and
from the server's metrics how the engine spent each way's wall time: the share inside its steps
(the rest: admitting, answering, waiting for requests) and the tokens a step committed."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import statistics
import time

from angelspec.prompts import load_prompts
from angelspec.record import add_record_option, record_run
from angelspec.serving import triton
from angelspec.serving.openai_api import Backend
from angelspec.serving.openai_protocol import Call
from angelspec.serving.repo import write_repo


def cpu_seconds(group: int) -> float:
    """CPU time (user + system) of every live process in process group `group`."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # pgrp
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _pool(prompts: list[str], concurrency: int, one) -> tuple[dict, float]:
    """Run `one(prompt) -> (text, tokens)` over the prompts with `concurrency` in flight:
    ({prompt: (text, tokens)}, seconds)."""
    todo, out = list(prompts), {}

    async def worker():
        while todo:
            p = todo.pop()
            out[p] = await one(p)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, time.perf_counter() - t0


async def via_grpc(backend: Backend, prompt: str, max_tokens: int, drafter: str | None):
    inputs = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if drafter:
        inputs["drafter"] = drafter
    text, tokens = [], 0
    async for r in backend.generate(Call("text", "", inputs, True, False, [], drafter), stream=True):
        text.append(r["text"])
        tokens = r["output"]
    return "".join(text), tokens


async def via_openai(session, url: str, model: str, prompt: str, max_tokens: int, drafter: str | None):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if drafter:
        body["drafter"] = drafter
    text, tokens = [], 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for c in event.get("choices", []):
                text.append(c["delta"].get("content") or "")
    return "".join(text), tokens


async def compare(grpc_port: int, api_port: int, model: str, prompts: list[str], concurrency: int,
                  max_tokens: int, rounds: int, drafter: str | None, groups: dict[str, int],
                  metrics_port: int) -> dict:
    """`groups`: the process groups of the server and the frontend, whose CPU time each way's
    rounds take is counted (per 1,000 output tokens); `metrics_port`: the server's metrics, whose
    step counters give each way's share of wall time in engine steps."""
    import aiohttp

    backend = Backend(f"127.0.0.1:{grpc_port}")
    await backend.connect()
    url = f"http://127.0.0.1:{api_port}"
    rates, texts = {"grpc": [], "openai": []}, {}
    cpu = {(way, g): 0.0 for way in rates for g in groups}
    tokens = dict.fromkeys(rates, 0)
    spent = {way: {"wall": 0.0, "steps": 0.0, "step_s": 0.0} for way in rates}  # the engine's, each way
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        ways = {"grpc": lambda p: via_grpc(backend, p, max_tokens, drafter),
                "openai": lambda p: via_openai(session, url, model, p, max_tokens, drafter)}
        await _pool(prompts[:concurrency], concurrency, ways["openai"])  # warm both paths
        await _pool(prompts[:concurrency], concurrency, ways["grpc"])
        for k in range(rounds):
            for way in (("grpc", "openai") if k % 2 == 0 else ("openai", "grpc")):
                before = {g: cpu_seconds(pid) for g, pid in groups.items()}
                m0 = triton.server_counters(metrics_port)
                out, seconds = await _pool(prompts, concurrency, ways[way])
                m1 = triton.server_counters(metrics_port)
                for g, pid in groups.items():
                    cpu[way, g] += cpu_seconds(pid) - before[g]
                spent[way]["wall"] += seconds
                for k in ("steps", "step_s"):
                    spent[way][k] += m1[k] - m0[k]
                tokens[way] += sum(t for _, t in out.values())
                rates[way].append(sum(t for _, t in out.values()) / seconds)
                texts[way] = {p: t for p, (t, _) in out.items()}
    await backend.client.close()
    same = sum(texts["grpc"][p] == texts["openai"][p] for p in prompts)
    g, o = statistics.median(rates["grpc"]), statistics.median(rates["openai"])
    return {"concurrency": concurrency, "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens,
            "grpc_tok_s": round(g, 2), "openai_tok_s": round(o, 2), "ratio": round(o / g, 4),
            "grpc_rounds": [round(r, 2) for r in rates["grpc"]],
            "openai_rounds": [round(r, 2) for r in rates["openai"]], "same_text": same,
            "cpu_s_per_1k_tokens": {f"{way} way, {g}": round(1000 * cpu[way, g] / tokens[way], 3)
                                    for way, g in cpu},
            "in_steps": {way: round(s["step_s"] / s["wall"], 3) for way, s in spent.items()},
            "step_ms": {way: round(1000 * s["step_s"] / s["steps"], 2) for way, s in spent.items()},
            "tokens_per_step": {way: round(tokens[way] / s["steps"], 2) for way, s in spent.items()}}


def add_arguments(p) -> None:
    p.add_argument("--engine", default="engines/default", help="engine folder (angelspec build)")
    p.add_argument("--prompts", default=None, help="prompts (JSONL; default: the bundled ones)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each domain")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternated")
    p.add_argument("--drafter", default=None, help="default: the engine's")
    p.add_argument("--out", default="build/openai-bench.json")
    add_record_option(p)


def run(args) -> int:
    prompts = [r["prompt"] for r in load_prompts(args.prompts, args.limit)]
    out = pathlib.Path(args.out)
    work = out.parent / "openai-bench"
    work.mkdir(parents=True, exist_ok=True)
    ports = {k: triton.free_port() for k in ("http", "grpc", "metrics", "openai")}
    repo = write_repo(args.engine, work / "repo", max_batch=args.concurrency, max_queue=args.concurrency)
    server = triton.start(repo, "build/triton", ports["http"], ports["grpc"], ports["metrics"],
                          log=work / "server.log", record=False)
    api = None
    try:
        api = triton.start_openai(ports["grpc"], ports["openai"], ["engine"], "build/triton",
                                  log=work / "openai.log", record=False)
        r = asyncio.run(compare(ports["grpc"], ports["openai"], "engine", prompts, args.concurrency,
                                args.max_tokens, args.rounds, args.drafter,
                                {"server": server.pid, "frontend": api.pid}, ports["metrics"]))
    finally:
        for proc in (api, server):
            triton.shutdown(proc)
    r.update(engine=str(args.engine), drafter=args.drafter or "the engine's")
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"{r['prompts']} prompts, {r['concurrency']} in flight, {r['max_tokens']} tokens, median of "
          f"{r['rounds']} rounds each: Triton gRPC {r['grpc_tok_s']:.1f} output tok/s, OpenAI frontend "
          f"{r['openai_tok_s']:.1f} ({r['ratio']:.3f}x; rounds {r['grpc_rounds']} vs {r['openai_rounds']}); "
          f"same text on {r['same_text']} of {r['prompts']} prompts. CPU seconds per 1,000 output tokens: "
          + ", ".join(f"{k} {v}" for k, v in r["cpu_s_per_1k_tokens"].items()) + ". The engine in its "
          "steps: " + ", ".join(f"{w} way {r['in_steps'][w]:.0%} of the wall, {r['step_ms'][w]} ms a step, "
                                f"{r['tokens_per_step'][w]} tokens a step" for w in r["in_steps"])
          + f". Wrote {out}")
    record_run(args, "openai_bench", r, f"the OpenAI-compatible API against Triton's gRPC on {args.engine}, "
               f"{args.concurrency} in flight, {args.max_tokens} tokens, alternated rounds")
    return 0
