"""The trainers end to end on a tiny target: recipes, loss goes down, resume, torchrun/DDP."""
import collections
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import make_checkpoint
from safetensors.torch import load_file, save_file

from angelspec.checkpoint import load_target
from angelspec.drafters.draft_checkpoint import load_draft
from angelspec.training.data import build
from angelspec.training.recipe import load_recipe
from angelspec.training.train import train, use_bf16


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny 8-layer target with a character tokenizer and its self-distilled data folder."""
    root = tmp_path_factory.mktemp("training")
    make_checkpoint(root / "target", num_hidden_layers=8, seed=3)
    target = load_target(root / "target", max_len=512)
    build(target, root / "data", {"chat": 8, "code": 8, "math": 8}, heldout=1, max_tokens=32,
          max_prompt_tokens=200, batch_size=4, shard_size=8, progress=False)
    return target, root


def recipe(name, root, **kw):
    sets = {**dict(data=str(root / "data"), out=str(root / "drafts" / name), draft_vocab=60,
                   domains=["chat", "code", "math"], val_sequences=3, warmup=3, eval_every=1000,
                   save_every=1000), **kw}
    return load_recipe(name, overrides=[f"{k}={json.dumps(v)}" for k, v in sets.items()])


def log_rows(out) -> list[dict]:
    return [json.loads(l) for l in (pathlib.Path(out) / "log.jsonl").read_text().splitlines()]


def test_recipes_resolve_and_reject_mistakes():
    fly, flash = load_recipe("dfly"), load_recipe("dflash")
    assert (fly.hybrid, fly.ar_head) == (True, True)
    assert (flash.hybrid, flash.ar_head, flash.kind) == (False, False, "dflash")
    assert {k: v for k, v in fly.to_dict().items() if k not in ("hybrid", "ar_head", "kind", "out")} == \
        {k: v for k, v in flash.to_dict().items() if k not in ("hybrid", "ar_head", "kind", "out")}
    for name in ("mtp", "dfly", "dflash"):  # the presets are time budgets
        quick, full = load_recipe(name, "quick"), load_recipe(name, "full")
        assert quick.steps == full.steps == 0 and 0 < quick.minutes < full.minutes
    assert load_recipe("dflash", "quick").minutes == load_recipe("dfly", "quick").minutes
    assert load_recipe("mtp", overrides=["lr=5e-4"]).lr == 5e-4
    with pytest.raises(ValueError, match="unknown key.s. learning_rate; the keys are .*batch_size"):
        load_recipe("mtp", overrides=["learning_rate=1"])
    with pytest.raises(ValueError, match="steps must be int, got 'many'"):
        load_recipe("mtp", overrides=["steps=many"])
    with pytest.raises(ValueError, match="domains .'poetry'.: a non-empty subset of chat, code, math"):
        load_recipe("mtp", overrides=['domains=["poetry"]'])
    with pytest.raises(ValueError, match="lr -0.1: must be positive"):
        load_recipe("mtp", overrides=["lr=-0.1"])
    with pytest.raises(ValueError, match="steps 0: positive, or 0 .no step limit. with a time budget"):
        load_recipe("mtp", overrides=["steps=0"])
    assert load_recipe("mtp", overrides=["steps=0", "minutes=5"]).minutes == 5.0
    with pytest.raises(ValueError, match="labels 'fuzzy': soft or hard"):
        load_recipe("mtp", overrides=["labels=fuzzy"])
    with pytest.raises(ValueError, match="unknown recipe 'eagle'"):
        load_recipe("eagle")
    assert (use_bf16("bf16"), use_bf16("none")) == (True, False)
    with pytest.raises(ValueError, match="auto, bf16 or none"):
        use_bf16(False)  # YAML reads a bare `off` as False


@pytest.mark.parametrize("kind", ["mtp", "dfly", "dflash"])
def test_training_reduces_the_loss(tiny_data, kind):
    target, root = tiny_data
    r = recipe(kind, root, steps=40, lr=3e-3, **({} if kind == "mtp" else {"tv_fraction": 0.0}))
    train(r, target, progress=False, restart=True)
    rows = log_rows(r.out)
    first = sum(x["loss"] for x in rows[:5]) / 5
    last = sum(x["loss"] for x in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    cfg, _ = load_draft(r.out, target)
    assert (cfg.kind, cfg.trained_steps, cfg.target) == (kind, 40, str(target.path))


def test_ngram_recipe_builds_the_datastore_from_the_targets_responses(tiny_data):
    from angelspec.drafters import Datastore, make_drafter
    from angelspec.training.data import Sequences

    target, root = tiny_data
    r = load_recipe("ngram", "quick", [f"data={root / 'data'}", f"out={root / 'drafts' / 'ngram'}"])
    result = train(r, target, progress=False)
    seqs = Sequences(root / "data", layers=[])
    items = [seqs.ids(i) for i in range(len(seqs))]
    assert result["tokens"] == sum(len(it["tokens"]) - it["prompt_len"] + 1 for it in items)
    store = make_drafter("ngram", None, target, root / "drafts").datastore
    assert store.table == Datastore.load(root / "drafts" / "ngram").table and len(store.table) > 0
    # a 1-gram's stored continuation starts with the token that most often followed it
    responses = [it["tokens"].tolist()[it["prompt_len"] - 1:] for it in items]
    key = responses[0][0]
    follow = collections.Counter(r[i + 1] for r in responses for i in range(len(r) - 1) if r[i] == key)
    assert follow[store.table[(key,)][0]] == max(follow.values())
    make_checkpoint(root / "other", num_hidden_layers=6, seed=4)
    with pytest.raises(ValueError, match="another target"):
        train(r, load_target(root / "other", max_len=512), progress=False)


def test_training_resumes(tiny_data):
    target, root = tiny_data
    r = recipe("dfly", root, steps=6, save_every=3, out=str(root / "drafts" / "resume"))
    train(r, target, progress=False, restart=True)
    assert [x["step"] for x in log_rows(r.out)] == [1, 2, 3, 4, 5, 6]
    train(dataclasses.replace(r, steps=9), target, progress=False)  # longer budget: continues from 6
    assert [x["step"] for x in log_rows(r.out)][6:] == [7, 8, 9]
    assert train(dataclasses.replace(r, steps=9), target, progress=False)["step"] == 9  # done: no new work
    assert len(log_rows(r.out)) == 9
    assert load_draft(r.out)[0].trained_steps == 9
    # --eval: the saved draft's held-out metrics, the same as the last step logged
    ev = train(r, target, progress=False, only_eval=True)
    assert ev["step"] == 9 and ev["val_tau"] == log_rows(r.out)[-1]["val_tau"] >= 1
    with pytest.raises(ValueError, match="holds a dfly draft, not mtp"):
        train(dataclasses.replace(recipe("mtp", root), out=r.out), target, progress=False, only_eval=True)


def test_a_time_budget_ends_training_with_an_evaluation_and_the_curve_shows_it(tiny_data, tmp_path):
    """`minutes`: training stops once its time (evaluations included) is spent, whatever `steps`
    says, evaluates there, and a rerun finds it done. Each evaluation logs the accept length,
    the acceptance at each depth and the draft vocabulary's coverage, overall and per domain,
    against steps, labelled positions and seconds; --eval's table and plot read them."""
    from angelspec.training.curve import plot, read_curve, table

    target, root = tiny_data
    # an outside set: the target's responses to prompts of a file (none drawn, none held out)
    prompts = tmp_path / "outside.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "domain": d}) + "\n" for t, d in
                               (("abc abc", "chat"), ("def f(x):", "code"), ("1 + 2 =", "math"))))
    weights = json.loads((root / "data" / "manifest.json").read_text())["generation"]["weights"]
    m = build(target, tmp_path / "outside", {}, heldout=5, max_tokens=16, max_prompt_tokens=200,
              batch_size=4, progress=False, prompts_file=prompts, weights=weights)
    assert m["totals"]["sequences"] == 3 and (tmp_path / "outside" / "heldout.jsonl").read_text() == ""
    r = recipe("mtp", root, steps=0, minutes=0.02, eval_every=5, out=str(tmp_path / "mtp"),
               outside_data=str(tmp_path / "outside"))
    result = train(r, target, progress=False, restart=True)
    rows = log_rows(r.out)
    # the log rounds seconds to 0.01 s: a step just under the budget may read as the budget
    assert 1 < result["step"] and rows[-1]["seconds"] >= 0.02 * 60 >= rows[-2]["seconds"]
    assert [x["tokens"] for x in rows] == sorted(x["tokens"] for x in rows) and rows[0]["tokens"] > 0
    curve = read_curve(r.out)
    assert curve[-1]["step"] == result["step"] and all(x["step"] % 5 == 0 for x in curve[:-1])
    last = curve[-1]
    doms = [k[8:] for k in last if k.startswith("val_tau_")]
    assert doms and all(f"val_{m}_{d}" in last for d in doms for m in ("alpha1", "alpha2", "coverage"))
    assert all(k in last for k in ("val_tau", "val_alpha1", "val_alpha2", "val_coverage")) and "val_alpha3" not in last
    assert all(f"outside_{k}_{d}" in last for d in ("chat", "code", "math") for k in ("tau", "alpha1"))
    assert "outside_loss" not in last  # the walk alone there
    assert 0 <= last["val_alpha1"] <= 1 and 0 < last["val_coverage"] <= 1 and last["val_tau"] >= 1
    assert train(r, target, progress=False)["step"] == result["step"]  # spent: nothing more
    assert str(result["step"]) in table(curve) and plot(curve, tmp_path / "curve.png").stat().st_size > 0
    # an outside set made with other weights would measure something serving never sees: refused
    other = tmp_path / "outside-other"
    shutil.copytree(tmp_path / "outside", other)
    mf = json.loads((other / "manifest.json").read_text())
    mf["generation"]["weights"] = "bf16" if weights != "bf16" else "float32"
    (other / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(ValueError, match="generated with .* weights, the training data with .*--like"):
        train(dataclasses.replace(r, outside_data=str(other)), target, progress=False, only_eval=True)


def test_prompt_positions_teach_past_the_system_preamble(tiny_data):
    """prompt_labels: every position from `prompt_from` on is a label; soft labels keep the real
    prompt tokens (their teacher reads the target's distribution there), hard ones the target's
    own choices (teacher ids)."""
    from angelspec.training.train import collate

    h = 4
    items = [dict(tokens=torch.arange(10), prompt_len=6, features={1: torch.zeros(10, h)}),
             dict(tokens=torch.arange(20, 28), prompt_len=5, features={1: torch.zeros(8, h)},
                  teacher=torch.arange(50, 58))]
    tokens, ok, _, labels = collate(items, 64, [1])
    assert ok[0].tolist() == [False] * 6 + [True] * 4 and ok[1].tolist() == [False] * 5 + [True] * 3 + [False] * 2
    tokens, ok, _, labels = collate(items, 64, [1], prompt_from=3)
    assert ok[0].tolist() == [False] * 3 + [True] * 7 and ok[1, :8].tolist() == [False] * 3 + [True] * 5
    assert torch.equal(labels[0], tokens[0])  # no teacher ids: the prompt's own tokens
    assert labels[1, 1:5].tolist() == [50, 51, 52, 53] and labels[1, 5:8].tolist() == [25, 26, 27]


def test_torchrun_two_processes_keep_identical_weights(tiny_data):
    target, root = tiny_data
    out = root / "drafts" / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "angelspec.cli", "train", "--recipe", "mtp",
           "--target", str(target.path), "--restart"]
    for k, v in dict(data=str(root / "data"), out=str(out), steps=3, draft_vocab=60,
                     domains=["chat", "code", "math"], val_sequences=2, batch_size=2).items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [(out / f"rank{r}.sha256").read_text() for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [x["step"] for x in log_rows(out)] == [1, 2, 3]


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_no_objective_reads_a_sequences_last_feature_row(tiny_data, tmp_path, kind):
    """The data step keeps features as the engine commits tokens, so a sequence's last row (never
    decoded) is zero: the objectives and the accept-length walk must not read it."""
    target, root = tiny_data
    r = recipe(kind, root, steps=3, out=str(tmp_path / kind))
    train(r, target, progress=False, restart=True)
    before = train(r, target, progress=False, only_eval=True)
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    g = torch.Generator().manual_seed(0)
    for f in sorted(data.glob("features-*.safetensors")):
        last = load_file(str(f.with_name(f.name.replace("features-", "shard-"))))["offsets"][1:] - 1
        feats = load_file(str(f))
        for t in feats.values():
            assert not t[last].any()
            t[last] = torch.randn(len(last), t.shape[1], generator=g).to(t.dtype)
        save_file(feats, str(f))
    after = train(dataclasses.replace(r, data=str(data)), target, progress=False, only_eval=True)
    assert after == before and before["val_sequences"] > 0
