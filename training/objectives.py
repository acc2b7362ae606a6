"""Training objectives: MTP's TTT rollout and the block objective of DFly/DFlash.

A batch is S sequences padded to T: tokens [S, T], `label_ok` [S, T] (True where the token is a
fair label: a response token the target generated, or a prompt token past the system preamble
when prompt positions teach too), features {layer: [S, T, h]} (the frozen target's hidden states,
cached by the data step). Two kinds of labels:
- soft (distillation): at every labelled position the target's own next-token distribution, its
  logits from the cached last hidden state restricted to the draft vocabulary and renormalised
  there (the mass outside the draft vocabulary is dropped, as EAGLE-3 does with its reduced
  vocabulary), and the loss is KL(target || draft);
- hard: the token itself (the target's greedy choice), mapped to the draft vocabulary; a token
  outside it is not trained on.
A token outside the draft vocabulary can never be drafted: the accuracies count it as a miss.
Each objective returns (loss, metrics), where metrics["tau"] is the
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


def teacher_logprobs(fz: Frozen, h_last: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's next-token log-probabilities over the draft vocabulary after `positions`
    [S, N] (indices into h_last [S, T, h], its cached last hidden states): its logits there,
    restricted to the draft vocabulary and renormalised -> [S, N, Vd]. No gradient."""
    with torch.no_grad():
        rows = h_last.gather(1, positions[..., None].expand(-1, -1, h_last.shape[-1]))
        return torch.log_softmax(fz.logits(rows).float(), -1)


def soft_kl(logits: torch.Tensor, teacher: torch.Tensor, ok: torch.Tensor,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean (or `weight`-weighted mean) over the `ok` rows of KL(teacher || draft), the draft's
    logits [..., Vd] against the teacher's log-probabilities [..., Vd]: the cross-entropy less the
    teacher's entropy (the same gradient; 0 when the draft matches the target)."""
    kl = (teacher.exp() * (teacher - torch.log_softmax(logits.float(), -1))).sum(-1)
    w = ok.float() if weight is None else weight * ok
    return (kl * w).sum() / w.sum().clamp(min=1e-6)


def ttt_rollout(model, fz: Frozen, tokens, label_ok, feats, steps: int = 4, draft_len: int = 3,
                labels=None, soft: bool = False):
    """MTP loss (docs/algorithms.md, section 1): the label of step k at base i is always t[i+k+1]
    (soft: the target's distribution after position i+k), even after the draft's own tokens
    diverged; the loss is the mean of the step losses. `labels` [S, T]: the token at each
    position the accuracies (and hard labels) count (default: `tokens`; prompt positions: the
    target's own choice with hard labels, the real prompt token with soft ones, whose teacher
    distributions follow the real prompt)."""
    T = tokens.shape[1]
    labels = tokens if labels is None else labels
    base, real = label_bases(label_ok, steps)
    all_logits = rollout(model, fz, tokens, model.features(feats), steps, base)
    W = base.shape[1]
    if soft:  # one window of teacher rows covers every step: base i's step k reads row i + k
        window = (base[:, :1] + torch.arange(W + steps + 1)).clamp(max=T - 1)
        teacher = teacher_logprobs(fz, feats[model.cfg.target_num_layers], window)
    losses, hits, oks = [], [], []
    for step, logits in enumerate(all_logits, 1):
        # label t[i+step+1] for base i; past the end of the sequence there is none
        at = base + step + 1
        inside = real & (at < T)
        at = at.clamp(max=T - 1)
        lab = fz.index[labels.gather(1, at)]
        ok = inside & label_ok.gather(1, at)
        oks.append(ok)
        if soft:
            losses.append(soft_kl(logits, teacher[:, step: step + W], ok))
        else:
            fit = ok & (lab >= 0)
            losses.append(F.cross_entropy(logits[fit], lab[fit]) if fit.any() else logits.sum() * 0)
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
                    gamma: float = 4.0, labels=None, soft: bool = False, own: float = 0.0,
                    generator=None):
    """DFly/DFlash with the multi-anchor block mask: every anchor a makes one block
    [t[a], MASK...] at positions a..a+B-1 that sees the context strictly before a and itself.

    loss "ce": cross-entropy to the target's tokens (soft: to its distributions), position k
    weighted exp(-(k-1)/gamma);
    loss "tv": end-to-end TV, 1 - mean_j prod_{i<=j} alpha_i with alpha = sum_x min(p, q), p the
    target's distribution (over the draft vocabulary) and q the draft's.
    labels [S, T]: the token at each position the loss and accuracies count (default: `tokens`;
    prompt positions: the target's own choice with hard labels). The AR head reads the
    token before each link: the anchor, then the labels (teacher forcing), or, in a fraction
    `own` of the blocks (drawn with `generator`), its own greedy chain link by link, as served.
    """
    labels = tokens if labels is None else labels
    cfg = model.cfg
    B = cfg.block_size
    S, T = tokens.shape
    hidden = block_hidden(model, fz, tokens, feats, anchors)
    safe = (anchors[..., None] + torch.arange(B)).clamp(max=T - 1)
    teacher = None
    if soft or loss == "tv":  # the target's distribution at position a+k-1 (which predicts t[a+k])
        teacher = teacher_logprobs(fz, feats[cfg.target_num_layers], safe[..., :-1].flatten(1))
        teacher = teacher.view(S, -1, B - 1, teacher.shape[-1])
    lab = fz.index[labels.gather(1, safe[..., 1:].flatten(1)).view(S, -1, B - 1)]
    ok = valid[..., None].expand_as(lab)
    # teacher forcing: the anchor token, then the labels before each link
    prev_tok = labels.gather(1, safe[..., :-1].flatten(1)).view(S, -1, B - 1)
    prev_tok[..., 0] = tokens.gather(1, anchors)
    if cfg.ar_head and own > 0:
        logits = own_chain(model, fz, hidden, prev_tok, torch.rand(anchors.shape, generator=generator) < own)
    else:
        logits = fz.logits(model.head(hidden, fz.embed[prev_tok]))  # [S, A, B-1, Vd]
    pred = logits.argmax(-1)
    hits = (pred == lab) & ok
    metrics = {"acc": float(hits.sum()) / max(1, int(ok.sum()))}
    if valid.any():
        metrics["tau"] = 1 + float(leading(hits[valid]).float().mean())
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma)
    if loss == "ce" and soft:
        value = soft_kl(logits, teacher, ok, w)
    elif loss == "ce":
        fit = ok & (lab >= 0)
        ce = F.cross_entropy(logits.flatten(0, -2), lab.clamp(min=0).flatten(), reduction="none")
        wk = (w * fit).flatten()
        value = (ce * wk).sum() / wk.sum().clamp(min=1e-6)
    elif loss == "tv":
        q = torch.softmax(logits, -1)
        alpha = torch.minimum(teacher.exp(), q).sum(-1) * valid[..., None]  # [S, A, B-1]
        expected = alpha.cumprod(-1).mean(-1)  # expected accepted fraction of the block
        value = 1 - expected[valid].mean() if valid.any() else logits.sum() * 0
    else:
        raise ValueError(f"unknown loss {loss!r} (ce or tv)")
    metrics["loss"] = float(value.detach())
    return value, metrics


def own_chain(model, fz: Frozen, hidden, prev_tok, mine) -> torch.Tensor:
    """The AR head's logits [S, A, B-1, Vd] link by link: the blocks where `mine` [S, A] is
    True read their own previous link's argmax (no gradient through the choice) after the
    anchor, as served; the others read `prev_tok` (teacher forcing)."""
    out, prev = [], prev_tok[..., 0]
    for i in range(hidden.shape[-2]):
        if i:
            own = fz.vocab_ids[out[-1].detach().argmax(-1)]
            prev = torch.where(mine, own, prev_tok[..., i])
        out.append(fz.logits(model.head(hidden[..., i, :], fz.embed[prev])))
    return torch.stack(out, -2)


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
    at = anchors[:, None] + torch.arange(1, draft_len + 1)
    truth = torch.where(at < T, tokens[at.clamp(max=T - 1)], -1)  # the tokens a draft must match
    if model.cfg.kind == "mtp":  # the draft at p rolls out from base p-1 (h[p-1], t[p])
        steps = rollout(model, fz, batch, model.features(fb), draft_len, anchors[None] - 1)
        pred = torch.stack([fz.vocab_ids[l[0].argmax(-1)] for l in steps], -1)
    else:
        hidden = block_hidden(model, fz, batch, fb, anchors[None])[0, :, :draft_len]
        if model.cfg.ar_head and not model.cfg.rescore_top_k:
            accepted[start: T - 1] = chain_accepted(model, fz, hidden, tokens[anchors], truth)
            return accepted
        pred = fz.vocab_ids[greedy_chain(model, fz, hidden, tokens[anchors]) if model.cfg.ar_head
                            else fz.logits(hidden).argmax(-1)]
    accepted[start: T - 1] = leading(pred == truth)
    return accepted


def chain_accepted(model, fz: Frozen, hidden, anchor_tok, truth) -> torch.Tensor:
    """leading(greedy_chain(...) == truth) for blocks [A, n, h], link by link, each link run only
    for the blocks whose links before it all matched: what follows a miss is never accepted."""
    accepted = torch.zeros(len(hidden), dtype=torch.long)
    alive, prev = torch.arange(len(hidden)), anchor_tok
    for i in range(hidden.shape[1]):
        tok = fz.vocab_ids[fz.logits(model.head(hidden[alive, i], fz.embed[prev])).argmax(-1)]
        ok = tok == truth[alive, i]
        accepted[alive[ok]] += 1
        alive, prev = alive[ok], tok[ok]
        if not len(alive):
            break
    return accepted


def walk(accepted: torch.Tensor, start: int) -> tuple[int, int]:
    """Greedy serving over a sequence of len(accepted) tokens from its newest committed token at
    `start`: each step commits the accepted drafts + 1 (up to the end) and moves past them.
    -> (tokens committed, verification steps)."""
    steps = served_steps(accepted, start)
    return sum(steps) + len(steps), len(steps)


def served_steps(accepted: torch.Tensor, start: int) -> list[int]:
    """The draft tokens each verification step of that walk accepts (the last step's cut at the
    end of the sequence)."""
    end, p, out = len(accepted) - 1, start, []
    while p < end:
        c = min(int(accepted[p]) + 1, end - p)
        out.append(c - 1)
        p += c
    return out


def depth_acceptance(steps: list[int], depth: int) -> list[float]:
    """alpha_d for d = 1..depth: of the steps whose first d-1 drafts were accepted, the share
    that accepted the d-th too (a draft always proposes `depth` tokens in training's walk)."""
    out = []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in steps)
        out.append(sum(a >= d for a in steps) / reached if reached else 0.0)
    return out


def cosine_lr(step: int, progress: float, warmup: int, floor: float = 0.1) -> float:
    """Learning-rate multiplier: linear warm-up over the first `warmup` steps, then cosine down
    to `floor` as `progress` (the share of the training budget spent) goes from 0 to 1."""
    if step < warmup:
        return (step + 1) / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
