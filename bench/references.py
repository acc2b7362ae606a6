"""The runners bench times beside this engine's drafters, greedy, with no drafts and no accept
length: transformers `generate()` on the checkpoint (HFRunner), the same target's float32
weights (Float32Runner), and the native peers (peers.py) on the GGUF the target comes from or
one bench writes (gguf_of). open_references starts the ones asked for."""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time

import torch

from angelspec.bench.peers import PEERS, make_peer
from angelspec.bench.runs import Run, run_engine_chunk
from angelspec.builders.gguf import FORMATS, write_gguf
from angelspec.checkpoint import Target, load_target
from angelspec.default_target import gguf_folder
from angelspec.runtime import Engine

# timed beside ours, greedy: outside runtimes, and our float32 weights; no drafts, no accept length
REFERENCES = ("hf", "float32", *PEERS)
OTHER_NUMERICS = ("float32", *PEERS)  # their greedy text is compared with ar's, not required to match


class HFRunner:
    """transformers `generate()` (greedy, batch 1) on the same checkpoint: the outside reference."""

    def __init__(self, target: Target):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target.path),
                                                          dtype=torch.float32).eval()
        self.eos = target.eos_ids or None

    def __call__(self, run: Run, ids: list[list[int]], chunk: list[int], domain: str,
                 max_tokens: int, ignore_eos: bool = False) -> None:
        eos = None if ignore_eos else self.eos
        for i in chunk:
            x = torch.tensor([ids[i]])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=torch.ones_like(x),
                                          max_new_tokens=max_tokens, do_sample=False,
                                          eos_token_id=eos,
                                          pad_token_id=self.eos[0] if self.eos else 0)
            run.outputs[i] = out[0, x.shape[1]:].tolist()
            run.add(domain, time.perf_counter() - t0, 0.0, len(run.outputs[i]))


class Float32Runner:
    """The same target with float32 weights, decoding autoregressively with as many requests in
    flight as the engine (eager, this engine's kernels): what the engine's served weights (bf16,
    int8 / int4, w8a8 / w4a8) gain over float32 on this machine."""

    def __init__(self, target: Target, batch_size: int, max_len: int):
        ref = target if target.model.weights == "float32" else load_target(target.path, max_len=max_len)
        self.engine = Engine(ref, max_batch=batch_size, max_len=max_len)
        run_engine_chunk(self.engine, Run("ar", 1), [[1, 2, 3]], [0], "warm-up", 8)

    def __call__(self, run: Run, ids: list[list[int]], chunk: list[int], domain: str,
                 max_tokens: int, ignore_eos: bool = False) -> None:
        run_engine_chunk(self.engine, run, ids, chunk, domain, max_tokens, drafter="ar",
                         ignore_eos=ignore_eos)


GGUF_DIR = pathlib.Path("build/gguf")  # GGUFs bench writes for targets not converted from one


def gguf_of(target: Target) -> pathlib.Path:
    """The GGUF a converted target came from (angelspec_source.json: the default target's), or
    else the target written as one (builders/gguf.py) in the format of the weights its engine
    serves, once, under build/gguf/ (keyed by the checkpoint's path, files and weights)."""
    src = target.path / "angelspec_source.json"
    name = json.loads(src.read_text()).get("gguf") if src.exists() else None
    if name:  # the default target's lies in its package; a synthetic target's in its folder
        return target.path / name if (target.path / name).exists() else gguf_folder() / name
    weights = target.model.weights
    files = sorted(target.path.glob("*.safetensors")) + sorted(target.path.glob("*.json"))
    key = hashlib.sha256(str(target.path.resolve()).encode())
    for f in files:
        key.update(f"{f.name} {f.stat().st_size} {f.stat().st_mtime_ns}".encode())
    out = GGUF_DIR / f"{target.path.resolve().name}-{key.hexdigest()[:12]}-{weights}.gguf"
    if not out.exists():
        print(f"angelspec bench: writing {out} for llama.cpp ({weights} weights as "
              f"{FORMATS.get(weights, ('?',))[0].name})", file=sys.stderr)
        write_gguf(target, weights, out)
    return out


def open_references(names: list[str], target: Target, batch_size: int, max_len: int) -> dict:
    """The runner of each of REFERENCES among `names`, by name, ready to time (`close()` where
    it has one frees it)."""
    return {d: HFRunner(target) if d == "hf" else Float32Runner(target, batch_size, max_len)
            if d == "float32" else make_peer(d, gguf_of(target), torch.get_num_threads(), batch_size, max_len)
            for d in names if d in REFERENCES}
