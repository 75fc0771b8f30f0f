"""The architecture of ``pipeline/``, enforced: floors, no cycles, the pure core, the 600-line cap.

The floors, bottom to top (a module may import its own package and the floors below, never a floor above nor a
package beside it on the same floor):

====  =======================================================================================================
0     the ground floor: ``pipeline.config`` (which imports nothing else of ``pipeline``), ``io``, ``host``, ``plots``,
      ``legacy`` (old module paths)
1     ``pipeline.core`` (model, losses, backbones, ...) and ``pipeline.data`` (sources, prepared format, augment)
2     ``pipeline.theory`` (the paper's section 3)
3     ``pipeline.evaluation`` (probes, health, figures, report)
4     ``pipeline.training`` (the step, the loop)
5     ``pipeline.runs`` (Ray Train, Ray Tune, MLflow)
6     ``stages`` (the click commands)
====  =======================================================================================================

The graph is read statically from the AST (no module is imported for it). An edge ``a -> b`` is any import of
``b`` written anywhere in ``a``: at module level, inside a function (a lazy import runs too, just later) and under
``if TYPE_CHECKING:`` (the type checker follows it). The edges are those of :func:`tests.test_dvc_deps.imported_files`,
the reading DVC's code deps are checked with. ``pipeline/__init__.py`` (the public API, whose exports load lazily)
sits above everything and no project module imports through it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dvc_deps import PACKAGES, imported_files

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
GROUND = ("pipeline.config", "pipeline.io", "pipeline.host", "pipeline.plots", "pipeline.legacy")
FLOORS = {**dict.fromkeys(GROUND, 0), "pipeline.core": 1, "pipeline.data": 1, "pipeline.theory": 2,
          "pipeline.evaluation": 3, "pipeline.training": 4, "pipeline.runs": 5, "stages": 6}
PURE = (*GROUND, "pipeline.core", "pipeline.data", "pipeline.theory", "pipeline.evaluation",
        "pipeline.training")  # everything below Ray's floor
ORCHESTRATION = ("ray", "mlflow", "dvc", "click")


def project_files(root: Path = ROOT) -> list[Path]:
    """Every module of ``pipeline/`` and ``stages/``, subpackages included; a package's ``__init__.py`` when it holds
    code (a docstring alone is no code)."""
    return [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py")) if has_code(p)]


def has_code(path: Path) -> bool:
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def dotted(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str | None:
    """The package (or ground-floor module) a module belongs to: the longest key of :data:`FLOORS` it starts with."""
    keys = [k for k in FLOORS if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def import_graph(root: Path = ROOT) -> dict[Path, set[Path]]:
    files = project_files(root)
    return {f: (imported_files(f, root) & set(files)) - {f} for f in files}


def facade_names(path: Path, root: Path = ROOT) -> list[str]:
    """The names ``path`` takes from ``pipeline`` itself that are not its subpackages or modules (the facade's)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "pipeline" and not node.level:
            found += [a.name for a in node.names
                      if not ((root / "pipeline" / a.name).is_dir() or (root / "pipeline" / f"{a.name}.py").is_file())]
    return found


def layer_violations(graph: dict[Path, set[Path]], root: Path = ROOT) -> list[str]:
    found = []
    for a, targets in sorted(graph.items()):
        ma = dotted(a, root)
        if ma == "pipeline":
            continue  # the public API: above everything
        ua = unit(ma)
        if ua is None:
            found.append(f"{a.relative_to(root)}: in no floor (add its package to tests/test_layers.py FLOORS)")
            continue
        found += [f"{ma} imports {name} from the public API `pipeline`; import the module that defines it"
                  for name in facade_names(a, root)]
        for b in sorted(targets):
            mb = dotted(b, root)
            ub = unit(mb)
            if ub is None or ub == ua:
                continue
            elif ua == "pipeline.config":
                found.append(f"{ma} -> {mb}: pipeline.config imports nothing else of pipeline")
            elif FLOORS[ub] >= FLOORS[ua] and not (FLOORS[ua] == FLOORS[ub] == 0):
                found.append(f"{ma} (floor {FLOORS[ua]}) -> {mb} (floor {FLOORS[ub]})")
    return found


def test_each_package_imports_only_the_floors_below_it():
    graph = import_graph()
    assert len(graph) > 40 and graph[ROOT / "pipeline/config/params.py"], "the scan sees the modules and their imports"
    assert layer_violations(graph) == []


def test_a_floor_above_a_package_beside_and_the_facade_are_found(tmp_path):
    write(tmp_path, "pipeline/__init__.py", "def __getattr__(name):\n    return name\n")
    write(tmp_path, "pipeline/core/model.py", "from pipeline.training import step\n")  # floor 1 -> 4
    write(tmp_path, "pipeline/core/losses.py", "from pipeline.data.sources import x\n")  # beside it, on floor 1
    write(tmp_path, "pipeline/training/step.py", "from pipeline.core.model import M\nfrom pipeline.io import w\n")
    write(tmp_path, "pipeline/io.py", "")
    write(tmp_path, "pipeline/data/sources.py", "")
    write(tmp_path, "pipeline/config/data.py", "from pipeline.io import w\n")  # config imports nothing else
    write(tmp_path, "pipeline/runs/train.py", "from pipeline import build_model\n")
    write(tmp_path, "pipeline/oops.py", "")
    found = layer_violations(import_graph(tmp_path), tmp_path)
    assert found == [
        "pipeline.config.data -> pipeline.io: pipeline.config imports nothing else of pipeline",
        "pipeline.core.losses (floor 1) -> pipeline.data.sources (floor 1)",
        "pipeline.core.model (floor 1) -> pipeline.training.step (floor 4)",
        "pipeline/oops.py: in no floor (add its package to tests/test_layers.py FLOORS)",
        "pipeline.runs.train imports build_model from the public API `pipeline`; import the module that defines it",
    ], found


def test_no_module_is_over_the_line_cap():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "pipeline").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concern"


def test_the_pure_floors_name_no_orchestration_library():
    """Statically: no module below ``pipeline.runs`` imports Ray, MLflow, DVC or click, not even lazily."""
    found = []
    for path in project_files():
        if unit(dotted(path)) not in PURE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found += [f"{dotted(path)} imports {n}" for n in names if n.split(".")[0] in ORCHESTRATION]
    assert found == []


@pytest.mark.slow
def test_the_pure_floors_load_no_orchestration_library():
    """At run time, in a fresh interpreter: every module below ``pipeline.runs`` imported, none of Ray, MLflow, DVC or
    click is loaded (a third-party import that pulls one in is caught here, not by the AST)."""
    modules = sorted(dotted(p) for p in project_files() if unit(dotted(p)) in PURE)
    probe = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(ORCHESTRATION)!r}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert len(modules) > 30 and out.stdout.strip() == "[]", out.stdout


def test_no_import_cycle_among_pipeline_and_stages():
    graph = import_graph()
    found = cycles(graph)
    assert found == [], "import cycles (move what both sides need into a module both can import): " + " | ".join(
        describe(c, graph) for c in found)


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[Path], graph: dict[Path, set[Path]], root: Path = ROOT) -> str:
    members = set(component)
    edges = [f"{a.relative_to(root)} -> {b.relative_to(root)}" for a in component for b in sorted(graph[a] & members)]
    return "; ".join(edges)


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path):
    write(tmp_path, "pipeline/a.py", "from pipeline.b import B\n")
    write(tmp_path, "pipeline/b.py", "B = 1\n\ndef f():\n    from pipeline import c\n")
    write(tmp_path, "pipeline/c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.a\n")
    write(tmp_path, "pipeline/d.py", "import pipeline.a\n")  # into the cycle, not on it
    write(tmp_path, "stages/x.py", "def run():\n    import stages.y\n")
    write(tmp_path, "stages/y.py", "from stages.x import run\n")
    graph = import_graph(tmp_path)
    names = [[p.relative_to(tmp_path).as_posix() for p in c] for c in cycles(graph)]
    assert sorted(names) == [["pipeline/a.py", "pipeline/b.py", "pipeline/c.py"], ["stages/x.py", "stages/y.py"]]
    write(tmp_path, "pipeline/c.py", "import os\n")  # the cycle broken: what is left is the other one
    assert [[p.name for p in c] for c in cycles(import_graph(tmp_path))] == [["x.py", "y.py"]]
