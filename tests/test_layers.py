"""The architecture of ``pipeline/``, enforced: floors, no cycles, the pure core, the 600-line cap, ruff's rules.

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

These rules are import-linter contracts (``[tool.importlinter]`` in ``pyproject.toml``; ``lint-imports`` checks them
from the command line too): the floors (a package of ``pipeline/`` on no floor breaks them), ``stages`` on top, no
import through the public API ``pipeline`` (whose exports load lazily; it sits above everything), no Ray, MLflow, DVC
or click below ``pipeline.runs``, no import cycle. The graph is read statically (grimp; no module is imported for
it), and every import counts: at module level, inside a function (a lazy import runs too, just later) and under
``if TYPE_CHECKING:`` (the type checker follows it), as DVC's code deps are read (tests/test_dvc_deps.py).

What import-linter cannot express stays here: the 600-line cap, and the pure floors loading no orchestration library
at run time (a third-party import that pulls one in).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def read_contracts(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, dict]:
    import tomllib  # Python 3.11+

    return {c["id"]: c for c in tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]}


CONTRACTS = read_contracts()
PURE = tuple(CONTRACTS["pure-core"]["source_modules"])  # everything below Ray's floor
ORCHESTRATION = tuple(CONTRACTS["pure-core"]["forbidden_modules"])
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    out = run("-c", LINT_IMPORTS, "--no-cache", "--no-logo")  # lint-imports
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out.stdout, out.stdout
    assert len(CONTRACTS) == 5


def test_ruff_is_clean():
    """``ruff check .`` with [tool.ruff.lint], SLF001 among its rules: no module uses another's private names."""
    out = run("-m", "ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_module_is_over_the_line_cap():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "pipeline").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concern"


def pure_modules(root: Path = ROOT) -> list[str]:
    """Every module of the pure floors (the packages' ``__init__`` as the package)."""
    found = []
    for name in PURE:
        base = root / Path(*name.split("."))
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for path in files:
            parts = path.relative_to(root).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


@pytest.mark.slow
def test_the_pure_floors_load_no_orchestration_library():
    """At run time, in a fresh interpreter: every module below ``pipeline.runs`` imported, none of Ray, MLflow, DVC or
    click is loaded (a third-party import that pulls one in is caught here, not by the contracts)."""
    modules = pure_modules()
    probe = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(ORCHESTRATION)!r}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert len(modules) > 30 and "pipeline.core.model" in modules and out.stdout.strip() == "[]", out.stdout
