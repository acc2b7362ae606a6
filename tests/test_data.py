"""Training data: prompt sources, and the self-distilled build (responses, features, resume)."""
import argparse
import dataclasses
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from angelspec.model import Segment
from angelspec.plugins import amx_available
from angelspec.prompts import CALIBRATION_PROMPTS, DOMAINS, load_prompts
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.training import data
from angelspec.training.data import Sequences, build
from angelspec.training.sources import held_out, prompts
from angelspec.weights import served_as

FORBIDDEN = ("gsm", "humaneval", "mbpp", "mt_bench", "mt-bench", "hendrycks", "competition_math")
SETTINGS = dict(counts={d: 2 for d in DOMAINS}, heldout=1, max_tokens=8,
                max_prompt_tokens=256, shard_size=4, progress=False)


@pytest.mark.parametrize("domain", DOMAINS)
def test_sources_are_deterministic_deduplicated_and_clean(domain):
    rows = prompts(domain, 8, seed=0)
    assert rows == prompts(domain, 8, seed=0) and rows != prompts(domain, 8, seed=1)
    assert len(rows) == 8 and len({r["prompt"] for r in rows}) == 8
    bench = {r["prompt"] for f in (None, CALIBRATION_PROMPTS) for r in load_prompts(f)}
    for r in rows:
        assert set(r) == {"prompt", "domain", "source"} and r["domain"] == domain
        assert 0 < len(r["prompt"]) <= 1200 and r["prompt"] not in bench
        assert not any(f in r["source"].lower() for f in FORBIDDEN)


def test_calibration_prompts_are_neither_benchmark_nor_training_prompts():
    """The build tunes on its own prompts (3+ a domain): none is a bundled benchmark prompt, and
    the sources skip both sets."""
    from angelspec.training.sources import _bench_prompts, _key

    cal, bench = load_prompts(CALIBRATION_PROMPTS), load_prompts(None)
    assert all(sum(r["domain"] == d for r in cal) >= 3 for d in DOMAINS)
    assert not {r["prompt"] for r in cal} & {r["prompt"] for r in bench}
    assert {_key(r["prompt"]) for r in cal + bench} <= _bench_prompts()


@pytest.mark.parametrize("domain", DOMAINS)
def test_sources_draw_the_same_prompts_in_every_process(domain):
    """The same seed gives the same prompts under any string-hash seed (a data folder resumed in
    a new process, or made again on another machine, draws what the first run drew); a generator
    whose items followed Python's per-process hash order drew other polynomials each run."""
    import os
    import subprocess

    code = ("import json; from angelspec.training.sources import prompts; "
            f"print(json.dumps(prompts({domain!r}, 100, 0)))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONHASHSEED=h)) for h in ("1", "2")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)


def test_code_source_holds_the_presets_prompts():
    """Functions and methods of the standard library: the quick and full presets' 1,200 code
    prompts and their held-out share (1 in 8 of the draw) without running dry."""
    assert len(prompts("code", 1500, seed=0)) == 1500


def test_no_preset_trains_on_another_presets_held_out_prompts(default_target, tmp_path):
    """The split is decided by each prompt's hash, not by its place in a draw: a smaller and a
    larger data step (the quick and full presets draw different lists) never cross it."""
    sets = {}
    for name, n in (("small", 6), ("large", 24)):
        out = tmp_path / name
        out.mkdir()
        train, held = data._prompt_sets(default_target, out, {d: n for d in DOMAINS}, 2, 256, 0)
        assert len(held) == 2 * len(DOMAINS) and len(train) == n * len(DOMAINS)
        assert all(held_out(r["prompt"]) for r in held) and not any(held_out(r["prompt"]) for r in train)
        sets[name] = ({r["prompt"] for r in train}, {r["prompt"] for r in held})
    (small_train, small_held), (large_train, large_held) = sets["small"], sets["large"]
    assert not small_held & large_train and not large_held & small_train
    assert small_train & large_train  # the same sources: the sets do overlap on their own sides


def test_a_missing_source_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(RuntimeError, match=r"pip install reasoning-gym==0\.1\.25"):
        prompts("math", 2, seed=0)


def test_reading_a_folder_without_data_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="angelspec data"):
        Sequences(tmp_path)


def test_arguments_map_onto_build():
    p = argparse.ArgumentParser()
    data.add_arguments(p)
    a = p.parse_args(["--chat", "3", "--math", "0", "--temperature", "0.7", "--out", "x"])
    assert (a.chat, a.code, a.math, a.temperature, a.out) == (3, 1000, 0, 0.7, "x")


@pytest.fixture(scope="module")
def built(default_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return out, build(default_target, out, **SETTINGS)


def as_made(target, m):
    """The target as the data step ran it: with the matmul weights an engine serves."""
    if m["generation"]["weights"] != "float32":  # an exact int4 is recorded as float32's numbers
        return dataclasses.replace(target, model=served_as(target.model, m["generation"]["weights"]))
    return target


@pytest.mark.slow
def test_build_writes_shards_features_manifest_and_heldout(built, default_target):
    out, m = built
    assert json.loads((out / "manifest.json").read_text()) == m
    assert m["counts"] == {d: 2 for d in DOMAINS} and m["heldout"] == {d: 1 for d in DOMAINS}
    assert [s["n"] for s in m["shards"]] == [4, 2] and m["totals"]["sequences"] == 6
    assert m["layers"][-1] == default_target.config.num_layers and m["hidden_size"] == 576
    assert m["generation_tokens_per_s"] > 0
    assert m["generation"]["drafter"] == "ngram"
    # weights an engine built here may serve (auto: of float32 or bf16 with AMX, and the default
    # target's exact int4 (recorded as float32) or w4a8, the fastest with as many requests in
    # flight as the step keeps, said in the manifest); the caller's target is left as it is
    assert m["generation"]["weights"] in ("float32", "w4a8") + (("bfloat16",) if amx_available() else ())
    assert "a step of 64 requests" in m["weights_why"]
    assert default_target.model.weights == "float32"
    held = load_prompts(out / "heldout.jsonl")
    assert sorted(r["domain"] for r in held) == list(DOMAINS)
    s = load_file(str(out / "shard-00000.safetensors"))
    assert s["tokens"].dtype == torch.int32 and s["offsets"].dtype == torch.int64
    assert s["offsets"][-1] == len(s["tokens"]) == m["shards"][0]["n_tokens"]
    f = load_file(str(out / "features-00000.safetensors"))
    assert set(f) == {f"layer_{l}" for l in m["layers"]}
    assert all(t.dtype == torch.bfloat16 and t.shape == (len(s["tokens"]), 576) for t in f.values())


@pytest.mark.slow
def test_responses_are_the_targets_plain_greedy_continuations(built, default_target):
    out, m = built
    target = as_made(default_target, m)
    seqs = Sequences(out, layers=[])
    rows = [json.loads(l) for l in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(seqs) == len(rows) == 6
    items = [seqs[i] for i in range(len(seqs))]
    engine = Engine(target, max_batch=8, max_len=512)
    reqs = [Request(target.encode_chat(r["prompt"]), SamplingParams(max_tokens=8))
            for r in rows]
    for x, r, req, res in zip(items, rows, reqs, engine.generate(reqs)):
        assert x["tokens"][:x["prompt_len"]].tolist() == req.prompt_ids
        assert x["tokens"][x["prompt_len"]:].tolist() == res.tokens
        assert x["domain"] == DOMAINS.index(r["domain"]) and x["features"] == {}


@pytest.mark.slow
def test_teacher_ids_are_the_targets_own_choices(built, default_target):
    """teacher[j] is the target's argmax after position j: on the greedy responses it is the
    generated token (bar bf16 near-ties); collate labels prompt tokens with it."""
    from angelspec.training.train import collate

    out, m = built
    data.ensure_teachers(out, default_target, progress=False)  # on first use, not by the data step
    assert (out / "teacher-00000.safetensors").exists()
    seqs = Sequences(out, layers=[m["layers"][0]], teacher=True)
    agree = total = 0
    for i in range(len(seqs)):
        x = seqs[i]
        p = x["prompt_len"]
        agree += int((x["teacher"][p - 1:-1] == x["tokens"][p:]).sum())
        total += len(x["tokens"]) - p
    assert agree >= 0.95 * total
    x = seqs[0]
    start = len(default_target.chat_prefix()) + 1  # past the system preamble, as the trainer asks
    tokens, label_ok, _, labels = collate([x], 512, [m["layers"][0]], prompt_from=start)
    p, n = x["prompt_len"], len(x["tokens"])
    assert labels[0, 1:p].tolist() == x["teacher"][: p - 1].tolist()
    assert labels[0, p:n].tolist() == x["tokens"][p:].tolist() and label_ok[0, start:n].all()
    assert not label_ok[0, :start].any()
    _, label_ok, _, labels = collate([x], 512, [m["layers"][0]])
    assert torch.equal(labels, tokens) and not label_ok[0, :p].any() and label_ok[0, p:n].all()


@pytest.mark.slow
def test_features_are_the_targets_hidden_states(built, default_target):
    """Kept while generating (the rows the engine fed its drafters), they match one forward over
    the whole sequence up to bf16 rounding; the last token's row, never decoded, is zero."""
    out, m = built
    seqs, model = Sequences(out), as_made(default_target, m).model
    for i in range(len(seqs)):
        x = seqs[i]
        n = len(x["tokens"])
        _, ref = model.forward(x["tokens"], model.batch([Segment(0, 0, n)]), model.new_cache(1, n),
                               capture=tuple(m["layers"]))
        for l in m["layers"]:
            torch.testing.assert_close(x["features"][l][:-1], ref[l][:-1], rtol=1e-2,
                                       atol=1e-2 * ref[l].abs().max().item())
            assert not x["features"][l][-1].any()


@pytest.mark.slow
def test_a_rerun_resumes_and_does_no_finished_work(built, default_target, tmp_path, monkeypatch):
    src, m = built
    out = tmp_path / "data"
    shutil.copytree(src, out)

    def no_engine(*a, **k):
        raise AssertionError("a finished folder must not generate")

    with monkeypatch.context() as mp:
        mp.setattr(data, "Engine", no_engine)
        assert build(default_target, out, **SETTINGS) == m
    first = (out / "shard-00000.safetensors").stat().st_mtime_ns
    (out / "shard-00001.safetensors").unlink()  # an interrupted build: only shard 1 is redone
    again = build(default_target, out, **SETTINGS)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == first
    assert load_file(str(out / "shard-00001.safetensors"))["tokens"].equal(
        load_file(str(src / "shard-00001.safetensors"))["tokens"])
    assert [s["n_tokens"] for s in again["shards"]] == [s["n_tokens"] for s in m["shards"]]


@pytest.mark.slow
def test_another_target_or_setting_is_refused(built, default_target, tmp_path):
    src, _ = built
    out = tmp_path / "data"
    shutil.copytree(src, out)
    with pytest.raises(ValueError, match="generation.max_tokens.*another --out"):
        build(default_target, out, **{**SETTINGS, "max_tokens": 9})
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "target_hash": "0" * 64}))
    with pytest.raises(ValueError, match="target_hash.*delete the folder"):
        build(default_target, out, **SETTINGS)
    # a folder from before the weights key was made with float32 weights: `auto` resumes it so,
    # as it resumes any folder with the weights it was made with; other weights are refused
    m["generation"].pop("weights")
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="generation.weights"):
        build(default_target, out, **SETTINGS, weights="w4a8")
    assert build(default_target, out, **SETTINGS)["shards"] == m["shards"]
