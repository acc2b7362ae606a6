"""`angelspec bench --contend N`: the engine's speed when it shares the CPU.

N busy processes run beside the engine (stopped with SIGSTOP while an idle configuration runs),
and every prompt runs, taking turns, in five configurations: idle with all threads fixed, idle
with the thread governor (angelspec/runtime/threads.py), busy with all threads fixed (the engine
before the governor), busy with the governor, and busy on one thread. Reported per drafter:
tokens/s of each, the governor's busy speed against one thread's, and its idle speed against
fixed threads' (the governor must cost nothing when the machine is idle). Greedy, batch 1.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from angelspec.runtime import Request, SamplingParams
from angelspec.runtime.threads import ThreadGovernor

CONFIGS = ("idle_fixed", "idle_adaptive", "busy_fixed", "busy_adaptive", "busy_one_thread")


def busy_processes(n: int) -> list[subprocess.Popen]:
    """n processes that spin on a core each, stopped (SIGSTOP) until asked to run."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    return procs


def contend(engine, ids: list[list[int]], drafters: list[str], n_busy: int, max_tokens: int = 64) -> dict:
    full = torch.get_num_threads()
    params = SamplingParams(max_tokens=max_tokens)
    tokens = {(d, c): 0 for d in drafters for c in CONFIGS}
    seconds = dict.fromkeys(tokens, 0.0)
    # one governor per adaptive configuration, kept across its turns as a server keeps one
    governors = {c: ThreadGovernor() for c in CONFIGS if c.endswith("adaptive")}
    own = engine.governor
    procs = busy_processes(n_busy)
    try:
        engine.generate([Request(ids[0], SamplingParams(max_tokens=8), "none")])  # warm-up
        for x in tqdm(ids, desc=f"contend {n_busy} busy", unit="prompt", file=sys.stderr):
            for d in drafters:
                for c in CONFIGS:
                    for p in procs:
                        os.kill(p.pid, signal.SIGCONT if c.startswith("busy") else signal.SIGSTOP)
                    torch.set_num_threads(1 if c == "busy_one_thread" else full)
                    engine.governor = governors.get(c)
                    time.sleep(0.05)  # the neighbours are running (or stopped) before timing
                    t0 = time.perf_counter()
                    out = engine.generate([Request(x, params, d)])[0]
                    seconds[(d, c)] += time.perf_counter() - t0
                    tokens[(d, c)] += len(out.tokens)
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        torch.set_num_threads(full)
        engine.governor = own
    rows = []
    for d in drafters:
        tps = {c: round(tokens[(d, c)] / seconds[(d, c)], 2) for c in CONFIGS}
        rows.append({"drafter": d, "tokens_per_s": tps,
                     "busy_adaptive_vs_one_thread": round(tps["busy_adaptive"] / tps["busy_one_thread"], 3),
                     "busy_adaptive_vs_fixed": round(tps["busy_adaptive"] / tps["busy_fixed"], 3),
                     "idle_adaptive_vs_fixed": round(tps["idle_adaptive"] / tps["idle_fixed"], 3)})
    return {"busy_processes": n_busy, "threads": full, "cores": os.cpu_count(),
            "prompts": len(ids), "max_tokens": max_tokens, "results": rows,
            "thread_switches": {c: g.switches for c, g in governors.items()}}


def format_table(result: dict) -> str:
    head = (f"{result['busy_processes']} busy processes beside the engine ({result['threads']} "
            f"threads, {result['cores']} cores), {result['prompts']} prompts x "
            f"{result['max_tokens']} tokens, batch 1, tokens/s:")
    lines = [head, f"{'drafter':<8}" + "".join(f"{c:>17}" for c in CONFIGS)
             + f"{'adaptive/1 thread':>19}{'idle adaptive/fixed':>21}"]
    for r in result["results"]:
        lines.append(f"{r['drafter']:<8}" + "".join(f"{r['tokens_per_s'][c]:>17}" for c in CONFIGS)
                     + f"{r['busy_adaptive_vs_one_thread']:>19}{r['idle_adaptive_vs_fixed']:>21}")
    lines.append("thread switches of the governor: " + ", ".join(
        f"{c} {n}" for c, n in result["thread_switches"].items()))
    return "\n".join(lines)
