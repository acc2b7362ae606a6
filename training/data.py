"""Self-distilled training data: prompts -> the target's own responses -> cached target features.

Responses come from the runtime (ngram drafting: lossless, faster than plain decoding), every
prompt of the run in one continuously batched stream, so the engine stays full across shard
boundaries. The target's hidden states at the layers the trained drafters read are kept as the
engine commits each token (FeatureRecorder): the rows a served engine hands its drafters, with
no second pass over the sequences, so trainers never recompute them. The target runs with
matmul weights an engine can serve (`weights`, as `angelspec build --weights`; `auto` takes the
option of those an engine may choose that is fastest with as many requests in flight as the
data step keeps (`batch_size`): bf16 on AMX-BF16 tiles rather than the w4a8 an engine picks for
batch 1 there),
so drafts learn the hidden states and choices they will see when served. A shard is written as
soon as its last prompt is answered and the manifest is rewritten after each one, so an
interrupted build resumes where it stopped.

out_dir/
  prompts.jsonl, heldout.jsonl  {prompt, domain, source} per line (heldout: for `angelspec bench`)
  shard-00000.safetensors       tokens int32 [T] (prompt then response ids, samples concatenated),
                                offsets int64 [n+1], prompt_lens int32 [n], domains int8 [n]
  features-00000.safetensors    layer_{i} bf16 [T, hidden] for each i in manifest["layers"] (a
                                sequence's last row is zero: nothing follows it to predict)
  teacher-00000.safetensors     teacher int32 [T]: the target's own next-token choice after each
                                position (labels for prompt tokens, where nothing was generated);
                                written on first use by a recipe with prompt_labels
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
from angelspec.drafters import Drafter, make_drafter
from angelspec.drafters.target_layers import training_layers
from angelspec.params import SamplingParams
from angelspec.prompts import DOMAINS, load_prompts, read_jsonl
from angelspec.runtime.backend import WEIGHTS, choose_weights
from angelspec.runtime.engine import Engine, Request, settle_heap
from angelspec.training.sources import HELDOUT_EVERY, held_out
from angelspec.training.sources import prompts as draw_prompts
from angelspec.weights import served_as

FORMAT = 1
GENERATION_BEFORE = {"weights": "float32"}  # generation settings of folders older than the key


def _write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _prompt_sets(target, out, counts, heldout, max_prompt_tokens, seed, given=None):
    """Draw, length-filter and split the prompts once (`given`: these prompts, all on the
    sequences' side, none held out); a rerun reads the same files back."""
    train_f, held_f = out / "prompts.jsonl", out / "heldout.jsonl"
    if train_f.exists() and held_f.exists():
        return read_jsonl(train_f), read_jsonl(held_f)
    if given is not None:
        train = [r for r in given if len(target.encode_chat(r["prompt"])) <= max_prompt_tokens]
        _write(held_f, "")
        _write(train_f, _jsonl(train))
        return train, []
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


class FeatureRecorder(Drafter):
    """Drafts with `inner` (ngram) and keeps, per request, the target's hidden states at `layers`
    of every position the engine commits: the prompt's rows from its prefill, then each step's
    anchor and accepted path. These are the rows the engine hands drafters when it serves, so
    the data step needs no second forward over the sequences. The last token of a sequence is
    never fed back (nothing is decoded after it): its row is left zero, and no objective reads
    it (nothing follows it to predict)."""

    def __init__(self, inner: Drafter, layers: list[int]):
        super().__init__(inner.draft_len)
        self.inner, self.layers = inner, list(layers)
        self.capture = tuple(sorted(set(inner.capture) | set(layers)))
        self.rows: dict[int, list[dict]] = {}

    def propose(self, states):
        return self.inner.propose(states)

    def on_commit(self, state, hidden):
        self.inner.on_commit(state, {l: hidden[l] for l in self.inner.capture})
        self.rows.setdefault(state.index, []).append({l: hidden[l].to(torch.bfloat16) for l in self.layers})

    def release(self, state):
        self.inner.release(state)

    def take(self, index: int, n: int) -> dict[int, torch.Tensor]:
        """Request `index`'s features {layer: bf16 [n, h]} for its n tokens (a step fed past a
        stop or length cut is trimmed; the last row is zero)."""
        rows = self.rows.pop(index)
        out = {}
        for l in self.layers:
            h = torch.cat([r[l] for r in rows])[: n - 1]
            out[l] = torch.cat([h, h.new_zeros(n - len(h), h.shape[1])])
        return out


def _generate(target, chunks, todo, gen, layers, batch_size, max_len, shard_size, bar):
    """Responses and features for every prompt of the chunks in `todo`, in one continuously
    batched stream (the engine stays full across shard boundaries). Yields (k, [(prompt ids,
    response ids)], {layer: features}, seconds since the previous yield) as soon as chunk k's
    last request finishes."""
    recorder = FeatureRecorder(make_drafter(gen["drafter"], None, target), layers)
    engine = Engine(target, max_batch=batch_size, max_len=max_len, drafters={"record": recorder},
                    prompt_prefix=target.chat_prefix())
    settle_heap()
    reqs, owner = [], []
    for k in todo:
        for i, r in enumerate(chunks[k]):
            reqs.append(Request(target.encode_chat(r["prompt"]),
                                SamplingParams(max_tokens=gen["max_tokens"], temperature=gen["temperature"],
                                               seed=gen["seed"] + k * shard_size + i), drafter="record"))
            owner.append(k)
    outs = [[] for _ in reqs]
    left = {k: len(chunks[k]) for k in todo}
    done: dict[int, list] = {k: [] for k in todo}
    tokens, t0 = 0, time.perf_counter()
    last = t0
    for ev in engine.stream(reqs):
        outs[ev.index] += ev.tokens
        tokens += len(ev.tokens)
        if not ev.finish_reason:
            continue
        if ev.finish_reason == "error":
            raise RuntimeError(f"generation failed: {ev.error}")
        k, req = owner[ev.index], reqs[ev.index]
        done[k].append((ev.index, req.prompt_ids, outs[ev.index],
                        recorder.take(ev.index, len(req.prompt_ids) + len(outs[ev.index]))))
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        left[k] -= 1
        if not left[k]:
            rows = sorted(done.pop(k))
            now = time.perf_counter()
            yield (k, [(p, o) for _, p, o, _ in rows],
                   {l: torch.cat([f[l] for *_, f in rows]) for l in layers}, now - last)
            last = now


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
                generation_s=round(s("generation_s"), 3),
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
          shard_size: int = 64, progress: bool = True, weights: str = "auto",
          prompts_file=None) -> dict:
    """Build (or resume) a data folder; returns the manifest. weights: the dtype of the target's
    matmul weights (auto: as `angelspec build` will serve them; the caller's target is left
    as it is). prompts_file: the target's responses to these prompts (JSONL with a domain each:
    the bundled benchmark prompts, an evaluation set to measure drafts on) instead of prompts
    drawn from the sources; nothing held out."""
    given = None
    if prompts_file is not None:
        given = [r for r in load_prompts(prompts_file) if r["domain"] in DOMAINS]
        counts = {d: sum(r["domain"] == d for r in given) for d in DOMAINS}
        heldout = 0

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = out / "manifest.json"
    if weights == "auto" and made.exists():  # a rerun resumes with the weights the folder was made
        # with, rather than with a new measurement's pick (near-equal options can trade places)
        weights = json.loads(made.read_text()).get("generation", {}).get("weights", GENERATION_BEFORE["weights"])
    choice = choose_weights(target.model, weights, loaded=batch_size)  # timed at the job's load
    dtype = choice["dtype"]
    if dtype != target.model.weights:
        target = dataclasses.replace(target, model=served_as(target.model, dtype))
    # int8 / int4 that give back the checkpoint's weights exactly compute the float32 model's
    # numbers, as bf16 values without AMX tiles do: the data is float32's (a float32 folder
    # resumes, an exact int4 engine reads it)
    weight_only = ("int8", "int4") + (("bfloat16",) if not choice["amx_tiles"] else ())
    numerics = "float32" if choice["exact"] and dtype in weight_only else dtype
    cfg = target.config
    layers = training_layers(cfg.num_layers)
    gen = dict(max_tokens=max_tokens, temperature=float(temperature), seed=seed,
               batch_size=batch_size, drafter="ngram", max_prompt_tokens=max_prompt_tokens,
               weights=numerics)
    requested = dict(counts={d: counts.get(d, 0) for d in DOMAINS}, heldout=heldout,
                     shard_size=shard_size, **({"prompts": str(prompts_file)} if given is not None else {}))
    m = _open_manifest(out, dict(format=FORMAT, target=str(target.path),
                                 target_hash=target.model_hash(), layers=layers,
                                 hidden_size=cfg.hidden_size, generation=gen, requested=requested,
                                 shards=[]))
    m.setdefault("weights_why", choice["why"])
    _write(out / "manifest.json", json.dumps(m, indent=1))
    train, held = _prompt_sets(target, out, counts, heldout, max_prompt_tokens, seed, given)
    m["counts"] = {d: n for d in DOMAINS if (n := sum(r["domain"] == d for r in train))}
    m["heldout"] = {d: n for d in DOMAINS if (n := sum(r["domain"] == d for r in held))}
    m["sources"] = {d: dict(sorted(Counter(r.get("source", "prompts file") for r in train if r["domain"] == d).items()))
                    for d in m["counts"]}
    done = {s["tokens"]: s for s in m["shards"]
            if (out / s["tokens"]).exists() and (out / s["features"]).exists()}
    chunks = [train[i: i + shard_size] for i in range(0, len(train), shard_size)]
    todo = [k for k in range(len(chunks)) if f"shard-{k:05d}.safetensors" not in done]
    bar = tqdm(total=len(train), initial=len(train) - sum(len(chunks[k]) for k in todo),
               unit="prompt", disable=not progress)
    if todo:  # only when there is work: a finished folder needs no target runs
        for k, pairs, feats, gen_s in _generate(target, chunks, todo, gen, layers, batch_size,
                                                max_prompt_tokens + max_tokens + 1, shard_size, bar):
            rows, seqs = chunks[k], [p + r for p, r in pairs]
            name, fname = f"shard-{k:05d}.safetensors", f"features-{k:05d}.safetensors"
            lens = torch.tensor([0] + [len(s) for s in seqs])
            save_file({"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                       "offsets": lens.cumsum(0).to(torch.int64),
                       "prompt_lens": torch.tensor([len(p) for p, _ in pairs], dtype=torch.int32),
                       "domains": torch.tensor([DOMAINS.index(r["domain"]) for r in rows],
                                               dtype=torch.int8)}, str(out / name))
            save_file({f"layer_{l}": f.contiguous() for l, f in feats.items()}, str(out / fname))
            by = {d: {"n": sum(r["domain"] == d for r in rows),
                      "response_tokens": sum(len(o) for r, (_, o) in zip(rows, pairs)
                                             if r["domain"] == d)} for d in DOMAINS}
            done[name] = dict(tokens=name, features=fname, n=len(rows), n_tokens=int(lens.sum()),
                              response_tokens=sum(len(r) for _, r in pairs), domains=by,
                              generation_s=round(gen_s, 3))
            _save(out, m, done)
    bar.close()
    return _save(out, m, done)


def _save(out: pathlib.Path, m: dict, done: dict) -> dict:
    """Manifest with the finished shards and their totals, written atomically."""
    m["shards"] = [done[n] for n in sorted(done)]
    t = m["totals"] = _totals(m["shards"])
    per = lambda a, b, k: round(a * k / b, 2) if b else None  # noqa: E731
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
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="the target's matmul weights while generating and caching features: "
                        "auto = of the options `angelspec build --weights auto` weighs (float32, "
                        "bfloat16 with AMX-BF16 tiles or bf16 checkpoints, and int8 / int4 / w8a8 / "
                        "w4a8 where they give back the checkpoint's weights exactly), the one "
                        "fastest here with --batch-size requests in flight; a scheme by name to match an "
                        "engine built with those weights")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling (and response sampling "
                                                        "when --temperature > 0)")
    p.add_argument("--shard-size", type=int, default=64, metavar="N", help="prompts per shard")
    p.add_argument("--like", default=None, metavar="DIR",
                   help="generate as the data folder DIR was: its weights, response length, prompt "
                        "length limit and temperature (for --prompts: a set measured beside it)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="the target's responses to the prompts of this JSONL file (a domain each; "
                        "e.g. angelspec/data/prompts.jsonl, the bundled benchmark prompts) instead "
                        "of prompts drawn from the sources, nothing held out: a set to measure "
                        "drafts on (train's outside_data), never to train on")


def run(args) -> int:
    if args.like:  # the other folder's generation settings
        like = pathlib.Path(args.like) / "manifest.json"
        if not like.exists():
            raise FileNotFoundError(f"{like} not found: --like names a data folder")
        gen = json.loads(like.read_text())["generation"]
        args.weights, args.max_tokens = gen["weights"], gen["max_tokens"]
        args.max_prompt_tokens, args.temperature = gen["max_prompt_tokens"], gen["temperature"]

    m = build(load_target_or_default(args.target), args.out, {d: getattr(args, d) for d in DOMAINS},
              args.heldout, args.max_tokens, args.max_prompt_tokens, args.batch_size,
              args.temperature, args.seed, args.shard_size, weights=args.weights, prompts_file=args.prompts)
    t = m["totals"]
    print(f"{args.out}: {t['sequences']} sequences, {t['tokens']} tokens "
          f"({t['response_tokens']} generated at {m['generation_tokens_per_s']} tok/s with "
          f"{m['generation']['weights']} weights, features of layers {m['layers']} kept on the way)")
    return 0
