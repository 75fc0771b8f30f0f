"""Shared fixtures: one local Ray instance per test session, small projects in temp dirs."""

from __future__ import annotations

import atexit
import csv
import gc
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The tests share one Ray (ray_session): a request that no node can hold (a test of the resource wait) would have its
# autoscaler events ("No available node types can fulfill resource request ...") printed minutes later by that Ray's
# driver thread, into whichever test's captured output is open then. Subprocesses inherit it, except those of
# tests/stages/test_console.py, which run the CLI with a user's environment.
os.environ.setdefault("RAY_SCHEDULER_EVENTS", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):  # the test processes side by side (pytest -n 2): one thread
    # each, for torch (which reads these when it loads, after this file) and BLAS, so they share the cores rather
    # than contend for them (2 workers of 2 threads each on 2 cores took 1.7x the time of one process here)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


def pytest_collection_finish(session):
    """The objects alive once the tests are collected (the modules of torch, Ray, MLflow, scikit-learn: ~450,000)
    moved out of the garbage collector's reach (``gc.freeze``): each full collection traversed them all, 0.2 s each,
    pytest's end-of-session collections included. Nothing of a test is frozen: its objects are made later."""
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """Tests marked ``first`` first (a stable sort: the others keep their order). Under ``pytest -n 2`` the longest
    test then starts at once in one process while the other process runs the rest; last in the queue, it ran alone at
    the end while the other process idled (70 s of 863 s in one measured run).

    And every test that uses the session's Ray (:func:`ray_session`) in one test process (``xdist_group``): one local
    Ray for the suite instead of one per test process. An idle local Ray takes ~7 % of a core (its dashboard, agents,
    raylet, GCS and prestarted workers: 4.2 CPU-s a minute, measured), so a second one kept for the whole suite
    cost 4.2 CPU-s a minute of the suite, and its start ~5 more (ray.init: 4.9 CPU-s)."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("ray_session"))


def invoke(*args: str):
    """Run the `transfusion` CLI in-process (exceptions propagate, so a bug shows its traceback)."""
    from click.testing import CliRunner

    from stages.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def as_a_foreground_job() -> None:
    """``preexec_fn`` of a command a test presses Ctrl-C at: SIGINT at its default, as in a terminal's foreground job.
    A suite started in the background of a non-interactive shell (``nohup bash .ci/run &``) hands SIGINT on ignored,
    and Python then installs no handler: the Ctrl-C would reach nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pretrain_curve(project: Path) -> list[dict[str, str]]:
    """The rows of a project's ``plots/pretrain.csv`` (one per epoch logged), as ``transfusion pretrain`` wrote them."""
    with open(project / "plots" / "pretrain.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def one_thread():
    """torch and BLAS on one thread for the test (small matrices: one thread is faster than two contending ones, and
    the timings are one thread's); restored after (``pipeline.host.one_thread``)."""
    from pipeline.host import one_thread as limit

    with limit():
        yield


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every Ray test (start-up costs ~8 s); shut down at the end of the session."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    if not ray.is_initialized():  # as a stage starts its local Ray (its own GCS port, that address in its processes)
        from pipeline.runs.cluster import start_local_ray

        start_local_ray(num_cpus=2, object_store_memory=200 * 1024**2)
    yield ray
    # ray.shutdown joins Ray's log thread, which once waited for good in its GCS subscriber's poll (a suite whose
    # tests had all passed, then hung): bounded here; if it hangs, the process's exit ends the Ray it started, and
    # Ray's own exit hook (a second shutdown, behind the same lock) is dropped
    stop = threading.Thread(target=ray.shutdown, daemon=True)
    stop.start()
    stop.join(timeout=120)
    if stop.is_alive():
        atexit.unregister(ray.shutdown)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory holding the repo's params.yaml, with its own MLflow store; cwd set to it."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK", "true")
    for var in ("TRANSFUSION_CALLBACKS", "TRANSFUSION_TEST_FAULTS"):  # no callbacks unless a test installs them
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def _prepared_digits(tmp_path_factory):
    """The digits as ``transfusion prepare`` writes them for params.yaml with ``data.limit_train`` = each size asked
    for (None: params.yaml's own), prepared once per size for the test session."""
    made: dict[int | None, Path] = {}

    def get(limit: int | None) -> Path:
        if limit not in made:
            from stages.prepare import load_data, run

            made[limit] = tmp_path_factory.mktemp("prepared") / "prepared"
            run(load_data(str(ROOT / "params.yaml"), [] if limit is None else [f"data.limit_train={limit}"]),
                made[limit])
        return made[limit]

    return get


@pytest.fixture
def prepare_digits(project, _prepared_digits):
    """``prepare_digits(limit)``: the project with ``data/prepared`` as ``transfusion prepare -S
    data.limit_train=<limit>`` writes it there (None: params.yaml's own, all the digits), copied from the session's one
    preparation of that size. For tests of what comes after ``prepare`` (its own tests run it)."""

    def put(limit: int | None = None) -> Path:
        shutil.copytree(_prepared_digits(limit), project / "data" / "prepared")
        return project

    return put


@pytest.fixture
def prepared(prepare_digits) -> Path:
    """The project with 256 digits prepared (``prepare_digits(256)``): what the stages after ``prepare`` run on."""
    return prepare_digits(256)


@pytest.fixture
def install_faults(monkeypatch):
    """Install a test-fault plan (``tests.faults``: ``install_faults(crash_at_epoch=2)``) in this process, whose stages
    then ship it to the Ray processes they start; ``install_faults()`` removes it. Undone after the test."""
    from tests import faults

    def install(**plan) -> None:
        env = faults.environment(**plan)
        for var in (faults.ENV, faults.CALLBACKS_ENV):  # this process imports tests.faults already
            if plan:
                monkeypatch.setenv(var, env[var])
            else:
                monkeypatch.delenv(var, raising=False)

    return install


@pytest.fixture
def ray_starts(monkeypatch) -> list[str]:
    """Every call of the stages' one way into Ray (``runs.cluster.init_ray``) is recorded and refused: bad input
    must fail before it. (Checking ``ray.is_initialized()`` is not enough: another test's session Ray may be up.)
    The stage sees no Ray running in its process, as in the fresh process DVC starts it in, whatever Ray this test
    session runs: its checks before Ray starts are the ones tested."""
    import pipeline.runs.cluster

    calls: list[str] = []

    def refuse(params) -> None:
        calls.append("ray")
        raise AssertionError("bad input reached Ray start-up")

    monkeypatch.setattr(pipeline.runs.cluster, "init_ray", refuse)
    monkeypatch.setattr(pipeline.runs.cluster, "ray_up", lambda: False)
    return calls


def poison_test_split(data_dir) -> None:
    """Replace the prepared test split by noise (random inputs, shuffled labels), its manifest's digests updated."""
    import numpy as np

    from pipeline.data.prepared import write_npy

    manifest = json.loads((data_dir / "manifest.json").read_text())
    rng = np.random.default_rng(11)
    x, y = np.load(data_dir / "test_x.npy"), np.load(data_dir / "test_y.npy")
    for name, array in (("test_x.npy", rng.random(x.shape).astype(x.dtype)), ("test_y.npy", rng.permutation(y))):
        manifest["files"][name]["sha256"] = write_npy(data_dir / name, array.shape, array.dtype, [array])
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
