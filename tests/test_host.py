"""pipeline/host.py: this machine's CPUs, and a worker's threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # a fresh process: what a Ray worker starts as
def test_use_threads_lifts_the_blas_pool_ray_set_to_one():
    """Ray sets OMP_NUM_THREADS to the whole part of a task's CPUs (1 for a tables trial's 1.75): BLAS starts on one
    thread; use_threads(2) gives torch and every BLAS / OpenMP pool 2."""
    code = ("import json, numpy, torch; from threadpoolctl import threadpool_info;"
            "from pipeline.host import use_threads;"
            "before = {i['internal_api']: i['num_threads'] for i in threadpool_info()}; use_threads(2);"
            "after = {i['internal_api']: i['num_threads'] for i in threadpool_info()};"
            "print(json.dumps([before, after, torch.get_num_threads()]))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    before, after, torch_threads = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(before.values()) == {1} and "openblas" in before
    assert set(after.values()) == {2} and torch_threads == 2
