"""The served stack: a real tritonserver (the nvidia-pytriton build) started by the tests on free
ports, hosting a tiny engine the tests build themselves; HTTP generate, gRPC streaming, bad input,
seeds, busy, cancellation, metrics, and lossless output through the whole stack (the hardening
probe, with a slower engine, is test_probe.py)."""
import json
import math
import os
import queue
import signal
import subprocess
import time
import urllib.error
import urllib.request
import warnings

import numpy as np
import pytest
from conftest import make_checkpoint
from test_drafters import draft

from angelspec.builders.build import build
from angelspec.checkpoint import load_target
from angelspec.drafters.draft_checkpoint import save_draft
from angelspec.runtime import Request, SamplingParams
from angelspec.runtime.engine_dir import load_engine
from angelspec.serving import triton
from angelspec.serving.repo import write_repo

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    make_checkpoint(root / "target", num_hidden_layers=8, seed=3)
    target = load_target(root / "target", max_len=512)
    for kind, vocab in (("mtp", 60), ("dfly", 60)):
        cfg, model = draft(target, kind, vocab=vocab)
        save_draft(root / "drafts" / kind, cfg, model.state_dict())
    (root / "data").mkdir()
    rows = [{"prompt": p, "domain": d} for d, p in (("chat", "hello there"), ("code", "def f(x):"),
                                                     ("math", "12 * 7 = ?"))]
    (root / "data" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build(str(root / "target"), str(root / "drafts"), str(root / "engine"), str(root / "data"),
          backends=("eager",), max_tokens=16)
    repo = write_repo(root / "engine", root / "repo", max_batch=2, max_queue=2,
                             request_timeout_s=20)
    ports = {"http": triton.free_port(), "grpc": triton.free_port(), "metrics": triton.free_port()}
    log = root / "server.log"
    proc = triton.start(repo, root / "triton", ports["http"], ports["grpc"], ports["metrics"], log=log)
    yield {"target": target, "engine": root / "engine", "log": log, "pid": proc.pid, **ports}
    proc.terminate()
    try:  # a request left open would hold the shutdown (and leave stubs behind)
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("tritonserver did not stop within 120 s of SIGTERM; log:\n" + log.read_text()[-3000:])
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)  # a backend stub of this server still runs
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    warnings.warn("a Python backend stub outlived the server (killed); server log tail:\n"
                  + log.read_text()[-1500:])


@pytest.fixture(autouse=True)
def show_log_on_failure(request, server):
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print("---- tritonserver log (tail) ----\n" + server["log"].read_text()[-4000:])


def generate(server, **body):
    req = urllib.request.Request(f"http://127.0.0.1:{server['http']}/v2/models/ensemble/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def reference(server, text, n, drafter="none"):
    """What `angelspec generate --engine` gives: batch 1, in process, the engine's own weights."""
    if "local" not in server:
        server["local"] = load_engine(server["engine"], max_batch=1, max_len=512)
    eng = server["local"]
    ids = eng.target.tokenizer.encode(text, add_special_tokens=False)
    out = eng.generate([Request(ids, SamplingParams(max_tokens=n), drafter)])[0]
    return eng.target.decode(out.tokens)


def test_http_generate_is_lossless_with_stats(server):
    for drafter in ("auto", "dfly", "none"):
        status, body = generate(server, text_input="hello there", max_tokens=24, drafter=drafter)
        assert status == 200, body
        assert body["text_output"] == reference(server, "hello there", 24)
        assert 0 <= body["acceptance_rate"] <= 1
        if drafter == "dfly":
            assert body["total_draft_tokens"] > 0 and body["drafter_used"] == "dfly"


def tensor(name, value, dtype, ttype):
    t = grpcclient.InferInput(name, [1], ttype)
    t.set_data_from_numpy(np.array([value], dtype=dtype))
    return t


def grpc_call(server, ins):
    """One request over gRPC streaming (the only gRPC path to a decoupled model): the text of
    every response, and the error if one came."""
    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server['grpc']}")
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    c.async_stream_infer("ensemble", ins)
    chunks, error = [], None
    while True:
        r, e = results.get(timeout=120)
        if e is not None:
            error = str(e)
            break
        chunks.append(r.as_numpy("text_output").reshape(-1)[0].decode())
        if r.get_response().parameters["triton_final_response"].bool_param:
            break
    c.stop_stream()
    return chunks, error


def stream(server, text, max_tokens, **extra):
    ins = [tensor("text_input", text.encode(), object, "BYTES"),
           tensor("max_tokens", max_tokens, np.int32, "INT32"), tensor("stream", True, bool, "BOOL")]
    return grpc_call(server, ins + [tensor(k, *v) for k, v in extra.items()])


def test_grpc_streaming_chunks_add_up_to_the_full_text(server):
    chunks, error = stream(server, "def f(x):", 30)
    assert error is None and len(chunks) > 1
    assert "".join(chunks) == reference(server, "def f(x):", 30)


@pytest.mark.parametrize("body,message", [
    ({"text_input": "", "max_tokens": 8}, "text_input is empty"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"text_input": "hi", "max_tokens": 100000}, "exceeds the room left in the context"),
    ({"text_input": "hi", "max_tokens": 8, "temperature": -1.0}, "temperature must be"),
    ({"text_input": "hi", "max_tokens": 8, "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "max_tokens": 8, "drafter": "medusa"}, "unknown drafter 'medusa'"),
    ({"text_input": "x" * 3000, "max_tokens": 8}, "does not fit the context"),
])
def test_bad_input_gets_a_clear_error_and_the_server_stays_up(server, body, message):
    status, out = generate(server, **body)
    assert status >= 400 and message in out.get("error", ""), out
    status, out = generate(server, text_input="hello there", max_tokens=4)
    assert status == 200


def test_nan_temperature_and_non_utf8_bytes_are_refused(server):
    _, error = stream(server, "hi", 4, temperature=(math.nan, np.float32, "FP32"))
    assert error and "temperature must be" in error
    bad = tensor("text_input", b"\xff\xfe bad", object, "BYTES")
    _, error = grpc_call(server, [bad, tensor("max_tokens", 4, np.int32, "INT32")])
    assert error and "not valid UTF-8" in error
    _, error = grpc_call(server, [tensor("text_input", b"hi", object, "BYTES"),
                                  tensor("max_tokens", 4.0, np.float32, "FP32")])  # wrong dtype
    assert error and "max_tokens" in error


def test_seeded_sampling_is_reproducible(server):
    # a seed pins the sample whatever drafts (the engine's D-cut and router decide by timing)
    def run(seed, drafter="auto"):
        return generate(server, text_input="hello there", max_tokens=20, temperature=0.9, seed=seed,
                        drafter=drafter)[1]["text_output"]
    assert run(5) == run(5) == run(5, "dfly") == run(5, "none")
    assert run(5) != run(6)


def test_metrics_count_drafted_and_accepted_tokens(server):
    generate(server, text_input="12 * 7 = ?", max_tokens=16, drafter="dfly")
    text = urllib.request.urlopen(f"http://127.0.0.1:{server['metrics']}/metrics", timeout=10).read().decode()
    assert 'angelspec_draft_tokens_total{drafter="dfly"}' in text
    assert "angelspec_step_seconds" in text and "nv_inference_request_success" in text


def test_client_cli_over_http_and_grpc_streaming(server):
    import sys

    expect = reference(server, "hello there", 16)
    for extra in ([f"--url=127.0.0.1:{server['http']}"], ["--grpc", f"--url=127.0.0.1:{server['grpc']}"],
                  ["--grpc", "--stream", f"--url=127.0.0.1:{server['grpc']}"]):
        proc = subprocess.run([sys.executable, "-m", "angelspec.cli", "client", "hello there",
                               "--max-tokens", "16", *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.rstrip("\n") == expect.rstrip("\n") and "acceptance rate" in proc.stderr


def in_flight(server) -> float:
    return triton.metrics(server["metrics"]).get("angelspec_requests_in_flight", 0.0)


def test_overload_gets_busy_and_everything_else_completes(server):
    """max_batch 2 + max_queue 2: of 8 simultaneous long requests, the extra ones are told to
    retry at once; the admitted ones finish, and the slots are free afterwards."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: stream(server, "def f(x):", 300), range(8)))
    busy = [e for _, e in outcomes if e and "busy" in e]
    done = [c for c, e in outcomes if e is None]
    assert busy and done and len(busy) + len(done) == 8, [e for _, e in outcomes]
    assert all("".join(c) == "".join(done[0]) for c in done)
    assert generate(server, text_input="hello there", max_tokens=4)[0] == 200


def test_a_client_that_goes_away_frees_its_slot(server):

    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server['grpc']}")
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    c.async_stream_infer("ensemble", [tensor("text_input", b"def f(x):", object, "BYTES"),
                                      tensor("max_tokens", 500, np.int32, "INT32"),
                                      tensor("stream", True, bool, "BOOL")])
    result, error = results.get(timeout=60)  # the first chunk arrived: the request holds a slot
    assert error is None and in_flight(server) == 1
    c.stop_stream(cancel_requests=True)
    deadline = time.time() + 30
    while in_flight(server) > 0 and time.time() < deadline:
        time.sleep(0.5)
    assert in_flight(server) == 0
    assert generate(server, text_input="hello there", max_tokens=4)[0] == 200


def test_a_request_past_its_timeout_is_ended_and_frees_its_slot(server):
    """The client's own request timeout (shorter than the server's) ends a long generation with
    a clear error; the slot is free again."""

    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server['grpc']}")
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    t0 = time.time()
    c.async_stream_infer("ensemble", [tensor("text_input", b"def f(x):", object, "BYTES"),
                                      tensor("max_tokens", 500, np.int32, "INT32"),
                                      tensor("stream", True, bool, "BOOL")],
                        timeout=20_000)  # 20 ms: far less than 500 tokens take, however fast the engine
    error = None
    while error is None:
        result, error = results.get(timeout=60)
        if error is None and result.get_response().parameters["triton_final_response"].bool_param:
            break
    c.stop_stream()
    assert error is not None and "timed out after 0.02 s" in str(error), error
    assert time.time() - t0 < 10
    deadline = time.time() + 30
    while in_flight(server) > 0 and time.time() < deadline:
        time.sleep(0.5)
    assert in_flight(server) == 0


def test_soak_many_streaming_clients_no_errors_no_leaks(server):
    """The soak of `make soak` (32 clients, 30 s, default engine), small: as many clients as the
    server admits, a few seconds."""
    from angelspec.bench.soak import soak

    r = soak(server["grpc"], server["metrics"], server["pid"], ["hello there", "def f(x):", "12 * 7 = ?"],
             clients=4, seconds=6, max_tokens=24)
    assert r["errors"] == [] and r["requests"] >= 4 and r["in_flight_after"] == 0, r
    assert r["rss_end_mb"] < 1.25 * r["rss_mid_mb"], r
