"""The MTP draft's greedy proposal as one call (`angelspec::MTPDraft`, csrc/mtp_draft.cpp): the
catch-up forward on newly committed positions and the whole rollout (inputs, the draft's layer,
the target's final norm, the logits over the draft vocabulary, the best guesses and their
probability) through the engine's kernels, without a trip through Python per step. The drafter
(angelspec/drafters/mtp.py) takes it for chains of greedy requests; its op-by-op path, which
computes the same, serves trees and sampled requests."""
import torch

from angelspec.plugins.build import load_kernels
from angelspec.plugins.decoder_layer import weight_args
from angelspec.plugins.linear import SKINNY_MAX_ROWS

load_kernels()


def prepare_mtp_draft(embed: torch.Tensor, enorm: torch.Tensor, hnorm: torch.Tensor, fuse, stack,
                      final_norm: torch.Tensor, head, vocab_ids: torch.Tensor, eps: float):
    """embed [V, h] float32; the norms' weights [h]; fuse [h, 2h] and head [Vd, h] any weight
    `linear` takes; stack: the draft layer as a one-layer DecoderStack (prepare_stack);
    vocab_ids [Vd]: the target id of each head row. Its `draft(hidden, next_tokens, slots,
    positions, last, steps, width, cos, sin, k_cache, v_cache)`: hidden [N, h] the target's
    features at N newly committed positions of R requests (each request's in position order),
    next_tokens [N] the token after each, at (slots, positions); last [R] each request's newest
    row -> (tokens [R, steps, width] target ids, confidence [R, steps, width]), the best `width`
    guesses at each step of each request's greedy chain, rolled out from its newest row in its
    slot; it writes the layer's keys and values."""
    return torch.classes.angelspec.MTPDraft(embed, enorm.detach().float().contiguous(),
                                            hnorm.detach().float().contiguous(), *weight_args(fuse), stack,
                                            final_norm, *weight_args(head), vocab_ids.long().contiguous(),
                                            eps, SKINNY_MAX_ROWS)

