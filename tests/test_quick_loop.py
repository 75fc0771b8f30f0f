"""The quick loop (``pytest -m "not slow"``) still covers every module of pipeline/ and stages/.

Read statically (ast), so this costs well under a second: collecting the suite with ``pytest --collect-only``
imports torch, MLflow and Ray through every test module and takes 10-20 s on 2 cores. Measuring the quick loop
with coverage.py instead would cost more than the loop can spare: under coverage 7.17 (``patch = subprocess``, so
that the xdist workers and the CLI subprocesses count) ``pytest -m "not slow" -n 2`` took 1.41x and 1.49x the CPU
time of the plain run (149 s vs 106 s, 147 s vs 99 s; two pairs, 2 cores shared with other jobs), i.e. ~62-66 s
for the 44 s loop, over its 60 s budget.

A test is *quick* unless ``pytest.mark.slow`` reaches it: the file's ``pytestmark``, its class's or its own
decorators, or every value of one of its ``parametrize`` decorators being ``pytest.param(..., marks=slow)``.
A quick test *reaches* a module if it imports it (``import pipeline.x``, ``from pipeline import x``,
``from pipeline.x import y``), in its file's top level, in its own body, or in a helper or fixture of its file
that it uses (by name, transitively). A stages/ module with a ``click.command`` also counts as reached when a
quick test runs that subcommand through the CLI (``invoke("prepare", ...)``, ``runner.invoke(main, ["prepare",
...])``, ``[python, "-m", "stages.cli", "prepare"]``, or a case table's ``("prepare", "-S", ...)``).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "stages")
CLI_MODULE = "stages.cli"


def project_modules(root: Path = ROOT) -> set[str]:
    """Every module of pipeline/ and stages/, subpackages included (the packages' ``__init__`` aside)."""
    return {".".join(p.relative_to(root).with_suffix("").parts) for pkg in PACKAGES for p in (root / pkg).rglob("*.py")
            if p.stem != "__init__"}


def dotted(node: ast.AST) -> str:
    """``pytest.mark.slow`` -> "pytest.mark.slow" (a call is read as its function); "" for anything else."""
    if isinstance(node, ast.Call):
        return dotted(node.func)
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return node.id if isinstance(node, ast.Name) else ""


def is_slow_mark(node: ast.AST) -> bool:
    """A ``slow`` mark, or a list/tuple holding one (``pytestmark = [pytest.mark.slow, ...]``)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(is_slow_mark(e) for e in node.elts)
    name = dotted(node)
    return name == "mark.slow" or name.endswith(".mark.slow")


def cli_commands(root: Path = ROOT) -> dict[str, str]:
    """Subcommand name -> the stages/ module defining it (from ``@click.command("name")``)."""
    found = {}
    for path in sorted((root / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                if dotted(deco).endswith("command"):
                    args = deco.args if isinstance(deco, ast.Call) else []
                    name = args[0].value if args and isinstance(args[0], ast.Constant) else node.name.replace("_", "-")
                    found[name] = f"stages.{path.stem}"
    return found


@dataclass
class ReadTests:
    """One test module, read: its quick tests and what they reach."""

    path: Path
    quick: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)
    reached: set[str] = field(default_factory=set)


def _imported(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    out = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            out |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    elif node.module and node.level == 0:
        out.add(node.module)
        out |= {f"{node.module}.{alias.name}" for alias in node.names}  # from pipeline.evaluation import figures
    return out & modules


def _cli_calls(node: ast.AST, commands: dict[str, str]) -> set[str]:
    """Subcommands run through the CLI inside ``node``."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.List, ast.Tuple)):
            strs = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in sub.elts]
            if strs and strs[0] in commands:  # ["prepare", "-S", ...] / ("check",)
                names.add(strs[0])
            for a, b in zip(strs, strs[1:], strict=False):  # [python, "-m", "stages.cli", "prepare"]
                if a == CLI_MODULE and b in commands:
                    names.add(b)
        elif isinstance(sub, ast.Call) and dotted(sub.func).split(".")[-1] == "invoke" and sub.args:
            first = sub.args[0]
            if isinstance(first, ast.Constant) and first.value in commands:  # invoke("prepare", ...)
                names.add(first.value)
    return {commands[n] for n in names}


def _all_slow_values(deco: ast.AST, assigned: dict[str, ast.AST]) -> bool:
    """A ``parametrize`` whose every value is ``pytest.param(..., marks=<slow>)``: no quick case is left."""
    if not (isinstance(deco, ast.Call) and dotted(deco.func).endswith("mark.parametrize") and len(deco.args) >= 2):
        return False
    values = deco.args[1]
    if isinstance(values, ast.Name):
        values = assigned.get(values.id, values)
    if not isinstance(values, (ast.List, ast.Tuple)) or not values.elts:
        return False
    return all(isinstance(v, ast.Call) and dotted(v.func).endswith("param")
               and any(k.arg == "marks" and is_slow_mark(k.value) for k in v.keywords) for v in values.elts)


def read_test_file(path: Path, source: str | None = None, modules: set[str] | None = None,
                   commands: dict[str, str] | None = None) -> ReadTests:
    modules = project_modules() if modules is None else modules
    commands = cli_commands() if commands is None else commands
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    result = ReadTests(path)
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    file_slow = "pytestmark" in assigned and is_slow_mark(assigned["pytestmark"])

    defs: dict[str, ast.AST] = {}  # top-level helpers, fixtures, classes and tests, by name
    tests: list[tuple[str, ast.AST, bool]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            tests.append((node.name, node, file_slow))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls_assigned = {t.id: n.value for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                            if isinstance(t, ast.Name)}
            cls_slow = (file_slow or any(is_slow_mark(d) for d in node.decorator_list)
                        or ("pytestmark" in cls_assigned and is_slow_mark(cls_assigned["pytestmark"])))
            tests += [(f"{node.name}::{m.name}", m, cls_slow) for m in node.body
                      if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
    quick_nodes = []
    for name, node, inherited in tests:
        slow = inherited or any(is_slow_mark(d) or _all_slow_values(d, assigned) for d in node.decorator_list)
        (result.slow if slow else result.quick).append(name)
        if not slow:
            quick_nodes.append(node)
    if not quick_nodes:
        return result

    # what the quick tests use: themselves, then the helpers and fixtures they name, transitively
    used, todo = [], list(quick_nodes)
    seen_names: set[str] = set()
    while todo:
        node = todo.pop()
        used.append(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {a.arg for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for a in n.args.args}  # fixtures, by parameter name
        for name in names - seen_names:
            seen_names.add(name)
            if name in defs and not name.startswith("test"):
                todo.append(defs[name])
    top_level = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in [*top_level, *used]:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                result.reached |= _imported(sub, modules)
    uses_cli = CLI_MODULE in result.reached or "invoke" in seen_names
    if uses_cli:
        for node in [*top_level, *used]:
            result.reached |= _cli_calls(node, commands)
    return result


def find_test_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "tests").rglob("test_*.py"))


def quick_loop_coverage(root: Path = ROOT) -> tuple[set[str], dict[str, set[str]]]:
    """(modules no quick test reaches, module -> the test files whose quick tests reach it)."""
    modules, commands = project_modules(root), cli_commands(root)
    by_module: dict[str, set[str]] = {m: set() for m in modules}
    for path in find_test_files(root):
        read = read_test_file(path, modules=modules, commands=commands)
        for m in read.reached:
            by_module[m].add(str(path.relative_to(root)))
    return {m for m, files in by_module.items() if not files}, by_module


# ----------------------------------------------------------------------------------------------------- the check
def test_every_module_is_reached_by_a_quick_test():
    missing, _ = quick_loop_coverage()
    assert not missing, (f"no quick test (pytest -m 'not slow') imports or runs: {', '.join(sorted(missing))}; "
                         "add a fast test for each, or leave its cheapest test unmarked")


def test_the_quick_loop_still_has_most_tests_and_all_test_files_parse():
    modules, commands = project_modules(), cli_commands()
    reads = [read_test_file(p, modules=modules, commands=commands) for p in find_test_files()]
    quick = sum(len(r.quick) for r in reads)
    slow = sum(len(r.slow) for r in reads)
    assert quick > slow  # test functions, not parametrized cases: the quick loop is most of the suite
    assert {"check", "prepare", "pretrain", "evaluate", "sweep"} <= commands.keys()
    assert len(modules) >= 30 and "stages._common" in modules and "pipeline.__init__" not in modules


# -------------------------------------------------------------------- the reader itself: it can tell slow from quick
MODULES = {"pipeline.a", "pipeline.b", "pipeline.c", "pipeline.d", "stages.prep", "stages.cli"}
COMMANDS = {"prepare": "stages.prep"}


def read(source: str) -> ReadTests:
    return read_test_file(Path("tests/test_x.py"), textwrap.dedent(source), MODULES, COMMANDS)


def test_reader_counts_only_what_quick_tests_reach():
    r = read("""
        import pytest
        from pipeline.a import f
        from pipeline import b as B

        def helper():
            from pipeline.c import g

        def unused_helper():
            import pipeline.d

        def test_quick():
            helper()

        @pytest.mark.slow
        def test_slow():
            unused_helper()
        """)
    assert r.quick == ["test_quick"] and r.slow == ["test_slow"]
    assert r.reached == {"pipeline.a", "pipeline.b", "pipeline.c"}  # pipeline.d: only a slow test uses it


def test_reader_honours_file_marks_and_all_slow_params():
    r = read("""
        import pytest
        from pipeline.a import f
        pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

        def test_one():
            pass
        """)
    assert r.quick == [] and r.reached == set()
    r = read("""
        import pytest
        CASES = [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=[pytest.mark.slow])]

        @pytest.mark.parametrize("n", CASES)
        def test_all_slow(n):
            import pipeline.a

        @pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 2])
        def test_one_quick(n):
            import pipeline.b
        """)
    assert r.slow == ["test_all_slow"] and r.quick == ["test_one_quick"] and r.reached == {"pipeline.b"}


def test_reader_counts_cli_subcommands_only_in_quick_tests():
    quick = read("""
        from stages.cli import main
        CASES = [("prepare", "-S", "x=1")]

        def test_table():
            for args in CASES:
                CliRunner().invoke(main, list(args))
        """)
    assert quick.reached == {"stages.cli", "stages.prep"}
    assert read("""
        import pytest

        @pytest.mark.slow
        def test_subprocess():
            subprocess.run([sys.executable, "-m", "stages.cli", "prepare"])
        """).reached == set()
    assert read("""
        from tests.conftest import invoke

        def test_helper():
            invoke("prepare", "-S", "x=1")
        """).reached == {"stages.prep"}


def test_coverage_names_a_module_no_quick_test_reaches(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "fast.py").write_text("")
    (tmp_path / "pipeline" / "heavy.py").write_text("")
    (tmp_path / "stages" / "prep.py").write_text("import click\n@click.command('prepare')\ndef prepare():\n    pass\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(textwrap.dedent("""
        import pytest
        from pipeline.fast import x
        from tests.conftest import invoke

        def test_fast():
            invoke("prepare")

        @pytest.mark.slow
        def test_heavy():
            from pipeline.heavy import y
        """))
    missing, by_module = quick_loop_coverage(tmp_path)
    assert missing == {"pipeline.heavy"}
    assert by_module["stages.prep"] == {"tests/test_a.py"}
