"""Named server-side logits processors that requests enable with JSON arguments.

A plugin is a class loaded from ``--processor-plugin module:Class``: it is instantiated
once at start-up with a ``PluginContext`` and has a ``name`` and ``build(args) ->``
processor or factory (see ``engine.logits_process``). ``build`` raises ``ValueError`` for
bad arguments; the request then gets INVALID_ARGUMENT. The two built-in plugins
(``service.builtin_processors``) are always registered.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

from genserve.v1 import generation_pb2 as pb
from service.validation import MAX_ARGS_JSON_BYTES, InvalidArgument, check_json_depth

BUILTIN_PLUGINS = (
    "service.builtin_processors:BannedPhrases",
    "service.builtin_processors:NoRepeatWindow",
)


@dataclass
class PluginContext:
    tokenizer: Any
    vocab_size: int


class ProcessorPlugin(Protocol):
    name: str

    def build(self, args: dict[str, Any]) -> Any: ...


class PluginRegistry:
    def __init__(self, context: PluginContext, specs: list[str] | tuple[str, ...] = ()) -> None:
        self.plugins: dict[str, ProcessorPlugin] = {}
        for spec in (*BUILTIN_PLUGINS, *specs):
            self.register(load_plugin(spec, context))

    def register(self, plugin: ProcessorPlugin) -> None:
        if plugin.name in self.plugins:
            raise ValueError(f"processor plugin name {plugin.name!r} is registered twice")
        self.plugins[plugin.name] = plugin

    def build(self, refs: list[pb.ProcessorRef]) -> list[Any]:
        """Processors/factories for a request's ``processors`` list, in order."""
        built = []
        for i, ref in enumerate(refs):
            plugin = self.plugins.get(ref.name)
            if plugin is None:
                raise InvalidArgument(f"processors[{i}]: unknown processor {ref.name!r}; "
                                      f"registered: {sorted(self.plugins)}")
            if len(ref.args_json) > MAX_ARGS_JSON_BYTES:
                raise InvalidArgument(f"processors[{i}].args_json is longer than "
                                      f"{MAX_ARGS_JSON_BYTES} characters")
            check_json_depth(ref.args_json, f"processors[{i}].args_json")
            try:
                args = json.loads(ref.args_json) if ref.args_json.strip() else {}
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"processors[{i}].args_json is not valid JSON: {e}") \
                    from None
            if not isinstance(args, dict):
                raise InvalidArgument(f"processors[{i}].args_json must be a JSON object")
            try:
                built.append(plugin.build(args))
            except (ValueError, TypeError) as e:
                raise InvalidArgument(f"processors[{i}] ({ref.name}): {e}") from None
        return built


def load_plugin(spec: str, context: PluginContext) -> ProcessorPlugin:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--processor-plugin {spec!r}: expected module:Class")
    cls = getattr(importlib.import_module(module_name), attr)
    plugin = cls(context)
    if not isinstance(getattr(plugin, "name", None), str) or not callable(
            getattr(plugin, "build", None)):
        raise ValueError(f"--processor-plugin {spec!r}: needs a `name` and a `build(args)`")
    return plugin
