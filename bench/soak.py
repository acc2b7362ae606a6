"""`angelspec soak` / `make soak`: many streaming gRPC clients against a fresh server for a
while; passes when no request failed, nothing is left in flight and the server's memory stayed
flat."""
from __future__ import annotations

import pathlib
import time

import tritonclient.grpc as grpc

from angelspec.prompts import load_prompts
from angelspec.serving import triton
from angelspec.serving.client import inputs
from angelspec.serving.repo import write_repo


def server_rss_mb(pid: int) -> float:
    """Resident memory of a server and everything in its process group (the backend stubs)."""
    import os

    pgid, total = os.getpgid(pid), 0
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) != pgid:
                continue
            status = (d / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        total += next((int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS:")), 0)
    return total / 1024


def soak(grpc_port: int, metrics_port: int, server_pid: int, prompts: list[str], clients: int = 32,
         seconds: float = 30.0, max_tokens: int = 64, drafter: str | None = None) -> dict:
    """`clients` streaming gRPC clients in a bounded loop for `seconds`: each sends a request,
    reads its stream to the final response and sends the next. Returns the requests finished,
    the errors, the engine's requests in flight afterwards (leaked slots) and the server's
    memory after the first half and at the end."""
    import queue
    import threading

    deadline = time.time() + seconds
    done, errors, lock = [0], [], threading.Lock()

    def client(k: int) -> None:
        results: queue.Queue = queue.Queue()
        c = grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        i = k
        while time.time() < deadline:
            c.async_stream_infer("ensemble", inputs(grpc, prompts[i % len(prompts)], max_tokens, True,
                                                    drafter, 0.0, None))
            i += clients
            while True:
                try:
                    result, error = results.get(timeout=300)
                except queue.Empty:
                    error = "no response for 300 s"
                if error is not None:
                    with lock:
                        errors.append(str(error))
                    break
                if result.get_response().parameters["triton_final_response"].bool_param:
                    with lock:
                        done[0] += 1
                    break
        c.stop_stream()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds / 2)
    rss_mid = server_rss_mb(server_pid)
    for t in threads:
        t.join()
    time.sleep(1.0)  # the final step's bookkeeping
    m = triton.metrics(metrics_port)
    in_flight, steps = m.get("angelspec_requests_in_flight", 0.0), m.get("angelspec_steps_total", 0.0)
    return {"clients": clients, "seconds": seconds, "requests": done[0], "errors": errors,
            "in_flight_after": in_flight, "rss_mid_mb": round(rss_mid, 1),
            "rss_end_mb": round(server_rss_mb(server_pid), 1), "engine_steps": steps}


def add_arguments(p) -> None:
    p.add_argument("--engine", default="engines/default", help="engine folder (angelspec build)")
    p.add_argument("--prompts", default="build/data/heldout.jsonl", help="prompts (JSONL)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming gRPC clients")
    p.add_argument("--seconds", type=float, default=30.0, help="how long clients keep sending")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafter", default=None, help="default: the engine's (auto)")


def run(args) -> int:
    prompts = [r["prompt"] for r in load_prompts(args.prompts)]
    ports = {"http": triton.free_port(), "grpc": triton.free_port(), "metrics": triton.free_port()}
    out = pathlib.Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    # the engine decodes up to 16 at once and queues the rest: all clients are admitted
    repo = write_repo(args.engine, out / "repo", max_batch=min(16, args.clients),
                             max_queue=args.clients)
    proc = triton.start(repo, "build/triton", ports["http"], ports["grpc"], ports["metrics"],
                        log=out / "server.log", record=False)
    try:
        r = soak(ports["grpc"], ports["metrics"], proc.pid, prompts, args.clients, args.seconds,
                 args.max_tokens, args.drafter)
    finally:
        triton.shutdown(proc)
    growth = r["rss_end_mb"] / r["rss_mid_mb"] - 1
    print(f"{r['clients']} clients for {r['seconds']:.0f} s: {r['requests']} requests finished, "
          f"{len(r['errors'])} errors, {r['in_flight_after']:.0f} requests in flight afterwards; "
          f"server memory {r['rss_mid_mb']:.0f} MB halfway, {r['rss_end_mb']:.0f} MB at the end "
          f"({growth:+.1%})")
    for e in sorted(set(r["errors"]))[:5]:
        print("  error:", e)
    ok = not r["errors"] and r["in_flight_after"] == 0 and growth < 0.10
    print("soak: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
