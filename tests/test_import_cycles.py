"""No import cycle among the modules of pipeline/ and stages/.

The graph is read statically from the AST (no module is imported for it). An edge ``a -> b`` is any import of
``b`` written anywhere in ``a``: at module level, inside a function (a lazy import runs too, just later) and under
``if TYPE_CHECKING:`` (the type checker follows it, and a cycle there is the same tangle of responsibilities). The
edges are those of :func:`tests.test_dvc_deps.imported_files`, the reading DVC's code deps are checked with. As
there, the ``"module:attr"`` strings of ``stages/cli.py``'s command table are no imports: the CLI only gathers the
commands, and a command may run others through it. A package's non-empty ``__init__.py`` counts as a module.
"""

from __future__ import annotations

from pathlib import Path

import pipeline.config
import pipeline.model
from pipeline import choices
from tests.test_dvc_deps import PACKAGES, imported_files

ROOT = Path(__file__).resolve().parents[1]


def project_files(root: Path = ROOT) -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((root / pkg).glob("*.py"))
            if p.name != "__init__.py" or p.read_text().strip()]


def import_graph(root: Path = ROOT) -> dict[Path, set[Path]]:
    files = project_files(root)
    return {f: (imported_files(f, root) & set(files)) - {f} for f in files}


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


def test_no_import_cycle_among_pipeline_and_stages():
    graph = import_graph()
    assert len(graph) > 30 and graph[ROOT / "pipeline/config.py"], "the scan sees the modules and their imports"
    found = cycles(graph)
    assert found == [], "import cycles (move what both sides need into a module both can import): " + " | ".join(
        describe(c, graph) for c in found)


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


def test_the_model_and_the_params_read_one_set_of_choices():
    """The block options' choices live in pipeline/choices.py: the model and the params schema share them."""
    assert pipeline.model.ACTIVATIONS is choices.ACTIVATIONS and pipeline.model.QK_INITS is choices.QK_INITS
    fields = pipeline.config.ModelConfig.model_fields
    for name, allowed in (("activation", choices.ACTIVATIONS), ("block_norm", choices.BLOCK_NORMS),
                          ("fusion_scope", choices.FUSION_SCOPES), ("qk_init", choices.QK_INITS)):
        assert set(fields[name].annotation.__args__) == set(allowed), name
