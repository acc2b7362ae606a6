"""DFly's predecessor-conditioned AR head as one op (`angelspec::dfly_draft_head`).

The block backbone drafts all positions in one parallel pass; the AR head then corrects each
position by the token chosen just before it, a chain that is sequential by nature. The op runs
the whole chain (greedy: each link takes the argmax) so drafting does not bounce through Python
per position:

    h'_i = h_i + down(silu(gate(x_i)) * up(x_i)),  x_i = [head_norm(h_i) ; prev_norm(embed[t_{i-1}])]
    t_i  = vocab_ids[argmax(lm_head_rows . final_norm(h'_i))],  t_0 = the anchor
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from angelspec.plugins.build import load_kernels
from angelspec.plugins.decoder_layer import weight_args
from angelspec.plugins.linear import linear

load_kernels()


@torch.library.custom_op("angelspec::dfly_draft_head", mutates_args=())
def dfly_draft_head(hidden: Tensor, anchor: Tensor, embed: Tensor, head_norm: Tensor,
                    prev_norm: Tensor, gate: Tensor, up: Tensor, down: Tensor, final_norm: Tensor,
                    lm_head: Tensor, vocab_ids: Tensor, eps: float,
                    candidates: Optional[Tensor] = None, width: int = 1) -> tuple[Tensor, Tensor]:
    """The chains of R blocks at once: hidden [R, k, h] (backbone output per draft position),
    anchor [R] long, embed [V, h], lm_head [Vd, h] rows of the draft vocabulary with target ids
    vocab_ids [Vd]; candidates [R, k, c] (optional): re-score only these draft-vocabulary
    indices per position. Each link is one product over the R rows (the weights read once).
    Returns (tokens [R, k, width] target ids, confidence [R, k, width] = the draft's probability
    of each): at each link the best `width` tokens, best first; the chain goes on with the best."""
    return draft_head(hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm,
                      lm_head, vocab_ids, eps, candidates, width)


def prepare_dfly_head(embed: Tensor, head_norm: Tensor, prev_norm: Tensor, gate_up, down, final_norm: Tensor,
                      lm_head, vocab_ids: Tensor, eps: float):
    """draft_head's computation for the whole draft vocabulary as one C++ call a drafting step
    (`angelspec::DFlyHead`, csrc/dfly_head.cpp; its `chains(hidden, anchor, width, stop_below)`
    returns what draft_head does): embed [V, h] float32; the norms' weights [h]; gate_up [2m, 2h]
    (gate's rows, then up's), down [h, m] and lm_head [Vd, h] any weight `linear` takes;
    vocab_ids [Vd]."""
    def norm(w):
        return w.detach().float().contiguous()
    return torch.classes.angelspec.DFlyHead(embed, norm(head_norm), norm(prev_norm), *weight_args(gate_up),
                                            *weight_args(down), final_norm, *weight_args(lm_head),
                                            vocab_ids.long().contiguous(), eps)


def draft_head(hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm, lm_head,
               vocab_ids, eps, candidates=None, width=1, stop_below=0.0):
    """dfly_draft_head's computation, which a drafter calls directly: gate, up, down and (without
    candidates) lm_head may be any weight `linear` takes (bf16 tiles, a QuantWeight), as the
    engine serves its own. stop_below > 0: the chains end as soon as every block's path survival
    (the product of its chosen tokens' probabilities) is below it, returning the links so far."""
    r, k, h = hidden.shape
    tokens = torch.empty(r, k, width, dtype=torch.long)
    conf = torch.empty(r, k, width, dtype=hidden.dtype)
    hn = F.rms_norm(hidden, (h,), head_norm, eps)
    prev = anchor.reshape(r)
    survival = torch.ones(r, dtype=hidden.dtype)
    for i in range(k):
        pe = F.rms_norm(embed[prev], (h,), prev_norm, eps)
        x = torch.cat([hn[:, i], pe], dim=-1)
        y = hidden[:, i] + linear(F.silu(linear(x, gate)) * linear(x, up), down)
        yn = F.rms_norm(y, (h,), final_norm, eps)
        if candidates is None:
            logits, ids = linear(yn, lm_head), vocab_ids.expand(r, -1)
        else:  # a few rows each: one product per block
            rows = candidates[:, i]
            logits = torch.stack([lm_head[rows[b]] @ yn[b] for b in range(r)])
            ids = vocab_ids[rows]
        p, j = torch.softmax(logits.float(), -1).topk(width, dim=-1)
        tokens[:, i], conf[:, i] = ids.gather(-1, j), p
        prev = tokens[:, i, 0]
        survival = survival * p[:, 0]
        if stop_below and bool((survival < stop_below).all()):
            return tokens[:, : i + 1], conf[:, : i + 1]
    return tokens, conf


@dfly_draft_head.register_fake
def _(hidden, anchor, embed, head_norm, prev_norm, gate, up, down, final_norm, lm_head, vocab_ids,
      eps, candidates=None, width=1):
    r, k = hidden.shape[:2]
    return hidden.new_empty(r, k, width, dtype=torch.long), hidden.new_empty(r, k, width)
