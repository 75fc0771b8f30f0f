"""`transfusion ui`: a real MLflow server on the project's sqlite store, stopped by Ctrl-C; no browser needed."""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlflow
import psutil
import pytest
from click.testing import CliRunner

from stages.cli import main
from tests.ui_server import READY, UiProcess, free_port


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # exited, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_serves_the_project_store_and_ctrl_c_stops_the_whole_server(project):
    port = free_port()
    ui = UiProcess("--port", str(port), cwd=project)
    try:
        url = ui.wait_for(READY, timeout=300)["url"]
        # the experiment exists (created with the project's artifact root) and the URL opens its runs table
        exp = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_experiment_by_name("transfusion")
        assert exp is not None and exp.artifact_location == (project / "mlartifacts").as_uri()
        assert url == f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert resp.status == 200
        # the server runs in its own process group, apart from the command's
        server = psutil.Process(ui.server_pid())
        tree = [server, *server.children(recursive=True)]
        assert any("uvicorn" in " ".join(p.cmdline()) for p in tree), [p.cmdline() for p in tree]
        assert {p.pid for p in psutil.Process(ui.proc.pid).children()} == {server.pid}
        assert {os.getpgid(p.pid) for p in tree} == {server.pid} != {os.getpgid(ui.proc.pid)}

        ui.ctrl_c()
        assert ui.proc.wait(timeout=60) == 0, ui.output
        assert "MLflow UI stopped." in ui.output
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

        monkeypatch.setattr("pipeline.runs.mlflow_ui.subprocess.Popen", no_server)
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
