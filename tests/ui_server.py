"""Test helper: `transfusion ui` as a real subprocess in its own process group, always stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"MLflow UI ready: (?P<url>\S+)")
SERVER_PID = re.compile(r"mlflow server pid (?P<pid>\d+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class UiProcess:
    """``python -m stages.cli ui ARGS`` (the `transfusion` entry point), output collected line by line."""

    def __init__(self, *args: str, cwd: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stages.cli", "ui", *args], cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {pattern.pattern!r} within {timeout:.0f} s:\n{self.output}") from None
            if line is None:
                raise AssertionError(f"`transfusion ui` exited ({self.proc.wait()}) before {pattern.pattern!r}:\n"
                                     f"{self.output}")
            if m := pattern.search(line):
                return m

    def server_pid(self) -> int | None:
        m = SERVER_PID.search(self.output)
        return int(m["pid"]) if m else None

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group (the server has its own)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self) -> None:
        """Teardown: Ctrl-C; if the command does not stop in time, kill it and its server's process group."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.ctrl_c()
        try:
            self.proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass
        for pgid in (self.proc.pid, self.server_pid()):
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)
