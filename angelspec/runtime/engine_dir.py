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

import hashlib
import json
import pathlib
import sys

from safetensors.torch import load_file

from angelspec.checkpoint import load_target
from angelspec.plugins import amx_available
from angelspec.runtime.backend import use_backend
from angelspec.runtime.cost import CostTable, fingerprint, profile
from angelspec.runtime.engine import Engine
from angelspec.runtime.router import DomainClassifier, Router

FORMAT = 1
MANIFEST = "engine.json"


class EngineError(ValueError):
    """An engine folder that cannot be served: missing, partial, corrupted or of another format."""


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _inside(path: pathlib.Path, name: object) -> bool:
    """Whether manifest entry `name` is a plain relative path to a regular file inside `path`
    (no `..`, no absolute path, no link leading out)."""
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "\\" in name:
        return False
    parts = pathlib.PurePosixPath(name).parts
    if ".." in parts or "." in parts:
        return False
    root = path.resolve()
    return (path / name).resolve().is_relative_to(root)


def read_manifest(path: str | pathlib.Path, verify: bool = True) -> dict:
    """The manifest of an engine folder. Every entry must name a file inside the folder; with
    `verify`, every file in the folder must be listed (the loader reads nothing unverified) and
    every listed file's SHA-256 must match. Errors name entries, never what lies outside."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: no such engine folder (build one with `angelspec build`)")
    mf = path / MANIFEST
    if not mf.exists():
        raise EngineError(f"{path}: no {MANIFEST}: not an engine, or its build did not finish "
                          "(rerun `angelspec build`)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{mf}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise EngineError(f"{mf}: engine format {found!r}, this AngelSpec reads "
                          f"format {FORMAT}: rebuild the engine")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise EngineError(f"{mf}: no file list: rebuild the engine")
    outside = [i for i, name in enumerate(files) if not _inside(path, name)]
    if outside:
        raise EngineError(f"{mf}: entries {outside[:5]} of its file list are not paths inside the "
                          "engine folder: refused (rebuild the engine)")
    if verify:
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise EngineError(f"{path}: incomplete engine, missing {', '.join(missing)}")
        unlisted = sorted(str(f.relative_to(path)) for f in path.rglob("*")
                          if (f.is_file() or f.is_symlink()) and f.name != MANIFEST
                          and str(f.relative_to(path)) not in files)
        if unlisted:
            raise EngineError(f"{path}: files not in the manifest: {', '.join(unlisted[:5])} "
                              "(an engine serves only files it verifies: rebuild it)")
        bad = [f for f, digest in files.items() if sha256(path / f) != digest]
        if bad:
            raise EngineError(f"{path}: corrupted engine, checksum mismatch in {', '.join(bad)} "
                              "(rebuild it with `angelspec build`)")
    return manifest


def load_engine(path: str | pathlib.Path, max_batch: int = 8, max_len: int = 2048,
                dcut: bool | None = None, verify: bool = True, target=None):
    """An Engine serving the folder's target, drafts, router, backend and D-cut profile. The cost
    table is re-profiled when this machine's fingerprint differs from the build machine's.
    `target`: the folder's target, if the caller has already loaded it (<path>/target)."""
    path = pathlib.Path(path)
    manifest = read_manifest(path, verify)
    if target is None:
        target = load_target(path / "target", max_len=max(max_len, 64))
    backend = manifest["backend"]["chosen"]
    if manifest.get("weights", {}).get("dtype") == "bfloat16":
        if amx_available():
            target.model.pack_bf16()
        else:
            print("angelspec: this CPU has no AMX-BF16 tiles; serving the engine's weights as "
                  "float32 (outputs can differ from the build machine's)", file=sys.stderr)
    if backend != "eager":  # before any re-profiling: the profile measures the served forward
        use_backend(target.model, backend)
    cost = CostTable.from_json(manifest["dcut"]["profile"])
    here = fingerprint(backend, target.model.weights)
    if cost.fingerprint != here:
        changed = {k: (cost.fingerprint.get(k), v) for k, v in here.items() if cost.fingerprint.get(k) != v}
        print(f"angelspec: this machine differs from the build machine ({changed}); "
              "re-profiling the verification cost for D-cut", file=sys.stderr)
        cost = profile(target.model, max_tokens=cost.n[-1], backend=backend)
    router = None
    if manifest.get("router"):
        r = manifest["router"]
        state = load_file(str(path / r["classifier"]))
        router = Router(DomainClassifier(state["log_prior"], state["log_prob"], r["domains"]),
                        r["routes"], tuple(r["candidates"]), shadow_every=r["shadow_every"],
                        min_obs=r["min_obs"], margin=r["margin"], max_every=r["max_every"],
                        budget=r["budget"], contenders=r.get("contenders"))
    engine = Engine(target, max_batch=max_batch, max_len=max_len, drafts=str(path / "drafts"),
                    dcut=manifest["defaults"]["dcut"] if dcut is None else dcut, cost=cost,
                    router=router, draft_lens={k: d["max_draft_len"]
                                               for k, d in manifest["drafters"].items()},
                    kinds=set(manifest["drafters"]) | {"none", "ngram"})
    engine.manifest = manifest
    engine.default_drafter = manifest["defaults"]["drafter"]
    return engine
