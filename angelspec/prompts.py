"""Prompt files: JSONL with a `prompt` and a `domain` per line (bench, build and the data step
read them), and the bundled set of chat, code and math prompts."""
from __future__ import annotations

import json
import pathlib

DEFAULT_PROMPTS = pathlib.Path(__file__).with_name("data") / "prompts.jsonl"
# the build measures routes and draft lengths on these, so that no figure reported on the
# bundled prompts comes from prompts the engine was tuned on; neither set is ever trained on
CALIBRATION_PROMPTS = DEFAULT_PROMPTS.with_name("calibration.jsonl")
DOMAINS = ("chat", "code", "math")  # what prompts, data, drafts and routes are specialised for


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    """One JSON object per non-empty line."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def load_prompts(path: str | pathlib.Path | None, limit: int | None = None) -> list[dict]:
    """JSONL with `prompt` and `domain` per line; `limit` keeps the first N of each domain."""
    path = pathlib.Path(path or DEFAULT_PROMPTS)
    rows, seen = [], {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{i}: each line needs a non-empty string `prompt`")
        row.setdefault("domain", "other")
        seen[row["domain"]] = seen.get(row["domain"], 0) + 1
        if limit is None or seen[row["domain"]] <= limit:
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows
