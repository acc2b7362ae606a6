"""Code comments and docstrings say what and why (an invariant, a reason, a pointer to docs);
the measurements behind a choice, their dates and the CPUs they ran on live in docs/results
(design-measurements.md for the code's choices). This fails on a date, a speed or time figure
(tokens/s, GB/s, ms, us), a percentage or a CPU model's name in a comment or docstring."""
import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("angelspec", "bench", "builders", "plugins", "serving", "training", "model_repo")
MEASURED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"                        # a date
                      r"|\d[\d.,]*\s*(?:tokens/s|tok/s|GB/s|MB/s|ms|us|µs)\b"  # a speed, a time
                      r"|(?:~|\d-)\d[\d.]*\s*s\b"                         # seconds measured: ~2 s, 40-80 s
                      r"|\d+(?:\.\d+)?\s*%"                                # a percentage
                      r"|\b(?:EPYC|Xeon|Ryzen|Zen ?\d|Sapphire Rapids)\b")  # a CPU


def python_comments(path: pathlib.Path):
    src = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                for i, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + i, line


def cpp_comments(path: pathlib.Path):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if "//" in line:
            yield i, line[line.index("//"):]


def test_no_measurement_in_a_code_comment():
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if "__pycache__" in path.parts:
                continue
            comments = (python_comments(path) if path.suffix == ".py" else
                        cpp_comments(path) if path.suffix in (".cpp", ".h", ".cu") else ())
            for line, text in comments:
                if MEASURED.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()[:100]}")
    assert not found, "measurements belong in docs/results, not in code comments:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    for text in ("ran at 244 tokens/s", "on 2026-12-02", "~0.3 ms a row", "an AVX-512 EPYC", "5-11% slower",
                 "took ~0.11 s", "in 40-80 s"):
        assert MEASURED.search(text), text
    for text in ("kRegionRows = 16 rows", "576-wide", "version 2.51", "(docs/results/design-measurements.md)",
                 "every 2 s, at most every 32 s"):
        assert not MEASURED.search(text), text
