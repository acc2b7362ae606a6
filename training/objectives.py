"""Training objectives: MTP's TTT rollout and the block objective of DFly/DFlash.

A batch is S sequences padded to T: tokens [S, T], `label_ok` [S, T] (True where the token is a
response token the target generated, i.e. a fair label), features {layer: [S, T, h]} (the frozen
target's hidden states, cached by the data step). Labels map to the draft vocabulary; tokens
outside it are not trained on. Each objective returns (loss, metrics), where metrics["tau"] is the
mean accept length greedy drafting would reach from these positions (accepted + 1 bonus), each
position counted once. Serving does not start a step at every position: it jumps over what a
step accepted, so easy stretches take few steps and hard ones many. `accepted_at` + `walk` go
over a sequence the way serving does: that is the figure `angelspec bench` measures.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from angelspec.drafters.dfly import candidates
from angelspec.drafters.modules import Frozen, attend


def leading(correct: torch.Tensor) -> torch.Tensor:
    """[..., D] bool -> number of leading Trues (accepted draft tokens)."""
    return correct.int().cumprod(-1).sum(-1)


def rollout(model, fz: Frozen, tokens, h_last, steps: int = 4, base=None) -> list[torch.Tensor]:
    """MTP's training-time-test rollout: draft logits [S, W, Vd] of each step, from the base
    positions `base` [S, W] (default: every position 0..T-2).

    Base position i: step 1 reads (embed(t[i+1]), target hidden h[i]) at position i; step k >= 2
    reads the draft's own previous output and its own stop-gradient argmax token at position
    i+k-1, attending to the real keys up to i plus the diagonal keys of the earlier steps, exactly
    what serving sees after k-1 drafted tokens. Keys are computed at every position; queries,
    the MLP and the lm_head only at the bases (training passes the bases that have labels).
    """
    S, n = tokens.shape[0], tokens.shape[1] - 1
    layer = model.layer
    pos = torch.arange(n)
    if base is None:
        base = pos.expand(S, n)
    x = model.inputs(fz.embed[tokens[:, 1:]], h_last[:, :-1])
    xn = layer.in_norm(x)
    k_real, v_real = layer.kv(xn, *fz.rope_tables(pos))
    rows = base[..., None].expand(-1, -1, x.shape[-1])
    x, xn = x.gather(1, rows), xn.gather(1, rows)
    causal = (base[..., None] >= pos)[:, None, None]  # [S, 1, 1, W, n]
    o = layer.finish(x, attend(layer.q(xn, *fz.rope_tables(base)), k_real, v_real, causal))
    out, extra = [fz.logits(o)], []
    for step in range(2, steps + 1):
        prev = fz.vocab_ids[out[-1].argmax(-1)].detach()
        x = model.inputs(fz.embed[prev], o)
        q, ks, vs = layer.qkv(x, *fz.rope_tables(base + step - 1))
        extra.append((ks, vs))
        o = layer.finish(x, attend(q, k_real, v_real, causal, tuple(extra)))
        out.append(fz.logits(o))
    return out


def label_bases(label_ok: torch.Tensor, steps: int):
    """The base positions [S, W] whose rollout has at least one label (step k at base i is
    labelled by token i+k+1), one window per sequence, and which of them are real [S, W]."""
    S, T = label_ok.shape
    n = T - 1
    idx = torch.arange(T)
    first = torch.where(label_ok, idx, T).min(1).values
    last = torch.where(label_ok, idx, -1).max(1).values
    lo = (first - steps - 1).clamp(min=0)
    hi = (last - 2).clamp(max=n - 1)  # step 1 is the last to reach token `last`, from last-2
    width = max(1, int((hi - lo + 1).max()))
    raw = lo[:, None] + torch.arange(width)
    return raw.clamp(max=n - 1), raw <= hi[:, None]


def ttt_rollout(model, fz: Frozen, tokens, label_ok, feats, steps: int = 4, draft_len: int = 3,
                labels=None):
    """MTP loss (docs/algorithms.md, section 1): the label of step k at base i is always t[i+k+1],
    even after the draft's own tokens diverged; the loss is the mean of the step losses.
    `labels` [S, T]: the target's token at each position (default: `tokens`)."""
    T = tokens.shape[1]
    labels = tokens if labels is None else labels
    base, real = label_bases(label_ok, steps)
    all_logits = rollout(model, fz, tokens, model.features(feats), steps, base)
    losses, hits, oks = [], [], []
    for step, logits in enumerate(all_logits, 1):
        # label t[i+step+1] for base i; past the end of the sequence there is none
        at = base + step + 1
        inside = real & (at < T)
        at = at.clamp(max=T - 1)
        lab = fz.index[labels.gather(1, at)]
        ok = inside & label_ok.gather(1, at) & (lab >= 0)
        oks.append(ok)
        losses.append(F.cross_entropy(logits[ok], lab[ok]) if ok.any() else logits.sum() * 0)
        hits.append((logits.argmax(-1) == lab) & ok)
    loss = sum(losses) / len(losses)
    metrics = {"loss": float(loss.detach())}
    for i, (h, ok) in enumerate(zip(hits, oks)):
        metrics[f"acc{i + 1}"] = float(h.sum()) / max(1, int(ok.sum()))
    d = min(draft_len, steps)
    base = torch.stack(oks[:d], -1).all(-1)  # every drafted step has a label: a fair estimate
    if base.any():
        metrics["tau"] = 1 + float(leading(torch.stack(hits[:d], -1)[base]).float().mean())
    return loss, metrics


def sample_anchors(label_ok: torch.Tensor, block: int, count: int, generator=None):
    """Anchors [S, A] (and a validity mask) whose B-1 block labels are all response tokens."""
    S, T = label_ok.shape
    ok = torch.zeros_like(label_ok)
    if T > block - 1:
        # anchor a is usable when labels a+1..a+B-1 all exist and are response tokens
        win = label_ok.int().unfold(1, block - 1, 1).all(-1)  # [S, T-B+2] for start a+1
        ok[:, : win.shape[1] - 1] = win[:, 1:]
    anchors = torch.zeros(S, count, dtype=torch.long)
    valid = torch.zeros(S, count, dtype=torch.bool)
    for s in range(S):
        cand = ok[s].nonzero()[:, 0]
        if len(cand):
            pick = cand[torch.randperm(len(cand), generator=generator)[:count]]
            anchors[s, : len(pick)], valid[s, : len(pick)] = pick, True
    return anchors, valid


def block_hidden(model, fz: Frozen, tokens, feats, anchors) -> torch.Tensor:
    """Backbone output [S, A, B-1, h] of the blocks drafted at `anchors` [S, A]: block j is
    [t[a], MASK...] at positions a..a+B-1 and sees the context strictly before a, and itself."""
    B = model.cfg.block_size
    S, T = tokens.shape
    ctx = model.context([feats[l] for l in model.cfg.target_layers])
    ctx_kv = model.context_kv(ctx, *fz.rope_tables(torch.arange(T)))
    ctx_mask = torch.arange(T)[None, None, :] < anchors[..., None]  # [S, A, T]
    x = torch.cat([fz.embed[tokens.gather(1, anchors)][..., None, :],
                   model.mask_embed.expand(S, anchors.shape[1], B - 1, -1)], dim=-2)
    pos = anchors[..., None] + torch.arange(B)
    return model.block(x, *fz.rope_tables(pos), ctx_kv, ctx_mask)[..., 1:, :]


def greedy_chain(model, fz: Frozen, hidden, anchor_tok) -> torch.Tensor:
    """Serving's AR-head chain over blocks [..., B-1, h]: each link conditioned on the previous
    link's argmax, re-scoring the backbone's top-k when the draft says so. -> vocab indices."""
    cand = candidates(fz, hidden, model.cfg.rescore_top_k)
    preds, prev = [], anchor_tok
    for i in range(hidden.shape[-2]):
        rows = None if cand is None else cand[..., i, :]
        idx = fz.logits(model.head(hidden[..., i, :], fz.embed[prev]), rows).argmax(-1)
        if rows is not None:
            idx = rows.gather(-1, idx[..., None])[..., 0]
        preds.append(idx)
        prev = fz.vocab_ids[idx]
    return torch.stack(preds, -1)


def block_objective(model, fz: Frozen, tokens, label_ok, feats, anchors, valid, loss: str = "ce",
                    gamma: float = 4.0, labels=None):
    """DFly/DFlash with the multi-anchor block mask: every anchor a makes one block
    [t[a], MASK...] at positions a..a+B-1 that sees the context strictly before a and itself.

    loss "ce": cross-entropy to the target's tokens, position k weighted exp(-(k-1)/gamma);
    loss "tv": end-to-end TV, 1 - mean_j prod_{i<=j} alpha_i with alpha = sum_x min(p, q), p the
    target's distribution (over the draft vocabulary) and q the draft's.
    labels [S, T]: the target's token at each position (default: `tokens`); the AR head is
    teacher-forced on them after the anchor.
    """
    labels = tokens if labels is None else labels
    cfg = model.cfg
    B = cfg.block_size
    S, T = tokens.shape
    hidden = block_hidden(model, fz, tokens, feats, anchors)
    safe = (anchors[..., None] + torch.arange(B)).clamp(max=T - 1)
    lab = fz.index[labels.gather(1, safe[..., 1:].flatten(1)).view(S, -1, B - 1)]
    ok = valid[..., None] & (lab >= 0)
    # teacher forcing: the anchor token, then the labels before each link
    prev_tok = labels.gather(1, safe[..., :-1].flatten(1)).view(S, -1, B - 1)
    prev_tok[..., 0] = tokens.gather(1, anchors)
    logits = fz.logits(model.head(hidden, fz.embed[prev_tok]))  # [S, A, B-1, Vd]
    pred = logits.argmax(-1)
    hits = (pred == lab) & ok
    metrics = {"acc": float(hits.sum()) / max(1, int(ok.sum()))}
    full = valid & ok.all(-1)
    if full.any():
        metrics["tau"] = 1 + float(leading(hits[full]).float().mean())
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma)
    if loss == "ce":
        ce = F.cross_entropy(logits.flatten(0, -2), lab.clamp(min=0).flatten(), reduction="none")
        wk = (w * ok).flatten()
        value = (ce * wk).sum() / wk.sum().clamp(min=1e-6)
    elif loss == "tv":
        # teacher: the target's distribution at position a+k-1 (which predicts t[a+k])
        h_last = feats[cfg.target_num_layers]
        src = safe[..., :-1].flatten(1)
        p = torch.softmax(fz.logits(h_last.gather(1, src[..., None].expand(-1, -1, h_last.shape[-1])))
                          .view(S, -1, B - 1, len(fz.vocab_ids)), -1)
        q = torch.softmax(logits, -1)
        alpha = torch.minimum(p, q).sum(-1) * valid[..., None]  # [S, A, B-1]
        expected = alpha.cumprod(-1).mean(-1)  # expected accepted fraction of the block
        value = 1 - expected[valid].mean() if valid.any() else logits.sum() * 0
    else:
        raise ValueError(f"unknown loss {loss!r} (ce or tv)")
    metrics["loss"] = float(value.detach())
    return value, metrics


def accepted_at(model, fz: Frozen, tokens: torch.Tensor, feats: dict, start: int,
                draft_len: int) -> torch.Tensor:
    """One sequence tokens [T], features {layer: [T, h]}: accepted[p] for p >= start = the draft
    tokens greedy serving accepts when the newest committed token is t[p] (the target's features
    known up to p-1): the leading drafts that equal t[p+1], t[p+2], ... (0 before `start`)."""
    T = len(tokens)
    accepted = torch.zeros(T, dtype=torch.long)
    if start >= T - 1:
        return accepted
    anchors = torch.arange(start, T - 1)
    batch, fb = tokens[None], {l: f[None] for l, f in feats.items()}
    if model.cfg.kind == "mtp":  # the draft at p rolls out from base p-1 (h[p-1], t[p])
        steps = rollout(model, fz, batch, model.features(fb), draft_len, anchors[None] - 1)
        pred = torch.stack([fz.vocab_ids[l[0].argmax(-1)] for l in steps], -1)
    else:
        hidden = block_hidden(model, fz, batch, fb, anchors[None])[0, :, :draft_len]
        pred = fz.vocab_ids[greedy_chain(model, fz, hidden, tokens[anchors]) if model.cfg.ar_head
                            else fz.logits(hidden).argmax(-1)]
    at = anchors[:, None] + torch.arange(1, draft_len + 1)
    hits = (pred == tokens[at.clamp(max=T - 1)]) & (at < T)
    accepted[start: T - 1] = leading(hits)
    return accepted


def walk(accepted: torch.Tensor, start: int) -> tuple[int, int]:
    """Greedy serving over a sequence of len(accepted) tokens from its newest committed token at
    `start`: each step commits the accepted drafts + 1 (up to the end) and moves past them.
    -> (tokens committed, verification steps)."""
    end, p, committed, steps = len(accepted) - 1, start, 0, 0
    while p < end:
        c = min(int(accepted[p]) + 1, end - p)
        committed, steps, p = committed + c, steps + 1, p + c
    return committed, steps


def cosine_lr(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
