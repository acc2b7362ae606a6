"""How the target's forward runs on this machine: the backend (eager PyTorch, or `inductor`:
torch.compile with the C++ ops kept opaque) and the dtype its matmul weights serve in. The build
measures and picks (builders/backend.py); engines, the data step and training apply the choice."""
from __future__ import annotations

import statistics
import time

import torch

from angelspec.model import Llama, Segment
from angelspec.plugins import amx_available, can_quantize, quantize
from angelspec.plugins.linear import SCHEMES, WEIGHT_BITS, WITH_INT8_ACTIVATIONS
from angelspec.weights import bf16_exact, gives_back, served_as

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


WEIGHTS = ("auto", "exact", "float32", "bfloat16") + SCHEMES
LOADED = 16  # requests in flight for an engine's second measurement (choose_weights)


class DecodeStep:
    """A decoding step of `model`: one token for each of `requests` requests after `context` cached
    tokens each, the caches filled once; `ms` times it."""

    def __init__(self, model: Llama, context: int = 256, requests: int = 1):
        self.model, self.cache = model, model.new_cache(requests, context + 2)
        toks = torch.arange(context + 1) % model.cfg.vocab_size
        model.forward(toks[:context].repeat(requests), model.batch([Segment(r, 0, context) for r in range(requests)]),
                      self.cache, logit_rows=torch.arange(1, requests + 1) * context - 1)
        self.tokens = toks[context:].repeat(requests)
        self.step = model.batch([Segment(r, context, 1) for r in range(requests)])

    @torch.inference_mode()
    def ms(self, reps: int = 9, head: bool = True) -> float:
        """Median ms of `reps` steps; without `head`, of their layers alone (the eager forward,
        asked for no logits' rows)."""
        forward = self.model.forward if head else self.model.eager_forward
        rows = None if head else torch.zeros(0, dtype=torch.long)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            forward(self.tokens, self.step, self.cache, rows)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000


def decode_ms(model: Llama, context: int = 256, reps: int = 9, requests: int = 1) -> float:
    """Median ms of a decoding step: one token for each of `requests` requests, after `context`
    cached tokens each."""
    return DecodeStep(model, context, requests).ms(reps)


def choose_weights(model, asked: str = "auto", loaded: int = 0) -> dict:
    """How the engine's matmul weights serve. `exact`: as `auto`, among only the options that
    compute the checkpoint's own outputs (`own_outputs`: float32, bf16 values without AMX tiles,
    int8 / int4 that give its weights back; never w8a8 / w4a8 or AMX tiles, which round the
    activations). `auto`: the fastest of the options that keep the
    model, measured here (a decoding step each, in turns): float32; bfloat16 when this CPU has
    AMX-BF16 tiles (a float32 checkpoint's weights are then rounded to bf16, at most 2^-9
    relative, as any bf16 serving stack does), and without them when the checkpoint's weights
    are bf16 values (the float32 kernels then read them as bf16 and compute float32's numbers
    at half the bytes); int8 / int4 (weight-only, plugins.quantize) only
    when they give back the checkpoint's weights exactly, as for a checkpoint converted from such
    blocks (the default target), and then also w8a8 / w4a8 (those weights, each matmul's input
    rounded to int8 in blocks of 32 as llama.cpp rounds it: integer dot products). Otherwise
    int8 / int4 change the model's outputs more than bf16 does (`angelspec bench` reports how
    much), so that is the user's call: asked for by name. A step of LOADED requests is timed too
    and reported with the option that serves such a load fastest, when that is another one. A
    throughput job passes the requests it keeps in flight as `loaded` (the data step: 64): the
    step is timed at that load, and its fastest option chosen."""
    if asked not in WEIGHTS:
        raise ValueError(f"unknown weights {asked!r} ({', '.join(WEIGHTS)})")
    amx, bf16_values = amx_available(), bf16_exact(model)
    given_back = set()  # int8 / int4 that dequantize to exactly the checkpoint's weights
    if asked in ("auto", "exact"):
        own = asked == "exact"  # the checkpoint's own outputs only
        dtype = "bfloat16" if amx and not own else "float32"
        why = ("exact: only options that compute the checkpoint's own outputs" if own else
               "AMX-BF16 tiles on this CPU" if amx else "no AMX-BF16 tiles on this CPU")
        models = {dtype: model if dtype == "float32" else served_as(model, dtype)}
        if not amx and bf16_values:
            models["bfloat16"] = served_as(model, "bfloat16")
        w0 = model.layers[0]["down"]
        for scheme in ("int8", "int4"):  # one weight first: most checkpoints fail at once, cheaply
            if not (can_quantize(w0) and torch.equal(quantize(w0, scheme).dequantized(), w0)):
                continue
            q = served_as(model, scheme)
            if gives_back(model, q):
                twin = WITH_INT8_ACTIVATIONS[scheme]
                models[scheme] = q
                given_back |= {scheme, twin}
                if not own:
                    models[twin] = served_as(model, twin)
        if len(models) > 1:
            times = {w: [] for w in models}
            for _ in range(3):  # in turns: a slow phase of a noisy machine hits all alike
                for w, m in models.items():
                    times[w].append(decode_ms(m))
            measured = {w: round(statistics.median(t), 3) for w, t in times.items()}
            # the same under load: a step of LOADED requests (a ranking can turn, as bf16 on AMX
            # tiles against w4a8); an engine is chosen for batch 1, a throughput job for the load
            requests = loaded or LOADED
            under = {w: decode_ms(m, context=128, reps=3, requests=requests) for w, m in models.items()}
            at_one, under_load = min(measured, key=measured.get), min(under, key=under.get)
            dtype = under_load if loaded else at_one
            weight_only = sorted(w for w in given_back if w in WITH_INT8_ACTIVATIONS)
            if "bfloat16" in models and not amx:
                weight_only.insert(0, "bfloat16")
            verb = "gives" if len(weight_only) == 1 else "give"
            why += (f"; {' and '.join(weight_only)} {verb} back the checkpoint's weights exactly; "
                    "a decoding step measured here: " +
                    ", ".join(f"{w} {ms:.2f} ms" for w, ms in measured.items()) + f"; {at_one} the fastest"
                    f"; a step of {requests} requests: " +
                    ", ".join(f"{w} {ms:.1f} ms" for w, ms in under.items()) +
                    ("" if under_load == at_one else
                     f"; {under_load} the fastest under load, chosen for throughput" if loaded else
                     f" (for throughput at {requests} in flight, --weights {under_load})"))
    else:
        dtype, why = asked, "asked for"
        if dtype in SCHEMES and gives_back(model, served_as(model, dtype)):
            given_back.add(dtype)
    if dtype == "bfloat16":
        why += ("; the checkpoint's weights are bf16 values (nothing rounded)" if bf16_values else
                "; the checkpoint's float32 weights rounded to bf16")
        why += ("; multiplied on the AMX tiles, each matmul's input rounded to bf16" if amx else
                "; widened to float32 by the float32 kernels as they are read (no AMX-BF16 tiles "
                "here), activations float32")
    if dtype in SCHEMES:
        why += ("; weights rounded to nearest in groups of 32: " +
                ("a scale each (Q8_0)" if WEIGHT_BITS[dtype] == 8 else
                 "a scale and a minimum each (Q4_1), the logits' matmul int8") +
                ("; activations float32 (weight-only)" if dtype in WITH_INT8_ACTIVATIONS else
                 "; each matmul's input rounded to int8 in blocks of 32, integer dot products"))
    exact = dtype == "float32" or (dtype == "bfloat16" and bf16_values) or dtype in given_back
    rounds = dtype in WITH_INT8_ACTIVATIONS.values() or (dtype == "bfloat16" and amx)
    return {"dtype": dtype, "asked": asked, "why": why, "checkpoint_is_bf16": bf16_values, "exact": exact,
            "own_outputs": exact and not rounds, "amx_tiles": dtype == "bfloat16" and amx}


@torch.inference_mode()
def fidelity(reference: Llama, served: Llama, sequences: list[list[int]]) -> dict:
    """What serving `served` instead of the float32 `reference` costs in quality, teacher-forced
    over `sequences` (text neither was tuned on): how often their top-1 next tokens agree, and
    each one's perplexity of the sequences' own next tokens."""
    agree = total = 0
    nll = {"reference": 0.0, "served": 0.0}
    for seq in sequences:
        x = torch.tensor(seq)
        rows = torch.arange(len(seq) - 1)
        top, gold = [], x[1:]
        for name, m in (("reference", reference), ("served", served)):
            logits, _ = m.forward(x, m.batch([Segment(0, 0, len(seq))]), m.new_cache(1, len(seq) + 1),
                                  logit_rows=rows)
            logp = torch.log_softmax(logits.float(), -1)
            nll[name] -= float(logp.gather(1, gold[:, None]).sum())
            top.append(logits.argmax(-1))
        agree += int((top[0] == top[1]).sum())
        total += len(seq) - 1
    ppl = {k: round(float(torch.exp(torch.tensor(v / max(total, 1)))), 3) for k, v in nll.items()}
    return {"tokens": total, "top1_agreement": round(agree / max(total, 1), 4),
            "perplexity_float32": ppl["reference"], "perplexity_served": ppl["served"]}

