"""The committed Go stubs are what ``make clients`` generates from today's .proto."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.interop.conftest import REPO, build_client


def test_committed_go_stubs_are_current():
    build_client("go")  # regenerates clients/go/genservev1 from protos/
    if not shutil.which("git") or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to compare the stubs with")
    status = subprocess.run(["git", "status", "--porcelain", "--", "clients/go/genservev1",
                             "clients/go/fmaas"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert status == "", (
        "clients/go/genservev1 or clients/go/fmaas differs from what `make clients` "
        "generates from the .proto files: "
        f"commit the regenerated stubs\n{status}")
