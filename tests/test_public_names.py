"""No module reaches into another project module's private names: what a module shares it names publicly."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages")


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def is_module(name: str) -> bool:
    """``pipeline.core.batchnorm`` -> True: a module or package of this repository."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """``from pipeline.x import _y``, ``x._y`` and ``setattr(x, "_y", ...)`` where ``x`` is a project module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = set(PACKAGES)  # local names bound to project modules (and the packages themselves)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
            for alias in node.names:
                if private(alias.name):
                    hits.append(f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{alias.name}")
                elif node.module in PACKAGES or is_module(f"{node.module}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] in PACKAGES)
    for node in ast.walk(tree):
        target = attr = None
        if isinstance(node, ast.Attribute) and private(node.attr):
            target, attr = dotted(node.value), node.attr
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "setattr"):
            target, attr = dotted(node.args[0]), node.args[1].value
        if target and (target in modules or target.split(".")[0] in PACKAGES):
            hits.append(f"{path.relative_to(root)}:{node.lineno} uses {target}.{attr}")
    return hits


def test_no_module_uses_another_modules_private_names():
    files = [f for d in ("pipeline", "stages", "tests", "benchmarks") for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 30
    hits = [h for f in files for h in private_uses(f)]
    assert hits == [], "give these names a public name at their definition: " + "; ".join(hits)


def test_the_scan_sees_each_kind_of_private_use(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from pipeline.runs.sweep import _rows, run_sweep\nimport pipeline.training.step as s\n"
                 "from pipeline.core "
                 "import batchnorm as bn\ns._hidden = 1\nsetattr(bn, '_world', 2)\npipeline.cluster._x\nself._ok\n"
                 "from stages._common import params_options\n")
    assert sorted(h.split(" ", 1)[1] for h in private_uses(f, tmp_path)) == sorted([
        "imports pipeline.runs.sweep._rows", "uses s._hidden", "uses bn._world", "uses pipeline.cluster._x"])
