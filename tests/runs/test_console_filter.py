"""The console filter (``pipeline.runs.cluster.RAY_CONSOLE_ENV``'s ``RAY_DEDUP_LOGS_SKIP_REGEX``, which Ray applies to
every line a worker prints before forwarding it): a worker's native crash dump stays out, our lines and Python
tracebacks stay in. The last two lines of the dump are Abseil's raw mutex log, which Ray Train's placement-group cleaner
printed once at a rehearsal's shutdown here (its pid prefix removed), then frames of Ray's C++ terminate handler
(glibc's backtrace format), which workers of ASHA-stopped two-worker trials printed in a GPU-preset rehearsal here.

The dump below is what a Ray task that calls ``os.abort()`` printed here (Ray 2.60, its pid prefix removed; addresses
and the module list shortened): Ray's failure-signal handler, then Python's faulthandler. tests/stages/test_console.py
checks the same with real Ray Train workers.
"""

from __future__ import annotations

import re

import pytest

from pipeline.runs.cluster import RAY_CONSOLE_ENV

SKIP = re.compile(RAY_CONSOLE_ENV["RAY_DEDUP_LOGS_SKIP_REGEX"])

DUMP = """\
*** SIGABRT received at time=1795641070 on cpu 1 ***
PC: @     0x7f2e528a8eec  (unknown)  (unknown)
    @     0x7f2e5285a050  116426512  (unknown)
    @     0x7f2e52fca4f0  (unknown)  (unknown)
Fatal Python error: Aborted

Thread 0x00007f2e3effd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2810 in all_reduce

Current thread 0x00007f2e52fca740 (most recent call first):
  File "/usr/lib/python3.11/site-packages/ray/_private/worker.py", line 1069 in main_loop
Stack (most recent call first):
  File "/tmp/gd11b/abort_task.py", line 10 in die
Extension modules: msgpack._cmsgpack, google._upb._message, psutil._psutil_linux (total: 3)
terminate called after throwing an instance of 'gloo::IoException'
  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [192.0.2.2]:41923
[mutex.cc : 452] RAW: Lock blocking 0x56539dd81fc0   @ 0x7fe195e2b1a2 0x7fe194efb23c 0x7fe1957c2022 0x7fe195e4c3b0
[mutex.cc : 452] RAW: Unlock 0x56539dd81fc0   @ 0x7fe1957c2037 0x7fe195e4c3b0
 /usr/lib/python3.11/site-packages/ray/_raylet.so(+0x1812b9a) [0x7fe7efc12b9a] ray::operator<<()
/usr/lib/python3.11/site-packages/ray/_raylet.so(+0x1815c08) [0x7fe7efc15c08] ray::TerminateHandler()
/lib/x86_64-linux-gnu/libstdc++.so.6(+0xa8e1a) [0x7fe7ee0a8e1a]
/lib/x86_64-linux-gnu/libgcc_s.so.1(_Unwind_ForcedUnwind+0x130) [0x7fe7f03b21b0] _Unwind_ForcedUnwind
/usr/lib/libpython3.11.so.1.0(_PyEval_EvalFrameDefault+0x3598) [0x7fe7f0cfe108] _PyEval_EvalFrameDefault
"""

KEPT = [
    "[pretrain] epoch 1/2 loss 1.29541 knn 0.7472 eps 0.0000 1,234 samples/s",
    "[sweep] trial 8f9dd_00001 stopped early at epoch 1 (2/2 done)",
    "Traceback (most recent call last):",
    '  File "/work/pipeline/training/loop.py", line 209, in train_epoch',  # a traceback's frame: ", in"
    "RuntimeError: injected crash after epoch 1 (TRANSFUSION_FAULT)",
    "Error: rank 0: injected crash after epoch 1",
]


@pytest.mark.parametrize("line", DUMP.splitlines())
def test_every_line_of_a_native_dump_is_skipped(line):
    assert SKIP.search(line), line


@pytest.mark.parametrize("line", KEPT)
def test_our_lines_and_python_tracebacks_are_kept(line):
    assert not SKIP.search(line), line
