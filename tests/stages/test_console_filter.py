"""The console filter (``pipeline.runs.undocumented.CONSOLE_SKIP``, which the ``transfusion`` command hands Ray as
``RAY_DEDUP_LOGS_SKIP_REGEX``; Ray's driver applies it to every line a worker prints before forwarding it): only what
no Ray setting keeps off the console. Each pattern is tested with the line it hides, and our lines and Python
tracebacks stay in.

The lines are what Ray 2.60 printed here (pid prefixes removed; addresses and module lists shortened): the native dump
of a Ray task that calls ``os.abort()`` (Ray's failure-signal handler, then Python's faulthandler), gloo's and Ray's
terminate handler in workers of ASHA-stopped two-worker trials (a GPU-preset rehearsal), Abseil's raw mutex log at a
rehearsal's shutdown, a C++ core error line and the raylet's worker-pool hint. tests/stages/test_console.py checks the
same with real Ray Train workers.
"""

from __future__ import annotations

import re

import pytest

from pipeline.runs.undocumented import CONSOLE_SKIP, CONSOLE_SKIP_PATTERNS

SKIP = re.compile(CONSOLE_SKIP)

# each pattern, and a line it hides
HIDDEN = {
    CONSOLE_SKIP_PATTERNS[0]: [
        "[2026-01-01 12:00:00,123 E 1968 1999] core_worker.cc:2465: Failed to send the actor task to the worker",
        "[2026-01-01 12:00:00,123 W 1968 1999] core_worker.cc:1890: Actor with class name: 'PreemptionWatcher' and "
        "ID: '0a1b' has constructor arguments in the object store and max_restarts > 0.",
    ],
    CONSOLE_SKIP_PATTERNS[1]: [
        "WARNING: 8 PYTHON worker processes have been started on node: 3ffdd02cd1be with address: 127.0.0.1. This "
        "could be a result of using a large number of actors, or due to tasks blocked in ray.get() calls",
    ],
    CONSOLE_SKIP_PATTERNS[2]: ["*** SIGABRT received at time=1795641070 on cpu 1 ***"],
    CONSOLE_SKIP_PATTERNS[3]: ["PC: @     0x7f2e528a8eec  (unknown)  (unknown)"],
    CONSOLE_SKIP_PATTERNS[4]: ["    @     0x7f2e5285a050  116426512  (unknown)"],
    CONSOLE_SKIP_PATTERNS[5]: ["Fatal Python error: Aborted"],
    CONSOLE_SKIP_PATTERNS[6]: ["Thread 0x00007f2e3effd6c0 (most recent call first):",
                               "Current thread 0x00007f2e52fca740 (most recent call first):",
                               "Stack (most recent call first):"],
    CONSOLE_SKIP_PATTERNS[7]: ['  File "/usr/lib/python3.11/threading.py", line 331 in wait',
                               '  File "/tmp/gd11b/abort_task.py", line 10 in die'],
    CONSOLE_SKIP_PATTERNS[8]: ["Extension modules: msgpack._cmsgpack, google._upb._message, psutil._psutil_linux "
                               "(total: 3)"],
    CONSOLE_SKIP_PATTERNS[9]: ["terminate called after throwing an instance of 'gloo::IoException'"],
    CONSOLE_SKIP_PATTERNS[10]: ["  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                                "peer [192.0.2.2]:41923"],
    CONSOLE_SKIP_PATTERNS[11]: [
        " /usr/lib/python3.11/site-packages/ray/_raylet.so(+0x1812b9a) [0x7fe7efc12b9a] ray::operator<<()",
        "/usr/lib/python3.11/site-packages/ray/_raylet.so(+0x1815c08) [0x7fe7efc15c08] ray::TerminateHandler()",
        "/lib/x86_64-linux-gnu/libstdc++.so.6(+0xa8e1a) [0x7fe7ee0a8e1a]",
        "/usr/lib/libpython3.11.so.1.0(_PyEval_EvalFrameDefault+0x3598) [0x7fe7f0cfe108] _PyEval_EvalFrameDefault",
    ],
    CONSOLE_SKIP_PATTERNS[12]: ["[mutex.cc : 452] RAW: Lock blocking 0x56539dd81fc0   @ 0x7fe195e2b1a2 0x7fe194efb23c",
                                "[mutex.cc : 452] RAW: Unlock 0x56539dd81fc0   @ 0x7fe1957c2037 0x7fe195e4c3b0"],
    CONSOLE_SKIP_PATTERNS[13]: ["", "   "],
}

KEPT = [
    "[pretrain] epoch 1/2 loss 1.29541 knn 0.7472 eps 0.0000 1,234 samples/s",
    "[sweep] trial 8f9dd_00001 stopped early at epoch 1 (2/2 done)",
    "Traceback (most recent call last):",
    '  File "/work/pipeline/training/loop.py", line 209, in train_epoch',  # a traceback's frame: ", in"
    "RuntimeError: injected crash after epoch 1 (TRANSFUSION_FAULT)",
    "Error: rank 0: injected crash after epoch 1",
    "A worker died or was killed while executing a task by an unexpected system error.",  # a real crash's notice
]


def test_every_pattern_has_its_line():
    assert list(HIDDEN) == list(CONSOLE_SKIP_PATTERNS)


@pytest.mark.parametrize(("pattern", "line"), [(p, line) for p, lines in HIDDEN.items() for line in lines])
def test_each_pattern_hides_its_line(pattern, line):
    assert re.search(pattern, line), line
    assert SKIP.search(line), line


@pytest.mark.parametrize("line", KEPT)
def test_our_lines_and_python_tracebacks_are_kept(line):
    assert not SKIP.search(line), line
