"""Self-distilled training data: prompts -> the target's own responses -> cached target features.

Responses come from the runtime (ngram drafting: lossless, faster than plain decoding); the
frozen target then runs once over every full sequence and its hidden states at the layers the
trained drafters read are cached, so trainers never recompute them. The target runs with the
matmul weights an engine will serve (`weights`, as `angelspec build --weights`: bf16 where the
CPU has AMX-BF16 tiles), so drafts learn the hidden states and choices they will see when
served. Work is done in shards and the manifest is rewritten after each one, so an interrupted
build resumes where it stopped.

out_dir/
  prompts.jsonl, heldout.jsonl  {prompt, domain, source} per line (heldout: for `angelspec bench`)
  shard-00000.safetensors       tokens int32 [T] (prompt then response ids, samples concatenated),
                                offsets int64 [n+1], prompt_lens int32 [n], domains int8 [n]
  features-00000.safetensors    layer_{i} bf16 [T, hidden] for each i in manifest["layers"]
  teacher-00000.safetensors     teacher int32 [T]: the target's own next-token choice after each
                                position (labels for prompt tokens, where nothing was generated)
  manifest.json                 settings, finished shards, totals
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import time
from collections import Counter

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from angelspec.checkpoint import Target
from angelspec.default_target import load_target_or_default
from angelspec.drafters.target_layers import training_layers
from angelspec.model import Segment
from angelspec.prompts import DOMAINS, read_jsonl
from angelspec.runtime.backend import choose_weights
from angelspec.runtime.engine import Engine, Request
from angelspec.sampling import SamplingParams
from angelspec.training.sources import HELDOUT_EVERY, held_out
from angelspec.training.sources import prompts as draw_prompts

FORMAT = 1
GENERATION_BEFORE = {"weights": "float32"}  # generation settings of folders older than the key


def _write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _prompt_sets(target, out, counts, heldout, max_prompt_tokens, seed):
    """Draw, length-filter and split the prompts once; a rerun reads the same files back."""
    train_f, held_f = out / "prompts.jsonl", out / "heldout.jsonl"
    if train_f.exists() and held_f.exists():
        return read_jsonl(train_f), read_jsonl(held_f)
    train, held = [], []
    for d in DOMAINS:
        if not counts.get(d, 0):
            continue
        n = counts[d] + HELDOUT_EVERY * heldout
        while True:  # draw more until both sides are full (or the source runs out)
            asked = n + n // 4 + 4  # spares for the length filter
            drawn = draw_prompts(d, asked, seed)
            rows = [r for r in drawn if len(target.encode_chat(r["prompt"])) <= max_prompt_tokens]
            mine = [r for r in rows if held_out(r["prompt"])][:heldout]
            rest = [r for r in rows if not held_out(r["prompt"])][:counts[d]]
            if (len(mine), len(rest)) == (heldout, counts[d]) or len(drawn) < asked:
                break
            n *= 2
        held += mine
        train += rest
    random.Random(seed).shuffle(train)  # domains mixed within shards
    _write(held_f, _jsonl(held))
    _write(train_f, _jsonl(train))
    return train, held


def _generate(engine, target, rows, gen, first, bar, speed):
    """Responses for one shard's prompts -> list of (prompt ids, response ids)."""
    reqs = [Request(target.encode_chat(r["prompt"]),
                    SamplingParams(max_tokens=gen["max_tokens"],
                                   temperature=gen["temperature"], seed=gen["seed"] + first + i),
                    drafter=gen["drafter"]) for i, r in enumerate(rows)]
    outs, t0 = [[] for _ in reqs], time.perf_counter()
    for ev in engine.stream(reqs):
        outs[ev.index] += ev.tokens
        speed["tokens"] += len(ev.tokens)
        if ev.finish_reason:
            rate = speed["tokens"] / (speed["s"] + time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(tok_s=f"{rate:.1f}")
    speed["s"] += time.perf_counter() - t0
    return [(r.prompt_ids, o) for r, o in zip(reqs, outs)]


def _features(model, seqs: list[list[int]], layers: list[int], cache,
              pack: int = 1024) -> dict[str, torch.Tensor]:
    """The frozen target's hidden states over each full sequence, bf16, concatenated. Sequences
    are packed into forwards of up to `pack` tokens (one cache slot each): ~15% faster on CPU."""
    feats, i = {l: [] for l in layers}, 0
    while i < len(seqs):
        group, rows = [], 0
        while i < len(seqs) and len(group) < cache.slots and (not group or
                                                              rows + len(seqs[i]) <= pack):
            group.append(seqs[i])
            rows += len(seqs[i])
            i += 1
        lens = torch.tensor([len(s) for s in group])
        batch = model.batch([Segment(j, 0, n) for j, n in enumerate(lens.tolist())])
        _, hidden = model.forward(torch.tensor([t for s in group for t in s]), batch, cache,
                                  logit_rows=lens.cumsum(0) - 1, capture=tuple(layers))
        for l in layers:
            feats[l].append(hidden[l].to(torch.bfloat16))
    return {f"layer_{l}": torch.cat(v).contiguous() for l, v in feats.items()}


def teacher_ids(model, h_last: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """The target's own next-token choice (argmax) after every position, from its cached last
    hidden states [T, h] (bf16, so at a near-tie it can differ from the full-precision choice)."""
    out = [model.head(h_last[i: i + chunk].float()).argmax(-1) for i in range(0, len(h_last), chunk)]
    return torch.cat(out).to(torch.int32)


def ensure_teachers(out_dir, target: Target, progress: bool = True) -> None:
    """Write teacher-*.safetensors for every shard that lacks it (folders made before it
    existed, or shards written by an older build)."""
    out = pathlib.Path(out_dir)
    m = json.loads((out / "manifest.json").read_text())
    last = f"layer_{target.config.num_layers}"
    todo = [s for s in m["shards"] if not (out / teacher_file(s)).exists()]
    for s in tqdm(todo, desc="teacher labels", unit="shard", disable=not progress or not todo):
        with safe_open(str(out / s["features"]), "pt") as f:
            h = f.get_tensor(last)
        with torch.no_grad():
            save_file({"teacher": teacher_ids(target.model, h)}, str(out / teacher_file(s)))


def teacher_file(shard: dict) -> str:
    return shard["features"].replace("features-", "teacher-")


def _totals(shards: list[dict]) -> dict:
    s = lambda k: sum(x[k] for x in shards)  # noqa: E731
    by = {}
    for d in DOMAINS:
        n, r = (sum(x["domains"][d][k] for x in shards) for k in ("n", "response_tokens"))
        if n:
            by[d] = dict(n=n, response_tokens=r, mean_response_tokens=round(r / n, 1))
    return dict(sequences=s("n"), tokens=s("n_tokens"), response_tokens=s("response_tokens"),
                generation_s=round(s("generation_s"), 3), feature_s=round(s("feature_s"), 3),
                by_domain=by)


def _open_manifest(out: pathlib.Path, new: dict) -> dict:
    """The existing manifest when it was made with the same target and settings, else `new`."""
    f = out / "manifest.json"
    if not f.exists():
        return new
    old = json.loads(f.read_text())
    diff = [k for k in ("format", "target_hash", "layers", "requested") if old.get(k) != new[k]]
    diff += [f"generation.{k}" for k, v in new["generation"].items() if k != "batch_size" and
             old.get("generation", {}).get(k, GENERATION_BEFORE.get(k)) != v]
    if diff:
        raise ValueError(f"{out} holds data made for another target or other settings "
                         f"({', '.join(diff)} differ): pass another --out or delete the folder")
    return old


def build(target: Target, out_dir, counts: dict[str, int], heldout: int, max_tokens: int,
          max_prompt_tokens: int, batch_size: int = 64, temperature: float = 0.0, seed: int = 0,
          shard_size: int = 64, progress: bool = True, weights: str = "auto") -> dict:
    """Build (or resume) a data folder; returns the manifest. weights: the dtype of the target's
    matmul weights (auto: as `angelspec build` will serve them; the caller's target is left
    as it is)."""

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = choose_weights(target.model, weights)["dtype"]
    if dtype != target.model.weights:
        if dtype == "float32":
            raise ValueError("this target already serves bf16 weights: pass a float32 one")
        target = dataclasses.replace(target, model=target.model.bf16_copy())
    cfg, model = target.config, target.model
    layers = training_layers(cfg.num_layers)
    gen = dict(max_tokens=max_tokens, temperature=float(temperature), seed=seed,
               batch_size=batch_size, drafter="ngram", max_prompt_tokens=max_prompt_tokens,
               weights=dtype)
    requested = dict(counts={d: counts.get(d, 0) for d in DOMAINS}, heldout=heldout,
                     shard_size=shard_size)
    m = _open_manifest(out, dict(format=FORMAT, target=str(target.path),
                                 target_hash=target.model_hash(), layers=layers,
                                 hidden_size=cfg.hidden_size, generation=gen, requested=requested,
                                 shards=[]))
    _write(out / "manifest.json", json.dumps(m, indent=1))
    train, held = _prompt_sets(target, out, counts, heldout, max_prompt_tokens, seed)
    m["counts"] = {d: n for d in DOMAINS if (n := sum(r["domain"] == d for r in train))}
    m["heldout"] = {d: n for d in DOMAINS if (n := sum(r["domain"] == d for r in held))}
    m["sources"] = {d: dict(sorted(Counter(r["source"] for r in train if r["domain"] == d).items()))
                    for d in m["counts"]}
    done = {s["tokens"]: s for s in m["shards"]
            if (out / s["tokens"]).exists() and (out / s["features"]).exists()}
    chunks = [train[i: i + shard_size] for i in range(0, len(train), shard_size)]
    todo = [k for k in range(len(chunks)) if f"shard-{k:05d}.safetensors" not in done]
    bar = tqdm(total=len(train), initial=len(train) - sum(len(chunks[k]) for k in todo),
               unit="prompt", disable=not progress)
    engine = cache = None
    speed = {"tokens": 0, "s": 0.0}
    for k in todo:
        if engine is None:  # only when there is work: a finished folder needs no target runs
            engine = Engine(target, max_batch=batch_size,
                            max_len=max_prompt_tokens + max_tokens + 1)
            cache = model.new_cache(4, engine.max_len)
        rows = chunks[k]
        t0 = speed["s"]
        pairs = _generate(engine, target, rows, gen, k * shard_size, bar, speed)
        gen_s = speed["s"] - t0
        seqs = [p + r for p, r in pairs]
        t1 = time.perf_counter()
        feats = _features(model, seqs, layers, cache)
        feat_s = time.perf_counter() - t1
        name, fname = f"shard-{k:05d}.safetensors", f"features-{k:05d}.safetensors"
        lens = torch.tensor([0] + [len(s) for s in seqs])
        save_file({"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                   "offsets": lens.cumsum(0).to(torch.int64),
                   "prompt_lens": torch.tensor([len(p) for p, _ in pairs], dtype=torch.int32),
                   "domains": torch.tensor([DOMAINS.index(r["domain"]) for r in rows],
                                           dtype=torch.int8)}, str(out / name))
        save_file(feats, str(out / fname))
        by = {d: {"n": sum(r["domain"] == d for r in rows),
                  "response_tokens": sum(len(o) for r, (_, o) in zip(rows, pairs)
                                         if r["domain"] == d)} for d in DOMAINS}
        done[name] = dict(tokens=name, features=fname, n=len(rows), n_tokens=int(lens.sum()),
                          response_tokens=sum(len(r) for _, r in pairs), domains=by,
                          generation_s=round(gen_s, 3), feature_s=round(feat_s, 3))
        _save(out, m, done)
    bar.close()
    m = _save(out, m, done)
    ensure_teachers(out, target, progress)
    return m


def _save(out: pathlib.Path, m: dict, done: dict) -> dict:
    """Manifest with the finished shards and their totals, written atomically."""
    m["shards"] = [done[n] for n in sorted(done)]
    t = m["totals"] = _totals(m["shards"])
    per = lambda a, b, k: round(a * k / b, 2) if b else None  # noqa: E731
    m["feature_ms_per_1k_tokens"] = per(t["feature_s"], t["tokens"], 1e6)
    m["generation_tokens_per_s"] = per(t["response_tokens"], t["generation_s"], 1)
    _write(out / "manifest.json", json.dumps(m, indent=1))
    return m


# -- reading ----------------------------------------------------------------------------------
def load(out_dir, layers: list[int] | None = None, teacher: bool = False) -> tuple[dict, list[dict]]:
    """(manifest, shards): each shard's tensors, plus {"features": {layer: bf16 [T, h]}} for
    `layers` (None: every cached layer, []: none) and, with `teacher`, the teacher ids."""
    out = pathlib.Path(out_dir)
    if not (out / "manifest.json").exists():
        raise FileNotFoundError(f"{out} has no manifest.json: run `angelspec data --out {out}` "
                                "first")
    m = json.loads((out / "manifest.json").read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"{out}: data format {m.get('format')!r}, this version reads {FORMAT}")
    layers = m["layers"] if layers is None else list(layers)
    if set(layers) - set(m["layers"]):
        raise ValueError(f"{out} caches layers {m['layers']}, not {sorted(set(layers))}")
    shards = []
    for s in m["shards"]:
        d = load_file(str(out / s["tokens"]))
        with safe_open(str(out / s["features"]), "pt") as f:
            d["features"] = {l: f.get_tensor(f"layer_{l}") for l in layers}
        if teacher:
            if not (out / teacher_file(s)).exists():
                raise FileNotFoundError(f"{out / teacher_file(s)} is missing: ensure_teachers() makes it")
            d["teacher"] = load_file(str(out / teacher_file(s)))["teacher"]
        shards.append(d)
    return m, shards


class Sequences:
    """Every sample of a data folder in memory: item i -> tokens, prompt_len, domain, features."""

    def __init__(self, out_dir, layers: list[int] | None = None, teacher: bool = False):
        self.manifest, self.shards = load(out_dir, layers, teacher)
        self.index = [(k, j) for k, s in enumerate(self.shards) for j in range(len(s["domains"]))]

    def __len__(self) -> int:
        return len(self.index)

    def ids(self, i: int) -> dict:
        """Item i without its features: tokens, prompt_len, domain (cheap)."""
        k, j = self.index[i]
        s = self.shards[k]
        a, b = int(s["offsets"][j]), int(s["offsets"][j + 1])
        return dict(tokens=s["tokens"][a:b].long(), prompt_len=int(s["prompt_lens"][j]),
                    domain=int(s["domains"][j]), span=(a, b))

    def __getitem__(self, i: int) -> dict:
        item = self.ids(i)
        a, b = item.pop("span")
        shard = self.shards[self.index[i][0]]
        if "teacher" in shard:
            item["teacher"] = shard["teacher"][a:b].long()
        return dict(item, features={l: f[a:b].float() for l, f in shard["features"].items()})


# -- command line -----------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--target", help="target checkpoint folder (default: the converted "
                                    "SmolLM2-135M-Instruct, made on first use)")
    p.add_argument("--out", default="build/data", help="data folder (resumed when it exists)")
    for d in DOMAINS:
        p.add_argument(f"--{d}", type=int, default=1000, metavar="N", help=f"{d} prompts")
    p.add_argument("--heldout", type=int, default=20, metavar="N",
                   help="held-out prompts per domain, written to heldout.jsonl for benchmarks")
    p.add_argument("--max-tokens", type=int, default=256, help="response length limit")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="longer prompts (chat-encoded) are dropped")
    p.add_argument("--batch-size", type=int, default=64, help="requests generated together")
    p.add_argument("--weights", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of the target's matmul weights while generating and caching "
                        "features: auto = as `angelspec build` serves them (bfloat16 where the "
                        "CPU has AMX-BF16 tiles, else float32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling (and response sampling "
                                                        "when --temperature > 0)")
    p.add_argument("--shard-size", type=int, default=64, metavar="N", help="prompts per shard")


def run(args) -> int:

    m = build(load_target_or_default(args.target), args.out, {d: getattr(args, d) for d in DOMAINS},
              args.heldout, args.max_tokens, args.max_prompt_tokens, args.batch_size,
              args.temperature, args.seed, args.shard_size, weights=args.weights)
    t = m["totals"]
    print(f"{args.out}: {t['sequences']} sequences, {t['tokens']} tokens "
          f"({t['response_tokens']} generated at {m['generation_tokens_per_s']} tok/s); "
          f"features for layers {m['layers']} at {m['feature_ms_per_1k_tokens']} ms/1k tokens")
    return 0
