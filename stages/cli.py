"""The ``transfusion`` command: one subcommand per DVC stage.

Each subcommand's module is imported when that subcommand runs, not before: a stage pays for its own imports only
(all of them together, from torch and scikit-learn to Ray Tune and matplotlib, take seconds). Before it imports one,
the command sets what Ray reads when ``ray`` is imported (:func:`ray_env`): the console filter :data:`CONSOLE_SKIP`
for what no Ray setting keeps off the console, Tune's output engine, ``RAY_AUTH_MODE`` as Ray would set it. The rest
of the console's quiet is Ray's logging configs (``pipeline.runs.cluster``).
"""

from __future__ import annotations

import importlib
import os
import sys

import click

#: What no Ray setting keeps off the console, as the filter Ray's driver applies to each line a worker prints before
#: it forwards it (:data:`CONSOLE_SKIP` in ``RAY_DEDUP_LOGS_SKIP_REGEX``; Ray reads it when ``ray`` is imported). Each
#: pattern is tested with the line it hides (tests/stages/test_console_filter.py); docs/cluster.md says why no setting
#: reaches it.
CONSOLE_SKIP_PATTERNS = (
    # Ray's C++ core logs ERROR and above to the process's stderr as well as to its log file ("[date time E pid tid]
    # core_worker.cc:N: ..."); its only knob, RAY_BACKEND_LOG_LEVEL, would take them out of python-core-worker-*.log too
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ [DIWE] \d+ \d+\] \S+\.(cc|h):\d+: ",
    # the raylet, when trials start their worker processes at once (several per CPU): its hint about its start-up
    # concurrency, whose threshold is the start-up concurrency itself (raising it would start more processes at once)
    r"^WARNING: \d+ PYTHON worker processes have been started on node",
    # the native dump of a worker that dies by a signal (ASHA stopping a multi-worker trial kills its workers inside a
    # collective: ~60 lines each): Ray's failure-signal handler ("*** SIGABRT received at time=... ***", its "@ 0x..."
    # frames), Python's faulthandler, which Ray enables in every worker ("Fatal Python error: Aborted", "Stack/Thread
    # ... (most recent call first):", frames '  File "...", line N in f' (a traceback's have ", in"), "Extension
    # modules: ..."), C++'s "terminate called ..." and Ray's terminate handler's backtrace in glibc's format
    # ("/lib/libc.so.6(+0x91500) [0x7fe7f0aaf500] symbol"). It stays in the worker's ``worker-*.err``; a run that fails
    # by it still ends in an error.
    r"^\*\*\* SIG[A-Z]+ received at time=", r"^PC: @ +0x[0-9a-f]+ ", r"^ +@ +0x[0-9a-f]+ ",
    r"^Fatal Python error: ", r"^(Stack|(Current thread|Thread) 0x[0-9a-f]+) \(most recent call first\):",
    r"^  File \".*\", line \d+ in ", r"^Extension modules: ", r"^terminate called ", r"^  what\(\): ",
    r"^ ?/\S+\([^)]*\) \[0x[0-9a-f]+\]",
    # Abseil's raw log of Ray's native mutexes, which a process killed at shutdown may print: "[mutex.cc : 452] RAW:"
    r"^\[\w+\.(cc|h) : \d+\] RAW: ",
    r"^\s*$",  # and the blank lines between the parts of a dump
)
CONSOLE_SKIP = "|".join(CONSOLE_SKIP_PATTERNS)


def _token_available() -> bool:
    """A Ray auth token is at hand where Ray looks for one: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.path.isfile(path)


def _auth_mode_default() -> str | None:
    """``RAY_AUTH_MODE`` for a local Ray, chosen as Ray would, so that Ray does not announce it.

    With ``RAY_AUTH_MODE`` unset, Ray (2.59+) turns token auth on for a local Ray it starts (creating
    ``~/.ray/auth_token`` if needed) and for a local cluster it finds while a token exists, and prints "Token
    authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ..." on every run: nothing to
    act on for a local run. An explicit ``RAY_ADDRESS`` is left as Ray leaves it (Ray sends no token to a named cluster
    unless ``RAY_AUTH_MODE=token`` asks for it); when authentication matters, the connect error says what to do.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return None
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None or address == "local" or (address == "auto" and _token_available()):
        return "token"
    return None


def ray_env() -> dict[str, str]:
    """The environment settings Ray reads when ``ray`` is imported, for a program that is about to import it (the
    ``transfusion`` command does, before it imports a stage): :data:`CONSOLE_SKIP`; ``RAY_AIR_NEW_OUTPUT=0`` (Tune's
    default output engine prints an experiment box, the results path and a TensorBoard hint even at ``verbose=0``;
    the legacy one is silent there, and the jobs print their own line per trial event); and ``RAY_AUTH_MODE`` as Ray
    would choose it (:func:`_auth_mode_default`). Only defaults: a variable the user set is left out."""
    env = {"RAY_DEDUP_LOGS_SKIP_REGEX": CONSOLE_SKIP, "RAY_AIR_NEW_OUTPUT": "0"}
    mode = _auth_mode_default()
    if mode and "ray._raylet" not in sys.modules:  # set once Ray is loaded, the driver and Ray's processes disagree
        env["RAY_AUTH_MODE"] = mode
    return {k: v for k, v in env.items() if k not in os.environ}


# subcommand -> "module:click command", in the order of --help
COMMANDS = {
    "check": "stages.check:check",
    "prepare": "stages.prepare:prepare",
    "pretrain": "stages.pretrain:pretrain_cmd",
    "evaluate": "stages.evaluate:evaluate_cmd",
    "report": "stages.report:report_cmd",
    "sweep": "stages.sweep:sweep_cmd",
    "tables": "stages.tables:tables_cmd",
    "theory": "stages.theory:theory_cmd",
    "sets": "stages.sets:sets_cmd",
    "rehearse": "stages.rehearse:rehearse_cmd",
    "ui": "stages.ui:ui_cmd",
}


class LazyGroup(click.Group):
    """A group whose subcommands (:data:`COMMANDS`) are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        os.environ.update(ray_env())  # the settings Ray reads when it is imported: before the stage imports it
        command = getattr(importlib.import_module(module), attr)
        if command.name != cmd_name:
            raise RuntimeError(f"{target} is the command {command.name!r}, listed as {cmd_name!r}")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="transfusion-pipeline")
def main() -> None:
    """TransFusion contrastive learning: the stages of the DVC pipeline (`dvc repro` runs them all)."""


if __name__ == "__main__":
    main()
