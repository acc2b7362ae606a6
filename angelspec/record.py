"""The JSON records under docs/results/: what one holds, and how a tool writes one.

A record is one run that the docs cite: an object whose metadata keys are

  what      what was measured, in one sentence (the engine, the prompts, the settings)
  date      YYYY-MM-DD, the day it ran
  commit    the short commit of the code that ran (`git rev-parse --short HEAD`), or null
  cpu       the CPU in words: its model name, the instruction sets that matter here, its cores
  isa       the kind of CPU, one of ISAS: which kernels the engine runs
  commands  the repository commands that produced the figures, as typed

and every other key is a figure, as the tool wrote it (numbers, or strings where a figure is a
range or carries a note). A few further keys have a meaning of their own (OPTIONAL): `change`,
one line of the results log saying what changed and what it did to the numbers; `with`, the
names of other records that line also cites; `summary`, the standard figures the results tables
are generated from (SUMMARY); `page`, the file name of the prose page under docs/results/ that a
record was transcribed from (git history keeps it); `time`, HH:MM, to order the runs of one day
(for a transcribed record, the time of the commit that added its page).
`python -m angelspec.bench.results` generates the tables from the records and checks them."""
import datetime
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

REQUIRED = ("what", "date", "commit", "cpu", "isa", "commands")
OPTIONAL = ("change", "with", "summary", "page", "time", "notes")
# the kinds of CPU, by the kernels the engine runs on them: AMX-BF16 tiles (and AMX-INT8 where
# present), AVX-512 with AVX512-BF16 but no tiles, AVX-512 without BF16, AVX2 and FMA only;
# "unknown" for a transcribed run whose page did not name its machine
ISAS = ("AMX-BF16", "AVX-512+BF16", "AVX-512", "AVX2", "unknown")
# summary: prompt sets, each {"ar": tokens/s, "x_ar": {runner: ratio}, "note": str}; "vs_llamacpp":
# {"runner", "x", "tok_s", "llamacpp_tok_s", "how"}; "in_flight_16": {"x_ar": {...}, "note"}
SUMMARY = ("weights", "heldout", "bundled", "vs_llamacpp", "in_flight_16", "bf16_x_float32", "note")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
TIME = re.compile(r"^\d{2}:\d{2}$")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def read_cpuinfo(cpuinfo: str | None = None) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo (or the given text); the
    model name is empty where the file does not give one (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = " ".join(value.split())
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def isa_of(flags: set[str]) -> str:
    """The kind of CPU (one of ISAS) its flags make it."""
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512f" in flags:
        return "AVX-512+BF16" if "avx512_bf16" in flags else "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "unknown"


ISA_WORDS = {"AMX-BF16": "AVX-512 with AMX-BF16 tiles", "AVX-512+BF16": "AVX-512 with AVX512-BF16, no AMX",
             "AVX-512": "AVX-512 without BF16, no AMX", "AVX2": "AVX2 only", "unknown": "no AVX2"}


def this_cpu(cpuinfo: str | None = None, cores: int | None = None) -> tuple[str, str]:
    """(cpu, isa) of this machine: its model name, its relevant instruction sets and its cores."""
    model, flags = read_cpuinfo(cpuinfo)
    model = model or "unknown CPU"
    isa = isa_of(flags)
    words = ISA_WORDS[isa]
    if isa == "AMX-BF16" and "amx_int8" in flags:
        words += " and AMX-INT8"
    cores = cores or len(os.sched_getaffinity(0))
    return f"{model}, {words}, {cores} cores", isa


def this_commit(where: pathlib.Path = ROOT) -> str | None:
    """The short commit of the checkout this code runs from; None outside a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def slug(cpu: str, isa: str) -> str:
    """A record name's CPU part: its kind and its maker's line (the avx2-epyc of <date>-avx2-epyc-peers)."""
    kind = {"AMX-BF16": "amx", "AVX-512+BF16": "avx512", "AVX-512": "avx512", "AVX2": "avx2"}.get(isa, "cpu")
    for line in ("EPYC", "Xeon", "Ryzen", "Core"):
        if line.lower() in cpu.lower():
            return f"{kind}-{line.lower()}"
    return kind


def problems(record: dict) -> list[str]:
    """What is wrong with a record; empty when it holds the required keys, well formed."""
    out = [f"missing {k}" for k in REQUIRED if k not in record]
    if not isinstance(record.get("what", ""), str) or not record.get("what", "x"):
        out.append("what: a sentence")
    if "date" in record and not (isinstance(record["date"], str) and DATE.match(record["date"])):
        out.append("date: YYYY-MM-DD")
    if "time" in record and not (isinstance(record["time"], str) and TIME.match(record["time"])):
        out.append("time: HH:MM")
    commit = record.get("commit")
    if commit is not None and not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit)):
        out.append("commit: a short hash or null")
    if "cpu" in record and not (isinstance(record["cpu"], str) and record["cpu"]):
        out.append("cpu: words")
    if "isa" in record and record["isa"] not in ISAS:
        out.append(f"isa: one of {', '.join(ISAS)}")
    commands = record.get("commands")
    if "commands" in record and not (isinstance(commands, list) and commands
                                     and all(isinstance(c, str) and c for c in commands)):
        out.append("commands: a list of command lines")
    if "change" in record and not (isinstance(record["change"], str) and "\n" not in record["change"]):
        out.append("change: one line")
    if "with" in record and not (isinstance(record["with"], list) and all(isinstance(w, str) for w in record["with"])):
        out.append("with: a list of record names")
    summary = record.get("summary", {})
    if not isinstance(summary, dict):
        out.append("summary: an object")
    else:
        out += [f"summary: unknown key {k}" for k in summary if k not in SUMMARY]
        for k in ("heldout", "bundled", "in_flight_16"):
            part = summary.get(k, {})
            if not isinstance(part, dict) or not isinstance(part.get("x_ar", {}), dict):
                out.append(f"summary.{k}: an object with x_ar an object")
        vs = summary.get("vs_llamacpp")
        if vs is not None and not (isinstance(vs, dict) and {"runner", "x"} <= vs.keys()):
            out.append("summary.vs_llamacpp: runner and x at least")
    if not [k for k in record if k not in REQUIRED and k not in OPTIONAL]:
        out.append("no figures")
    return out


def dumps(value, indent: int = 0, width: int = 100) -> str:
    """JSON with objects and lists on one line where they fit, nested ones indented otherwise."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or not value or len(flat) + indent <= width:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, list):
        items = [pad + dumps(v, indent + 1, width) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {dumps(v, indent + 1, width)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def write_record(path_or_dir, name: str, result: dict, commands: list[str] | str, what: str, **meta) -> pathlib.Path:
    """Write one record: the figures in `result` under the metadata this machine and checkout give
    (date, time, commit, cpu, isa) and the caller's `commands` and `what`; `meta` may set any
    OPTIONAL key or override the metadata (a transcription's date). A directory gets the file
    `<date>-<cpu slug>-<name>.json`; a path ending in .json is written as given. Returns the path."""
    clash = sorted(set(result) & set(REQUIRED + OPTIONAL))
    if clash:
        raise ValueError(f"figure keys clash with the record's metadata: {clash}")
    now = datetime.datetime.now()
    cpu, isa = this_cpu()
    record = {"what": what, "date": now.date().isoformat(), "time": now.strftime("%H:%M"),
              "commit": this_commit(), "cpu": cpu, "isa": isa,
              "commands": [commands] if isinstance(commands, str) else list(commands)}
    record.update(meta)
    record.update(result)
    bad = problems(record)
    if bad:
        raise ValueError(f"record {name}: " + "; ".join(bad))
    path = pathlib.Path(path_or_dir)
    if path.suffix != ".json":
        path = path / f"{record['date']}-{slug(record['cpu'], record['isa'])}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(record) + "\n")
    return path


RESULTS = pathlib.Path("docs/results")  # where --record writes, from the repository's root


def add_record_option(p) -> None:
    """`--record NAME` for a command whose result the docs may cite."""
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the result as a record docs/results/<date>-<cpu>-NAME.json: the "
                        "command line, commit, CPU and figures (`make results` then tabulates it "
                        "once it has a summary)")


def record_run(args, tool: str, result: dict, what: str) -> None:
    """With `--record NAME`: this command line's result as a record, its figures under `tool`."""
    if getattr(args, "record", None):
        path = write_record(RESULTS, args.record, {tool: result}, "angelspec " + shlex.join(sys.argv[1:]), what)
        print(f"recorded {path}")
