"""Test-only processor plugins, loaded by module path as an operator would."""

from __future__ import annotations

import threading


class Recording:
    """Stateful: each sequence's processor records every output prefix it was shown."""

    def __init__(self, records: list, lock: threading.Lock) -> None:
        self.records, self.lock = records, lock
        self.prompt: tuple[int, ...] | None = None
        self.seen: list[list[int]] = []

    def __call__(self, prompt_ids, output_ids, logits):
        self.prompt = tuple(prompt_ids)
        self.seen.append(list(output_ids))
        return logits


class RecordingFactory:
    def __init__(self, plugin: RecorderPlugin) -> None:
        self.plugin = plugin

    def create(self) -> Recording:
        with self.plugin.lock:
            self.plugin.created += 1
        proc = Recording(self.plugin.records, self.plugin.lock)
        return proc

    def release(self, proc: Recording) -> None:
        with self.plugin.lock:
            self.plugin.released += 1
            self.plugin.records.append(proc)


class RecorderPlugin:
    name = "recorder"
    instance: RecorderPlugin | None = None

    def __init__(self, context) -> None:
        self.records: list[Recording] = []
        self.lock = threading.Lock()
        self.created = self.released = 0
        RecorderPlugin.instance = self

    def build(self, args):
        return RecordingFactory(self)


class FailOnNth:
    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, prompt_ids, output_ids, logits):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError(f"plugin exploded on call {self.n}")
        return logits


class FailFactory:
    def __init__(self, n: int) -> None:
        self.n = n

    def create(self) -> FailOnNth:
        return FailOnNth(self.n)

    def release(self, proc) -> None:
        pass


class FailPlugin:
    name = "fail_on_nth"

    def __init__(self, context) -> None:
        pass

    def build(self, args):
        n = args.get("n")
        if not isinstance(n, int) or n < 1:
            raise ValueError("'n' must be a positive integer")
        return FailFactory(n)
