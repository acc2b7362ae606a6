"""Serving side shared by the trained drafters (mtp, dfly, dflash): load a draft for a target,
keep per-request KV caches, and turn draft logits into proposals."""
from __future__ import annotations

import dataclasses
import pathlib

import torch

from angelspec.drafters.base import Drafter, Proposal
from angelspec.drafters.draft_checkpoint import DraftConfig, load_draft
from angelspec.drafters.modules import Frozen, Linear
from angelspec.plugins import served
from angelspec.plugins.attention import KEY_TILE, kv_cache
from angelspec.plugins.decoder_layer import prepare_stack
from angelspec.sampling import probs_from_logits


class SlotCache:
    """A draft layer's keys and values in the target's cache layout (plugins.attention.kv_cache,
    the engine's KV value type), a slot per request or branch as the caller assigns them, grown
    as slots appear; positions up to `max_len`. Entries past a request's committed positions are
    stale and overwritten by its next step, as in the target's cache."""

    def __init__(self, nkv: int, hd: int, max_len: int, dtype=torch.float32):
        self.nkv, self.hd, self.max_len, self.dtype = nkv, hd, max_len, dtype
        self.k = self.v = None

    def fit(self, slots: torch.Tensor) -> None:
        """Room for every slot in `slots` (doubling: growing costs O(1) per slot)."""
        top = int(slots.max()) + 1
        if self.k is None or self.k.shape[0] < top:
            have = 0 if self.k is None else self.k.shape[0]
            k, v = kv_cache(max(top, 2 * have), self.nkv, self.hd, self.max_len, self.dtype)
            if have:
                k[:have], v[:have] = self.k, self.v
            self.k, self.v = k, v

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [N, Hkv, D] of rows at (slot, position) each."""
        self.fit(slots)
        self.k[slots, :, positions // KEY_TILE, :, positions % KEY_TILE] = k.to(self.dtype)
        self.v[slots, :, positions] = v.to(self.dtype)


def stacked(linears: list, weights: str):
    """The weights of `linears` (same inputs) stacked, their outputs one after another, as the
    engine serves a matmul of `weights` (plugins.served; float32 as they are)."""
    w = torch.cat([m.weight.detach().float() for m in linears]).contiguous()
    return w if weights == "float32" else served(w, weights)


def layer_stack(layers: list, weights: str):
    """Draft decoder layers (modules.DecoderLayer) as one DecoderStack (plugins.decoder_layer):
    the engine's kernels, weights served as it serves its own."""
    dicts = [dict(in_norm=l.in_norm.weight.detach().float().contiguous(),
                  post_norm=l.post_norm.weight.detach().float().contiguous(),
                  qkv=stacked([l.q_proj, l.k_proj, l.v_proj], weights), o=stacked([l.o_proj], weights),
                  gate_up=stacked([l.mlp.gate, l.mlp.up], weights), down=stacked([l.mlp.down], weights),
                  qkv_b=None, o_b=None, gate_up_b=None, down_b=None) for l in layers]
    first = layers[0]
    return prepare_stack(dicts, first.in_norm.eps, first.nq, first.nkv, first.hd)


def choose(logits: torch.Tensor, ids: torch.Tensor, states: list,
           width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [R, ..., m] of R requests over target token ids `ids` ([m] or logits' shape)
    -> (tokens, confidence) [R, ..., width]: the best `width` guesses, best first, and the draft's
    probability of each under each request's sampling (greedy: plain softmax; sampling: after its
    temperature/top-k/top-p, the chance that the target's own sample is that token, if the draft
    were the target). Greedy requests share one softmax."""
    ids = ids.expand(logits.shape)
    if all(s.params.greedy for s in states):
        probs = torch.softmax(logits.float(), -1)
    else:
        probs = torch.stack([torch.softmax(row.float(), -1) if s.params.greedy else
                             probs_from_logits(row.reshape(-1, row.shape[-1]), s.params).reshape(row.shape)
                             for row, s in zip(logits, states)])
    conf, idx = probs.topk(width, dim=-1)
    return ids.gather(-1, idx), conf


class TrainedDrafter(Drafter):
    """Base of the drafters built from a trained draft checkpoint. `model_cls` is the nn.Module."""
    model_cls = None

    def __init__(self, target, path: str | pathlib.Path, **options):
        """options (checked by the registry, angelspec.drafters.OPTIONS): draft_len,
        rescore_top_k, draft_vocab=0 (serve over the full vocabulary), branches (1: a chain;
        b > 1: a tree of the b best first tokens, each continued, and the runners-up along the
        best chain; proposals_from_chains)."""
        self.branches = options.pop("branches", 1)
        cfg, state = load_draft(path, target)
        if cfg.kind != self.name:
            raise ValueError(f"{path} holds a {cfg.kind} draft, not {self.name}")
        trained_vocab = state["vocab_ids"]
        cfg = dataclasses.replace(cfg, **options)
        super().__init__(cfg.draft_len)
        self.cfg: DraftConfig = cfg
        self.model = self.model_cls(dataclasses.replace(cfg, draft_vocab=len(trained_vocab)))
        self.model.load_state_dict(state)
        self.model.eval().requires_grad_(False)
        vocab = self.model.vocab_ids if cfg.draft_vocab else torch.arange(cfg.vocab_size)
        self.frozen = Frozen(target.model, vocab)
        self.capture = tuple(cfg.target_layers)
        # the engine's precision and kernels (bf16 tiles, a quantized scheme): the draft's
        # numbers never change what is committed, only how fast it drafts
        for m in self.model.modules():
            if isinstance(m, Linear):
                m.scheme = target.model.weights

    def choose(self, logits: torch.Tensor, states: list, ids: torch.Tensor | None = None):
        """The best `branches` tokens [R, ..., branches] from draft logits [R, ..., m] of R
        requests over the draft vocabulary, or over target ids `ids`, with their confidence."""
        return choose(logits, self.frozen.vocab_ids if ids is None else ids, states, self.branches)

    @staticmethod
    def proposals_from_chains(cont: tuple[torch.Tensor, torch.Tensor], first: torch.Tensor,
                              conf1: torch.Tensor) -> list[Proposal]:
        """first, conf1 [R, b]: each request's best b first tokens; cont = (tokens, confidence)
        [R, b, k - 1, b]: each first token's chain continued, with the b best guesses at each
        step (the first goes on) -> one proposal per request: the best chain, the runners-up
        along it as leaves, then the other first tokens' chains (a chain when b = 1)."""
        tokens, confs = cont
        if first.shape[1] == 1:  # chains: no tree to merge
            return [Proposal(torch.cat([f, t[0, :, 0]]).long(), torch.cat([c1, c[0, :, 0]]).float())
                    for f, c1, t, c in zip(first, conf1, tokens, confs)]
        out = []
        for r in range(len(first)):
            chains = [([int(first[r, j])] + tokens[r, j, :, 0].tolist(),
                       [float(conf1[r, j])] + confs[r, j, :, 0].tolist()) for j in range(first.shape[1])]
            best, best_conf = chains[0]
            runners = [(best[:d + 1] + [int(tokens[r, 0, d, w])], best_conf[:d + 1] + [float(confs[r, 0, d, w])])
                       for d in range(tokens.shape[2]) for w in range(1, tokens.shape[3])]
            out.append(Proposal.tree([chains[0]] + runners + chains[1:]))
        return out

    def release(self, state) -> None:
        state.drafter_state.clear()

    def on_commit(self, state, hidden: dict[int, torch.Tensor]) -> None:
        """Queue the target's hidden rows of newly cached positions until the next proposal."""
        pending = state.drafter_state.setdefault("pending", {l: [] for l in self.capture})
        for l in self.capture:
            pending[l].append(hidden[l])

    @staticmethod
    def take_pending(state) -> dict[int, torch.Tensor]:
        pending = state.drafter_state.get("pending", {})
        out = {l: rows[0] if len(rows) == 1 else torch.cat(rows) for l, rows in pending.items() if rows}
        for rows in pending.values():
            rows.clear()
        return out
