"""The last line of defence for JSON schemas a backend enforces only in part.

llguidance's lenient build ignores keywords it cannot enforce, xgrammar is looser than
the schema in a few corners (``minLength`` beside ``pattern``, overlapping ``oneOf``), and
lm-format-enforcer's parser fallback once allowed EOS mid-string: every backend's finished
outputs are validated once, here, and a failure is reported as such.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema

from structured.spec import StructuredSpec

OutputCheck = Callable[[str], str | None]


def _load(text: str, how: str) -> tuple[object, str | None]:
    """(the parsed output, None), or (None, why it is not JSON)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"structured_output: the output is not JSON ({e}); grammar by {how}"


def schema_checker(spec: StructuredSpec, backend: str, ignored: list[str]) -> OutputCheck:
    """``check(text)`` -> None if ``text`` is JSON valid under the schema, else why not
    (``structured_output: ...``: the engine reports it as the sequence's error)."""
    assert isinstance(spec.value, str)
    schema = json.loads(spec.value)
    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator = validator_cls(schema)
    except Exception:  # a schema jsonschema cannot load: nothing to check it with
        return lambda text: None
    how = f"{backend} (lenient: {'; '.join(ignored)})" if ignored else backend

    def check(text: str) -> str | None:
        instance, problem = _load(text, how)
        if problem is not None:
            return problem
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        except Exception:  # e.g. a remote $ref, never fetched: the grammar stands
            return None
        if error is None:
            return None
        return (f"structured_output: the output does not match the schema: "
                f"{error.message[:300]} at /{'/'.join(map(str, error.absolute_path))}; "
                f"grammar by {how}")

    return check


def object_checker(backend: str) -> OutputCheck:
    """``check(text)`` for ``json_object``: None if ``text`` is one JSON object."""

    def check(text: str) -> str | None:
        instance, problem = _load(text, backend)
        if problem is not None:
            return problem
        if not isinstance(instance, dict):
            return (f"structured_output: the output is JSON but not an object; grammar by "
                    f"{backend}")
        return None

    return check
