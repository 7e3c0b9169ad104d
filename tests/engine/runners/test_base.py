"""The runner-neutral helpers of engine/runners/base.py."""

from __future__ import annotations

from types import SimpleNamespace

from engine.runners.base import config_eos_ids


def test_config_eos_ids_unites_ints_and_lists_and_skips_unset():
    """What both runners read from a model's generation config and config: an int, a list
    or nothing, in any mix."""
    generation = SimpleNamespace(eos_token_id=[2, 7])
    config = SimpleNamespace(eos_token_id=2)
    assert config_eos_ids(generation, config) == {2, 7}
    assert config_eos_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(), config) == {2}
    assert config_eos_ids() == set()
