"""How the target's forward runs on this machine: the backend (eager PyTorch, or `inductor`:
torch.compile with the C++ ops kept opaque) and the dtype its matmul weights serve in. The build
measures and picks (builders/backend.py); engines, the data step and training apply the choice."""
from __future__ import annotations

import torch

from angelspec.model import Llama
from angelspec.plugins import amx_available

BACKENDS = ("eager", "inductor")


def use_backend(model: Llama, backend: str) -> None:
    """Run model.forward through `backend` from now on (`eager` restores the plain forward).
    Compiled, only decoding and verification forwards go through the compiled graph (Llama.forward
    says which); prompt prefill stays eager, so a compiled engine computes what the eager one
    does."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    model.backend = backend
    model.compiled = None if backend == "eager" else torch.compile(model.eager_forward, dynamic=True)


WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4")


def choose_weights(model, asked: str = "auto") -> dict:
    """How the engine's matmul weights serve. `auto`: bfloat16 when this CPU has AMX-BF16 tiles (a
    float32 checkpoint's weights are then rounded to bf16, at most 2^-9 relative, as any bf16
    serving stack does), else float32. `int8` / `int4` (weight-only, plugins.quantize) only when
    asked: they change the model's outputs more than bf16 does (`angelspec bench` reports how
    much), so that is the user's call."""
    if asked not in WEIGHTS:
        raise ValueError(f"unknown weights {asked!r} ({', '.join(WEIGHTS)})")
    amx, exact = amx_available(), model.bf16_exact()
    if asked == "auto":
        dtype = "bfloat16" if amx else "float32"
        why = "AMX-BF16 tiles on this CPU" if amx else "no AMX-BF16 tiles on this CPU"
    else:
        dtype, why = asked, "asked for"
    if dtype == "bfloat16" and not amx:
        raise ValueError("bfloat16 weights need AMX-BF16 tiles, which this CPU does not offer")
    if dtype == "bfloat16":
        why += ("; the checkpoint's weights are bf16 values (nothing rounded)" if exact else
                "; the checkpoint's float32 weights rounded to bf16")
    if dtype in ("int8", "int4"):
        why += ("; weight-only, round to nearest in groups of 32: " +
                ("a scale each (Q8_0)" if dtype == "int8" else
                 "a scale and a minimum each (Q4_1), the logits' matmul int8"))
    return {"dtype": dtype, "asked": asked, "why": why, "checkpoint_is_bf16": exact}

