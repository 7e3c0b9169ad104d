"""Logging set-up: text (human) or JSON (one object per line) on stderr.

The servicer sets ``request_id_var`` for the duration of each call, so any line logged
while answering a request carries its id without passing it around; a line may also name
it with ``extra={"request_id": ...}``. Other ``extra`` fields (rpc, code, tokens, duration)
become fields of the JSON object.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "genserve_request_id", default=None)

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class RequestIdFilter(logging.Filter):
    """Stamps ``record.request_id`` from the call's context (unless ``extra`` named one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    """The classic format, with ``[request_id]`` before the message when there is one."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging API)
        rid = getattr(record, "request_id", None)
        if rid is None:
            return super().formatMessage(record)
        saved = record.message
        record.message = f"[{rid}] {saved}"
        try:
            return super().formatMessage(record)
        finally:
            record.message = saved


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message,
    request_id (when the line concerns a request), ``extra`` fields, and exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out and key != "request_id":
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def make_handler(fmt: str = "text", stream=None) -> logging.Handler:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


def setup_logging(level: str | int = "INFO", fmt: str = "text", stream=None) -> None:
    """Configure the root logger (replacing its handlers) for the ``genserve`` process."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)  # warnings as log lines too (JSON when json)
