"""Grammar-compile workers import at the lowest priority, then return every thread (the
backends' pools included) to their compile priority where the OS allows it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, threading
from structured.compile_worker import _renice_threads
os.setpriority(os.PRIO_PROCESS, 0, 3)
stop = threading.Event()
pool = threading.Thread(target=stop.wait)  # started at 3, as a backend's pool would be
pool.start()
_renice_threads(4)  # lowering priority is always allowed
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
stop.set()
"""


def test_renice_reaches_threads_started_before_it():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[4]"
