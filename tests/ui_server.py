"""Test helper: `transfusion ui` as a real subprocess in its own process group, always stopped afterwards.

The command becomes `mlflow server` (exec): its pid and process group are the server's."""

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
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import as_a_foreground_job

RUNS_URL = re.compile(r"Runs of experiment '\w+' \(id \w+\): (?P<url>\S+)")


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
            preexec_fn=as_a_foreground_job,
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

    def wait_ready(self, timeout: float) -> str:
        """The runs table's URL the command printed, once its server answers /health (within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        url = self.wait_for(RUNS_URL, timeout)["url"]
        base = url.partition("/#")[0]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"`transfusion ui` exited ({self.proc.returncode}) before {base}/health "
                                     f"answered:\n{self.output}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"{base}/health did not answer within {timeout:.0f} s:\n{self.output}")

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group (the server and its workers)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self) -> None:
        """Teardown: Ctrl-C; if the server does not stop in time, kill its whole process group."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.ctrl_c()
        try:
            self.proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
