"""MLflow's calls of a stage made in a process of their own, as wandb's service does, so that the stage never
imports MLflow.

Importing MLflow and opening its store take 1.5-2.5 s of one core, longer than importing torch (1.0-1.1 s); in a
process of their own they run beside the stage's imports (2 cores), and the training loop's process then spends
nothing on MLflow: no import, no writer thread, no system-metrics thread. ``transfusion pretrain`` starts the process
first (:func:`start`, from ``stages.cli`` before the stage's module is imported) when it runs as a program of its own: a
process that already holds torch or MLflow (a notebook, a test) gains nothing from one and calls
:mod:`pipeline.runs.tracking` itself. :func:`tracker` says which; both answer the same calls.

The tracking process serves the functions of :mod:`pipeline.runs.tracking` by name, in the order they are sent.
:meth:`TrackingProcess.call` waits for the answer (an error comes back as the stage's error: a
:class:`~pipeline.runs.tracking.TrackingError` names the store); :meth:`TrackingProcess.send` does not (the epochs'
writes). What the tracking process prints (the new store's line, a warning) comes back with the next answer and is
printed by the stage. It runs in a session of its own, so that a Ctrl-C reaches only the stage, which ends its run
KILLED through it; if the stage dies without saying goodbye (killed, out of memory), the tracking process ends the
runs it opened FAILED, tagged ``error``, where a stage that logged its runs itself would leave them RUNNING.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import BinaryIO

DIED = "the stage's process ended without closing its MLflow run (killed, or out of memory)"
_STARTED: list[TrackingProcess] = []  # this process's tracking process, once started


class TrackingProcess:
    """The stage's side: a child process serving :mod:`pipeline.runs.tracking`'s functions over a pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)  # no Ctrl-C from the terminal: the stage ends the run
        self.ids = itertools.count(1)
        self.closed = False
        self.lost = False  # a send found the tracking process gone

    def __getattr__(self, name: str) -> Callable[..., object]:
        """``tracking_process.experiment_id(uri)`` calls ``pipeline.runs.tracking.experiment_id`` there."""
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def send(self, name: str, *args: object, **kwargs: object) -> None:
        """Call ``name`` there without waiting (its error, if any, is printed there as one warning). Tracking never
        stops training: a tracking process that is gone is one warning line here, and nothing more is sent."""
        if self.lost:
            return
        try:
            self._write((0, name, args, kwargs))
        except Exception as exc:
            self.lost = True
            print(f"[mlflow] warning: {exc}; the stage goes on without logging")

    def call(self, name: str, *args: object, **kwargs: object) -> object:
        """Call ``name`` there and return its value (raise its error), after the calls sent before it."""
        call_id = next(self.ids)
        self._write((call_id, name, args, kwargs))
        while True:  # an answer to a call that a Ctrl-C abandoned may come first: skipped
            try:
                answer_id, ok, value, out, err = pickle.load(self.proc.stdout)
            except (EOFError, pickle.UnpicklingError, OSError) as exc:
                raise self._gone(exc) from None
            _echo(out, err)
            if answer_id == call_id:
                break
        if not ok:
            raise value
        return value

    @contextlib.contextmanager
    def opened(self, name: str, *args: object) -> Iterator[Callable[..., None]]:
        """The context manager ``pipeline.runs.tracking.<name>(*args)`` entered there for the block; the block gets a
        function that sends its arguments to the entered value (an :class:`~pipeline.runs.tracking.EpochLog`'s
        epochs). An error or Ctrl-C in the block reaches the context manager there as the same kind of exception."""
        handle = self.call("_enter", name, *args)
        try:
            yield lambda *a: self.send("_use", handle, *a)
        except BaseException as exc:
            self.call("_exit", handle, "KeyboardInterrupt" if isinstance(exc, KeyboardInterrupt) else "Exception")
            raise
        self.call("_exit", handle, None)

    def prepare_model_logging(self) -> None:
        self.send("prepare_model_logging")  # while the stage trains: no answer awaited

    def EpochLog(self, uri: str, run_id: str) -> contextlib.AbstractContextManager:  # noqa: N802 - tracking's name
        return self.opened("EpochLog", uri, run_id)

    def system_metrics(self, uri: str | None, run_id: str | None) -> contextlib.AbstractContextManager:
        return self.opened("system_metrics", uri, run_id)

    def close(self) -> None:
        """Say goodbye (the runs stay as the stage left them) and let the tracking process end on its own."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):  # already gone: nothing to say goodbye to
                self._write((0, "_bye", (), {}))
                self.proc.stdin.close()

    def _write(self, message: tuple) -> None:
        try:
            pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise self._gone(exc) from None

    def _gone(self, exc: BaseException) -> Exception:
        from pipeline.runs.tracking import TrackingError

        code = self.proc.poll()
        why = f"exit code {code}" if code is not None else str(exc)
        return TrackingError(f"the MLflow tracking process ended ({why}); its runs may be left RUNNING")


def start() -> TrackingProcess:
    """Start this process's tracking process (once): MLflow's import and store begin now, beside the caller's."""
    if not _STARTED:
        _STARTED.append(TrackingProcess())
        atexit.register(_STARTED[0].close)
    return _STARTED[0]


def tracker() -> TrackingProcess | ModuleType:
    """Where this process's MLflow calls go: its tracking process (:func:`start`), else :mod:`pipeline.runs.tracking`
    in this process. Both answer the same calls."""
    if _STARTED and not _STARTED[0].closed:
        return _STARTED[0]
    from pipeline.runs import tracking

    return tracking


def _echo(out: str, err: str) -> None:
    if out:
        sys.stdout.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------ the tracking process
def serve(requests: BinaryIO, answers: BinaryIO, out: io.StringIO, err: io.StringIO) -> None:
    """Answer the stage's calls until it says goodbye; at end of input without one, end its open runs FAILED."""
    from pipeline.runs import tracking

    opened: dict[int, contextlib.AbstractContextManager] = {}
    entered: dict[int, Callable[..., object]] = {}
    runs: dict[str, str] = {}  # run id -> uri: the runs this process created or resumed and has not ended
    handles = itertools.count(1)

    def run(name: str, args: tuple, kwargs: dict) -> object:
        if name == "_enter":
            handle = next(handles)
            opened[handle] = getattr(tracking, args[0])(*args[1:])
            entered[handle] = opened[handle].__enter__()
            return handle
        if name == "_use":
            return entered[args[0]](*args[1:])
        if name == "_exit":
            cm, kind = opened.pop(args[0]), args[1]
            entered.pop(args[0])
            exc = None if kind is None else KeyboardInterrupt() if kind == "KeyboardInterrupt" else RuntimeError()
            try:
                cm.__exit__(type(exc) if exc else None, exc, None)
            except BaseException as raised:  # the block's exception, re-raised by the context manager: expected
                if raised is not exc:
                    raise
            return None
        value = getattr(tracking, name)(*args, **kwargs)
        _follow(runs, name, args, kwargs, value)
        return value

    for message in _messages(requests):
        call_id, name, args, kwargs = message
        if name == "_bye":
            return
        try:
            ok, value = True, run(name, args, kwargs)
        except Exception as exc:  # the stage's error: ours as it is, a library's as a TrackingError naming it
            ok, value = False, _portable(exc)
        if call_id:
            text, errors = _drain(out), _drain(err)
            pickle.dump((call_id, ok, value, text, errors), answers, protocol=pickle.HIGHEST_PROTOCOL)
            answers.flush()
        elif not ok:
            print(f"[mlflow] warning: {name} failed ({value})")
    for run_id, uri in runs.items():  # the stage died without closing them
        with contextlib.suppress(Exception):
            tracking.end_run(uri, run_id, "FAILED", {"error": DIED})


def _messages(requests: BinaryIO) -> Iterator[tuple]:
    while True:
        try:
            yield pickle.load(requests)
        except (EOFError, pickle.UnpicklingError, OSError):
            return


def _follow(runs: dict[str, str], name: str, args: tuple, kwargs: dict, value: object) -> None:
    """Keep ``runs`` (the runs open here) up to date after the call ``name`` that returned ``value``."""
    if name in ("create_job_run", "create_run"):
        runs[value] = args[0]
    elif name == "resume_run":
        runs[args[1]] = args[0]
    elif name in ("end_run", "log_pytorch_model"):
        runs.pop(args[1], None)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it can travel to the stage as it is (ours, Python's), else a TrackingError with its first line."""
    from pipeline.runs.tracking import TrackingError

    module = type(exc).__module__
    if module.startswith("pipeline.") or module == "builtins":
        with contextlib.suppress(Exception):
            pickle.loads(pickle.dumps(exc))
            return exc
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return TrackingError(f"{type(exc).__name__}: {first[:500]}")


def _drain(buffer: io.StringIO) -> str:
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


def main() -> None:
    """``python -m pipeline.runs.tracking_process``: the calls on stdin, the answers on stdout; what it prints goes
    back with the answers (C-level output on fd 1 goes to stderr)."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err  # before MLflow's import: its loggers write here
    from pipeline.runs import tracking

    tracking.warm()
    serve(sys.stdin.buffer, answers, out, err)


if __name__ == "__main__":
    main()
