"""MTP drafter (docs/algorithms.md, section 1): one decoder layer of the target's architecture over a
DeepSeek-V3 style fusion of the next token's embedding and the target's last hidden state.
Drafting D tokens applies the layer D times, its own output hidden state and token standing in
for the target's from the second step on. Embedding, final norm and lm_head are the target's."""
from __future__ import annotations

import torch
import torch.nn as nn

from angelspec.drafters.modules import DecoderLayer, Linear, RMSNorm, attend
from angelspec.drafters.trained import GrowingKV, TrainedDrafter


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

    def inputs(self, token_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x = fuse([RMSNorm(embed(next token)) ; RMSNorm(hidden)])."""
        return self.fuse(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))


class MTPDrafter(TrainedDrafter):
    name = "mtp"
    model_cls = MTP

    def draft(self, s, k: int):
        """Catch up the layer's cache on the newly committed positions, then roll out k steps."""
        model, fz = self.model, self.frozen
        st = s.drafter_state
        layer = model.layer
        cache = st.setdefault("kv", GrowingKV(layer.nkv, layer.hd))
        start = st.get("real", 0)  # positions whose real (target-hidden) input is cached
        h = self.take_pending(s)[self.cfg.target_num_layers]  # rows for positions start..n-1
        n = start + len(h)
        # real inputs at positions p = start..n-1: (embed(token p+1), target hidden at p)
        x = model.inputs(fz.embed[torch.tensor(s.tokens[start + 1: n + 1])], h)
        pos = torch.arange(start, n)
        q, kk, vv = layer.qkv(x, *fz.rope_tables(pos))
        cache.write(start, kk, vv)
        keys, vals = cache.upto(n)
        mask = pos[:, None] >= torch.arange(n)[None, :]
        o = layer.finish(x, attend(q, keys, vals, mask))[-1:]
        st["real"] = n
        tokens, confs = [], []
        for step in range(k):
            if step:  # own hidden state and own token from the second step on
                x = model.inputs(fz.embed[tokens[-1]], o)
                p = n - 1 + step
                q, kk, vv = layer.qkv(x, *fz.rope_tables(torch.tensor([p])))
                cache.write(p, kk, vv)
                o = layer.finish(x, attend(q, *cache.upto(p + 1)))
            t, c = self.choose(fz.logits(o), s)
            tokens.append(t)
            confs.append(c)
        return torch.cat(tokens), torch.cat(confs)
