"""The MLflow UI's supervision (``pipeline.runs.mlflow_ui``) without MLflow: ports, URLs, a stand-in server that answers
/health in its own process group, stopping that group, and the stop signals. The real server: tests/stages/test_ui.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.runs.mlflow_ui import (
    UiError,
    UiServer,
    UiStopped,
    check_port_free,
    healthy,
    next_free_port,
    port_is_free,
    runs_url,
    server_command,
    server_env,
    stop_group,
    stop_signals,
    url_host,
    wait_healthy,
)
from tests.ui_server import free_port

# answers /health with 200 and forks a child into its group, like mlflow server's workers
STAND_IN = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class StandIn(UiServer):
    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(self.port)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_urls():
    assert url_host("0.0.0.0") == url_host("") == url_host("::") == "127.0.0.1"
    assert url_host("::1") == "[::1]" and url_host("example.org") == "example.org"
    assert runs_url("http://h:5000/", "3") == "http://h:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert runs_url("http://h:5000/", None) == "http://h:5000"
    cmd = server_command("sqlite:////p/mlflow.db", Path("/p/mlartifacts"), "127.0.0.1", 5001, 1)
    assert cmd[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert cmd[cmd.index("--default-artifact-root") + 1] == "file:///p/mlartifacts"
    assert cmd[cmd.index("--port") + 1] == "5001" and cmd[cmd.index("--workers") + 1] == "1"


def test_the_job_runner_is_off_unless_asked_for():
    assert server_env({"A": "1"}) == {"A": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    assert server_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"})["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"


def test_a_taken_port_is_named_with_a_free_one_to_use():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        with pytest.raises(UiError, match=f"port {port} on 127.0.0.1 is already in use") as info:
            check_port_free("127.0.0.1", port)
        suggested = next_free_port("127.0.0.1", port)
        assert suggested is not None and suggested > port and port_is_free("127.0.0.1", suggested)
        assert str(info.value).endswith(f"pick a free one with --port, e.g. --port {suggested}")
    check_port_free("127.0.0.1", free_port())
    with pytest.raises(UiError, match="cannot resolve --host 'no-such-host.invalid'"):
        check_port_free("no-such-host.invalid", 5000)


def test_the_server_runs_in_its_own_group_until_stopped(tmp_path):
    server = StandIn("sqlite:///x.db", tmp_path, port=free_port(), cwd=tmp_path, grace=5.0)
    with pytest.raises(UiError, match="not started"):
        server.wait_healthy(1)
    with server:
        assert server.pid is not None and os.getpgid(server.pid) == server.pid != os.getpgid(0)
        server.wait_healthy(60)
        assert healthy(server.base)
        deadline = time.monotonic() + 30
        while not (tree := psutil.Process(server.pid).children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree and all(os.getpgid(p.pid) == server.pid for p in tree)
    assert gone(server.pid) and all(gone(p.pid) for p in tree), "the whole group is stopped"
    assert not healthy(server.base)
    server.stop()  # again: nothing left to do


def test_a_server_that_exits_early_is_named(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(UiError, match=r"exited with code 3 before answering http://127\.0\.0\.1:9/health"):
        wait_healthy(proc, "http://127.0.0.1:9", timeout=60, poll=0.05)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with pytest.raises(UiError, match=r"did not answer http://127\.0\.0\.1:9/health within 0 s"):
            wait_healthy(sleeper, "http://127.0.0.1:9", timeout=0.2, poll=0.05)
    finally:
        stop_group(sleeper, grace=5.0)
    assert sleeper.returncode is not None


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace():
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # its handler is set
    started = time.monotonic()
    stop_group(proc, grace=0.5)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - started < 5.0
    proc.stdout.close()


def test_stop_signals_raise_and_are_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    cases = [(signal.SIGTERM, UiStopped), (signal.SIGINT, KeyboardInterrupt)]
    if before[signal.SIGHUP] is not signal.SIG_IGN:  # under nohup a hang-up stays ignored
        cases.append((signal.SIGHUP, UiStopped))
    for sig, raised in cases:
        with pytest.raises(raised), stop_signals():
            signal.raise_signal(sig)
            time.sleep(1)  # the handler runs between bytecodes; never reached
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_ignored_hang_up_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
    try:
        with stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
