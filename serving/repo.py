"""The model repository for an engine: the templates in model_repo/ (never modified) filled in
for one engine folder, which is verified first."""
from __future__ import annotations

import json
import pathlib
import shutil
import string

from angelspec import DEFAULT_MAX_LEN
from angelspec.runtime.manifest import read_manifest

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "model_repo"
MODELS = ("ensemble",)


def write_repo(engine: str | pathlib.Path, out: str | pathlib.Path = "build/model_repo",
               max_batch: int = 8, max_queue: int = 32, request_timeout_s: float = 300.0,
               decoupled: bool = True, dcut: bool | None = None,
               max_len: int = DEFAULT_MAX_LEN) -> pathlib.Path:
    """Fill the templates in model_repo/ (never modified) into `out` for `engine`, verified
    first (every file's checksum: a broken engine is refused here, not after the server
    started); `dcut` None keeps the engine's own setting, False serves fixed draft lengths.
    `max_len`: the context (prompt + output tokens) of each request slot."""
    engine = pathlib.Path(engine).resolve()
    read_manifest(engine, verify=True)
    out = pathlib.Path(out)
    values = {"max_batch_size": str(max_batch), "max_len": str(max_len),
              "max_queue": str(max_queue), "request_timeout_s": str(request_timeout_s),
              "decoupled_mode": "true" if decoupled else "false",
              "dcut": {None: "engine", True: "on", False: "off"}[dcut]}
    private = json.dumps({"engine_dir": str(engine)})  # beside the model, not in its config
    shutil.rmtree(out, ignore_errors=True)
    for model in MODELS:
        for f in (TEMPLATES / model).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                dst = out / f.relative_to(TEMPLATES)
                dst.parent.mkdir(parents=True, exist_ok=True)
                text = f.read_text()
                dst.write_text(string.Template(text).substitute(values) if f.suffix == ".pbtxt" else text)
        (out / model / "1").mkdir(parents=True, exist_ok=True)
        (out / model / "1" / "private.json").write_text(private)
    return out
