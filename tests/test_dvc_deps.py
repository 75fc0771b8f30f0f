"""dvc.yaml against the code: each stage's code deps cover its import closure, its params match what the code reads.

A stage runs ``transfusion <name>``: the click command named ``<name>`` that ``stages/cli.py`` imports from
``stages/<module>.py``. Its code is that module plus every project module it imports, transitively, read from the
AST (module level and inside functions alike: a lazy import runs too). Third-party imports are ignored, and so is
``stages/cli.py`` itself (it only gathers the commands).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages")
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
STAGES = DVC["stages"]


# ------------------------------------------------------------------------------------------ import closure
def module_file(dotted: str, root: Path = ROOT) -> Path | None:
    """``pipeline.x`` -> ``pipeline/x.py`` (or a package's ``__init__.py``); None if not a project module."""
    if dotted.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_files(path: Path, root: Path = ROOT) -> set[Path]:
    """The project files one file imports, anywhere in it (``import a.b``, ``from a import b``, ``from a.b import c``).

    A package's ``__init__.py`` counts only when it holds code (an empty one, or a docstring alone, changes nothing).
    ``pipeline/__init__.py``, the public API, never counts: its exports load lazily and no project module uses them
    (tests/test_layers.py), so it changes no stage's output, and a new export re-runs nothing.
    """
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pipeline.evaluation import figures`: evaluation/figures.py; `from pipeline.io import x`: io.py
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.relative_to(root)}:{node.lineno}: relative import; use the absolute form")
        for dotted in names:
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
                file = module_file(".".join(parts[:i]), root)
                if file is not None and file != root / "pipeline" / "__init__.py" and (
                        file.name != "__init__.py" or holds_code(file)):
                    found.add(file)
    return found


def holds_code(path: Path) -> bool:
    """Whether a file holds more than a docstring (a package's docstring-only ``__init__.py`` runs nothing)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def closure(start: Path, root: Path = ROOT) -> set[Path]:
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path, root) - seen)
    return seen


def command_modules(root: Path = ROOT) -> dict[str, Path]:
    """``{command name: stages/<module>.py}`` for every command of ``stages/cli.py`` (its ``COMMANDS`` table,
    read from the AST: the modules are imported only when their command runs)."""
    cli = ast.parse((root / "stages/cli.py").read_text())
    table = next(node.value for node in cli.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 and ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target) == "COMMANDS")
    commands: dict[str, Path] = {}
    for key, value in zip(table.keys, table.values, strict=True):
        module, attr = value.value.split(":")
        path = module_file(module, root)
        assert path is not None, module
        fn = next((f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef) and f.name == attr),
                  None)
        assert fn is not None, f"{value.value}: no such function"
        assert command_name(fn) == key.value, f"{value.value} is the command {command_name(fn)!r}, not {key.value!r}"
        commands[key.value] = path
    return commands


def command_name(fn: ast.FunctionDef) -> str:
    """The name of a ``@click.command("name")`` function (click's default: the function name, ``_`` -> ``-``)."""
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func) in ("click.command", "command"):
            if deco.args and isinstance(deco.args[0], ast.Constant):
                return deco.args[0].value
            for kw in deco.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
            return fn.name.replace("_", "-")
    raise AssertionError(f"{fn.name} is listed by stages/cli.py but is not a click command")


def stage_command(stage: dict) -> str:
    words = stage["cmd"].split()
    assert words[0] == "transfusion" and len(words) >= 2, f"cmd {stage['cmd']!r} is not `transfusion <stage>`"
    return words[1]


def listed(stage: dict) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]


def code_problems(name: str, stage: dict, root: Path = ROOT) -> list[str]:
    """What is wrong with one stage's code deps (empty when right)."""
    commands = command_modules(root)
    command = stage_command(stage)
    if command not in commands:
        return [f"stage {name}: `transfusion {command}` is not a command of stages/cli.py"]
    needed = {p.relative_to(root).as_posix() for p in closure(commands[command], root)}
    deps = listed(stage)
    problems = [f"stage {name}: deps miss {f} (imported by `transfusion {command}`)"
                for f in sorted(needed - set(deps))]
    problems += [f"stage {name}: deps list {d}, which does not exist" for d in deps
                 if d.endswith(".py") and not (root / d).is_file()]
    problems += [f"stage {name}: deps list {d}, which `transfusion {command}` never imports" for d in deps
                 if d.endswith(".py") and (root / d).is_file() and d not in needed]
    code = [d for d in deps if d.endswith(".py")]
    if code != sorted(code):
        problems.append(f"stage {name}: code deps are not sorted: {code}")
    return problems


def write_code_deps(path: Path = ROOT / "dvc.yaml", root: Path = ROOT) -> None:
    """Rewrite each stage's code deps in ``dvc.yaml`` to its import closure, after its data deps, keeping every other
    line: ``python -m tests.test_dvc_deps`` after moving code."""
    commands, stages = command_modules(root), yaml.safe_load(path.read_text())["stages"]
    out: list[str] = []
    stage = pending = None  # pending: the code deps to write where the current deps list ends
    for line in path.read_text().splitlines(keepends=True):
        stripped = line.strip()
        in_list = pending is not None and stripped.startswith("- ") and not stripped.endswith(":")
        if pending is not None and not in_list:
            out += pending
            pending = None
        if line.startswith("  ") and not line.startswith("   ") and stripped.endswith(":"):
            stage = stripped[:-1]
        if in_list and stripped.endswith(".py"):
            continue  # an old code dep
        out.append(line)
        if stage in stages and stripped == "deps:":
            indent = line[: len(line) - len(line.lstrip())] + "  "
            needed = sorted(p.relative_to(root).as_posix() for p in closure(commands[stage_command(stages[stage])],
                                                                            root))
            pending = [f"{indent}- {d}\n" for d in needed]
    out += pending or []
    path.write_text("".join(out))


if __name__ == "__main__":
    write_code_deps()


def test_every_stage_command_is_found():
    commands = command_modules()
    assert {"prepare", "pretrain", "evaluate", "report", "sweep", "theory"} <= set(commands)
    for name, stage in STAGES.items():
        assert stage_command(stage) in commands, name


def test_closure_follows_every_import_form(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "stages").mkdir()
    for name in ("pipeline/__init__.py", "stages/__init__.py"):
        (tmp_path / name).write_text("")
    files = {
        "stages/go.py": ("import click\nfrom stages._c import x\nimport pipeline.a\n\n"
                         "def f():\n    from pipeline import b\n"),
        "stages/_c.py": "from pipeline.c import y\n",
        "pipeline/a.py": "import numpy\n",
        "pipeline/b.py": "import pipeline.d as d\n",
        "pipeline/c.py": "y = 1\n",
        "pipeline/d.py": "from pipeline.e import z\n",
        "pipeline/e.py": "z = 1\n",
        "pipeline/unused.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    got = {p.relative_to(tmp_path).as_posix() for p in closure(tmp_path / "stages/go.py", tmp_path)}
    assert got == set(files) - {"pipeline/unused.py"}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_code_deps_cover_the_import_closure(name):
    problems = code_problems(name, STAGES[name])
    assert not problems, "dvc.yaml is out of date with the code:\n  " + "\n  ".join(problems)


def test_a_missing_dep_is_named(monkeypatch):
    stage = {**STAGES["theory"], "deps": [d for d in listed(STAGES["theory"]) if d != "pipeline/io.py"]
             + ["pipeline/gone.py"]}
    problems = code_problems("theory", stage)
    assert "stage theory: deps miss pipeline/io.py (imported by `transfusion theory`)" in problems
    assert "stage theory: deps list pipeline/gone.py, which does not exist" in problems


# ------------------------------------------------------------------------------------------------- params
PARAMS_YAML = yaml.safe_load((ROOT / "params.yaml").read_text())
# ray keys that say where and how patiently a job runs, never what it computes: no stage depends on them
RAY_EXECUTION = {"ray.address", "ray.storage_path", "ray.max_failures", "ray.connect_timeout_s",
                 "ray.resources_timeout_s", "ray.backend"}  # backend: how workers talk (same sums), not what


def in_params_yaml(key: str) -> bool:
    node = PARAMS_YAML
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def sweep_reads() -> list[str]:
    """What the sweep's trials read, from ``base_params`` and ``axes`` run on params.yaml, in dvc.yaml's form:
    the section name where every key of it (in params.yaml) is read, else the keys, in params.yaml's order."""
    from pipeline.config.base import flatten
    from pipeline.config.params import load_params
    from pipeline.config.space import axes, base_params

    # every value base_params might overwrite set to something else than what it would write
    params = load_params(ROOT / "params.yaml", [
        "sweep.epochs=3", "train.epochs=7", "train.knn_every=2", "train.checkpoint_every=2", "train.warmup_epochs=0",
        "sweep.cpus_per_worker=0.5", "ray.cpus_per_worker=1.0", "sweep.lr=[]"])
    before, after = flatten(params.model_dump()), flatten(base_params(params))
    overwritten = {k for k in before if before[k] != after.get(k)}
    swept = set(axes(params))  # with sweep.lr empty: what every sweep overrides
    assert overwritten and swept, (overwritten, swept)
    out = ["sweep"]
    for section in ("model", "loss", "augment", "train", "ray"):
        keys = [f"{section}.{k}" for k in PARAMS_YAML[section]]
        read = [k for k in keys if k not in overwritten | swept | RAY_EXECUTION]
        out += [section] if read == keys else read
    return out


def test_sweep_params_are_the_code_constant():
    from pipeline.runs.sweep import DVC_PARAMS

    listed_params = STAGES["sweep"]["params"]
    assert listed_params == list(DVC_PARAMS), (
        "dvc.yaml's sweep params differ from pipeline.runs.sweep.DVC_PARAMS: "
        f"only in dvc.yaml {sorted(set(listed_params) - set(DVC_PARAMS))}, "
        f"only in the code {sorted(set(DVC_PARAMS) - set(listed_params))} (same order too)")


def test_sweep_params_constant_is_what_the_trials_read():
    from pipeline.runs.sweep import DVC_PARAMS

    expected = sweep_reads()
    assert list(DVC_PARAMS) == expected, (
        "pipeline.runs.sweep.DVC_PARAMS is not what base_params hands the trials: "
        f"read but not listed {[k for k in expected if k not in DVC_PARAMS]}, "
        f"listed but not read {[k for k in DVC_PARAMS if k not in expected]}")


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_params_exist_and_cover_what_the_command_reads(name):
    """Every listed key is in params.yaml (else DVC stops with MissingParamsError), and every ``params.<section>``
    the stage's module reads is listed (the section or keys of it)."""
    stage = STAGES[name]
    keys = [p if isinstance(p, str) else next(iter(p)) for p in stage.get("params", [])]
    assert all(isinstance(p, str) for p in stage.get("params", [])), "only params.yaml keys are expected"
    missing = [k for k in keys if not in_params_yaml(k)]
    assert not missing, f"stage {name}: params {missing} are not in params.yaml"
    module = command_modules()[stage_command(stage)]
    read = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "params"
                and node.attr in PARAMS_YAML):
            read.add(node.attr)
    if name == "theory":
        read.add("theory")  # getattr(params, "theory")
    uncovered = [s for s in sorted(read) if not any(k == s or k.startswith(s + ".") for k in keys)]
    assert not uncovered, f"stage {name}: reads params.{uncovered} but dvc.yaml lists no key of them"
