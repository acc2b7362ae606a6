"""The kernels are compiled at install time (setup.py). A build that is killed half-way leaves
nothing that stops or fools the next one: the kernels refuse to load with a message that says
what to run, and the next build starts afresh, finishes, and its kernels load and compute.
Runs on a copy of the build files, so the installed kernels are never touched."""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = textwrap.dedent("""
    import importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("kb", "plugins/build.py")
    kb = importlib.util.module_from_spec(spec); spec.loader.exec_module(kb)
    try:
        kb.load_kernels()
    except RuntimeError as exc:
        print("REFUSED", exc); sys.exit(3)
    x, w = torch.randn(3, 64), torch.randn(64)
    ref = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
    print("OK" if torch.allclose(torch.ops.angelspec.rms_norm(x, w, 1e-6), ref, atol=1e-5) else "WRONG")
""")


def build(repo: pathlib.Path, tmp: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=repo,
                            env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def check(repo: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK], cwd=repo, capture_output=True, text=True)


def test_killed_build_then_the_next_build_works(tmp_path):
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    tmp.mkdir()
    shutil.copytree(ROOT / "plugins", repo / "plugins",
                    ignore=shutil.ignore_patterns("_kernels*", "__pycache__"))
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / f, repo / f)

    proc = build(repo, tmp)
    deadline = time.time() + 300
    while not list(tmp.rglob("*.o")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)  # half-way: the first object file is written, the others are compiling
    assert proc.poll() is None, f"the build ended before it could be killed:\n{proc.stdout.read()}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    refused = check(repo)
    assert refused.returncode == 3 and "make setup" in refused.stdout, refused.stdout + refused.stderr

    proc = build(repo, tmp)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    done = check(repo)
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


def test_kernels_built_from_other_sources_are_refused(tmp_path):
    """An edited source with the old library: a clear message, never stale kernels."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "plugins", repo / "plugins", ignore=shutil.ignore_patterns("__pycache__"))
    src = repo / "plugins" / "csrc" / "elementwise.cpp"
    src.write_text(src.read_text() + "\n// edited\n")
    out = check(repo)
    assert out.returncode == 3 and "built from other sources" in out.stdout, out.stdout + out.stderr
