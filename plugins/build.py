"""Compile and load the C++ ops (once per machine and torch version)."""
import os
import pathlib

import torch

CSRC = pathlib.Path(__file__).with_name("csrc")
_loaded = False


def build_dir() -> pathlib.Path:
    root = os.environ.get("ANGELSPEC_EXT_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "angelspec", "ext")
    path = pathlib.Path(root) / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_kernels() -> None:
    """Build (if needed) and load the shared library that registers `torch.ops.angelspec.*`."""
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load

    try:
        load(name="angelspec_kernels", sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir()), is_python_module=False, verbose=False)
    except Exception as exc:  # the message of a failed compile is long; say what to do first
        raise RuntimeError(
            "could not build AngelSpec's C++ kernels (needs g++ with AVX2/FMA and ninja); "
            f"build folder: {build_dir()}\n{exc}") from exc
    _loaded = True
