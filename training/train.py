"""`angelspec train --recipe mtp|dfly|dflash|ngram`: one loop for the three trained drafters
(ngram's recipe builds its datastore instead: no gradient steps).

Reads the data step's sequences and cached target features, trains the draft against the frozen
target, saves `<out>/model.safetensors` + `config.json` (a servable draft) and `train_state.pt`
(optimizer, step: a rerun resumes), logs to `<out>/log.jsonl`. Multi-process with torchrun
(DistributedDataParallel; gloo on CPU, NCCL on GPU): each process takes its share of every batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from angelspec.default_target import load_target_or_default
from angelspec.drafters import Datastore
from angelspec.drafters.dfly import DFly
from angelspec.drafters.draft_checkpoint import DraftConfig, load_draft, save_draft
from angelspec.drafters.modules import Frozen
from angelspec.drafters.mtp import MTP
from angelspec.drafters.target_layers import dfly_layers, mtp_layers
from angelspec.plugins import amx_available
from angelspec.prompts import DOMAINS
from angelspec.runtime.cost import cpu_flags
from angelspec.training.curve import plot, read_curve, table
from angelspec.training.data import Sequences, ensure_teachers, load
from angelspec.training.objectives import (
    accepted_at,
    block_objective,
    cosine_lr,
    depth_acceptance,
    sample_anchors,
    served_steps,
    ttt_rollout,
)
from angelspec.training.recipe import Recipe, load_recipe

MODELS = {"mtp": MTP, "dfly": DFly, "dflash": DFly}


# -- data ------------------------------------------------------------------------------------
def collate(items: list[dict], max_len: int, layers: list[int], prompt_from: int | None = None):
    """Pad sequences to the longest (cut at max_len): tokens [S, T], label_ok [S, T], features,
    labels [S, T]. Labels are the response tokens the target generated and, with `prompt_from`,
    also the prompt's from that position on (past the system preamble every prompt shares):
    there labels[s, j] is the target's own choice after position j-1 where the data folder has
    it (teacher ids, for hard labels), else the prompt's token (soft labels read the target's
    distribution after the real prompt instead)."""
    T = min(max_len, max(len(it["tokens"]) for it in items))
    S, h = len(items), items[0]["features"][layers[0]].shape[-1]
    tokens = torch.zeros(S, T, dtype=torch.long)
    label_ok = torch.zeros(S, T, dtype=torch.bool)
    feats = {l: torch.zeros(S, T, h) for l in layers}
    for s, it in enumerate(items):
        n = min(T, len(it["tokens"]))
        tokens[s, :n] = it["tokens"][:n]
        label_ok[s, it["prompt_len"] if prompt_from is None else prompt_from:n] = True
        for l in layers:
            feats[l][s, :n] = it["features"][l][:n]
    labels = tokens.clone()
    if prompt_from is not None:
        for s, it in enumerate(items):
            p = min(T, it["prompt_len"])
            if "teacher" in it and p > 1:
                labels[s, 1:p] = it["teacher"][: p - 1]
    return tokens, label_ok, feats, labels


def draft_vocab(seqs, indices: list[int], size: int, vocab_size: int, keep: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens of the training sequences (+ `keep`), sorted."""
    if not size or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size)
    for i in indices:
        it = seqs.ids(i)
        counts += torch.bincount(it["tokens"][it["prompt_len"]:], minlength=vocab_size).float()
    counts[torch.tensor(keep, dtype=torch.long)] = float("inf")
    return counts.topk(size).indices.sort().values


VOCAB_SIZES = (4096, 8192, 16384, 32768)  # the draft vocabularies whose coverage a new draft records


def vocab_coverage(seqs, train_idx: list[int], val_idx: list[int], vocab_size: int, keep: list[int],
                   sizes=VOCAB_SIZES) -> dict:
    """{size: {domain: share}}: how much of the held-out responses (the target's greedy output)
    a draft vocabulary of each size, chosen from the training responses, covers, per domain: a
    token outside it can never be drafted."""
    out = {}
    for size in sizes:
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[draft_vocab(seqs, train_idx, size, vocab_size, keep)] = True
        hits, total = {}, {}
        for i in val_idx:
            it = seqs.ids(i)
            d, resp = DOMAINS[it["domain"]], it["tokens"][it["prompt_len"]:]
            hits[d] = hits.get(d, 0) + int(inside[resp].sum())
            total[d] = total.get(d, 0) + len(resp)
        out[str(size)] = {d: round(hits[d] / total[d], 4) for d in total if total[d]}
    return out


# -- model -----------------------------------------------------------------------------------
def init_from_target(model: torch.nn.Module, target, fz: Frozen) -> None:
    """Start draft layers from the target's last decoder layers; mask embedding = mean token."""
    layers = [model.layer] if hasattr(model, "layer") else list(model.layers)
    src = target.model.layers[-len(layers):]
    c = target.config
    nq, nkv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    with torch.no_grad():
        for dst, w in zip(layers, src):
            q, k, v = w["qkv"].split([nq, nkv, nkv])
            dst.q_proj.weight.copy_(q)
            dst.k_proj.weight.copy_(k)
            dst.v_proj.weight.copy_(v)
            dst.o_proj.weight.copy_(w["o"])
            dst.in_norm.weight.copy_(w["in_norm"])
            dst.post_norm.weight.copy_(w["post_norm"])
            dst.mlp.gate.weight.copy_(w["gate_up"][:inter])
            dst.mlp.up.weight.copy_(w["gate_up"][inter:])
            dst.mlp.down.weight.copy_(w["down"])
        if hasattr(model, "mask_embed"):
            model.mask_embed.copy_(fz.embed.mean(0))


def use_bf16(autocast: str) -> bool:
    """Whether training steps (on the CPU) run under bf16 autocast (weights, optimizer state,
    norms and losses stay float32): `bf16`, `none`, or `auto` (bf16 when the CPU multiplies bf16
    in hardware: AMX-BF16 tiles or AVX512-BF16, where steps ran faster (docs/training.md);
    emulated elsewhere, so float32)."""
    if autocast not in ("auto", "bf16", "none"):
        raise ValueError(f"autocast={autocast!r}: auto, bf16 or none")
    if autocast == "auto":
        return amx_available() or "avx512_bf16" in cpu_flags()
    return autocast == "bf16"


def draft_config(recipe: Recipe, target) -> DraftConfig:
    kind = recipe.kind
    n = target.config.num_layers
    if kind == "mtp":
        extra = dict(target_layers=mtp_layers(n, recipe.feature_layers), num_layers=1,
                     draft_len=recipe.draft_len)
    else:
        b = recipe.block_size
        extra = dict(target_layers=dfly_layers(n), num_layers=recipe.num_layers, block_size=b,
                     draft_len=b - 1, hybrid=recipe.hybrid, ar_head=recipe.ar_head,
                     prior_sharpness=recipe.prior_sharpness)
    vocab = recipe.draft_vocab if 0 < recipe.draft_vocab < target.config.vocab_size else 0
    return DraftConfig.for_target(target, kind, draft_vocab=vocab, **extra)


class Objective(torch.nn.Module):
    """The draft plus its loss, as one module: DistributedDataParallel wraps this."""

    def __init__(self, model, fz: Frozen, recipe: Recipe):
        super().__init__()
        self.model, self.fz, self.recipe = model, fz, recipe

    def forward(self, tokens, label_ok, feats, labels, anchors=None, valid=None, loss="ce", own=0.0,
                generator=None):
        r = self.recipe
        soft = r.labels == "soft"
        if r.kind == "mtp":
            return ttt_rollout(self.model, self.fz, tokens, label_ok, feats, r.ttt_steps,
                               r.draft_len, labels, soft=soft)
        return block_objective(self.model, self.fz, tokens, label_ok, feats, anchors, valid,
                               loss=loss, gamma=r.gamma, labels=labels, soft=soft, own=own,
                               generator=generator)


OBJECTIVE_SEQUENCES = 48  # held-out sequences the objective's loss and accuracies are averaged over


def evaluate(model, fz, recipe, seqs, indices, layers, prefix: str = "val", objective: bool = True) -> dict:
    """Held-out metrics over the responses of the sequences `indices`: the training objective's
    loss and accuracies (val_loss, val_acc*: over the first OBJECTIVE_SEQUENCES of them, a check
    against over-fitting), and what greedy serving would measure, each
    response walked as serving walks it from its first token: `val_tau` (the accept length),
    `val_alpha{d}` (of the verification steps whose first d-1 drafts were accepted, the share
    that accepted the d-th) and `val_coverage` (the share of the response tokens, the target's
    greedy output, inside the draft vocabulary); these three also per domain (`_chat`, ...).
    `prefix` names them (`outside`: a data folder of prompts from other sources); without
    `objective`, the walk alone."""
    model.eval()
    totals, weight, walked = {}, 0, {}
    with torch.no_grad():
        for i in range(0, len(indices), recipe.batch_size):
            items = [seqs[j] for j in indices[i: i + recipe.batch_size]]
            batch = collate(items, recipe.max_seq_len, layers)[:3]
            m = {}  # past the first OBJECTIVE_SEQUENCES, the walk alone: what serving measures
            if objective and i < OBJECTIVE_SEQUENCES and recipe.kind == "mtp":
                _, m = ttt_rollout(model, fz, *batch, recipe.ttt_steps, recipe.draft_len,
                                   soft=recipe.labels == "soft")
            elif objective and i < OBJECTIVE_SEQUENCES:
                g = torch.Generator().manual_seed(1234 + i)
                anchors, valid = sample_anchors(batch[1], model.cfg.block_size, 64, g)
                _, m = block_objective(model, fz, *batch, anchors, valid, soft=recipe.labels == "soft")
            m.pop("tau", None)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
            weight += bool(m)
            for it in items:
                n = min(len(it["tokens"]), recipe.max_seq_len)
                feats = {l: f[:n] for l, f in it["features"].items()}
                acc = accepted_at(model, fz, it["tokens"][:n], feats, it["prompt_len"],
                                  model.cfg.draft_len)
                w = walked.setdefault(DOMAINS[it["domain"]], {"steps": [], "inside": 0, "tokens": 0})
                w["steps"] += served_steps(acc, it["prompt_len"])
                response = it["tokens"][it["prompt_len"]: n]
                w["inside"] += int((fz.index[response] >= 0).sum())
                w["tokens"] += len(response)
    model.train()
    out = {f"{prefix}_{k}": v / max(1, weight) for k, v in totals.items()}

    def served(w: dict, suffix: str = "") -> dict:
        steps = w["steps"]
        alphas = depth_acceptance(steps, model.cfg.draft_len)
        return {f"{prefix}_tau{suffix}": (sum(steps) + len(steps)) / max(1, len(steps)),
                **{f"{prefix}_alpha{d}{suffix}": a for d, a in enumerate(alphas, 1)},
                f"{prefix}_coverage{suffix}": w["inside"] / max(1, w["tokens"])}

    if walked:
        every = {"steps": [a for w in walked.values() for a in w["steps"]],
                 "inside": sum(w["inside"] for w in walked.values()),
                 "tokens": sum(w["tokens"] for w in walked.values())}
        out.update(served(every))
        for d, w in walked.items():
            out.update(served(w, f"_{d}"))
    return out


def load_outside(recipe: Recipe, target, layers: list[int], weights: str):
    """(sequences, indices) of `outside_data` in the recipe's domains, or None: a data folder
    made with `angelspec data --prompts FILE --like DATA` (prompts from sources never trained
    on), whose responses every evaluation walks too; its target and weights must be the
    training data's (`weights`), so that it measures what serving would."""
    if not recipe.outside_data:
        return None
    seqs = Sequences(recipe.outside_data, layers=layers)
    if seqs.manifest["target_hash"] != target.model_hash():
        raise ValueError(f"{recipe.outside_data} was generated by another target than {target.path}")
    theirs = seqs.manifest["generation"]["weights"]
    if theirs != weights:
        raise ValueError(f"{recipe.outside_data} was generated with {theirs} weights, the training data "
                         f"with {weights}: make it again with `angelspec data --like {recipe.data}`")
    wanted = {DOMAINS.index(d) for d in recipe.domains}
    return seqs, [i for i in range(len(seqs)) if seqs.ids(i)["domain"] in wanted]


# -- the loop --------------------------------------------------------------------------------
def build_datastore(recipe: Recipe, target, progress: bool = True) -> dict:
    """The ngram drafter's datastore from the target's responses in the data folder (each from
    its prompt's last token on, so a response's opening is keyed by the chat template's end)."""

    manifest, shards = load(recipe.data, layers=[])
    if manifest["target_hash"] != target.model_hash():
        raise ValueError(f"{recipe.data} was generated by another target than {target.path}")
    wanted = {DOMAINS.index(d) for d in recipe.domains}
    responses = []
    for s in shards:
        off, toks = s["offsets"].tolist(), s["tokens"].tolist()
        for j, (dom, plen) in enumerate(zip(s["domains"].tolist(), s["prompt_lens"].tolist())):
            if dom in wanted:
                responses.append(toks[off[j] + plen - 1: off[j + 1]])
    total = sum(len(r) for r in responses)
    with tqdm(total=total, desc="ngram datastore", unit="tok", disable=not progress) as bar:
        store = Datastore.build(responses, recipe.max_ngram, recipe.width, bar.update)
    out = pathlib.Path(recipe.out)
    store.save(out, {"target": str(target.path), "tokenizer_hash": target.tokenizer_hash(),
                     "data": str(recipe.data), "domains": recipe.domains,
                     "responses": len(responses), "tokens": total})
    return {"out": str(out), "responses": len(responses), "tokens": total, "entries": len(store.table)}


@dataclasses.dataclass
class Setup:
    """What training (or evaluating) a draft works on: the recipe's data split, the draft and the
    frozen target it reads, and this process's place among the torchrun processes."""
    recipe: Recipe
    out: pathlib.Path
    cfg: DraftConfig
    layers: list[int]  # the target layers whose cached features the draft reads
    prompt_from: int | None  # where prompt positions start teaching (collate's prompt_from)
    seqs: Sequences
    val: list[int]
    train_idx: list[int]
    outside: tuple | None  # load_outside's (sequences, indices)
    model: torch.nn.Module
    fz: Frozen
    resume: bool  # the draft (and, training, its optimizer state) came from `out`
    world: int
    rank: int


@dataclasses.dataclass
class Budget:
    """Training done so far, saved with the draft: `step`s and `seen` (labelled positions trained
    on, training seconds), against the recipe's `total` steps and `budget` seconds (0: none)."""
    step: int
    seen: dict
    total: int
    budget: float

    def spent(self) -> float:
        """The share of the budget spent: steps, or minutes when sooner."""
        return max(self.step / self.total if self.total else 0.0,
                   self.seen["seconds"] / self.budget if self.budget else 0.0)


def _split(recipe: Recipe, seqs: Sequences) -> tuple[list[int], list[int]]:
    """(held-out, training) indices of the recipe's domains, shuffled by the recipe's seed."""
    wanted = {DOMAINS.index(d) for d in recipe.domains}
    chosen = [i for i in range(len(seqs)) if seqs.ids(i)["domain"] in wanted]
    order = torch.randperm(len(chosen), generator=torch.Generator().manual_seed(recipe.seed))
    chosen = [chosen[i] for i in order]
    n_val = min(recipe.val_sequences, len(chosen) // 5)
    val, train_idx = chosen[:n_val], chosen[n_val:][: recipe.train_sequences or None]
    if not train_idx:
        raise ValueError(f"no training sequences of domains {recipe.domains} in {recipe.data}"
                         ": run `angelspec data` with those domains")
    return val, train_idx


def _draft(recipe: Recipe, target, cfg: DraftConfig, seqs, val, train_idx, resume: bool,
           only_eval: bool):
    """(cfg, model, fz): the draft saved in the recipe's `out` when resuming, else a new one
    (its draft vocabulary and coverage chosen from the training responses)."""
    out = pathlib.Path(recipe.out)
    if resume:
        saved_cfg, weights = load_draft(out, target)
        if saved_cfg.kind != cfg.kind:
            raise ValueError(f"{out} holds a {saved_cfg.kind} draft, not {cfg.kind}: pass another "
                             "out=" + ("" if only_eval else " or --restart"))
        cfg = dataclasses.replace(saved_cfg)
        model = MODELS[cfg.kind](cfg)
        model.load_state_dict(weights)
        return cfg, model, Frozen(target.model, model.vocab_ids)
    torch.manual_seed(recipe.seed)
    model = MODELS[cfg.kind](cfg)
    vocab = draft_vocab(seqs, train_idx, cfg.draft_vocab, cfg.vocab_size, target.eos_ids)
    model.vocab_ids.copy_(vocab)
    cfg.notes["vocab_coverage"] = vocab_coverage(seqs, train_idx, val, cfg.vocab_size, target.eos_ids)
    fz = Frozen(target.model, model.vocab_ids)
    if recipe.init_from_target:
        init_from_target(model, target, fz)
    return cfg, model, fz


def _setup(recipe: Recipe, target, progress: bool, restart: bool, only_eval: bool) -> Setup:
    """Join the torchrun processes, read the data and split it, load or make the draft."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    out = pathlib.Path(recipe.out)
    cfg = draft_config(recipe, target)
    layers = sorted(set(cfg.target_layers) | {target.config.num_layers})
    # prompt positions teach from past the system preamble; hard labels there need the target's
    # own choices (teacher ids, computed once), soft ones read its distribution from the features
    prompt_from = len(target.chat_prefix()) + 1 if recipe.prompt_labels else None
    hard_prompts = recipe.prompt_labels and recipe.labels == "hard"
    if hard_prompts:
        ensure_teachers(recipe.data, target, progress and rank == 0)
    seqs = Sequences(recipe.data, layers=layers, teacher=hard_prompts)
    val, train_idx = _split(recipe, seqs)
    outside = load_outside(recipe, target, layers, seqs.manifest["generation"]["weights"])
    resume = only_eval or ((out / "train_state.pt").exists() and not restart)
    cfg, model, fz = _draft(recipe, target, cfg, seqs, val, train_idx, resume, only_eval)
    return Setup(recipe, out, cfg, layers, prompt_from, seqs, val, train_idx, outside, model, fz,
                 resume, world, rank)


def _evaluations(s: Setup) -> dict:
    """The held-out metrics (evaluate), and those of outside_data's responses, rounded."""
    got = evaluate(s.model, s.fz, s.recipe, s.seqs, s.val, s.layers)
    if s.outside:
        got.update(evaluate(s.model, s.fz, s.recipe, *s.outside, s.layers, "outside", objective=False))
    return {k: round(v, 4) for k, v in got.items()}


def _optimizer(s: Setup) -> tuple[torch.optim.Optimizer, Budget]:
    """The optimizer and the training done so far: both from `train_state.pt` when resuming."""
    r = s.recipe
    opt = torch.optim.AdamW([p for p in s.model.parameters() if p.requires_grad], lr=r.lr,
                            weight_decay=r.weight_decay, betas=(0.9, 0.95))
    step, seen = 0, {"tokens": 0, "seconds": 0.0}  # labelled positions trained on, training time
    if s.resume:
        st = torch.load(s.out / "train_state.pt", weights_only=False)
        if st["recipe"]["data"] != r.data:
            raise ValueError(f"{s.out} was trained on {st['recipe']['data']}, not {r.data}: "
                             "pass another out= or --restart")
        opt.load_state_dict(st["optimizer"])
        step, seen = st["step"], st.get("seen", {"tokens": 0, "seconds": 0.0})
    return opt, Budget(step, seen, r.steps, r.minutes * 60)


def _open_log(s: Setup, step: int):
    """`<out>/log.jsonl` open for appending on rank 0 (None elsewhere): a resumed run keeps the
    rows up to its saved step, a new one starts it empty."""
    if s.rank != 0:
        return None
    s.out.mkdir(parents=True, exist_ok=True)
    log_file = s.out / "log.jsonl"
    rows = log_file.read_text().splitlines() if s.resume and log_file.exists() else []
    kept = [r for r in rows if json.loads(r)["step"] <= step]  # drop steps after the save
    log_file.write_text("".join(r + "\n" for r in kept))
    return log_file.open("a")


def _save(s: Setup, opt, at: Budget) -> None:
    """The draft and `train_state.pt` (optimizer, step, seen; replaced whole) from rank 0; every
    process waits for it."""
    if s.rank == 0:
        s.cfg.trained_steps = at.step
        save_draft(s.out, s.cfg, s.model.state_dict())
        state_file = s.out / "train_state.pt"
        torch.save({"step": at.step, "optimizer": opt.state_dict(), "recipe": s.recipe.to_dict(),
                    "seen": at.seen}, state_file.with_suffix(".tmp"))
        state_file.with_suffix(".tmp").replace(state_file)
    if s.world > 1:
        dist.barrier()


def _stop_now(s: Setup, mine: bool) -> bool:
    """Every process stops at rank 0's step (their clocks differ)."""
    if s.world == 1:
        return mine
    flag = torch.tensor([float(mine)])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _batch(s: Setup, at: Budget, per_step: int, per_epoch: int):
    """This process's share of the step's batch, collated, and the objective's extra arguments
    (DFly/DFlash: anchors, the loss, the AR head's own-token share ramped up from 0)."""
    r = s.recipe
    epoch, k = divmod(at.step, per_epoch)
    perm = torch.randperm(len(s.train_idx), generator=torch.Generator().manual_seed(r.seed * 1000 + epoch))
    mine = [s.train_idx[int(j)] for j in perm[k * per_step: (k + 1) * per_step][s.rank::s.world]]
    tokens, label_ok, feats, labels = collate([s.seqs[i] for i in mine], r.max_seq_len, s.layers,
                                              s.prompt_from)
    extra = {}
    if s.cfg.kind != "mtp":
        g = torch.Generator().manual_seed(r.seed * 7919 + at.step * 31 + s.rank)
        extra = dict(zip(("anchors", "valid"), sample_anchors(label_ok, s.cfg.block_size, r.anchors, g)))
        extra["loss"] = "tv" if at.spent() >= 1 - r.tv_fraction else "ce"
        extra["own"], extra["generator"] = r.ar_own * at.spent(), g
    return tokens, label_ok, feats, labels, extra


def _loop(s: Setup, wrapped, opt, at: Budget, log, progress: bool) -> dict:
    """Step until the budget is spent: a log row every step, evaluations every eval_every steps
    and at the end, a save every save_every steps and at the end; the last row."""
    r = s.recipe
    per_step = r.batch_size * s.world
    per_epoch = max(1, len(s.train_idx) // per_step)
    bf16 = use_bf16(r.autocast)
    bar = tqdm(total=100, initial=round(100 * at.spent(), 1), desc=f"train {s.cfg.kind}",
               unit="%", bar_format="{l_bar}{bar}| {n:.1f}% [{elapsed}<{remaining}{postfix}]",
               disable=not progress or s.rank > 0)
    tokens_here, here_s, done = 0, 0.0, False  # this run's, for its speed
    while not done:
        t0 = time.perf_counter()
        tokens, label_ok, feats, labels, extra = _batch(s, at, per_step, per_epoch)
        for group in opt.param_groups:
            group["lr"] = r.lr * cosine_lr(at.step, at.spent(), r.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, metrics = wrapped(tokens, label_ok, feats, labels, **extra)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), r.grad_clip)
        opt.step()
        at.step += 1
        took, labelled = time.perf_counter() - t0, int(label_ok.sum()) * s.world
        tokens_here, here_s = tokens_here + labelled, here_s + took
        at.seen["tokens"] += labelled
        at.seen["seconds"] += took
        row = {"step": at.step, "lr": opt.param_groups[0]["lr"],
               **{k: round(v, 4) for k, v in metrics.items()},
               "tokens": at.seen["tokens"], "tokens_per_s": round(tokens_here / here_s, 1)}
        done = _stop_now(s, at.spent() >= 1)
        if at.step % r.eval_every == 0 or done:
            t1 = time.perf_counter()
            row.update(_evaluations(s))
            at.seen["seconds"] += time.perf_counter() - t1  # the budget counts evaluations too
            done = _stop_now(s, at.spent() >= 1)  # an evaluation that spent the budget is the last
        row["seconds"] = round(at.seen["seconds"], 2)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        bar.set_postfix({k: v for k, v in row.items() if k in ("step", "loss", "acc", "acc1", "tau", "val_tau",
                                                             "val_alpha1")})
        bar.update(round(100 * min(1.0, at.spent()), 1) - bar.n)
        if at.step % r.save_every == 0 or done:
            _save(s, opt, at)
    bar.close()
    return row


def train(recipe: Recipe, target, progress: bool = True, restart: bool = False,
          only_eval: bool = False) -> dict:
    """Train (or resume) the recipe's draft; only_eval: the held-out metrics of the draft saved
    in the recipe's `out`, nothing trained."""
    if recipe.kind == "ngram":
        return build_datastore(recipe, target, progress)
    s = _setup(recipe, target, progress, restart, only_eval)
    if only_eval:
        return {"out": str(s.out), "step": s.cfg.trained_steps, "val_sequences": len(s.val),
                **_evaluations(s), "vocab_coverage": s.cfg.notes.get("vocab_coverage")}
    objective = Objective(s.model, s.fz, recipe)
    wrapped = torch.nn.parallel.DistributedDataParallel(objective) if s.world > 1 else objective
    opt, at = _optimizer(s)
    if (at.total and at.step >= at.total) or (at.budget and at.seen["seconds"] >= at.budget):
        if s.rank == 0:
            print(f"{s.out}: already trained for {at.step} steps, {at.seen['seconds'] / 60:.1f} min "
                  "(pass --restart to train again)")
        return {"step": at.step, "out": str(s.out)}
    row = _loop(s, wrapped, opt, at, _open_log(s, at.step), progress)
    if s.world > 1:  # identical weights on every rank is what DDP promises: record it
        flat = torch.cat([p.detach().flatten() for p in s.model.parameters()])
        (s.out / f"rank{s.rank}.sha256").write_text(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    return {"step": at.step, "out": str(s.out), **row}


def add_arguments(p) -> None:
    p.add_argument("--recipe", required=True, help="mtp, dfly, dflash, or a YAML file")
    p.add_argument("--preset", choices=["quick", "full"], default=None,
                   help="budget preset from the recipe (default: the recipe's own steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set steps=50 --set lr=5e-4 (repeatable)")
    p.add_argument("--target", help="target checkpoint folder (default: the converted SmolLM2)")
    p.add_argument("--restart", action="store_true", help="ignore a saved state and start over")
    p.add_argument("--show", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--curve", action="store_true",
                   help="print the learning curve of the draft in out= (its log's evaluations: "
                        "accept length per domain and acceptance per depth against steps, "
                        "labelled positions and minutes, on the held-out split and on outside_data's "
                        "prompts), plot it to out=/curve.png, and exit")
    p.add_argument("--eval", action="store_true",
                   help="the learning curve as --curve, then evaluate the saved draft afresh (val_tau: "
                        "the accept length greedy serving would measure) and exit")


def run(args) -> int:

    recipe = load_recipe(args.recipe, args.preset, args.overrides)
    if args.show:
        print(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        return 0
    if args.curve or args.eval:  # the learning curve so far
        rows = read_curve(recipe.out)
        print(table(rows))
        if (made := plot(rows, pathlib.Path(recipe.out) / "curve.png", f"{recipe.kind}: {recipe.out}")):
            print(f"plot: {made}")
        if args.curve:
            return 0
    result = train(recipe, load_target_or_default(args.target), restart=args.restart, only_eval=args.eval)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result))
    return 0
