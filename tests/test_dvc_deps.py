"""dvc.yaml against the code: each stage's code deps are its command's import closure, its params what the code reads.

A stage runs ``transfusion <name>``, the command ``stages/cli.py`` maps to ``stages/<module>`` (its ``COMMANDS``
table). Its code is that module and every project module it imports, transitively, in grimp's import graph (the one
``lint-imports`` reads: module level, in functions, under ``if TYPE_CHECKING:``), plus the ``__init__.py`` above each
of them that holds code (importing ``a.b`` runs ``a/__init__.py``); ``pipeline/__init__.py``, the lazy public API, never
counts: no project module imports through it (the ``no-facade`` contract), so it changes no stage's output.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
COMMANDS = next(ast.literal_eval(n.value) for n in ast.parse((ROOT / "stages/cli.py").read_text()).body
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "COMMANDS")  # {"prepare": "stages.x:f"}


def module_of(stage: dict) -> str:
    """``transfusion prepare`` -> ``stages.prepare``."""
    words = stage["cmd"].split()
    assert words[0] == "transfusion" and words[1] in COMMANDS, f"cmd {stage['cmd']!r} is not `transfusion <command>`"
    return COMMANDS[words[1]].split(":")[0]


def code_files(module: str, graph: grimp.ImportGraph) -> list[str]:
    """The files ``module`` runs: its own, its imports' (transitively) and their packages' that hold code."""
    files = set()
    for name in {module} | graph.find_upstream_modules(module):
        parts = name.split(".")
        for i in range(2, len(parts) + 1):  # a.b.c: a/b/__init__.py (with code), then a/b/c.py or a/b/c/__init__.py
            base = ROOT.joinpath(*parts[:i])
            init = base / "__init__.py"
            if i == len(parts) and not init.is_file():
                files.add(base.with_suffix(".py"))
            elif any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # more than a docstring
                     for n in ast.parse(init.read_text()).body):
                files.add(init)
    return sorted(f.relative_to(ROOT).as_posix() for f in files)


def test_code_deps_are_the_import_closure():
    graph = grimp.build_graph("pipeline", "stages", cache_dir=None)
    assert {"prepare", "pretrain", "evaluate", "report", "sweep", "theory", "sets"} <= set(STAGES)
    problems = []
    for name, stage in STAGES.items():
        listed = [d for d in stage["deps"] if isinstance(d, str) and d.endswith(".py")]
        needed = code_files(module_of(stage), graph)
        if listed != needed:
            problems.append(f"stage {name}: missing {sorted(set(needed) - set(listed))}, never imported by "
                            f"`{stage['cmd']}` {sorted(set(listed) - set(needed))}, or not sorted")
    assert not problems, "dvc.yaml's code deps are not what the commands import:\n  " + "\n  ".join(problems)


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
    module = ROOT.joinpath(*module_of(stage).split(".")).with_suffix(".py")
    read = {node.attr for node in ast.walk(ast.parse(module.read_text())) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "params" and node.attr in PARAMS_YAML}
    if name == "theory":
        read.add("theory")  # getattr(params, "theory")
    uncovered = [s for s in sorted(read) if not any(k == s or k.startswith(s + ".") for k in keys)]
    assert not uncovered, f"stage {name}: reads params.{uncovered} but dvc.yaml lists no key of them"
