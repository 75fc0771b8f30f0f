"""The MLflow UI's set-up (``stages.ui``) without MLflow: ports, URLs, the server's command and
environment, and handing the process over to it (exec). The real server, started and stopped: tests/stages/test_ui.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stages.ui import (
    UiError,
    check_port_free,
    exec_server,
    next_free_port,
    port_is_free,
    runs_url,
    server_command,
    server_env,
    url_host,
)
from tests.ui_server import free_port

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
def test_the_command_becomes_the_server_with_its_output_kept(tmp_path):
    """exec, not a child: the same pid runs the server's command, in the server's environment; what was printed
    before, into a pipe (block-buffered), comes out first."""
    shown = ("import os, sys; print(os.getpid(), os.environ['MLFLOW_SERVER_ENABLE_JOB_EXECUTION'], "
             "os.environ['KEPT'], sys.argv[1:])")
    script = ("import os, sys\nfrom stages.ui import exec_server\nprint('before', os.getpid())\n"
              f"exec_server([sys.executable, '-c', {shown!r}, 'a b'])\nprint('never')\n")
    unset = ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "PYTHONUNBUFFERED")  # stdout block-buffered, as in a user's shell
    env = {k: v for k, v in os.environ.items() if k not in unset} | {"KEPT": "yes"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.splitlines()
    pid = before.split()[1]
    assert before == f"before {pid}" and after == f"{pid} false yes ['a b']"


def test_a_command_that_cannot_run_is_named(tmp_path):
    with pytest.raises(UiError, match=f"cannot run {tmp_path}/missing: No such file or directory"):
        exec_server([str(tmp_path / "missing"), "server"])
