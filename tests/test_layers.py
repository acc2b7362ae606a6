"""The flow's direction, checked on every import in the project (module level or not): a stage
imports the core, never another stage or the command line; inside the core, each layer imports
only the layers below it. `angelspec.cli` alone may import inside functions (so that `--help`,
`client` and `stop` start without torch)."""
import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# top to bottom; a layer of several packages separated by " | " holds independent stages (none
# imports another); "a : b" lists modules of one layer that may import each other
LAYERS = [
    "angelspec.cli",
    "angelspec.bench",
    "angelspec.builders | angelspec.training | angelspec.serving | model_repo",
    "angelspec.runtime",
    "angelspec.drafters",
    "angelspec.checkpoint : angelspec.default_target : angelspec.synthetic_target : angelspec.sampling"
    " : angelspec.prompts : angelspec.text : angelspec.params : angelspec.weights : angelspec.record",
    "angelspec.model",
    "angelspec.pages",
    "angelspec.plugins",
]


def modules() -> dict[str, pathlib.Path]:
    """Every project module's dotted name -> its file, through pyproject's package-dir."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in dirs.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package,) + parts).removesuffix(".__init__")
            out.setdefault(name, f)  # a sub-package's own entry (deeper) wins over its parent's walk
    for f in (ROOT / "model_repo").rglob("model.py"):
        out["model_repo." + ".".join(f.relative_to(ROOT / "model_repo").with_suffix("").parts)] = f
    return out


def layer_of(name: str):
    """(layer index, group) of a module; group None where the layer's modules may import each
    other; None for modules no layer names (angelspec/__init__)."""
    best = None
    for i, layer in enumerate(LAYERS):
        independent = " | " in layer
        for unit in layer.replace(" | ", " : ").split(" : "):
            if name == unit or name.startswith(unit + "."):
                if best is None or len(unit) > len(best[2]):
                    best = (i, unit if independent else None, unit)
    return None if best is None else best[:2]


def imports(path: pathlib.Path):
    """(line, imported module, inside a function) for every import of a project module."""
    tree = ast.parse(path.read_text())
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested |= {id(n) for n in ast.walk(node) if n is not node}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("angelspec"):
                yield node.lineno, name, id(node) in nested


def test_imports_point_down():
    mods = modules()
    bad = {}  # (file, line) -> the first problem found there
    for name, path in sorted(mods.items()):
        mine = layer_of(name)
        for line, target, in_function in imports(path):
            key = (str(path.relative_to(ROOT)), line)
            where = f"{key[0]}:{line} imports {target}"
            if key in bad:
                continue
            if in_function and mine != layer_of("angelspec.cli"):
                bad[key] = f"{where} inside a function (import at the top; a cycle means a layer is wrong)"
            theirs = layer_of(target) if target in mods or any(m.startswith(target + ".") for m in mods) else None
            if mine is None or theirs is None or name.startswith(target):
                continue
            if theirs[0] < mine[0]:
                bad[key] = f"{where}: up, from {LAYERS[mine[0]]!r} to {LAYERS[theirs[0]]!r}"
            elif theirs[0] == mine[0] and mine[1] is not None and theirs[1] != mine[1]:
                bad[key] = f"{where}: sideways, between independent stages"
    assert not bad, "imports against the flow:\n" + "\n".join(bad.values())


def test_every_module_has_a_layer():
    """A new package must be placed in LAYERS before it can be checked."""
    missing = [n for n in modules() if layer_of(n) is None and n != "angelspec"]
    assert not missing, f"modules in no layer: {missing}"


EXPORT_LIBRARIES = ("onnx", "onnxscript", "onnxruntime", "onnxruntime_extensions", "tensorrt")


def test_the_core_imports_no_export_library():
    """ONNX, ONNX Runtime and TensorRT belong to the export stage (builders/, run in its own
    environment): no module of the core layers imports them, at module level or inside a
    function."""
    core = LAYERS[LAYERS.index("angelspec.runtime"):]
    bad = []
    for name, path in sorted(modules().items()):
        layer = layer_of(name)
        if layer is None or LAYERS[layer[0]] not in core:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in EXPORT_LIBRARIES]
    assert not bad, "\n".join(bad)
