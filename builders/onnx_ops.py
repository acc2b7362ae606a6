"""AngelSpec's plugin ops in their own ONNX domain, `angelspec` (version 1), for TensorRT graphs.

Two ops, each the ONNX face of an existing torch.library op (its body is the reference):

- `DflyDraftHeadPlugin` = `angelspec::dfly_draft_head`: DFly's predecessor-conditioned AR head
  over a batch of blocks. A chain of data-dependent links (each link's input embeds the token the
  link before chose), which no stock ONNX op expresses.
  Inputs: hidden [R, k, h], anchor [R] int64, embed [V, h], head_norm [h], prev_norm [h],
  gate [h, 2h], up [h, 2h], down [h, h], final_norm [h], lm_head [Vd, h], vocab_ids [Vd] int64.
  Attributes: eps, width. Outputs: tokens [R, k, width] int64 (target ids, best first; the chain
  goes on with the best), confidence [R, k, width] float (the draft's probability of each).
- `DcutSelectPlugin` = `angelspec::dcut_select`: D-cut's choice of which draft tokens of a
  batch one verification forward checks (global top-K of survival scores against the measured
  cost table). Runs between drafting and verification.
  Inputs: confidence [N] float, lengths [B] int64, parents [N] int64, draft_time [] and
  fixed_time [] float (seconds, as measured by the serving loop: this step's drafting, the
  rest of a step outside drafting and the forward), cost_n [P] float, cost_t [P] float
  (seconds), ratios [R] float. Outputs: keep [N] bool, ratio [] float.

DFly's other addition, the per-layer mixture of target layers, needs no plugin: it folds into a
per-layer copy of the context projection (standard MatMul), see builders/tensorrt_drafts.py.

`register_schemas()` makes `onnx.checker` and shape inference know both ops;
`translation_table()` maps the torch ops onto them for `torch.onnx.export(dynamo=True)`.
Every node carries `plugin_version` and `plugin_namespace`, which TensorRT's ONNX parser uses to
find the plugin (builders/tensorrt_plugins.py registers both as angelspec::<op>).
Needs the export environment's packages (onnx, onnxscript): `make export-env`.
"""
from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import FLOAT, INT64

import angelspec.plugins  # noqa: F401  (registers torch.ops.angelspec.*)

DOMAIN = "angelspec"
VERSION = 1
PLUGIN_VERSION = "1"
_op = onnxscript.values.Opset(DOMAIN, VERSION)


def _param(name: str, doc: str, type_str: str) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(name=name, description=doc, type_str=type_str)


def _attr(name: str, kind, doc: str, required: bool = True) -> OpSchema.Attribute:
    return OpSchema.Attribute(name=name, type=kind, description=doc, required=required)


A = OpSchema.AttrType
SCHEMAS = [
    OpSchema(
        name="DflyDraftHeadPlugin", domain=DOMAIN, since_version=VERSION,
        doc="DFly's predecessor-conditioned AR head over R blocks of k draft positions: link i "
            "adds down(silu(gate(x)) * up(x)), x = [head_norm(h_i); prev_norm(embed[t_(i-1)])], "
            "then picks the best `width` tokens of lm_head . final_norm(h'_i); t_0 = the anchor.",
        inputs=[_param("hidden", "backbone output [R, k, h]", "tensor(float)"),
                _param("anchor", "the token before each block [R]", "tensor(int64)"),
                _param("embed", "the target's embedding [V, h]", "tensor(float)"),
                _param("head_norm", "[h]", "tensor(float)"),
                _param("prev_norm", "[h]", "tensor(float)"),
                _param("gate", "[h, 2h]", "tensor(float)"),
                _param("up", "[h, 2h]", "tensor(float)"),
                _param("down", "[h, h]", "tensor(float)"),
                _param("final_norm", "the target's final norm [h]", "tensor(float)"),
                _param("lm_head", "rows of the draft vocabulary [Vd, h]", "tensor(float)"),
                _param("vocab_ids", "target id of each draft-vocabulary row [Vd]", "tensor(int64)")],
        outputs=[_param("tokens", "[R, k, width] target ids, best first", "tensor(int64)"),
                 _param("confidence", "[R, k, width] the draft's probability of each", "tensor(float)")],
        attributes=[_attr("eps", A.FLOAT, "RMSNorm epsilon"),
                    _attr("width", A.INT, "guesses kept per link (1: a chain)"),
                    _attr("plugin_version", A.STRING, "TensorRT plugin version"),
                    _attr("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False)],
    ),
    OpSchema(
        name="DcutSelectPlugin", domain=DOMAIN, since_version=VERSION,
        doc="D-cut: for each keep ratio rho, K = ceil(rho * N) tokens of the batch with the highest "
            "survival (product of confidences on the path; ties in draft order) are kept; the rho "
            "with the largest (B + sum of kept survivals) / (draft_time + C(B + K) + fixed_time) "
            "wins (ties: the smaller). C interpolates the profiled cost table.",
        inputs=[_param("confidence", "[N] draft confidence of each token", "tensor(float)"),
                _param("lengths", "[B] draft tokens per request", "tensor(int64)"),
                _param("parents", "[N] parent index within the request, -1: the anchor", "tensor(int64)"),
                _param("draft_time", "[] seconds spent drafting this step", "tensor(float)"),
                _param("fixed_time", "[] seconds per step outside drafting and the forward", "tensor(float)"),
                _param("cost_n", "[P] verified tokens of each profiled point", "tensor(float)"),
                _param("cost_t", "[P] seconds of one verification forward", "tensor(float)"),
                _param("ratios", "[R] keep ratios, ascending", "tensor(float)")],
        outputs=[_param("keep", "[N] the tokens to verify", "tensor(bool)"),
                 _param("ratio", "[] the chosen keep ratio", "tensor(float)")],
        attributes=[_attr("plugin_version", A.STRING, "TensorRT plugin version"),
                    _attr("plugin_namespace", A.STRING, "TensorRT plugin namespace", required=False)],
    ),
]


def register_schemas() -> None:
    """Make the checker and shape inference know the angelspec domain (once per process)."""
    for s in SCHEMAS:
        if not onnx.defs.has(s.name, s.domain):
            onnx.defs.register_schema(s)


@onnxscript.script()
def _dfly_draft_head(hidden: FLOAT, anchor: INT64, embed: FLOAT, head_norm: FLOAT, prev_norm: FLOAT,
                     gate: FLOAT, up: FLOAT, down: FLOAT, final_norm: FLOAT, lm_head: FLOAT,
                     vocab_ids: INT64, eps: float, candidates: INT64 = None,
                     width: int = 1) -> tuple[INT64, FLOAT]:
    tokens, confidence = _op.DflyDraftHeadPlugin(
        hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm, lm_head, vocab_ids,
        eps=eps, width=width, plugin_version="1", plugin_namespace="angelspec")
    return tokens, confidence


def translation_table() -> dict:
    """torch op -> onnxscript function, to merge into Edge-LLM's table when exporting."""
    register_schemas()
    return {torch.ops.angelspec.dfly_draft_head.default: _dfly_draft_head}


def dcut_node(inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    """The D-cut node (D-cut runs in the serving loop, between two graphs: its graph is built
    by hand around this node, see builders/tensorrt.py)."""
    return onnx.helper.make_node("DcutSelectPlugin", inputs, outputs, domain=DOMAIN,
                                 plugin_version=PLUGIN_VERSION, plugin_namespace=DOMAIN)
