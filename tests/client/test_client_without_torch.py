"""``genserve generate``, ``genserve --help``, ``genserve serve --help`` and genserve.client
where torch, transformers and the grammar backends cannot be imported: what a client-only
install gives them."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from genserve.client import Client

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "transformers", "xgrammar", "lmformatenforcer", "tokenizers", "numpy")

# Imported at start-up (site runs any sitecustomize on sys.path): every later import of a
# blocked package, or of a module inside one, fails as if it were not installed.
SITECUSTOMIZE = f'''
import sys

BLOCKED = {BLOCKED!r}


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: a client must not import it", name=name)
        return None


sys.meta_path.insert(0, _Block())
'''


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("no_torch")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": f"{site}:{REPO}:{REPO / 'protos'}"}


def genserve(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("genserve")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.cli"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, env=env,
                          timeout=60)


def test_the_block_works(blocked_env):
    """Serving needs torch: with the block in place ``serve`` must fail to import it (its
    ``--help`` no longer does: the flags are built without torch)."""
    proc = genserve(blocked_env, "serve", "--port", "0", "--model", "/no/such/model")
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_help_without_torch(blocked_env, argv):
    proc = genserve(blocked_env, *argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: genserve")


def test_generate_without_torch(blocked_env, make_echo_server):
    server = make_echo_server()
    proc = genserve(blocked_env, "generate", "Hello there", "--address", server.address,
                    "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    with Client(server.address, timeout=30) as client:
        assert proc.stdout == client.generate("Hello there", max_new_tokens=4).text + "\n"
    proc = genserve(blocked_env, "generate", "Hello there", "--address", server.address,
                    "--max-new-tokens", "4", "--stream", "--json")
    assert proc.returncode == 0 and '"usage"' in proc.stdout, proc.stderr


def test_the_client_library_without_torch(blocked_env, make_echo_server):
    server = make_echo_server()
    code = ("import asyncio, sys; from genserve.client import AsyncClient, Client\n"
            f"c = Client({server.address!r}, timeout=30); print(c.health()); c.close()\n"
            "async def main():\n"
            f"    async with AsyncClient({server.address!r}, timeout=30) as c:\n"
            "        print((await c.model_info()).model_id)\n"
            "asyncio.run(main())\n"
            f"assert not {{m.split('.')[0] for m in sys.modules}} & set({BLOCKED!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=blocked_env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "SERVING"


def test_the_client_extra_matches_the_pins_and_the_manual():
    """The `client` extra names what a client-only install needs, with the base pins; the
    manual's install command (docs/clients.md) lists exactly those."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = project["optional-dependencies"]["client"]
    assert {r.split(">")[0] for r in client} == {"grpcio", "grpcio-health-checking",
                                                  "protobuf"}
    assert set(client) <= set(project["dependencies"])
    manual = (REPO / "docs" / "clients.md").read_text()
    assert "pip install " + " ".join(f"'{r}'" for r in client) in manual
