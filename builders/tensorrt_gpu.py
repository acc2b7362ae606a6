"""`make tensorrt-engines`: on a host with an NVIDIA GPU, TensorRT and Edge-LLM's plugin library,
build TensorRT engines from <engine>/tensorrt/ and decode one prompt with them, comparing the
tokens with the CPU engine's (the reference file `angelspec verify-export` wrote).

It first checks and names what is missing: the `tensorrt` Python module and its libnvinfer, the
ONNX parser, a GPU (name, compute capability), nvcc (only needed to build Edge-LLM's plugins
from source), and Edge-LLM's plugin library for this GPU (its wheel ships sm80/86/100/120 only;
elsewhere, e.g. an H200 (sm_90), point EDGELLM_PLUGIN_PATH at a library built from
TensorRT-Edge-LLM's sources). Our own plugins register through plugins/tensorrt_plugins.py.

The engines are built with TensorRT's ONNX parser (one per graph: target, dfly, dcut; float16
allowed), then the decode runs builders/verify_export.py's loop with TensorRT execution contexts
in place of ONNX Runtime sessions. NOT RUN ON THESE MACHINES (no GPU, no libnvinfer); see
docs/tensorrt.md for what was run where.

    .venv-export/bin/python -m angelspec.builders.tensorrt_gpu --engine engines/default \\
        --reference build/verify-export/reference.json
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np

from angelspec.builders import verify_export

# dynamic dimensions of the exported graphs: (min, opt, max) for the build's optimisation profile
DIMS = {"physical_tokens": (1, 16, 2048), "delta_tokens": (1, 16, 2048), "num_sequences": (1, 1, 1),
        "num_sequences + 1": (2, 2, 2), "num_pages": (1, 16, 64), "max_pages_per_seq": (1, 16, 64),
        "execution_phase_extent": (1, 2, 8), "num_context_sequences": (1, 1, 1), "logits_rows": (1, 16, 2048),
        "packed_mask_width": (1, 1, 64), "draft_tokens": (1, 8, 64), "cost_points": (1, 16, 64)}


def check() -> dict:
    """What this host has, and what is missing (named)."""
    found, missing = {}, []
    try:
        import tensorrt as trt

        found["tensorrt"] = trt.__version__
        trt.Builder(trt.Logger(trt.Logger.ERROR))  # loads libnvinfer
        found["onnx_parser"] = hasattr(trt, "OnnxParser")
        import tensorrt.plugin  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any failure here is a missing piece, reported)
        missing.append(f"TensorRT (python module, libnvinfer, tensorrt.plugin): {exc}")
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True)
        found["gpu"] = q.stdout.strip() or q.stderr.strip()
    else:
        missing.append("an NVIDIA GPU (nvidia-smi not found)")
    found["nvcc"] = shutil.which("nvcc")  # only to build Edge-LLM's plugins from source
    plugin = os.environ.get("EDGELLM_PLUGIN_PATH")
    if not plugin:
        try:
            from tensorrt_edgellm._native.load import resolve_payload

            plugin = str(resolve_payload().plugin)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"Edge-LLM's plugin library for this GPU ({exc}); build it from TensorRT-Edge-LLM's "
                           "sources (needs nvcc) and set EDGELLM_PLUGIN_PATH")
    found["edgellm_plugin"] = plugin
    try:
        import torch

        found["torch_cuda"] = torch.cuda.is_available()
        if not torch.cuda.is_available():
            missing.append("CUDA in torch (the plugins' JIT implementations run torch on the GPU)")
    except ImportError:
        missing.append("torch")
    return {"found": found, "missing": missing}


def _profile_dims(onnx_path: pathlib.Path) -> dict:
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}


def build_engine(onnx_path: pathlib.Path, out: pathlib.Path, log=print) -> pathlib.Path:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, dims in _profile_dims(onnx_path).items():
        lo, opt, hi = ([DIMS.get(d, (d, d, d))[k] if isinstance(d, str) else d for d in dims] for k in range(3))
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError(f"TensorRT could not build {onnx_path}")
    out.write_bytes(bytes(blob))
    log(f"built {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return out


class TrtSession:
    """A TensorRT engine behind ONNX Runtime's `run(None, feed)` / `get_inputs()` interface, so
    verify_export's decode loop drives it unchanged."""

    def __init__(self, path: pathlib.Path):
        import tensorrt as trt
        import torch

        self.trt, self.torch = trt, torch
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(path.read_bytes())
        self.ctx = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = self.engine.get_tensor_mode
        self.inputs = [n for n in names if mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if mode(n) == trt.TensorIOMode.OUTPUT]

    def get_inputs(self):
        return [SimpleNamespace(name=n) for n in self.inputs]

    def run(self, _, feed: dict) -> list[np.ndarray]:
        torch, trt = self.torch, self.trt
        bufs = {}
        for n in self.inputs:
            t = torch.from_numpy(np.ascontiguousarray(feed[n])).cuda()
            self.ctx.set_input_shape(n, tuple(t.shape))
            self.ctx.set_tensor_address(n, t.data_ptr())
            bufs[n] = t
        for n in self.outputs:
            dtype = torch.from_numpy(np.zeros(0, trt.nptype(self.engine.get_tensor_dtype(n)))).dtype
            alias = getattr(self.engine, "get_aliased_input_tensor", lambda _: None)(n)
            t = bufs[alias] if alias else torch.empty(tuple(self.ctx.get_tensor_shape(n)), dtype=dtype, device="cuda")
            self.ctx.set_tensor_address(n, t.data_ptr())
            bufs[n] = t
        stream = torch.cuda.current_stream()
        if not self.ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return [bufs[n].cpu().numpy() for n in self.outputs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", default="engines/default")
    p.add_argument("--reference", default="build/verify-export/reference.json",
                   help="prompts and the CPU engine's tokens (angelspec verify-export)")
    p.add_argument("--check-only", action="store_true", help="only report what this host has and lacks")
    args = p.parse_args(argv)
    state = check()
    print(json.dumps(state, indent=1))
    if state["missing"] or args.check_only:
        return 1 if state["missing"] else 0
    import tensorrt as trt

    ctypes.CDLL(state["found"]["edgellm_plugin"], mode=ctypes.RTLD_GLOBAL)  # Edge-LLM's plugins
    trt.init_libnvinfer_plugins(trt.Logger(trt.Logger.WARNING), "")
    importlib.import_module("angelspec.builders.tensorrt_plugins")  # registers ours (imports TensorRT: only now)

    folder = pathlib.Path(args.engine) / "tensorrt"
    info = json.loads((folder / "export.json").read_text())
    (folder / "engines").mkdir(exist_ok=True)
    plans = {name: build_engine(folder / rel, folder / "engines" / f"{name}.plan")
             for name, rel in info["graphs"].items()}
    dec = verify_export.Decoder(folder, sessions={name: TrtSession(plan) for name, plan in plans.items()})
    ref = json.loads(pathlib.Path(args.reference).read_text())
    r = ref["prompts"][0]
    tokens, margins, (steps, acc) = dec.generate(r["ids"], ref["max_tokens"], set(ref["eos"]))
    verdict = verify_export.compare(r["tokens"], tokens, margins, 0.05)
    print(json.dumps({"tokens": len(tokens), "steps": steps, "accepted": acc, **verdict}))
    return 0 if verdict["equal"] or verdict["near_tie"] else 1


if __name__ == "__main__":
    sys.exit(main())
