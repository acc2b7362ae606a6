"""`angelspec build` and loading an engine folder: validation, manifest, checksums, re-profiling,
and lossless serving of every drafter (auto included) from the folder alone."""
import json
import shutil

import pytest
import torch
from conftest import make_checkpoint
from test_drafters import draft

from angelspec.builders.build import build
from angelspec.checkpoint import load_target
from angelspec.drafters import TRAINED, Datastore
from angelspec.drafters.draft_checkpoint import load_draft, save_draft
from angelspec.plugins import amx_available
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.engine_dir import load_engine
from angelspec.runtime.manifest import EngineError, read_manifest, sha256


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    make_checkpoint(root / "target", num_hidden_layers=8, seed=3)
    target = load_target(root / "target", max_len=512)
    for kind, vocab in (("mtp", 60), ("dfly", 60), ("dflash", 0)):
        cfg, model = draft(target, kind, vocab=vocab)
        save_draft(root / "drafts" / kind, cfg, model.state_dict())
    g = torch.Generator().manual_seed(5)
    Datastore.build([torch.randint(1, 96, (50,), generator=g).tolist() for _ in range(4)]).save(
        root / "drafts" / "ngram", {"tokenizer_hash": target.tokenizer_hash()})
    (root / "data").mkdir()
    rows = [{"prompt": p, "domain": d} for d, ps in
            (("chat", ["hello there, how are you", "tell me a story about a cat"]),
             ("code", ["def f(x): return x + 1", "for i in range(10): print(i)"]),
             ("math", ["what is 12 * 7 = ?", "solve 3x + 5 = 20 for x"])) for p in ps]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (root / "data" / "prompts.jsonl").write_text(text)
    (root / "data" / "heldout.jsonl").write_text(text)
    manifest = build(str(root / "target"), str(root / "drafts"), str(root / "engine"),
                     str(root / "data"), backends=("eager",), max_tokens=16, export="trtllm")
    return root, target, manifest


def test_manifest_names_every_part_with_checksums(parts):
    root, _, m = parts
    assert m == read_manifest(root / "engine")
    assert set(m.drafters) == {"mtp", "dfly", "dflash", "ngram"}
    assert (m.defaults.drafter, m.defaults.dcut) == ("auto", True)
    assert m.drafters["ngram"].path == "drafts/ngram"
    assert {"target/model.safetensors", "drafts/dfly/model.safetensors", "router.safetensors",
            "drafts/ngram/datastore.safetensors",
            "trtllm/speculative.yaml", "trtllm/dflash/model.safetensors"} <= set(m.files)
    assert m.backend.chosen == "eager" and m.dcut.profile["n"][-1] == 16
    assert m.router["accuracy"]["heldout"]["n"] == 6
    assert m.fingerprint["torch"] == torch.__version__
    # weights auto: bf16 on a CPU with AMX tiles (this random float32 checkpoint then rounded)
    dtype = "bfloat16" if amx_available() else "float32"
    assert m.weights.dtype == m.fingerprint["weights"] == dtype
    assert not m.weights.checkpoint_is_bf16
    # KV cache auto: bf16 where the tiles round the activations already, else float32's own numbers
    assert m.kv_cache == ("bfloat16" if amx_available() else "float32")
    assert m.drafters["ngram"].draft_len in (3, 5, 7)


def test_the_build_serves_the_fastest_draft_length_it_measured(parts):
    """ngram's and MTP's draft lengths are measured (MTP: 1 up to the rollout it was trained
    for) and the fastest is what the engine serves; DFly and DFlash keep their checkpoints'."""
    root, _, m = parts
    trained = {kind: load_draft(root / "drafts" / kind)[0].draft_len for kind in TRAINED}
    speeds = {kind: d.tokens_per_s_by_draft_len for kind, d in m.drafters.items()}
    assert sorted(speeds["mtp"], key=int) == [str(n) for n in range(1, trained["mtp"] + 1)]
    assert sorted(speeds["ngram"], key=int) == ["3", "5", "7"]
    for kind in ("mtp", "ngram"):
        assert speeds[kind][str(m.drafters[kind].draft_len)] == max(speeds[kind].values())
    for kind in ("dfly", "dflash"):
        assert speeds[kind] is None and m.drafters[kind].draft_len == trained[kind]
    eng = load_engine(root / "engine", max_batch=1, max_len=200)
    assert {k: eng.drafter(k).draft_len for k in m.drafters} == {k: d.draft_len for k, d in m.drafters.items()}


@pytest.mark.parametrize("weights,kv_cache", [("bfloat16", "float32"), ("int8", "float32"), ("int4", "bfloat16")])
def test_engine_with_packed_or_quantized_weights_serves_losslessly(parts, tmp_path, weights, kv_cache):
    root, _, _ = parts
    kinds = [] if weights == "bfloat16" else ["mtp", "dfly"]
    m = build(str(root / "target"), str(root / "drafts"), str(tmp_path / "engine"), None,
              drafters=kinds, backends=("eager",), max_tokens=8, weights=weights, kv_cache=kv_cache)
    assert m.weights.dtype == m.fingerprint["weights"] == weights and m.kv_cache == kv_cache
    eng = load_engine(tmp_path / "engine", max_batch=2, max_len=200)
    assert eng.target.model.weights == weights and eng.cache.k[0].dtype == getattr(torch, kv_cache)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 30)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = Engine(eng.target, max_batch=1, max_len=200).generate(
        [Request(p, params, "ar") for p in prompts])
    for name in ["ngram"] + kinds:
        for dcut in (False, True):
            eng.dcut = dcut
            out = eng.generate([Request(p, params, name) for p in prompts])
            assert [r.tokens for r in out] == [r.tokens for r in ref], (name, dcut)
    if weights == "bfloat16":  # bench times the same target's float32 weights beside the engine's
        from angelspec.bench.report import format_table
        from angelspec.bench.speed import bench
        from angelspec.prompts import load_prompts

        res = bench(None, load_prompts(root / "data" / "heldout.jsonl"), ["ar", "float32"], max_tokens=8,
                    engine_dir=str(tmp_path / "engine"))
        row = next(r for r in res["results"] if r["drafter"] == "float32" and r["domain"] == "all")
        assert row["tokens_per_s"] > 0 and row["lossless"] is None and row["mean_accept_len"] is None
        assert 0 <= row["same_as_ar"] <= row["n_prompts"] and res["config"]["weights"] == "bfloat16"
        assert "float32's greedy tokens:" in format_table(res)
        # bench measures what the engine serves: its own D-cut setting unless told, named in the header
        served = "on" if read_manifest(tmp_path / "engine").defaults.dcut else "off"
        assert res["config"]["dcut"] == served and f"D-cut {served}" in format_table(res)


def test_engine_serves_every_drafter_losslessly(parts):
    root, target, _ = parts
    eng = load_engine(root / "engine", max_batch=3, max_len=200)
    assert eng.dcut and eng.router is not None
    assert eng.drafter("ngram").datastore.table == Datastore.load(root / "drafts" / "ngram").table
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 11, 40)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    # the reference: batch-1 autoregressive decoding of the engine's own weights (bf16 on AMX)
    ref = Engine(eng.target, max_batch=1, max_len=200).generate(
        [Request(p, params, "ar") for p in prompts])
    for d in ("mtp", "dfly", "dflash", "ngram", "auto"):
        out = eng.generate([Request(p, params, d) for p in prompts])
        assert [r.tokens for r in out] == [r.tokens for r in ref], d
    assert all(r.drafter in ("mtp", "dfly", "ngram") for r in out)


def test_corrupt_partial_and_foreign_engines_are_refused(parts, tmp_path):
    root, _, _ = parts
    eng = tmp_path / "engine"
    shutil.copytree(root / "engine", eng)
    with open(eng / "drafts" / "mtp" / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    with pytest.raises(EngineError, match="checksum mismatch in drafts/mtp/model.safetensors"):
        read_manifest(eng)
    (eng / "router.safetensors").unlink()
    with pytest.raises(EngineError, match="missing router.safetensors"):
        read_manifest(eng)
    (eng / "engine.json").unlink()
    with pytest.raises(EngineError, match="did not finish"):
        read_manifest(eng)
    with pytest.raises(EngineError, match="no such engine"):
        read_manifest(tmp_path / "nowhere")


def _rewrite(eng, edit):
    m = json.loads((eng / "engine.json").read_text())
    edit(m)
    (eng / "engine.json").write_text(json.dumps(m))


def test_an_engine_folder_stays_inside_itself(parts, tmp_path):
    """Manifest entries that lead out of the folder (.., absolute, a link out) are refused
    before any file is read, naming no outside path; every file in the folder must be listed."""
    root, _, _ = parts
    eng = tmp_path / "engine"
    shutil.copytree(root / "engine", eng)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    digest = sha256(secret)
    for entry in ("../secret.txt", str(secret), "target/../../secret.txt"):
        e2 = tmp_path / "e2"
        shutil.rmtree(e2, ignore_errors=True)
        shutil.copytree(eng, e2)
        _rewrite(e2, lambda m: m["files"].__setitem__(entry, digest))
        with pytest.raises(EngineError, match="not paths inside the engine folder") as err:
            read_manifest(e2)
        assert "secret" not in str(err.value)
    (eng / "target" / "leak.txt").symlink_to(secret)
    _rewrite(eng, lambda m: m["files"].__setitem__("target/leak.txt", digest))
    with pytest.raises(EngineError, match="not paths inside"):
        read_manifest(eng)
    (eng / "target" / "leak.txt").unlink()
    _rewrite(eng, lambda m: m["files"].pop("target/leak.txt"))
    read_manifest(eng)
    # a weights file dropped from the list and then corrupted is not served
    _rewrite(eng, lambda m: m["files"].pop("drafts/mtp/model.safetensors"))
    with open(eng / "drafts" / "mtp" / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    with pytest.raises(EngineError, match="files not in the manifest: drafts/mtp/model.safetensors"):
        read_manifest(eng)


def test_build_checks_its_inputs_first_and_never_leaves_a_partial_engine(parts, tmp_path):
    root, _, _ = parts
    with pytest.raises(FileNotFoundError, match="prompts.jsonl not found"):
        build(str(root / "target"), str(root / "drafts"), str(tmp_path / "e"),
              str(tmp_path / "no-data"), backends=("eager",), max_tokens=8)
    with pytest.raises(ValueError, match="unknown draft kind.s. eagle: mtp, dfly, dflash or ngram"):
        build(str(root / "target"), str(root / "drafts"), str(tmp_path / "e"), None,
              drafters=["mtp", "eagle", "ngram"], backends=("eager",), max_tokens=8)
    assert not any(tmp_path.iterdir())  # failed before anything was written
    shutil.copytree(root / "engine", tmp_path / "e")
    before = (tmp_path / "e" / "engine.json").read_text()
    (tmp_path / "bad-data").mkdir()
    (tmp_path / "bad-data" / "prompts.jsonl").write_text("{not json\n")  # fails at the router step
    with pytest.raises(ValueError):
        build(str(root / "target"), str(root / "drafts"), str(tmp_path / "e"),
              str(tmp_path / "bad-data"), backends=("eager",), max_tokens=8)
    assert (tmp_path / "e" / "engine.json").read_text() == before  # the old engine still serves
    read_manifest(tmp_path / "e")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-data", "e"]  # nothing half-built


def test_build_refuses_drafts_of_another_target(parts, tmp_path):
    root, _, _ = parts
    make_checkpoint(tmp_path / "other", num_hidden_layers=8, hidden_size=32, num_attention_heads=2,
                    num_key_value_heads=1)
    with pytest.raises(ValueError, match="hidden size: draft 64, target 32"):
        build(str(tmp_path / "other"), str(root / "drafts"), str(tmp_path / "e"), None,
              backends=("eager",), max_tokens=8)


def test_another_machine_reprofiles_at_start(parts, tmp_path, capsys):
    root, _, _ = parts
    eng = tmp_path / "engine"
    shutil.copytree(root / "engine", eng)
    m = json.loads((eng / "engine.json").read_text())
    m["dcut"]["profile"]["fingerprint"]["cpu"] = "another CPU"
    (eng / "engine.json").write_text(json.dumps(m))
    load_engine(eng, max_batch=1, max_len=64)
    assert "re-profiling" in capsys.readouterr().err


def test_route_calibration_does_not_time_loading_a_drafter(parts, monkeypatch):
    """The first request of a drafter builds it (a real ngram datastore took 2.3 s to load): the
    routes are measured after each candidate has run once, else the first domain's route would
    go to whichever drafter had loaded before (it sent chat to a slower mtp)."""
    import time

    from angelspec.builders.build import calibrate_routes

    root, target, _ = parts
    load = Datastore.load.__func__

    def slow_load(cls, *args, **kwargs):
        time.sleep(1.0)
        return load(cls, *args, **kwargs)
    monkeypatch.setattr(Datastore, "load", classmethod(slow_load))
    _, speed = calibrate_routes(target, root / "drafts", ["mtp", "ngram"], per_domain=1, max_tokens=8)
    assert speed["chat"]["ngram"] > 40  # 8 tokens in over a second would be < 8 tokens/s


def test_a_trained_drafter_takes_a_route_from_ngram_only_by_a_margin():
    """A few percent is the route calibration's noise: ngram (no forward of its own) keeps a
    domain unless a trained drafter is faster by more than ROUTE_MARGIN."""
    from angelspec.builders.build import ROUTE_MARGIN, route

    assert route({"mtp": 230.7, "dfly": 244.3, "ngram": 239.2}) == "ngram"
    assert route({"mtp": 239.2 * (1 + 2 * ROUTE_MARGIN), "ngram": 239.2}) == "mtp"
    assert route({"mtp": 200.0, "dfly": 210.0}) == "dfly"



def test_mtp_keeps_a_domains_own_draft_length_only_where_it_pays(monkeypatch):
    """tune_length serves the fastest length overall and names a domain's own fastest where it
    beat that one there by more than ROUTE_MARGIN; routes and contenders then ask for it."""
    from angelspec.builders import build as b
    from angelspec.runtime.manifest import DraftSpec

    speed = {"chat": {"mtp:draft_len=1": 300.0, "mtp:draft_len=2": 280.0, "mtp:draft_len=3": 270.0},
             "code": {"mtp:draft_len=1": 300.0, "mtp:draft_len=2": 330.0, "mtp:draft_len=3": 350.0},
             "math": {"mtp:draft_len=1": 300.0, "mtp:draft_len=2": 325.0, "mtp:draft_len=3": 318.0}}
    monkeypatch.setattr(b, "calibrate_routes", lambda *a, **k: ({}, speed))
    best, mean, own = b.tune_length("mtp", (1, 2, 3), None, None)
    assert mean == {"1": 300.0, "2": 311.67, "3": 312.67}
    assert (best, own) == (3, {"chat": 1})  # math's 2 beat 3 there, within the margin
    specs = {"mtp": DraftSpec("mtp", draft_len=best, draft_len_by_domain=own), "ngram": DraftSpec("ngram")}
    routes, rivals = b.own_lengths({"chat": "mtp", "code": "mtp", "math": "ngram"},
                                   {"chat": ["mtp", "ngram"], "code": ["mtp", "ngram"], "math": ["ngram"]}, specs)
    assert routes == {"chat": "mtp:draft_len=1", "code": "mtp", "math": "ngram"}
    assert rivals["chat"] == ["mtp:draft_len=1", "ngram"] and rivals["code"] == ["mtp", "ngram"]


def test_routes_compare_each_run_with_ngrams_run_of_the_same_prompt():
    """The machine's speed drifts between runs: a drafter whose runs fell in fast moments looks
    faster in totals (dfly here: 0.74 s against ngram's 1.0 s), yet on two of three prompts it was
    slower than ngram's run of the same prompt moments before. The paired ratios decide."""
    from angelspec.builders.build import routes_from_runs

    runs = {("chat", "ngram"): [(64, 0.20), (64, 0.20), (64, 0.60)],
            ("chat", "dfly"): [(64, 0.22), (64, 0.22), (64, 0.30)],
            ("code", "ngram"): [(64, 0.30), (64, 0.30), (64, 0.30)],
            ("code", "dfly"): [(64, 0.20), (64, 0.20), (64, 0.40)]}
    routes, speed = routes_from_runs(runs, ["dfly", "ngram"])
    assert speed["chat"]["dfly"] > speed["chat"]["ngram"]  # the totals would send chat to dfly
    assert routes == {"chat": "ngram", "code": "dfly"}
    # without ngram among the candidates, the totals decide
    assert routes_from_runs({k: v for k, v in runs.items() if k[1] == "dfly"}, ["dfly"])[0] == \
        {"chat": "dfly", "code": "dfly"}

def test_a_prompts_rounds_are_averaged_before_the_median_over_prompts():
    """Runs alternate the drafters' order from round to round, and the one that runs second on a
    prompt can catch a fast moment: dfly beat ngram by 1.2x on every prompt in the first round, and
    lost on two of three in the second. Six single ratios have a median of 1.2 (dfly); each
    prompt's two averaged first, the median is 0.98 (ngram)."""
    from angelspec.builders.build import routes_from_runs

    ratios = [1.2, 1.2, 1.2, 0.8, 0.8, 1.3]  # round 1's three prompts, then round 2's
    runs = {("chat", "ngram"): [(64, 0.2)] * 6, ("chat", "dfly"): [(64, 0.2 / r) for r in ratios]}
    assert routes_from_runs(runs, ["dfly", "ngram"])[0] == {"chat": "dfly"}  # as if six prompts
    assert routes_from_runs(runs, ["dfly", "ngram"], rounds=2)[0] == {"chat": "ngram"}


@pytest.mark.parametrize("dcut", [True, False])
def test_routes_are_measured_as_the_engine_serves(parts, tmp_path, monkeypatch, dcut):
    """The route calibration runs the candidates with D-cut over the build's cost table when the
    engine serves D-cut, at fixed draft lengths when it does not (and so are ngram's and MTP's
    draft lengths)."""
    import angelspec.builders.build as b

    root, _, _ = parts
    calls, real = [], b.calibrate_routes

    def recording(target, drafts_dir, candidates, cost=None, **kw):
        calls.append((tuple(candidates), cost))
        return real(target, drafts_dir, candidates, cost, per_domain=1, max_tokens=4, **kw)
    monkeypatch.setattr(b, "calibrate_routes", recording)
    m = b.build(str(root / "target"), str(root / "drafts"), str(tmp_path / "e"), str(root / "data"),
                backends=("eager",), max_tokens=8, dcut=dcut)
    routed = [cost for names, cost in calls if "mtp" in names]
    assert len(calls) == 3 and len(routed) == 1 and set(m.router["routes"]) == {"chat", "code", "math"}
    assert all((cost is not None) == dcut for _, cost in calls)
    if dcut:
        assert routed[0].n == m.dcut.profile["n"]


def test_bench_cli_with_engine_concurrency_dcut_and_auto(parts, tmp_path):
    import subprocess
    import sys

    root, _, _ = parts
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "angelspec.cli", "bench", "--engine", str(root / "engine"),
           "--prompts", str(root / "data" / "heldout.jsonl"), "--max-tokens", "16",
           "--drafters", "ar,ngram,dfly,auto", "--concurrency", "2", "--dcut", "both",
           "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(r["drafter"], r["dcut"], r["domain"]): r for r in res["results"]}
    assert {(d, c) for d, c, _ in rows} == {("ar", False)} | {
        (d, c) for d in ("ngram", "dfly", "auto") for c in (False, True)}
    assert all(r["lossless"] and r["concurrency"] == 2 for r in res["results"])
    assert rows[("dfly", True, "all")]["tokens_per_s"] > 0
    ar = rows[("ar", False, "all")]  # two rounds: the time of both, the tokens of one each time
    assert res["config"]["rounds"] == 2
    drained = ar["drained_tokens_per_s"]
    assert abs(drained - 2 * ar["new_tokens"] / ar["seconds"]) < 0.02 * drained
    # tokens/s counts the steps with both slots busy: at most the whole run's tokens and time (all
    # of them where every chunk's requests end together)
    assert 0 < ar["busy_tokens"] <= 2 * ar["new_tokens"] and 0 < ar["busy_seconds"] <= ar["seconds"] + 1e-3
    assert abs(ar["tokens_per_s"] - ar["busy_tokens"] / ar["busy_seconds"]) < 0.01 * ar["tokens_per_s"]
    assert "while every slot was busy" in proc.stdout
    assert rows[("dfly", True, "chat")]["tokens_per_s"] is None  # mixed batches: time for all only
    used = rows[("auto", True, "all")]["drafter_used"]
    assert sum(used.values()) == 6 and {u.split(":")[0] for u in used} <= {"mtp", "dfly", "ngram"}
    assert "auto+dcut" in proc.stdout
    # each batch's rate against ar's run of the same batch: every batch of both rounds, once
    from angelspec.bench.runs import chunks
    from angelspec.prompts import load_prompts
    pair = rows[("ngram", True, "all")]["paired_vs_ar"]
    assert pair["batches"] == 2 * len(chunks(load_prompts(root / "data" / "heldout.jsonl"), 2))
    assert pair["min"] <= pair["median"] <= pair["max"] and 0 <= pair["at_least_ar"] <= pair["batches"]
    assert "paired_vs_ar" not in ar and "each batch against ar's run of it" in proc.stdout


def test_bench_sampled_checks_every_drafter_against_the_seeded_ar_sample(parts):
    from angelspec.bench.speed import bench
    from angelspec.prompts import load_prompts

    root, _, _ = parts
    prompts = load_prompts(root / "data" / "heldout.jsonl")
    sampled = bench(None, prompts, ["ngram", "dfly", "auto"], max_tokens=16, batch_size=2,
                    engine_dir=str(root / "engine"), dcut="on", temperature=1.0, top_p=0.95)
    assert sampled["config"]["temperature"] == 1.0 and not sampled["config"]["greedy"]
    assert all(r["lossless"] and r["near_ties"] == 0 for r in sampled["results"])
    assert sum(r["mean_accept_len"] for r in sampled["results"]) > 0
    with pytest.raises(ValueError, match="greedy reference"):
        bench(None, prompts, ["hf"], engine_dir=str(root / "engine"), temperature=1.0)


def test_generate_cli_decodes_as_the_engine_serves(parts):
    """`angelspec generate --engine` uses the engine's weights and router: its text is the
    engine's own greedy output (the reference the served model is tested against)."""
    import subprocess
    import sys

    root, _, _ = parts
    cmd = [sys.executable, "-m", "angelspec.cli", "generate", "--engine", str(root / "engine"),
           "--prompt", "hello there", "--no-chat", "--max-tokens", "12", "--max-len", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[auto]" in proc.stderr  # the engine's default drafter
    eng = load_engine(root / "engine", max_batch=1, max_len=200)
    ids = eng.target.tokenizer.encode("hello there", add_special_tokens=False)
    ref = eng.generate([Request(ids, SamplingParams(max_tokens=12), "none")])[0]
    assert proc.stdout == eng.target.decode(ref.tokens) + "\n"


def test_trtllm_export_follows_the_documented_format(parts, tmp_path):
    """TensorRT-LLM cannot be installed here: check the files against its documented format
    (DFlashDecodingConfig, DFlashForCausalLM.load_weights, the draft_len_schedule validator)."""
    import yaml
    from safetensors.torch import load_file

    from angelspec.builders.trtllm import export

    root, target, m = parts
    written = export(root / "engine", tmp_path / "trt")  # (angelspec build --export trtllm)
    spec = yaml.safe_load((tmp_path / "trt" / "speculative.yaml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and pathlib_exists(spec["speculative_model"])
    sched = spec["draft_len_schedule"]
    assert min(sched) == 1 and sched[1] == spec["max_draft_len"]
    assert all(k >= 1 and 0 <= v <= spec["max_draft_len"] for k, v in sched.items())
    assert spec["max_draft_len"] <= 5  # the tiny drafts have block size 6
    cfg = json.loads((tmp_path / "trt" / "dflash" / "config.json").read_text())
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 6
    assert cfg["dflash_config"]["target_layer_ids"] == [l - 1 for l in m.drafters["dflash"].target_layer_ids]
    w = load_file(str(tmp_path / "trt" / "dflash" / "model.safetensors"))
    layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(w) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in layer}
    assert w["fc.weight"].shape == (64, 5 * 64)
    ours = load_file(str(root / "engine" / "drafts" / "dflash" / "model.safetensors"))
    assert torch.equal(w["layers.1.mlp.down_proj.weight"], ours["layers.1.mlp.down.weight"])
    assert any(p.endswith("mtp-deepseek-layout") for p in written)


def pathlib_exists(p):
    import pathlib
    return pathlib.Path(p).is_dir()


def test_compiled_backend_is_measured_and_stays_lossless(tmp_path):
    """torch.compile over the C++ ops (through their fake kernels): the build's measurement
    reports bit-identical logits, and an engine on the compiled forward decodes exactly as eager."""
    from conftest import tiny_target
    from test_lossless import NoisyOracle, autoregressive, prompts

    from angelspec.builders.backend import choose
    from angelspec.runtime.backend import use_backend

    target = tiny_target(tmp_path / "t")
    report = choose(target.model, ("eager", "inductor"))
    assert report["measured"]["inductor"]["bit_identical_to_eager"]
    ps = prompts(3)
    ref = autoregressive(target, ps, 20)
    use_backend(target.model, "inductor")
    try:
        oracle = NoisyOracle({tuple(p): r for p, r in zip(ps, ref)}, 4)
        eng = Engine(target, max_batch=2, max_len=256, drafters={"oracle": oracle})
        out = eng.generate([Request(p, SamplingParams(max_tokens=20), "oracle") for p in ps])
        assert [r.tokens for r in out] == ref
    finally:
        use_backend(target.model, "eager")


def test_manifest_fields_are_typed_and_checked(parts, tmp_path):
    """engine.json is read into EngineManifest field by field: an unknown, missing or mistyped
    field is refused by name with "rebuild the engine"."""
    root, _, _ = parts
    for change, message in ((lambda m: m.__setitem__("extra", 1), r"unknown fields \['extra'\]"),
                            (lambda m: m.pop("defaults"), r"missing fields \['defaults'\]"),
                            (lambda m: m["defaults"].__setitem__("dcut", "yes"), "defaults: dcut: expected bool"),
                            (lambda m: m["drafters"]["ngram"].__setitem__("draft_len", "3"),
                             "drafters.ngram: draft_len: expected int"),
                            (lambda m: m.__setitem__("kv_cache", 16), "kv_cache: expected str")):
        eng = tmp_path / f"e{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root / "engine", eng)
        _rewrite(eng, change)
        with pytest.raises(EngineError, match=message + ".*rebuild the engine"):
            read_manifest(eng, verify=False)
