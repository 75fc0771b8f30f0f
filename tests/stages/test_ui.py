"""`transfusion ui`: a real MLflow server on the project's sqlite store, stopped as a user stops it; no browser needed.

The command hands its process to `mlflow server` (exec) instead of supervising it: these tests show that what the
supervisor used to do still happens (the URL printed, the whole process tree gone and the port free after Ctrl-C or
`kill PID`, exit code 0), and that nothing is started for a taken port or a remote tracking server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlflow
import psutil
import pytest
from click.testing import CliRunner

from stages.cli import main
from tests.ui_server import UiProcess, free_port


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # exited, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("stop", ["ctrl-c", "kill-pid"])
def test_serves_the_project_store_until_stopped_then_nothing_is_left(project, stop):
    port = free_port()
    ui = UiProcess("--port", str(port), cwd=project)
    try:
        url = ui.wait_ready(timeout=300)
        # the experiment exists (created with the project's artifact root) and the URL opens its runs table
        exp = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_experiment_by_name("transfusion")
        assert exp is not None and exp.artifact_location == (project / "mlartifacts").as_uri()
        assert url == f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        # the command became the server (same pid) and its uvicorn child serves the UI, in the same process group
        server = psutil.Process(ui.proc.pid)
        assert server.cmdline()[1:4] == ["-m", "mlflow", "server"], server.cmdline()
        tree = [server, *server.children(recursive=True)]
        assert any("uvicorn" in " ".join(p.cmdline()) for p in tree), [p.cmdline() for p in tree]
        assert {os.getpgid(p.pid) for p in tree} == {ui.proc.pid}

        if stop == "ctrl-c":
            ui.ctrl_c()  # SIGINT to the foreground group, as a terminal sends it
        else:
            os.kill(ui.proc.pid, signal.SIGTERM)  # `kill PID`: the command's pid alone
        assert ui.proc.wait(timeout=60) == 0, ui.output
        assert "Traceback" not in ui.output and "Shutting down" in ui.output, ui.output  # a clean stop, as a user sees
        psutil.wait_procs(tree, timeout=10)
        assert all(gone(p) for p in tree), [(p.pid, p.cmdline()) for p in tree if not gone(p)]
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, "the port is still served"
    finally:
        ui.stop()


def test_a_taken_port_is_a_clear_error(project):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = invoke("ui", "--port", str(port))
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.output and "--port" in result.output
    assert not (project / "mlflow.db").exists(), "nothing is set up before the port check"


class _FakeTrackingServer(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/health":
            body = b"OK"
        elif self.path.startswith("/api/2.0/mlflow/experiments/get-by-name?experiment_name=transfusion"):
            body = json.dumps({"experiment": {"experiment_id": "42", "name": "transfusion"}}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_remote_tracking_server_is_shown_not_started(project, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeTrackingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", base + "/")

        def no_server(*args, **kwargs):
            raise AssertionError("no local server may be started")

        monkeypatch.setattr("stages.ui.os.execve", no_server)
        result = invoke("ui")
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    assert f"points at the MLflow server {base}" in result.output
    assert f"{base}/#/experiments/42/runs?workflowType=machine_learning" in result.output


def test_an_unreachable_remote_tracking_server_is_a_clear_error(project, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    result = invoke("ui")
    assert result.exit_code == 1
    assert "http://127.0.0.1:9 is unreachable" in result.output
