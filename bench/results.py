"""The results tables, generated from the records in docs/results/ (angelspec/record.py says what a
record holds). Each table lies between `<!-- results:NAME -->` and `<!-- /results -->` in the
files of TARGETS; this rewrites them, or with `--check` exits 1 where the committed text differs
from what the records give (or a record lacks a required key).

  python -m angelspec.bench.results            # rewrite the tables (make results)
  python -m angelspec.bench.results --check    # what tests/test_results.py runs

Tables: `latest`, the newest figures on each kind of CPU (each cell from the newest record that
holds it); `history`, one row per record with a summary; `log`, one line per change."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

from angelspec.record import ROOT, problems

RESULTS = "docs/results"
TARGETS = {"README.md": ("latest",), "docs/results/README.md": ("latest", "history", "log")}
BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results -->)", re.S)
# the latest table's columns, in order, and how a column names its kind of CPU
COLUMNS = (("AVX-512+BF16", ", AVX-512 + AVX512-BF16, no AMX"), ("AMX-BF16", " with AMX"), ("AVX2", ", AVX2 only"))
KIND = {"AMX-BF16": "AMX", "AVX-512+BF16": "AVX-512 + BF16", "AVX-512": "AVX-512", "AVX2": "AVX2-only",
        "unknown": "not named"}
SLUGS = re.compile(r"^\d{4}-\d{2}-\d{2}-(?:(?:avx512|avx2|amx)-(?:epyc|xeon|ryzen|core)-)?")


def load(folder: pathlib.Path) -> list[tuple[str, dict]]:
    """(name, record) of every record in the folder, oldest first (a run without a time last in
    its day)."""
    out = [(p.stem, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    return sorted(out, key=lambda nr: (nr[1].get("date", ""), nr[1].get("time", "99:99"), nr[0]))


def invalid(records: list[tuple[str, dict]]) -> list[str]:
    """Every problem of every record, named; a `with` must name a record, a file its own date."""
    names = {n for n, _ in records}
    out = [f"{n}: {p}" for n, r in records for p in problems(r)]
    out += [f"{n}: with names no record {w}" for n, r in records for w in r.get("with", ()) if w not in names]
    out += [f"{n}: the name does not start with its date" for n, r in records if not n.startswith(str(r.get("date")))]
    return out


def vendor(cpu: str) -> str:
    for line, maker in (("EPYC", "AMD EPYC"), ("Ryzen", "AMD Ryzen"), ("Xeon", "Intel Xeon"), ("Core", "Intel Core")):
        if line in cpu:
            return maker
    return ""


def kind(record: dict) -> str:
    """The CPU of a log line or a history row: its kind (KIND) and its maker's line."""
    return f"{KIND[record['isa']]} {vendor(record['cpu']).split(' ')[-1]}".strip()


def short(name: str) -> str:
    return SLUGS.sub("", name)


def link(name: str, record: dict, here: pathlib.Path, root: pathlib.Path) -> str:
    target = os.path.relpath(root / RESULTS / f"{name}.json", (root / here).parent)
    return f"[{record['date']} {short(name)}]({target})"


def num(v) -> str:
    return str(v) if not isinstance(v, float) or v != int(v) else f"{v:.1f}"


def ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x" if isinstance(v, (int, float)) else f"{v}x"


def ratios(part: dict | None, runners: tuple[str, ...]) -> str:
    if not part:
        return "-"
    return " / ".join(ratio(part.get("x_ar", {}).get(r)) for r in runners)


def tok_s(part: dict | None) -> str:
    if not part or "ar" not in part:
        return "-"
    return f"{num(part['ar'])} tokens/s"


def with_note(text: str, part: dict | None) -> str:
    return f"{text} ({part['note']})" if part and part.get("note") and text != "-" else text


def vs_llamacpp(vs: dict | None) -> str:
    if not vs:
        return "-"
    out = f"`{vs['runner']}` **{ratio(vs['x'])}**"
    both = "tok_s" in vs and "llamacpp_tok_s" in vs
    detail = [f"{num(vs['tok_s'])} against {num(vs['llamacpp_tok_s'])}"] if both else []
    detail += [vs["how"]] if vs.get("how") else []
    return out + (f" ({', '.join(detail)})" if detail else "")


ROWS = (  # label, the summary part a cell reads, how it is written
    ("engine weights", "weights", lambda s: s),
    ("`ar`, held-out", "heldout", lambda s: with_note(tok_s(s), s)),
    ("`ngram` / `auto` x `ar`, held-out", "heldout", lambda s: ratios(s, ("ngram", "auto"))),
    ("`mtp` / `dfly` x `ar`, held-out", "heldout", lambda s: ratios(s, ("mtp", "dfly"))),
    ("`ar`, bundled", "bundled", lambda s: with_note(tok_s(s), s)),
    ("`ngram` / `auto` x `ar`, bundled", "bundled", lambda s: ratios(s, ("ngram", "auto"))),
    ("`mtp` / `dfly` x `ar`, bundled", "bundled", lambda s: ratios(s, ("mtp", "dfly"))),
    ("best x llama.cpp, bundled", "vs_llamacpp", vs_llamacpp),
    ("16 in flight, `ngram` / `auto` x `ar`", "in_flight_16", lambda s: with_note(ratios(s, ("ngram", "auto")), s)),
    ("bf16 `ar` x float32 `ar`, batch 1", "bf16_x_float32", ratio),
)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def latest(records, here: pathlib.Path, root: pathlib.Path) -> str:
    """The newest figures on each kind of CPU, a column per maker: each cell from the newest
    record holding that part of a summary, dated where it is older than the column's newest
    record."""
    header, cells, used = [""], [[label] for label, _, _ in ROWS], []
    columns = []  # (its records, newest first; its header): one per kind of CPU and maker
    for isa, words in COLUMNS:
        kinds = [(n, r) for n, r in reversed(records) if r.get("isa") == isa and r.get("summary")]
        for maker in dict.fromkeys(vendor(r["cpu"]) for _, r in kinds):
            columns.append(([(n, r) for n, r in kinds if vendor(r["cpu"]) == maker], f"{maker}{words}".lstrip(", ")))
    for mine, words in columns:
        header.append(words)
        column = []
        for i, (label, part, write) in enumerate(ROWS):
            found = next(((n, r) for n, r in mine if part in r["summary"]), None)
            if found is None:
                cells[i].append("-")
                continue
            text = write(found[1]["summary"][part])
            if found[1]["date"] != mine[0][1]["date"]:
                text = f"{found[1]['date']}: {text}"
            cells[i].append(text)
            if found[0] not in column:
                column.append(found[0])
        used.append(", ".join(link(n, dict(records)[n], here, root) for n in column))
    return table(header, [["records", *used], *cells])


def history(records, here: pathlib.Path, root: pathlib.Path) -> str:
    """One row per record with a summary, oldest first."""
    rows = []
    for n, r in records:
        s = r.get("summary")
        if not s:
            continue
        vs = {k: v for k, v in s.get("vs_llamacpp", {}).items() if k in ("runner", "x")}
        held, bundled = s.get("heldout", {}), s.get("bundled", {})
        rows.append([r["date"], kind(r), s.get("weights", "-"),
                     num(held.get("ar", "-")), ratios(held, ("ngram", "auto", "mtp", "dfly")),
                     num(bundled.get("ar", "-")), ratios(bundled, ("ngram", "auto")),
                     vs_llamacpp(vs), ratios(s.get("in_flight_16"), ("ngram", "auto")), link(n, r, here, root)])
    return table(["date", "CPU", "weights", "`ar` held-out, tokens/s",
                  "held-out x `ar`: `ngram` / `auto` / `mtp` / `dfly`", "`ar` bundled, tokens/s",
                  "bundled x `ar`: `ngram` / `auto`", "best x llama.cpp", "16 in flight: `ngram` / `auto`",
                  "record"], rows)


def log(records, here: pathlib.Path, root: pathlib.Path) -> str:
    """One line per change, oldest first: its date, its CPU, what it did, the records it cites."""
    by_name = dict(records)
    rows = []
    for n, r in records:
        if "change" not in r:
            continue
        cited = [n, *r.get("with", ())]
        rows.append([r["date"], kind(r), r["change"],
                     ", ".join(f"[{short(c)}]({os.path.relpath(root / RESULTS / f'{c}.json', (root / here).parent)})"
                               for c in cited if c in by_name)])
    return table(["date", "CPU", "what changed, and what it did to the numbers", "records"], rows)


TABLES = {"latest": latest, "history": history, "log": log}


def generate(root: pathlib.Path = ROOT) -> tuple[dict[str, str], list[str]]:
    """{target file: its text with every table regenerated}, and what is wrong (bad records,
    missing markers)."""
    records = load(root / RESULTS)
    bad = invalid(records)
    broken = {line.split(":")[0] for line in bad}
    records = [(n, r) for n, r in records if n not in broken]
    out = {}
    for target, names in TARGETS.items():
        path = root / target
        text = path.read_text()
        found = {m.group(2) for m in BLOCK.finditer(text)}
        bad += [f"{target}: no <!-- results:{n} --> ... <!-- /results --> block" for n in names if n not in found]
        bad += [f"{target}: unknown table {n}" for n in found if n not in TABLES]
        out[target] = BLOCK.sub(lambda m: m.group(1) + (TABLES[m.group(2)](records, pathlib.Path(target), root)
                                                        if m.group(2) in TABLES else m.group(3)) + m.group(4), text)
    return out, bad


def stale(root: pathlib.Path = ROOT) -> list[str]:
    """What --check reports: bad records and markers, and every file whose tables are not current."""
    texts, bad = generate(root)
    return bad + [f"{t}: its tables differ from the records (make results)" for t, text in texts.items()
                  if (root / t).read_text() != text]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m angelspec.bench.results", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 where the committed tables differ from the records")
    p.add_argument("--root", type=pathlib.Path, default=ROOT, help="the repository (default: this checkout)")
    args = p.parse_args(argv)
    if args.check:
        found = stale(args.root)
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    texts, bad = generate(args.root)
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        return 1
    for target, text in texts.items():
        if (args.root / target).read_text() != text:
            (args.root / target).write_text(text)
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
