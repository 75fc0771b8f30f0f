"""The pure core imports no orchestration: each module, alone in a fresh interpreter, loads none of these."""

import subprocess
import sys

import pytest

CORE = ["model", "losses", "augment", "theory", "datasets", "knn", "optim", "step", "loop", "health"]
FORBIDDEN = ("ray", "mlflow", "dvc", "click")


@pytest.mark.parametrize("module", [m if m == "loop" else pytest.param(m, marks=pytest.mark.slow) for m in CORE])
def test_core_module_imports_no_orchestration(module):
    probe = f"import sys, pipeline.{module}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(FORBIDDEN)}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"pipeline.{module} imports {out.stdout.strip()}"
