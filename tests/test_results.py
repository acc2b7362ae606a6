"""The results records and the tables generated from them: every record in docs/results holds the
required keys, the committed tables are what `make results` writes, and `write_record` fills in
the commit, the date and the CPU. No torch."""
import argparse
import json
import pathlib
import re
import shutil

import pytest

from angelspec import record
from angelspec.bench import results

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "docs/results").glob("*.json"))


def test_there_are_records():
    assert len(RECORDS) >= 40


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.stem)
def test_every_record_holds_the_required_keys(path):
    rec = json.loads(path.read_text())
    assert record.problems(rec) == []
    assert path.name.startswith(rec["date"])
    names = {p.stem for p in RECORDS}
    assert set(rec.get("with", ())) <= names


def test_the_committed_tables_are_the_generated_ones():
    assert results.stale(ROOT) == [], "run `make results` (python -m angelspec.bench.results)"
    assert results.main(["--check"]) == 0


def test_every_change_reaches_the_log_and_every_summary_the_history():
    log = (ROOT / "docs/results/README.md").read_text()
    for path in RECORDS:
        rec = json.loads(path.read_text())
        if "change" in rec or "summary" in rec:
            assert f"({path.name})" in log, path.name


def test_the_check_finds_a_stale_table_and_the_generator_mends_it(tmp_path):
    for target in results.TARGETS:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / target, tmp_path / target)
    for path in RECORDS:
        shutil.copy(path, tmp_path / "docs/results" / path.name)
    assert results.stale(tmp_path) == []
    newest = tmp_path / "docs/results/2026-12-06-avx512-epyc-layer-times.json"
    rec = json.loads(newest.read_text())
    rec["summary"]["heldout"]["ar"] = 999.0
    newest.write_text(json.dumps(rec))
    assert results.stale(tmp_path)
    assert results.main(["--check", "--root", str(tmp_path)]) == 1
    assert results.main(["--root", str(tmp_path)]) == 0
    assert results.stale(tmp_path) == []
    assert "999.0 tokens/s" in (tmp_path / "README.md").read_text()
    rec.pop("cpu")
    newest.write_text(json.dumps(rec))
    assert any("missing cpu" in line for line in results.stale(tmp_path))


FLAGS = {"AMX-BF16": "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_int8", "AVX-512+BF16": "fpu avx2 avx512f avx512_bf16",
         "AVX-512": "fpu avx2 avx512f", "AVX2": "fpu sse4_2 avx2 fma", "unknown": "fpu sse4_2"}


@pytest.mark.parametrize("isa", list(FLAGS))
def test_the_kind_of_cpu_from_its_flags(isa):
    cpuinfo = f"processor\t: 0\nmodel name\t: Some  CPU 9000\nflags\t\t: {FLAGS[isa]}\n\nprocessor\t: 1\n"
    cpu, kind = record.this_cpu(cpuinfo, cores=2)
    assert kind == isa
    assert cpu.startswith("Some CPU 9000, ") and cpu.endswith(", 2 cores")
    assert ("AMX-INT8" in cpu) == (isa == "AMX-BF16")


def test_write_record_fills_in_the_commit_the_date_and_the_cpu(tmp_path):
    path = record.write_record(tmp_path, "smoke", {"tok_s": {"ar": 1.5}}, "angelspec bench --drafters ar", "a test run")
    rec = json.loads(path.read_text())
    assert record.problems(rec) == []
    assert rec["commands"] == ["angelspec bench --drafters ar"] and rec["tok_s"] == {"ar": 1.5}
    assert rec["commit"] == record.this_commit()
    assert rec["isa"] in record.ISAS and rec["cpu"]
    assert re.fullmatch(rf"{rec['date']}-[a-z0-9]+(-[a-z]+)?-smoke\.json", path.name)
    named = record.write_record(tmp_path / "x.json", "ignored", {"n": 1}, ["make results"], "named", change="one line")
    assert named == tmp_path / "x.json" and json.loads(named.read_text())["change"] == "one line"


def test_a_record_that_would_be_malformed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="clash"):
        record.write_record(tmp_path, "bad", {"commit": "abc"}, ["x"], "bad")
    with pytest.raises(ValueError, match="no figures"):
        record.write_record(tmp_path, "empty", {}, ["x"], "nothing measured")
    undated = {"what": "x", "commit": None, "cpu": "c", "isa": "AVX2", "commands": ["x"], "n": 1}
    assert "missing date" in record.problems(undated)
    assert record.this_commit(tmp_path) is None


def test_record_writes_the_command_line_and_its_figures(tmp_path, monkeypatch):
    """`--record NAME` (bench, perf, openai-bench, aiperf, build): the command as typed, the
    tool's figures under its name; without it, nothing is written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["angelspec", "bench", "--drafters", "ar,ngram", "--record", "smoke"])
    record.record_run(argparse.Namespace(record=None), "bench", {"rows": [1]}, "a smoke run")
    assert not (tmp_path / "docs").exists()
    record.record_run(argparse.Namespace(record="smoke"), "bench", {"rows": [1]}, "a smoke run")
    (path,) = (tmp_path / "docs/results").glob("*-smoke.json")
    rec = json.loads(path.read_text())
    assert record.problems(rec) == [] and rec["bench"] == {"rows": [1]}
    assert rec["commands"] == ["angelspec bench --drafters ar,ngram --record smoke"]
