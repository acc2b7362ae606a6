"""The C++ kernels: compiled once when AngelSpec is installed (`make setup`, or
`pip install --no-build-isolation -e .`, through setup.py and torch's BuildExtension), loaded at
import. No command compiles at run time.

A build writes a stamp (the hash of the sources it compiled) beside the library only after the
library is in place, and removes it before it starts, so an interrupted build never passes for a
finished one: the next import says to build again, and the next build starts afresh."""
from __future__ import annotations

import hashlib
import importlib.machinery
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
CSRC = HERE / "csrc"
NAME = "_kernels"
STAMP = HERE / f"{NAME}.stamp"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
_loaded = False


def sources() -> list[pathlib.Path]:
    return sorted(CSRC.glob("*.cpp"))


def sources_hash() -> str:
    """What the library must have been built from: every source and header, and the flags."""
    h = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for f in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def library() -> pathlib.Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (HERE / (NAME + suffix)).exists():
            return HERE / (NAME + suffix)
    return None


def load_kernels() -> None:
    """Load the library that registers `torch.ops.angelspec.*` (built at install time)."""
    global _loaded
    if _loaded:
        return
    import torch

    lib = library()
    stamp = STAMP.read_text().strip() if STAMP.exists() else None
    if lib is None or stamp is None:
        raise RuntimeError(
            "AngelSpec's C++ kernels are not built (or their build was interrupted): run "
            "`make setup`, or `pip install --no-build-isolation -e .` (needs g++ and a CPU with AVX2/FMA)")
    if stamp != sources_hash():
        raise RuntimeError(
            f"AngelSpec's C++ kernels in {lib.name} were built from other sources than "
            f"{CSRC}: rebuild them with `make setup` (or `pip install --no-build-isolation -e .`)")
    torch.ops.load_library(str(lib))
    _loaded = True
