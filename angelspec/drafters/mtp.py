"""MTP drafter (docs/algorithms.md, section 1): one decoder layer of the target's architecture over a
DeepSeek-V3 style fusion of the next token's embedding and the target's last hidden state.
Drafting D tokens applies the layer D times, its own output hidden state and token standing in
for the target's from the second step on. Embedding, final norm and lm_head are the target's."""
from __future__ import annotations

import torch
import torch.nn as nn

from angelspec.drafters.base import Proposal
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

    @torch.inference_mode()
    def propose(self, states: list) -> list[Proposal]:
        """Every request at once: one pass catches up each request's cache on its newly committed
        positions (the target's hidden states as inputs), then k rollout steps, each one forward
        over one row per request. Only attention runs per request (over its own cache); the
        projections, the MLP and the lm_head read their weights once for the whole batch."""
        k = self.draft_len
        if k == 0 or not states:
            return [Proposal.empty() for _ in states]
        model, fz, layer = self.model, self.frozen, self.model.layer
        caches, starts, news = [], [], []
        embs, hids, poss = [], [], []
        for s in states:
            st = s.drafter_state
            caches.append(st.setdefault("kv", GrowingKV(layer.nkv, layer.hd)))
            start = st.get("real", 0)  # positions whose real (target-hidden) input is cached
            h = self.take_pending(s)[self.cfg.target_num_layers]  # rows for start..n-1
            n = start + len(h)
            # real inputs at positions p = start..n-1: (embed(token p+1), target hidden at p)
            embs.append(fz.embed[torch.tensor(s.tokens[start + 1: n + 1])])
            hids.append(h)
            poss.append(torch.arange(start, n))
            starts.append(start)
            news.append(n)
            st["real"] = n
        x = model.inputs(torch.cat(embs), torch.cat(hids))
        q, kk, vv = layer.qkv(x, *fz.rope_tables(torch.cat(poss)))
        attn, row = [], 0
        for cache, start, n in zip(caches, starts, news):
            m = n - start
            cache.write(start, kk[:, row: row + m], vv[:, row: row + m])
            attn.append(attend(q[:, row + m - 1: row + m], *cache.upto(n)))  # the last row's
            row += m
        last = x[torch.tensor([n - s0 for n, s0 in zip(news, starts)]).cumsum(0) - 1]
        o = layer.finish(last, torch.cat(attn, dim=-2))  # [B, h]: each request's newest position
        first, conf1 = self.choose(fz.logits(o), states)  # [B, branches]
        return self.proposals_from_chains(self.rollout(states, caches, news, o, first, k), first, conf1)

    def rollout(self, states: list, caches: list, news: list[int], o: torch.Tensor,
                first: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of the `branches` first guesses of each request continued greedily for k - 1
        more tokens, its own output hidden state and token standing in for the target's: one
        forward per step over all B * branches chains (each attends to its request's cache and
        its own earlier steps). Returns tokens, confidence [B, branches, k - 1, branches]: at
        each step every chain's best `branches` guesses (the first one goes on)."""
        model, fz, layer = self.model, self.frozen, self.model.layer
        b = first.shape[1]
        rows = [(r, j) for r in range(len(states)) for j in range(b)]
        row_states = [states[r] for r, _ in rows]
        o, prev = o.repeat_interleave(b, 0), first.reshape(-1)
        own_k, own_v = [[] for _ in rows], [[] for _ in rows]
        tokens, confs = [], []
        for step in range(1, k):
            x = model.inputs(fz.embed[prev], o)
            pos = torch.tensor([news[r] - 1 + step for r, _ in rows])
            q, kk, vv = layer.qkv(x, *fz.rope_tables(pos))
            attn = []
            for i, (r, _) in enumerate(rows):
                own_k[i].append(kk[:, i: i + 1])
                own_v[i].append(vv[:, i: i + 1])
                ck, cv = caches[r].upto(news[r])
                attn.append(attend(q[:, i: i + 1], torch.cat([ck, *own_k[i]], 1), torch.cat([cv, *own_v[i]], 1)))
            o = layer.finish(x, torch.cat(attn, dim=-2))
            t, c = self.choose(fz.logits(o), row_states)  # [B * b, b]
            tokens.append(t)
            confs.append(c)
            prev = t[:, 0]
        if not tokens:
            return first.new_zeros(len(states), b, 0, b), torch.zeros(len(states), b, 0, b)
        return (torch.stack(tokens, 1).unflatten(0, (len(states), b)),
                torch.stack(confs, 1).unflatten(0, (len(states), b)))
