"""`make export-tensorrt` / `angelspec build --export tensorrt`: an engine folder as ONNX graphs
TensorRT builds, in TensorRT Edge-LLM's layout, with our plugin ops (docs/tensorrt.md).

Writes <engine>/tensorrt/:
- target/llm/: the target through Edge-LLM's own exporter (`tensorrt-edgellm-export`): 30
  `AttentionPlugin` nodes over a paged KV cache; with a DFly or DFlash draft in the engine it is
  exported as a DFlash base (tree-mode attention for verification, and a `hidden_states` output
  of the target layers the drafts read). Also embedding.safetensors, tokenizer, config.
- dfly/, dflash/: each draft in the cached-DFlash contract (builders/tensorrt_drafts.py).
- dcut/model.onnx: D-cut's selection as one `angelspec::DcutSelectPlugin` node, with the
  engine's measured cost curve as default inputs (a runtime re-profiling feeds its own).
- export.json: what was written, from what, and what was not exported and why.
MTP is not exported: Edge-LLM reads MTP only from checkpoints that carry their own `mtp.*`
layers (DeepSeek-V3 / Qwen3-Next families), never beside a Llama target. ngram needs no graph.

Runs in the export environment (`make export-env`: Edge-LLM's pinned torch/transformers/numpy
stack, which serving's numpy<2 cannot share); reads the engine folder only.

    .venv-export/bin/python -m angelspec.builders.tensorrt --engine engines/default
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tensorrt_edgellm.onnx.dynamo_translations import build_custom_translation_table

from angelspec.builders import onnx_ops
from angelspec.builders.tensorrt_drafts import contract, export_draft
from angelspec.drafters.draft_checkpoint import load_draft
from angelspec.runtime.manifest import read_manifest

DRAFTS = ("dfly", "dflash")
EDGELLM_VERSION = "0.11.0"


def mask_token_id(target_dir: pathlib.Path) -> int:
    """The id Edge-LLM's runtime would embed at MASK positions: the target's pad token, else
    its end-of-sequence token (our runtime uses the draft's learned mask embedding)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    ids = cfg.get("pad_token_id")
    ids = cfg.get("eos_token_id") if ids is None else ids
    return int(ids[0] if isinstance(ids, list) else ids)


def export_target(target_dir: pathlib.Path, out: pathlib.Path, base_of: pathlib.Path | None) -> None:
    """Edge-LLM's exporter on the target; `base_of`: a draft folder whose config names the
    target layers the base must output (a DFlash base)."""
    tool = pathlib.Path(sys.executable).with_name("tensorrt-edgellm-export")
    cmd = [str(tool), str(target_dir), str(out)]
    if base_of is not None:
        cmd += ["--dflash-base", "--dflash-draft-dir", str(base_of)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tensorrt-edgellm-export failed ({done.returncode}):\n{done.stderr[-3000:]}")


def dcut_graph(profile: dict, ratios: list[float]) -> onnx.ModelProto:
    """D-cut between drafting and verification: confidence, lengths, parents and the two
    measured times in; keep and the chosen ratio out. The cost curve is an input whose default
    is the engine's profile (main curve, seconds)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    defaults = [numpy_helper.from_array(f32(profile["n"]), "cost_n"),
                numpy_helper.from_array(f32(profile["ms"]) / 1000, "cost_t"),
                numpy_helper.from_array(f32(ratios), "ratios")]
    vi = helper.make_tensor_value_info
    inputs = [vi("confidence", TensorProto.FLOAT, ["draft_tokens"]),
              vi("lengths", TensorProto.INT64, ["num_sequences"]),
              vi("parents", TensorProto.INT64, ["draft_tokens"]),
              vi("draft_time", TensorProto.FLOAT, []), vi("fixed_time", TensorProto.FLOAT, []),
              vi("cost_n", TensorProto.FLOAT, ["cost_points"]), vi("cost_t", TensorProto.FLOAT, ["cost_points"])]
    outputs = [vi("keep", TensorProto.BOOL, ["draft_tokens"]), vi("ratio", TensorProto.FLOAT, [])]
    node = onnx_ops.dcut_node(["confidence", "lengths", "parents", "draft_time", "fixed_time", "cost_n",
                               "cost_t", "ratios"], ["keep", "ratio"])
    graph = helper.make_graph([node], "dcut", inputs, outputs, initializer=defaults)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24),
                                                   helper.make_opsetid(onnx_ops.DOMAIN, onnx_ops.VERSION)])


def export(engine: str | pathlib.Path, out: str | pathlib.Path | None = None, log=print) -> dict:
    """Export `engine` into `out` (default <engine>/tensorrt); return export.json's contents."""
    engine = pathlib.Path(engine)
    out = pathlib.Path(out or engine / "tensorrt")
    manifest = read_manifest(engine, verify=False)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    target_dir = engine / "target"
    drafts = [k for k in DRAFTS if k in manifest.drafters]
    layers = {k: manifest.drafters[k].target_layer_ids for k in drafts}
    skipped = {"mtp": "Edge-LLM exports MTP only from checkpoints carrying their own mtp.* layers "
                      "(DeepSeek-V3 / Qwen3-Next families), not beside a Llama target",
               "ngram": "a lookup in the serving loop, no graph"}
    if len({tuple(v) for v in layers.values()}) > 1:  # one base serves one set of target layers
        for k in drafts[1:]:
            skipped[k] = f"reads target layers {layers[k]}, the exported base outputs {layers[drafts[0]]}"
        drafts = drafts[:1]
    mask_id = mask_token_id(target_dir)
    written = {"edgellm_version": EDGELLM_VERSION, "engine": manifest.name, "weights": manifest.weights.dtype,
               "plugins": {"angelspec": [s.name for s in onnx_ops.SCHEMAS],
                           "trt_edgellm": ["AttentionPlugin", "DFlashTargetKVCacheUpdate"]},
               "graphs": {}, "not_exported": {k: v for k, v in skipped.items() if k in manifest.drafters}}
    try:  # a failed export leaves nothing behind: the engine must list every file it holds
        base_of = None
        if drafts:  # the base export reads the target layer ids from a DFlash config
            cfg, _ = load_draft(engine / manifest.drafters[drafts[0]].path)
            base_of = tmp / "base-contract"
            base_of.mkdir()
            base = {**contract(cfg, mask_id), "num_target_layers": manifest.target.num_layers}
            (base_of / "config.json").write_text(json.dumps(base) + "\n")
        log(f"target: Edge-LLM's exporter{' (DFlash base)' if drafts else ''} ...")
        export_target(target_dir, tmp / "target", base_of)
        if base_of is not None:
            shutil.rmtree(base_of)
        written["graphs"]["target"] = "target/llm/model.onnx"
        table = build_custom_translation_table()
        table.update(onnx_ops.translation_table())
        for k in drafts:
            log(f"{k}: the draft's own graph with Edge-LLM's plugins ...")
            export_draft(engine / manifest.drafters[k].path, target_dir, tmp / k, table, mask_id)
            written["graphs"][k] = f"{k}/model.onnx"
        (tmp / "dcut").mkdir()
        onnx.save(dcut_graph(manifest.dcut.profile, manifest.dcut.ratios), str(tmp / "dcut" / "model.onnx"))
        written["graphs"]["dcut"] = "dcut/model.onnx"
        written["dcut_curves_by_batch"] = manifest.dcut.profile.get("by_batch", {})
        written["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "export.json").write_text(json.dumps(written, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if out.parent.resolve() == engine.resolve():  # inside the engine: its manifest lists the files
        manifest.exported["tensorrt"] = [f"{out.name}/{g}" for g in written["graphs"].values()]
        manifest.write(engine)
    log(f"wrote {out} in {written['seconds']} s: {', '.join(written['graphs'])}")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", required=True, help="engine folder (angelspec build)")
    p.add_argument("--out", default=None, help="output folder (default: <engine>/tensorrt)")
    args = p.parse_args(argv)
    export(args.engine, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
