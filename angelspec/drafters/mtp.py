"""MTP drafter (docs/algorithms.md, section 1): one decoder layer of the target's architecture over a
DeepSeek-V3 style fusion of the next token's embedding and the target's last hidden state (or, with
several target layers, their concatenation projected to one hidden state, as EAGLE-3 fuses low,
middle and high features).
Drafting D tokens applies the layer D times, its own output hidden state and token standing in
for the target's from the second step on. Embedding, final norm and lm_head are the target's."""
from __future__ import annotations

import torch
import torch.nn as nn

from angelspec.drafters.base import Proposal
from angelspec.drafters.modules import DecoderLayer, Linear, RMSNorm
from angelspec.drafters.trained import SlotCache, TrainedDrafter, layer_stack
from angelspec.plugins import SKINNY_MAX_ROWS
from angelspec.plugins.decoder_layer import decoder_stack
from angelspec.plugins.mtp_draft import prepare_mtp_draft


class MTP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.fuse = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg)
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab or cfg.vocab_size))
        if len(cfg.target_layers) > 1:  # starts as the last hidden state alone
            self.fc = Linear(len(cfg.target_layers) * h, h, bias=False)
            last = cfg.target_layers.index(max(cfg.target_layers))
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, last * h: (last + 1) * h] = torch.eye(h)

    def features(self, feats: dict) -> torch.Tensor:
        """The target hidden state the draft reads at each position, from {layer: [..., h]}: the
        last layer's, or fc over the concatenated target layers."""
        layers = self.cfg.target_layers
        if len(layers) == 1:
            return feats[layers[0]]
        return self.fc(torch.cat([feats[l].float() for l in layers], dim=-1))

    def inputs(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x = fuse([RMSNorm(embed(next token)) ; RMSNorm(hidden)])."""
        return self.fuse(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))


class FusedLayer:
    """The draft's decoder layer run as the target runs its own: a one-layer DecoderStack (the
    engine's kernels and weight precision, one op per forward), keys and values in a cache of
    the target's layout whose slots the caller assigns (grown as they appear). A rollout's rows
    sit at the positions past a request's committed ones, so the next catch-up overwrites
    them."""

    def __init__(self, layer: DecoderLayer, model):
        self.stack = layer_stack([layer], model.weights)
        self.cos, self.sin, self.max_len = model.cos, model.sin, model.max_len
        self.cache = SlotCache(layer.nkv, layer.hd, model.max_len, model.kv_dtype)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, h] at (slot, position) each -> the layer's output [N, h]; caches the rows' keys
        and values. Rows of one request in position order attend to its cache up to their own."""
        c = self.cache
        c.fit(slots)
        out = [decoder_stack(x[a: a + SKINNY_MAX_ROWS], self.stack, self.cos, self.sin,
                             positions[a: a + SKINNY_MAX_ROWS], [c.k], [c.v], slots[a: a + SKINNY_MAX_ROWS],
                             positions[a: a + SKINNY_MAX_ROWS], None, None, [])[0]
               for a in range(0, len(x), SKINNY_MAX_ROWS)]
        return out[0] if len(out) == 1 else torch.cat(out)


class MTPDrafter(TrainedDrafter):
    name = "mtp"
    model_cls = MTP

    def __init__(self, target, path, **options):
        super().__init__(target, path, **options)
        self.layer = FusedLayer(self.model.layer, target.model)
        m, fz = self.model, self.frozen
        # greedy chains: the whole proposal in one call (plugins/mtp_draft.py)
        self.fused = prepare_mtp_draft(fz.embed, m.enorm.weight, m.hnorm.weight, m.fuse.serving_weight,
                                       self.layer.stack, fz.norm_w, fz.head_mm, fz.vocab_ids, m.enorm.eps)

    @torch.inference_mode()
    def propose(self, states: list) -> list[Proposal]:
        """Every request at once: one forward catches up each request's cache on its newly
        committed positions (the target's hidden states as inputs), then k - 1 rollout steps,
        each one forward over one row per chain, its own output hidden state and token standing
        in for the target's. Chains of greedy requests take it in one call (`fused`); otherwise
        the layer is one op over all rows (FusedLayer) and the lm_head reads its weights once
        for the batch. With `branches` b > 1 each of a request's b best first guesses is
        continued greedily in a cache slot of its own (slot * b + j: the catch-up is written
        into each), keeping the b best guesses at each step (proposals_from_chains)."""
        k = self.draft_len
        if k == 0 or not states:
            return [Proposal.empty() for _ in states]
        model, fz, layer, b = self.model, self.frozen, self.layer, self.branches
        # in Python lists, each tensor made once: at one request this bookkeeping had cost about
        # half as much as the draft's own call
        nexts, hids, poss, slots, lasts, newests = [], [], [], [], [], []
        for s in states:
            st = s.drafter_state
            start = st.get("real", 0)  # positions whose real (target-hidden) input is cached
            h = model.features(self.take_pending(s))  # rows for start..n-1
            n = start + len(h)
            # real inputs at positions p = start..n-1: (embed(token p+1), target hidden at p)
            nexts += s.tokens[start + 1: n + 1]
            hids.append(h)
            poss += range(start, n)
            slots += [s.slot * b] * (n - start)
            lasts.append(n - 1)  # its newest position
            newests.append(len(poss) - 1)  # its row
            st["real"] = n
        nxt, pos, slot = torch.tensor(nexts), torch.tensor(poss), torch.tensor(slots)
        hid = hids[0] if len(hids) == 1 else torch.cat(hids)
        steps = max(min(k, layer.max_len - max(lasts)), 1)  # rollout positions stay in the cache
        if b == 1 and all(s.params.greedy for s in states):
            layer.cache.fit(slot)
            tokens, conf = self.fused.draft(hid, nxt, slot, pos, torch.tensor(newests), steps, 1, layer.cos,
                                            layer.sin, layer.cache.k, layer.cache.v)
            tokens, conf = tokens[:, :, 0], conf[:, :, 0]
            return [Proposal(tokens[r], conf[r]) for r in range(len(states))]
        last, newest = torch.tensor(lasts), torch.tensor(newests)
        x = model.inputs(fz.embed[nxt], hid)
        out = layer(x.repeat(b, 1), torch.cat([slot + j for j in range(b)]), pos.repeat(b))
        o = out[newest]
        first, conf1 = self.choose(fz.logits(o), states)  # [R, b]
        # the rollout: row r * b + j continues request r's j-th first guess
        rows = [s for s in states for _ in range(b)]
        slot = (torch.tensor([s.slot * b for s in states])[:, None] + torch.arange(b)).reshape(-1)
        pos = last.repeat_interleave(b)
        o, prev, tokens, confs = o.repeat_interleave(b, 0), first.reshape(-1), [], []
        for step in range(1, steps):
            o = layer(model.inputs(fz.embed[prev], o), slot, pos + step)
            t, c = self.choose(fz.logits(o), rows)  # [R * b, b]
            tokens.append(t)
            confs.append(c)
            prev = t[:, 0]
        if not tokens:
            cont = first.new_zeros(len(states), b, 0, b), torch.zeros(len(states), b, 0, b)
        else:
            cont = (torch.stack(tokens, 1).unflatten(0, (len(states), b)),
                    torch.stack(confs, 1).unflatten(0, (len(states), b)))
        return self.proposals_from_chains(cont, first, conf1)
