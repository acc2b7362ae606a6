"""The decoder layers of a decoding or verification forward in one call
(`angelspec::DecoderStack`, whose weights are checked and taken apart once, a model's forward
after forward; a draft's layer is a one-layer stack): per layer rms_norm, qkv, rope_,
cached_attention, o, the residual, rms_norm, gate_up, silu_mul, down and the residual, calling the
same kernels in the same order as the model's layer loop does op by op, so the numbers are the
same bit for bit, in one trip from Python instead of a dozen a layer. Up to SKINNY_MAX_ROWS rows
(longer inputs take the op-by-op path, whose matmuls change kernels there).
"""
import torch

from angelspec.plugins.attention import CHAIN
from angelspec.plugins.build import load_kernels
from angelspec.plugins.linear import Bf16Weight, QuantWeight

load_kernels()
MATMULS = ("qkv", "o", "gate_up", "down")


def weight_args(w) -> tuple[list[torch.Tensor], int]:
    """A matmul weight as DecoderStack takes it: its tensors and its kind, 0 float32, 1 bf16
    packed (pack_bf16), 2 weight-only quantized, 3 quantized with int8 activations (a Bf16Weight:
    kind 0, skinny_linear reads its bf16 rows)."""
    if isinstance(w, Bf16Weight):
        return [w.w], 0
    if isinstance(w, QuantWeight):
        return [w.q, w.scale] + ([] if w.offset is None else [w.offset]), 3 if w.int8_activations else 2
    return [w], 1 if w.dtype == torch.bfloat16 else 0


def prepare_stack(layers: list[dict], eps: float, nq: int, nkv: int, head_dim: int,
                  embed: torch.Tensor | None = None, head: tuple[torch.Tensor, object] | None = None):
    """Every layer's weights, checked and taken apart once (`angelspec::DecoderStack`: the layers'
    arguments flattened layer after layer), for decoder_stack; `embed` (the token embeddings) for
    token ids in place of x, `head` (the final norm's weight, the logits' matmul weight) for its
    `logits`."""
    norms, weights, counts, kinds, biases = [], [], [], [], []
    for layer in layers:
        norms += [layer["in_norm"], layer["post_norm"]]
        for k in MATMULS:
            w, kind = weight_args(layer[k])
            weights += w
            counts.append(len(w))
            kinds.append(kind)
            biases.append(layer[k + "_b"])
    stack = torch.classes.angelspec.DecoderStack(norms, eps, weights, counts, kinds, biases, nq, nkv, head_dim)
    if embed is not None:
        stack.set_embed(embed)
    if head is not None:
        stack.set_head(head[0], *weight_args(head[1]))
    return stack


def decoder_stack(x: torch.Tensor, stack, cos: torch.Tensor, sin: torch.Tensor,
                  rope_positions: torch.Tensor, k_caches: list, v_caches: list,
                  slots: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor | None,
                  window: int | None, capture: list[int], logits: bool = False
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x [N, hidden] (or token ids [N], a stack prepared with the embeddings: looked up in the
    same call) through every layer of `stack` (prepare_stack's) -> (the last layer's
    output, [the output of layer i (counted from 1) for i in capture]); writes this forward's
    keys and values into each layer's caches. With `logits` (a stack prepared with its head), the
    first is every row's logits instead: the head runs in the same call, the model's last layer
    hands over to it without a trip through Python (Llama.head's kernels, the same numbers)."""
    out = stack.forward(x, cos, sin, rope_positions, k_caches, v_caches, slots, positions,
                        CHAIN if parents is None else parents, window or 0, capture, logits)
    return (out[-1], out[1:-1]) if logits else (out[0], out[1:])
