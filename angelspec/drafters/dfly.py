"""DFly and its baseline DFlash (docs/algorithms.md, section 2): a block-diffusion draft that fills
[anchor, MASK, ..., MASK] in one parallel pass, conditioned on evenly spaced target layers.

Each draft layer attends over [context features ; block] with ONE k/v projection, bidirectionally
inside the block. DFly adds (1) a per-layer softmax mixture of the target layers on top of the
shared projection (distance-prior init) and (2) a predecessor-conditioned AR head before the
lm_head (zero-initialised down projection: untrained, it is exactly DFlash). DFlash is this code
with both switched off."""
from __future__ import annotations

import torch
import torch.nn as nn

from angelspec.drafters.base import Proposal
from angelspec.drafters.modules import DecoderLayer, Linear, RMSNorm, SwiGLU, grouped
from angelspec.drafters.trained import SlotCache, TrainedDrafter, layer_stack, stacked
from angelspec.plugins import SKINNY_MAX_ROWS
from angelspec.plugins.dfly_head import draft_head, prepare_dfly_head


def distance_prior(num_draft_layers: int, k: int, sharpness: float) -> torch.Tensor:
    """Mixture logits [Ld, K]: draft layer l prefers the target layers at its relative depth."""
    centre = torch.linspace(0, k - 1, num_draft_layers) if num_draft_layers > 1 \
        else torch.tensor([(k - 1) / 2])
    return -sharpness * (torch.arange(k)[None, :] - centre[:, None]).abs()


def candidates(fz, hidden: torch.Tensor, k: int) -> torch.Tensor | None:
    """Draft-vocabulary indices [..., k] the AR head re-scores: the backbone's best k for each
    position (None: the whole draft vocabulary, and no backbone lm_head product at all)."""
    if not k or k >= len(fz.vocab_ids):
        return None
    return fz.logits(hidden).topk(k, dim=-1).indices


def _over_context(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """a [..., A, Hkv, G, B, X] @ m [..., Hkv, X, Y] -> [..., A, Hkv, G, B, Y], every block's
    rows in one matmul per KV head (broadcasting m over the A blocks would copy it A*G times)."""
    A, G, B = a.shape[-5], a.shape[-3], a.shape[-2]
    rows = a.movedim(-5, -4).flatten(-4, -2)  # [..., Hkv, A*G*B, X]
    return (rows @ m).unflatten(-2, (A, G, B)).movedim(-4, -5)


def _block_attention(layer, q, kb, vb, kc, vc, ctx_mask=None) -> torch.Tensor:
    """Attention of A blocks: q [..., A, H, B, D] over [context (kc, vc [..., Hkv, T, D]) ; the
    block itself (kb, vb [..., A, Hkv, B, D]), bidirectionally] -> [..., A, H, B, D]."""
    qg = grouped(q, layer.nkv) * layer.hd ** -0.5  # [..., A, Hkv, G, B, D]
    s_ctx = _over_context(qg, kc.transpose(-1, -2))  # [..., A, Hkv, G, B, T]
    if ctx_mask is not None:
        s_ctx = s_ctx.masked_fill(~ctx_mask[..., None, None, None, :], float("-inf"))
    s_blk = qg @ kb.unsqueeze(-3).transpose(-1, -2)  # [..., A, Hkv, G, B, B]
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    t = kc.shape[-2]
    out = _over_context(p[..., :t], vc) + p[..., t:] @ vb.unsqueeze(-3)
    return out.flatten(-4, -3)


class DFly(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, k, eps = cfg.hidden_size, len(cfg.target_layers), cfg.rms_norm_eps
        self.cfg = cfg
        self.fc = Linear(k * h, h, bias=False)
        n_norms = cfg.num_layers if cfg.hybrid else 1
        self.ctx_norms = nn.ModuleList(RMSNorm(h, eps) for _ in range(n_norms))
        if cfg.hybrid:
            self.mix = nn.Parameter(distance_prior(cfg.num_layers, k, cfg.prior_sharpness))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.mask_embed = nn.Parameter(torch.zeros(h))
        if cfg.ar_head:
            self.prev_norm = RMSNorm(h, eps)
            self.head_norm = RMSNorm(h, eps)
            self.ar = SwiGLU(2 * h, h, h)
            nn.init.zeros_(self.ar.down.weight)
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab or cfg.vocab_size))

    def context(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Target hidden states of the K layers [..., T, h] each -> context per draft layer."""
        base = self.fc(torch.cat(feats, dim=-1))
        if not self.cfg.hybrid:
            return [self.ctx_norms[0](base)] * len(self.layers)
        stack = torch.stack(feats, dim=-1)  # [..., T, h, K]
        w = torch.softmax(self.mix, dim=-1)
        return [norm(base + stack @ w[l]) for l, norm in enumerate(self.ctx_norms)]

    def context_kv(self, ctx: list[torch.Tensor], cos, sin) -> list[tuple]:
        return [layer.kv(c, cos, sin) for layer, c in zip(self.layers, ctx)]

    def block(self, x: torch.Tensor, cos, sin, ctx_kv: list[tuple],
              ctx_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., A, B, h]: A blocks of B positions; ctx_kv per layer ([..., Hkv, T, D] each);
        ctx_mask [..., A, T]: which context positions each block sees (None: all)."""
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            q, kb, vb = layer.qkv(x, cos, sin)  # [..., A, H(kv), B, D]
            x = layer.finish(x, _block_attention(layer, q, kb, vb, kc, vc, ctx_mask))
        return x

    def head(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """Hidden states before the lm_head; DFly corrects each by its predecessor token."""
        if not self.cfg.ar_head:
            return h
        return h + self.ar(torch.cat([self.head_norm(h), self.prev_norm(prev_emb)], dim=-1))


class DFlyDrafter(TrainedDrafter):
    name = "dfly"
    model_cls = DFly
    # a chain (branches=1) ends at its first token whose path survival (the product of the AR
    # head's probabilities along it) is below this: D-cut would not verify it, and verified it
    # would almost never be accepted; the AR head's links past it are not computed
    stop_below = 0.02

    def __init__(self, target, path, **options):
        super().__init__(target, path, **options)
        m = target.model  # the context and the block, each layer's keys in one cache (SlotCache)
        self.caches = [SlotCache(l.nkv, l.hd, m.max_len + self.cfg.block_size, m.kv_dtype)
                       for l in self.model.layers]
        self.stack = layer_stack(list(self.model.layers), m.weights)  # the block forward in one call
        if self.cfg.ar_head:  # the chains over the whole draft vocabulary in one call a step
            d, fz = self.model, self.frozen
            self.head = prepare_dfly_head(fz.embed, d.head_norm.weight, d.prev_norm.weight,
                                          stacked([d.ar.gate, d.ar.up], m.weights), d.ar.down.serving_weight,
                                          fz.norm_w, fz.head_mm, fz.vocab_ids, fz.eps)

    @torch.inference_mode()
    def propose(self, states: list) -> list[Proposal]:
        """Every request at once: one pass projects all requests' newly committed context
        features into their slots of the draft's caches, one forward drafts every request's block
        (attention through the engine's kernel, all blocks in one call per layer), and one op
        runs every block's AR chain, link by link."""
        k = self.draft_len
        if k == 0 or not states:
            return [Proposal.empty() for _ in states]
        model, fz, layers = self.model, self.frozen, self.cfg.target_layers
        starts, ends, feats = [], [], {l: [] for l in layers}
        for s in states:
            st = s.drafter_state
            new = self.take_pending(s)
            starts.append(st.get("ctx", 0))
            ends.append(starts[-1] + len(new[self.capture[0]]))
            for l in layers:
                feats[l].append(new[l])
            st["ctx"] = ends[-1]
        slots = torch.tensor([s.slot for s in states])
        pos = torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)])
        if len(pos):
            rows = slots.repeat_interleave(torch.tensor(ends) - torch.tensor(starts))
            kvs = model.context_kv(model.context([torch.cat(feats[l]) for l in layers]), *fz.rope_tables(pos))
            for cache, (kk, vv) in zip(self.caches, kvs):
                cache.write(rows, pos, kk.transpose(0, 1), vv.transpose(0, 1))
        # the blocks: request r's [anchor, MASK...] at positions n_r .. n_r + b - 1
        b = self.cfg.block_size
        anchors = torch.tensor([s.tokens[-1] for s in states])  # at position n: the newest token
        x = torch.cat([fz.embed[anchors][:, None], model.mask_embed.expand(len(states), b - 1, -1)], 1)
        positions = torch.tensor(ends)[:, None] + torch.arange(b)[None, :]  # [R, b]
        hidden = self.blocks(x, positions, slots)[:, 1: k + 1]
        w = self.branches
        if not self.cfg.ar_head:  # DFlash: a position's guesses do not depend on the tokens before it
            t, c = self.choose(fz.logits(hidden), states)  # [R, k, w]
            rest = (t[:, None, 1:].expand(-1, w, -1, -1), c[:, None, 1:].expand(-1, w, -1, -1))
            return self.proposals_from_chains(rest, t[:, 0], c[:, 0])
        # the chains, each link conditioned on the token before it, one op for all blocks; the
        # other first guesses' chains in a second call
        cands = candidates(fz, hidden, self.cfg.rescore_top_k)
        stop = self.stop_below if w == 1 else 0.0
        t, c = self.ar_chains(hidden, anchors, cands, w, stop)  # [R, <= k, w]
        if stop:  # each chain up to its own stop, as it would end drafted alone
            return [p.clip(int((p.confidence.double().cumprod(0) >= stop).sum()))
                    for p in self.proposals_from_chains((t[:, None, 1:], c[:, None, 1:]), t[:, 0], c[:, 0])]
        rest_t, rest_c = t[:, None, 1:], c[:, None, 1:]
        if w > 1:
            alt = self.ar_chains(hidden[:, 1:].repeat_interleave(w - 1, 0), t[:, 0, 1:].reshape(-1),
                                 None if cands is None else cands[:, 1:].repeat_interleave(w - 1, 0), 1)
            alt_t, alt_c = (a.unflatten(0, (len(states), w - 1)).expand(-1, -1, -1, w) for a in alt)
            rest_t, rest_c = torch.cat([rest_t, alt_t], 1), torch.cat([rest_c, alt_c], 1)
        return self.proposals_from_chains((rest_t, rest_c), t[:, 0], c[:, 0])

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The draft layers over one block per request: x [R, b, h] at positions [R, b] of slots
        [R], in one call (DecoderStack.forward_blocks, up to SKINNY_MAX_ROWS rows): each layer
        writes the blocks' keys and values into its cache, then every row attends to its slot's
        keys up to the block's last position (the context and its whole block,
        bidirectionally)."""
        r, b = positions.shape
        for cache in self.caches:
            cache.fit(slots)
        ks, vs = [c.k for c in self.caches], [c.v for c in self.caches]
        rows = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        per = max(1, SKINNY_MAX_ROWS // b)  # blocks a call
        out = [self.stack.forward_blocks(rows(x[a: a + per]), self.frozen.cos, self.frozen.sin, ks, vs,
                                         slots[a: a + per].repeat_interleave(b), rows(positions[a: a + per]),
                                         positions[a: a + per, -1].repeat_interleave(b))
               for a in range(0, r, per)]
        return torch.cat(out).view(r, b, -1)

    def ar_chains(self, hidden: torch.Tensor, anchors: torch.Tensor, cands, width: int, stop_below: float = 0.0):
        """The AR head's chains over hidden [R, n, h] from anchors [R]: tokens, confidence
        [R, <= n, width] (the best `width` guesses per link; the first goes on; draft_head's
        stop_below)."""
        model, fz, ar = self.model, self.frozen, self.model.ar
        # every link's products read the weights in the engine's precision and kernels (bf16
        # tiles, a quantized scheme): over the whole draft vocabulary one call (self.head);
        # re-scoring gathers float32 rows of the head link by link
        if cands is None:
            return tuple(self.head.chains(hidden, anchors, width, stop_below))
        return draft_head(
            hidden.contiguous(), anchors, fz.embed, model.head_norm.weight, model.prev_norm.weight,
            ar.gate.serving_weight, ar.up.serving_weight, ar.down.serving_weight, fz.norm_w, fz.lm_head,
            fz.vocab_ids, fz.eps, cands, width, stop_below)


class DFlashDrafter(DFlyDrafter):
    name = "dflash"
