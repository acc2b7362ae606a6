"""An engine folder (`engines/<name>/`): what `angelspec build` writes and the runtime loads from
its manifest alone.

    engine.json            manifest: format, parts, drafter defaults, router, backend, D-cut
                           profile, machine fingerprint, torch version, SHA-256 of every file
    target/                the target checkpoint (config, weights, tokenizer)
    drafts/<kind>/         draft checkpoints (mtp, dfly, dflash) trained for that target
    router.safetensors     the domain classifier of `auto` routing

engine.json is written last, so a folder without it is a build that did not finish.
"""
from __future__ import annotations

import pathlib
import sys

from safetensors.torch import load_file

from angelspec import DEFAULT_MAX_LEN
from angelspec.checkpoint import load_target
from angelspec.model import KV_CACHES
from angelspec.plugins import amx_available
from angelspec.plugins.linear import SCHEMES
from angelspec.runtime.backend import use_backend
from angelspec.runtime.cost import CostTable, fingerprint, profile
from angelspec.runtime.engine import Engine
from angelspec.runtime.manifest import EngineError, read_manifest
from angelspec.runtime.router import DomainClassifier, Router
from angelspec.weights import pack_bf16, serve


def load_engine(path: str | pathlib.Path, max_batch: int = 8, max_len: int = DEFAULT_MAX_LEN,
                dcut: bool | None = None, verify: bool = True, target=None, weights: str | None = None):
    """An Engine serving the folder's target, drafts, router, backend and D-cut profile. The cost
    table is re-profiled when this machine's fingerprint (kernels included) differs from the build's.
    `target`: the folder's target, if the caller has already loaded it (<path>/target).
    `weights`: "float32" serves the checkpoint's own weights instead of the manifest's (the
    reference of `angelspec verify-export`, whose export carries them); the build's D-cut cost
    table is then kept as it is."""
    path = pathlib.Path(path)
    manifest = read_manifest(path, verify)
    if weights not in (None, "float32"):
        raise ValueError(f"load_engine: weights {weights!r}: only float32 (the checkpoint's own) overrides the build's")
    served = weights or manifest.weights.dtype
    if target is None:
        target = load_target(path / "target", max_len=max(max_len, 64))
    backend = manifest.backend.chosen
    if manifest.kv_cache not in KV_CACHES:
        raise EngineError(f"{path}: KV cache {manifest.kv_cache!r} unknown ({', '.join(KV_CACHES)}): "
                          "rebuild the engine")
    if weights is None:  # the checkpoint's own reference keeps float32 keys and values
        target.model.kv_dtype = KV_CACHES[manifest.kv_cache]
    if served in SCHEMES:
        serve(target.model, served)
    if served == "bfloat16":
        pack_bf16(target.model)
        if (manifest.weights.amx_tiles is not False) != amx_available():
            print("angelspec: this engine's bf16 weights were multiplied "
                  f"{'on' if manifest.weights.amx_tiles is not False else 'without'} AMX-BF16 tiles "
                  f"where it was built, {'on' if amx_available() else 'without'} them here: "
                  "outputs can differ from the build machine's", file=sys.stderr)
    if backend != "eager":  # before any re-profiling: the profile measures the served forward
        use_backend(target.model, backend)
    cost = CostTable.from_json(manifest.dcut.profile)
    here = fingerprint(backend, target.model.weights)
    if cost.fingerprint != here and weights is None:
        changed = {k: (cost.fingerprint.get(k), v) for k, v in here.items() if cost.fingerprint.get(k) != v}
        print(f"angelspec: this machine or its kernels differ from the build's ({changed}); "
              "re-profiling the verification cost for D-cut", file=sys.stderr)
        cost = profile(target.model, max_tokens=cost.n[-1], backend=backend)
    router = None
    if manifest.router:
        r = manifest.router
        state = load_file(str(path / r["classifier"]))
        router = Router(DomainClassifier(state["log_prior"], state["log_prob"], r["domains"]),
                        r["routes"], tuple(r["candidates"]), shadow_every=r["shadow_every"],
                        min_obs=r["min_obs"], margin=r["margin"], max_every=r["max_every"],
                        budget=r["budget"], contenders=r.get("contenders"))
    engine = Engine(target, max_batch=max_batch, max_len=max_len, drafts=str(path / "drafts"),
                    dcut=manifest.defaults.dcut if dcut is None else dcut, cost=cost,
                    router=router, draft_lens={k: d.draft_len for k, d in manifest.drafters.items()
                                               if d.draft_len},
                    kinds=set(manifest.drafters) | {"none", "ngram"},
                    default_drafter=manifest.defaults.drafter, manifest=manifest,
                    prompt_prefix=target.chat_prefix())
    return engine
