"""The engine manifest (`engine.json`): the contract between `angelspec build`, which writes it,
and everything that serves an engine folder, which reads it. Written and read only here.

    format            FORMAT; a folder of another format is refused with "rebuild the engine"
    name, created     the folder's name and build time (UTC)
    target            what the drafts were checked against (TargetInfo)
    drafters          kind -> DraftSpec (mtp, dfly, dflash: trained; ngram: always)
    defaults          the drafter and D-cut setting a request gets when it names none
    router            `auto` routing's settings (Router.settings() + classifier), or None
    backend           the forward's backend and what the build measured (BackendChoice)
    weights           the matmul weights' dtype and why (WeightsChoice)
    dcut              D-cut's keep ratios and the verification cost profile C(n)
    fingerprint       the build machine (re-profiled where a loader's machine differs)
    exported          other formats written beside the engine (trtllm: their files)
    files             every other file of the folder -> its SHA-256 (written last)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import types
import typing
from dataclasses import dataclass, field

FORMAT = 2  # 2: drafters' `draft_len` (was max_draft_len)
MANIFEST = "engine.json"


class EngineError(ValueError):
    """An engine folder that cannot be served: missing, partial, corrupted or of another format."""


@dataclass
class TargetInfo:
    path: str
    source: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokenizer_sha256: str


@dataclass
class DraftSpec:
    kind: str
    path: str | None = None  # its folder in the engine (ngram: only with a datastore)
    draft_len: int | None = None  # tokens it proposes per step (ngram, mtp: tuned by the build)
    target_layer_ids: list[int] | None = None  # trained drafts: the target layers they read
    draft_vocab: int | None = None  # trained drafts: their reduced vocabulary
    tokens_per_s_by_draft_len: dict[str, float] | None = None  # ngram, mtp: the build's tuning
    # mtp: a domain's own length where it beat the overall one there (auto routes it that way)
    draft_len_by_domain: dict[str, int] | None = None


@dataclass
class Defaults:
    drafter: str
    dcut: bool


@dataclass
class BackendChoice:
    chosen: str
    min_gain: float
    measured: dict
    why_eager: str | None = None


@dataclass
class WeightsChoice:
    dtype: str
    asked: str
    why: str
    checkpoint_is_bf16: bool
    exact: bool = False  # the served weights are the checkpoint's own values (float32, int8, int4,
    # and bf16 without AMX tiles: then also float32's numbers; bf16 on AMX tiles, w8a8 and w4a8
    # still round the activations entering each matmul)
    amx_tiles: bool | None = None  # bf16 multiplied on AMX tiles (None: built before the key,
    # when bf16 engines were built on AMX machines only)
    own_outputs: bool | None = None  # exact, and the activations float32 too: the checkpoint's
    # own outputs (None: built before the key)
    fidelity: dict | None = None  # against float32 where not own_outputs (runtime.backend.fidelity)


@dataclass
class DcutSpec:
    ratios: list[float]
    profile: dict  # CostTable.to_json()


@dataclass
class EngineManifest:
    name: str
    created: str
    target: TargetInfo
    drafters: dict[str, DraftSpec]
    defaults: Defaults
    router: dict | None
    backend: BackendChoice
    weights: WeightsChoice
    dcut: DcutSpec
    fingerprint: dict
    exported: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    format: int = FORMAT
    kv_cache: str = "float32"  # the KV cache's values (model.KV_CACHES)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data, where: str = MANIFEST) -> "EngineManifest":
        """Checked field by field: a missing, unknown or mistyped field is refused by name."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise EngineError(f"{where}: engine format {found!r}, this AngelSpec reads format "
                              f"{FORMAT}: rebuild the engine")
        if not isinstance(data.get("files"), dict):
            raise EngineError(f"{where}: no file list: rebuild the engine")
        return _load(cls, data, where)

    def write(self, folder: pathlib.Path) -> None:
        """List and hash every file of `folder`, then write the manifest (last: a folder without
        it is a build that did not finish)."""
        self.files = {str(f.relative_to(folder)): sha256(f) for f in sorted(folder.rglob("*"))
                      if f.is_file() and f.name != MANIFEST}
        (folder / MANIFEST).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _load(cls, data, where: str):
    """A dataclass from JSON, recursively, with every field checked."""
    if not isinstance(data, dict):
        raise EngineError(f"{where}: expected an object, got {type(data).__name__}: rebuild the engine")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in data
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    problems = [f"{what} fields {names}" for what, names in (("unknown", unknown), ("missing", missing))
                if names]
    if problems:
        raise EngineError(f"{where}: {'; '.join(problems)}: rebuild the engine")
    return cls(**{k: _value(hints[k], v, f"{where}: {k}") for k, v in data.items()})


def _value(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _load(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise EngineError(f"{where}: expected an object: rebuild the engine")
        return {k: _value(args[1], v, f"{where}.{k}") for k, v in value.items()} if args else value
    if origin is list:
        if not isinstance(value, list):
            raise EngineError(f"{where}: expected a list: rebuild the engine")
        return value
    expected = {int: int, float: (int, float), str: str, bool: bool}.get(hint)
    if expected is not None and (not isinstance(value, expected) or (hint is int and isinstance(value, bool))):
        raise EngineError(f"{where}: expected {hint.__name__}, got {type(value).__name__}: rebuild the engine")
    return value


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


def read_manifest(path: str | pathlib.Path, verify: bool = True) -> EngineManifest:
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
        data = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{mf}: not valid JSON ({exc})") from exc
    manifest = EngineManifest.from_json(data, str(mf))
    files = manifest.files
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
