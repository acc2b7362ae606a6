"""Triton Inference Server from the repo: install the server shipped in `nvidia-pytriton==0.7.0`
into a project folder, start `tritonserver` on loopback and wait until it is ready, stop it, read
its metrics. Nothing here assumes a GPU, and nothing here imports torch (`angelspec stop` is
quick)."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request


def pytriton_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        raise FileNotFoundError("nvidia-pytriton is not installed: pip install nvidia-pytriton==0.7.0 "
                                "(it ships the tritonserver binary and the Python backend)")
    return pathlib.Path(spec.submodule_search_locations[0])


def install(dest: str | pathlib.Path = "build/triton") -> pathlib.Path:
    """Copy tritonserver, the Python backend and this Python's backend stub into `dest` (once)."""
    dest = pathlib.Path(dest)
    if (dest / "bin" / "tritonserver").exists():
        return dest
    src = pytriton_dir() / "tritonserver"
    for part in ("bin", "backends", "caches"):
        if (src / part).exists():
            shutil.copytree(src / part, dest / part, dirs_exist_ok=True)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(src / "python_backend_stubs" / py / "triton_python_backend_stub",
                 dest / "backends" / "python" / "triton_python_backend_stub")
    (dest / "caches").mkdir(exist_ok=True)
    return dest


def environment(server: pathlib.Path) -> dict:
    """LD_LIBRARY_PATH with the wheel's libraries and this Python's libpython; the venv's bin/
    first on PATH (the backend stub finds packages through the `python3` there)."""
    env = dict(os.environ)
    libs = [str(pytriton_dir().parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = str(pathlib.Path(sys.executable).parent) + ":" + env.get("PATH", "")
    return env


def start(repo: str | pathlib.Path, server: str | pathlib.Path = "build/triton", http_port: int = 8000,
          grpc_port: int = 8001, metrics_port: int = 8002, log: str | pathlib.Path | None = None,
          timeout: float = 300.0, record: bool = True) -> subprocess.Popen:
    """Start tritonserver on 127.0.0.1 and wait for /v2/health/ready (or fail with its log).
    `record`: note it in <server>/server.json for `stop` (the server of `angelspec serve`)."""
    server = install(server)
    log = pathlib.Path(log or pathlib.Path(server) / "server.log")
    cmd = [str(server / "bin" / "tritonserver"), "--model-repository", str(pathlib.Path(repo).resolve()),
           "--backend-directory", str(server / "backends"), "--cache-directory", str(server / "caches"),
           "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
           "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--metrics-port", str(metrics_port), "--allow-metrics", "true", "--log-verbose", "0"]
    proc = _launch(cmd, log, environment(server), f"http://127.0.0.1:{http_port}/v2/health/ready",
                   "tritonserver", timeout)
    if record:
        (server / "server.json").write_text(json.dumps(
            {"pid": proc.pid, "http": http_port, "grpc": grpc_port, "metrics": metrics_port}))
    return proc


def _launch(cmd: list[str], log: pathlib.Path, env: dict | None, ready_url: str, what: str,
            timeout: float) -> subprocess.Popen:
    """Start `cmd` in a session of its own, its output in `log`, and wait until `ready_url`
    answers 200; fail with the log's tail if it exits or is not ready within `timeout` s."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); log {log}:\n" + log.read_text()[-4000:])
        try:
            if urllib.request.urlopen(ready_url, timeout=2).status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    _end(proc.pid)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s; log {log}:\n" + log.read_text()[-4000:])


def start_openai(grpc_port: int, port: int, models: list[str], server: str | pathlib.Path = "build/triton",
                 host: str = "127.0.0.1", log: str | pathlib.Path | None = None, timeout: float = 60.0,
                 record: bool = True, request_timeout: float = 0.0) -> subprocess.Popen:
    """Start the OpenAI-compatible frontend (angelspec.serving.openai_api) in front of the
    tritonserver on `grpc_port` and wait until its /health answers 200. `record`: note it in
    <server>/server.json beside the server, for `stop`. `request_timeout`: seconds before a
    request ends with 504 (0: the server's own limit)."""
    log = pathlib.Path(log or pathlib.Path(server) / "openai.log")
    cmd = [sys.executable, "-m", "angelspec.serving.openai_api", "--grpc-url", f"127.0.0.1:{grpc_port}",
           "--host", host, "--port", str(port), "--timeout", str(request_timeout)]
    cmd += [a for m in models for a in ("--model", m)]
    proc = _launch(cmd, log, None, f"http://127.0.0.1:{port}/health", "the OpenAI frontend", timeout)
    info = pathlib.Path(server) / "server.json"
    if record and info.exists():
        info.write_text(json.dumps({**json.loads(info.read_text()), "openai_pid": proc.pid, "openai": port}))
    return proc


def _end(pid: int) -> bool:
    """SIGTERM the process group of `pid`; once `pid` has exited (or after 10 s) SIGKILL what is
    left of the group (a backend stub can outlive its server); False if it was gone."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def shutdown(proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    """End a process `start` or `start_openai` started (record=False) and everything in its
    process group: tritonserver's Python backend stubs can outlive it, still decoding."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop(server: str | pathlib.Path = "build/triton") -> bool:
    """Stop the server `start` recorded, and its OpenAI frontend first; True if one was running."""
    info = pathlib.Path(server) / "server.json"
    if not info.exists():
        return False
    rec = json.loads(info.read_text())
    info.unlink()
    if rec.get("openai_pid"):
        _end(rec["openai_pid"])
    return _end(rec["pid"])


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started by tests and load tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metrics(metrics_port: int) -> dict[str, float]:
    """The server's Prometheus metrics: name -> value, summed over labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def server_counters(metrics_port: int) -> dict[str, float]:
    """The engine's own counters from the metrics port: steps, step time, drafted, accepted."""
    m = metrics(metrics_port)
    return {"steps": m.get("angelspec_steps_total", 0.0), "step_s": m.get("angelspec_step_seconds_total", 0.0),
            "drafted": m.get("angelspec_draft_tokens_total", 0.0),
            "accepted": m.get("angelspec_accepted_tokens_total", 0.0)}
