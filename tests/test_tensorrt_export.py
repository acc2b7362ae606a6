"""`angelspec build --export tensorrt` and `angelspec verify-export` on a tiny engine: every graph
passes the ONNX checker with the contracts TensorRT Edge-LLM's runtime reads, our plugin ops in
the angelspec domain, and a greedy speculative decode through ONNX Runtime (exported target +
DFly draft + D-cut, the plugins run by builders/ort_ops.py) returns the engine's own tokens.

These run in the export environment (`make export-env`, a prerequisite of `make test`); without
it they are skipped, except under CI, where a missing environment fails them."""
import json
import os
import subprocess

import pytest
import torch
from conftest import make_checkpoint
from test_drafters import draft

from angelspec.builders.build import build
from angelspec.builders.export_env import export_python, run_module
from angelspec.checkpoint import load_target
from angelspec.cli import main
from angelspec.drafters.draft_checkpoint import save_draft
from angelspec.runtime.manifest import read_manifest


def _export_env():
    try:
        return export_python()
    except RuntimeError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    _export_env()
    root = tmp_path_factory.mktemp("trt")
    make_checkpoint(root / "target", num_hidden_layers=6, seed=4)
    # Edge-LLM's exporter refuses a target without a chat template
    (root / "target" / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}")
    target = load_target(root / "target", max_len=512)
    for kind in ("dflash", "dfly"):
        cfg, model = draft(target, kind, vocab=60, block_size=6)
        save_draft(root / "drafts" / kind, cfg, model.state_dict())
    build(str(root / "target"), str(root / "drafts"), str(root / "engine"), None, drafters=["dfly", "dflash"],
          backends=("eager",), max_tokens=16, export="tensorrt")
    return root, cfg


def _graph(path, script: str) -> dict:
    """Run `script` (which prints one JSON line) in the export environment on the graph at `path`."""
    code = f"import json, onnx\nm = onnx.load({str(path)!r}, load_external_data=False)\n{script}"
    out = subprocess.run([str(export_python()), "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


IO = """ops = {}
for n in m.graph.node:
    ops[n.domain + '::' + n.op_type] = ops.get(n.domain + '::' + n.op_type, 0) + 1
def dims(v):
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
print(json.dumps({'ops': ops, 'in': {v.name: dims(v) for v in m.graph.input},
                  'out': {v.name: dims(v) for v in m.graph.output},
                  'attrs': {n.op_type: {a.name: onnx.helper.get_attribute_value(a) if a.type != a.STRING else
                                        a.s.decode() for a in n.attribute} for n in m.graph.node if n.domain}}))"""


def test_export_writes_edgellm_contracts_with_our_plugin_ops(exported):
    root, cfg = exported
    eng = root / "engine"
    m = read_manifest(eng)  # verifies every file, the export's included: the engine still loads
    assert m.exported["tensorrt"] == ["tensorrt/target/llm/model.onnx", "tensorrt/dfly/model.onnx",
                                      "tensorrt/dflash/model.onnx", "tensorrt/dcut/model.onnx"]
    info = json.loads((eng / "tensorrt" / "export.json").read_text())
    assert set(info["graphs"]) == {"target", "dfly", "dflash", "dcut"} and "ngram" not in info["graphs"]
    t = _graph(eng / "tensorrt/target/llm/model.onnx", IO)
    assert t["ops"]["trt_edgellm::AttentionPlugin"] == 6  # one per target layer
    assert t["out"]["hidden_states"] == ["physical_tokens", len(cfg.target_layers) * 64]  # the layers DFly reads
    assert t["attrs"]["AttentionPlugin"]["enable_tree_attention"] == 1  # a DFlash base verifies trees
    d = _graph(eng / "tensorrt/dfly/model.onnx", IO)
    assert d["ops"] == {**{k: v for k, v in d["ops"].items() if k.startswith("::")},
                        "trt_edgellm::DFlashTargetKVCacheUpdate": 2, "trt_edgellm::AttentionPlugin": 2,
                        "angelspec::DflyDraftHeadPlugin": 1}
    assert list(d["out"])[:2] == ["draft_tokens", "draft_confidence"]
    assert d["out"]["draft_tokens"][1:] == [cfg.block_size - 1, 1]
    assert {"anchor_ids", "dflash_target_hidden_concat", "packed_attention_mask"} <= set(d["in"])
    assert d["attrs"]["DflyDraftHeadPlugin"] == {"eps": pytest.approx(cfg.rms_norm_eps), "width": 1,
                                                 "plugin_version": "1", "plugin_namespace": "angelspec"}
    f = _graph(eng / "tensorrt/dflash/model.onnx", IO)  # DFlash: the same contract, logits out, no head
    assert "angelspec::DflyDraftHeadPlugin" not in f["ops"] and f["ops"]["trt_edgellm::AttentionPlugin"] == 2
    assert f["out"]["logits"][1:] == [cfg.block_size - 1, 60] and "anchor_ids" not in f["in"]
    c = _graph(eng / "tensorrt/dcut/model.onnx", IO)
    assert c["ops"] == {"angelspec::DcutSelectPlugin": 1}
    assert c["attrs"]["DcutSelectPlugin"] == {"plugin_version": "1", "plugin_namespace": "angelspec"}
    assert list(c["out"]) == ["keep", "ratio"]
    contract = json.loads((eng / "tensorrt/dfly/config.json").read_text())["dflash_config"]
    assert contract["target_layer_ids"] == [l - 1 for l in cfg.target_layers]
    assert contract["block_size"] == cfg.block_size and contract["is_causal"] is False


def test_plugin_ops_in_onnx_runtime_equal_their_references(exported):
    """ONNX Runtime's Python ops against the torch references (ours) and a dense attention
    written out (Edge-LLM's), on random inputs."""
    assert run_module("angelspec.builders.verify_export", "--self-test") == 0


def test_ort_decode_of_the_export_equals_the_engine(exported, tmp_path):
    root, _ = exported
    rc = main(["verify-export", "--engine", str(root / "engine"), "--limit", "2", "--max-tokens", "24",
               "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["different"] == 0
    rows = report["prompts"]
    assert len(rows) == 12 and report["equal"] >= 10, rows  # 6 prompts, DFly's drafts and oracle drafts
    assert all(g["plugin_ops"] for name, g in report["graphs"].items())
    # the tiny random draft is never right; the oracle's chains are accepted several tokens at a time
    assert min(r["accept_len"] for r in rows if r["drafts"] == "oracle" and r["tokens"] > 8) > 2
    assert torch.tensor([r["tokens"] for r in report["prompts"]]).min() > 0


def test_build_names_a_missing_export_environment_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGELSPEC_EXPORT_PYTHON", str(tmp_path / "none" / "python"))
    with pytest.raises(RuntimeError, match="make export-env"):
        build(str(tmp_path / "target"), str(tmp_path / "drafts"), str(tmp_path / "engine"), export="tensorrt")
    assert not (tmp_path / "engine").exists() and not (tmp_path / ".engine.partial").exists()
