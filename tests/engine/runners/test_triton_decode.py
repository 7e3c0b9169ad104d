"""The Triton paged-decode kernel's cases (triton_decode_cases.py), run by Triton's CPU
interpreter in a child pytest: the interpreter must be switched on before Triton is first
imported, which this process has done already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("triton_decode_cases.py")


def test_paged_decode_kernel_cases_pass_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider",
           str(CASES)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
