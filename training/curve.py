"""A draft's learning curve from its `log.jsonl`: the held-out figures of every evaluation
against steps, labelled positions trained on and training time, as a table and a plot."""
from __future__ import annotations

import json
import pathlib

from angelspec.prompts import DOMAINS


def read_curve(out) -> list[dict]:
    """The evaluated rows of `<out>/log.jsonl` (those with `val_tau`), in step order."""
    f = pathlib.Path(out) / "log.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
    return [r for r in rows if "val_tau" in r]


def depths(rows: list[dict]) -> list[int]:
    return sorted(int(k[9:]) for k in rows[-1] if k.startswith("val_alpha") and k[9:].isdigit()) if rows else []


def table(rows: list[dict]) -> str:
    """One line an evaluation: step, tokens, minutes, accept length overall and per domain,
    acceptance at each depth (held-out split), then accept length and first-token acceptance
    per domain on the outside prompts where the log has them."""
    if not rows:
        return "no evaluation in the log yet"
    last = rows[-1]
    cols = [("tau", "val_tau", ".3f")]
    cols += [(f"tau_{d}", f"val_tau_{d}", ".3f") for d in DOMAINS if f"val_tau_{d}" in last]
    cols += [(f"alpha{d}", f"val_alpha{d}", ".3f") for d in depths(rows)]
    cols += [(f"out_{k}_{d}", f"outside_{k}_{d}", ".3f") for d in DOMAINS for k in ("tau", "alpha1")
             if f"outside_{k}_{d}" in last]
    lines = [f"{'step':>6} {'tokens':>9} {'min':>6} " + " ".join(f"{n:>{max(6, len(n))}}" for n, _, _ in cols)]
    for r in rows:
        lines.append(f"{r['step']:>6} {r.get('tokens', 0):>9} {r.get('seconds', 0) / 60:>6.1f} "
                     + " ".join(f"{r.get(k, float('nan')):>{max(6, len(n))}{f}}" for n, k, f in cols))
    return "\n".join(lines)


def plot(rows: list[dict], path, title: str = "") -> pathlib.Path | None:
    """val_tau per domain and acceptance per depth against labelled positions trained on."""
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.get("tokens", r["step"]) / 1e6 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [r["val_tau"] for r in rows], "k-o", ms=3, label="all")
    for i, d in enumerate(DOMAINS):
        if f"val_tau_{d}" in rows[-1]:
            a.plot(x, [r.get(f"val_tau_{d}") for r in rows], "-o", ms=3, color=f"C{i}", label=f"{d} (held out)")
        if f"outside_tau_{d}" in rows[-1]:
            a.plot(x, [r.get(f"outside_tau_{d}") for r in rows], "--s", ms=3, color=f"C{i}",
                   label=f"{d} (outside prompts)")
    a.set(xlabel="labelled positions trained on (millions)", ylabel="accept length (responses walked as served)")
    a.legend()
    for d in depths(rows):
        b.plot(x, [r.get(f"val_alpha{d}") for r in rows], "-o", ms=3, label=f"depth {d}")
    b.set(xlabel="labelled positions trained on (millions)", ylabel="acceptance at depth d | d-1 accepted",
          ylim=(0, 1))
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
