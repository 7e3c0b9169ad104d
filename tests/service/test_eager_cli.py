"""``genserve serve --enforce-eager`` maps onto EngineConfig.enforce_eager."""

from __future__ import annotations

import pytest

import service.server
from service import cli


@pytest.mark.parametrize("flags,eager", [([], False), (["--enforce-eager"], True)])
def test_enforce_eager_flag(monkeypatch, flags, eager):
    seen = {}

    async def fake_serve(config):
        seen["config"] = config

    monkeypatch.setattr(service.server, "serve", fake_serve)
    assert cli.main(["serve", *flags]) == 0
    assert seen["config"].engine.enforce_eager is eager
