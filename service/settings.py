"""``genserve serve`` settings from the environment and a YAML file, as vLLM and the TGIS
adapter allow: every flag ``--some-flag`` is also ``GENSERVE_SOME_FLAG`` and ``some-flag:``
(or ``some_flag:``) in ``--config FILE``. Precedence: flag > environment > file > default.

Values are converted by the flag's own argparse type, so a bad value is reported exactly as
the flag would report it, naming where it came from.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "GENSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests set on the command line itself (argv re-parsed with no defaults)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved:
            a.default = default


def read_config_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _bool(text: str, where: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{where}: expected true or false, got {text!r}")


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
        return value if isinstance(value, bool) else _bool(str(value), where)
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else str(value).split(",")
        return [_convert_one(action, item, where) for item in items if str(item).strip()]
    return _convert_one(action, value, where)


def _convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    text = str(value).strip()
    try:
        converted = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{where}: {converted!r} is not one of {list(action.choices)}")
    return converted


def apply_env_and_file(parser: argparse.ArgumentParser, argv: list[str],
                       args: argparse.Namespace,
                       environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``args`` with every flag not on the command line taken from the environment, else
    from ``args.config``; raises ValueError naming the variable or key of a bad value."""
    environ = os.environ if environ is None else environ
    given = _given(parser, argv)
    actions = {a.dest: a for a in parser._actions
               if a.option_strings and a.dest not in ("help", "config")}
    file_values = read_config_file(args.config) if getattr(args, "config", None) else {}
    unknown = sorted(set(file_values) - set(actions))
    if unknown:
        raise ValueError(f"--config {args.config}: unknown setting(s) "
                         f"{', '.join(k.replace('_', '-') for k in unknown)}")
    for dest, action in actions.items():
        if dest in given:
            continue
        env_name = ENV_PREFIX + dest.upper()
        if env_name in environ:
            setattr(args, dest, _convert(action, environ[env_name], env_name))
        elif dest in file_values:
            setattr(args, dest, _convert(action, file_values[dest],
                                         f"--config {args.config}: {dest.replace('_', '-')}"))
    return args
