"""Structured logs: every line logged inside an operation names the operation, in text or in JSON.

``LEDGERFLOW_LOG_FORMAT=json`` makes the worker log one JSON object per line (``text``, the default, keeps
the readable format for development); ``LEDGERFLOW_LOG_LEVEL`` sets the level (default INFO). A JSON line::

    {"time": "2026-…Z", "level": "INFO", "logger": "temporalio.activity", "message": "submitting send 1 …",
     "task_id": "t-…", "node": "keyframes/S01", "operation_key": "t-…:keyframes/S01:a1", "epoch": 1,
     "run_id": "…", "route": "image.keyframe", "trace_id": "…", "span_id": "…",
     "temporal_activity": {"activity_type": "stage.run", "attempt": 1, "workflow_id": "task-t-…", …}}

The operation's fields come from a context variable the operation lifecycle binds (``bind``, called by
``activities/operation.py``), so they are on every line logged while it runs, whoever logs it; ``trace_id``
and ``span_id`` are there whenever a span is recording (``runtime/telemetry.py``), to jump from a line to its
trace. Activities keep logging through Temporal's ``activity.logger`` (it adds the activity's info) and the
workflow through ``workflow.logger`` (it also keeps a replaying workflow from logging again).

Why python-json-logger: everything the worker logs already goes through the standard library's ``logging``
— our lines through Temporal's two logger adapters, Temporal's own lines, the libraries' — so a JSON
*formatter* on that one pipeline is all it takes. structlog would be a second logging system, used here only
through its bridge to the standard library.

No secrets in logs: nothing the lifecycle logs holds a key or a presigned URL (requests, inputs' URLs and
vendor answers are never logged), and as a second line of defence every formatted line has the query string
of any URL (where presigned URLs carry their signature) and any bearer token cut out. httpx's per-request
lines (a URL per poll) are kept to WARNING and above.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import IO, Any, Literal

from opentelemetry import trace
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from pythonjsonlogger.json import JsonFormatter
from temporalio import activity, workflow

from runtime.settings import ConfigError

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Libraries that log a line (with its URL) per request at INFO: one per poll of every running job.
CHATTY = ("httpx", "httpcore")


class LogSettings(BaseSettings):
    """How the worker logs (read here: these are not deployment settings the workers must agree on)."""

    model_config = SettingsConfigDict(env_prefix="LEDGERFLOW_", extra="ignore")

    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


@dataclass(frozen=True, slots=True)
class OperationContext:
    """Whose operation the current code runs for: on every log line and span inside it."""

    task_id: str
    node: str
    operation_key: str
    epoch: int
    run_id: str | None = None  # the workflow run the activity serves
    route: str | None = None  # the executor's route, for a vendor call


_CURRENT: ContextVar[OperationContext | None] = ContextVar("ledgerflow_operation", default=None)


def bind(ctx: OperationContext) -> None:
    """Make ``ctx`` the current operation for the rest of the current asyncio task (and the threads it
    hands work to: ``asyncio.to_thread`` copies the context).

    Not reset on purpose: Temporal runs each activity attempt in an asyncio task of its own, so the binding
    ends with the attempt, after Temporal's own last line about it ("Completing activity as failed"), which
    then names the operation too.
    """
    _CURRENT.set(ctx)


def current() -> OperationContext | None:
    return _CURRENT.get()


class ContextFilter(logging.Filter):
    """Adds the current operation's fields and the current span's ids to each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _CURRENT.get()
        if ctx is not None:
            for name, value in asdict(ctx).items():
                if value is not None and not hasattr(record, name):
                    setattr(record, name, value)
        span = trace.get_current_span().get_span_context()
        if span.is_valid and not hasattr(record, "trace_id"):
            record.trace_id = format(span.trace_id, "032x")
            record.span_id = format(span.span_id, "016x")
        return True


# The query string of a URL (a presigned URL's signature and credential live there) and bearer tokens.
_URL_QUERY = re.compile(r"(https?://[^\s\"'<>?#\\]+)\?[^\s\"'<>\\]*")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """``text`` with every URL's query string and every bearer token cut out."""
    return _BEARER.sub(r"\1[redacted]", _URL_QUERY.sub(r"\1?[redacted]", text))


class JsonLines(JsonFormatter):
    """One JSON object per record: time (UTC), level, logger, message, then every extra field."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
        )

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class Text(logging.Formatter):
    """The development format, plus ``[operation_key epoch N]`` on a line logged inside an operation."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        key = getattr(record, "operation_key", None)
        if key is not None:
            head, _, rest = line.partition("\n")  # a traceback, if any, stays below
            line = f"{head} [{key} epoch {getattr(record, 'epoch', '?')}]" + (f"\n{rest}" if rest else "")
        return redact(line)


def configure(settings: LogSettings | None = None, *, stream: IO[str] | None = None) -> Callable[[], None]:
    """Log to ``stream`` (default stderr) in the configured format; replaces any handler set up before.

    In JSON the activity's and workflow's info are fields (``temporal_activity``, ``temporal_workflow``), so
    Temporal's adapters stop appending them to the message too. Returns a function that undoes all of it.
    """
    if settings is None:
        try:
            settings = LogSettings()
        except ValidationError as e:
            bad = e.errors()[0]
            raise ConfigError(f"LEDGERFLOW_{str(bad['loc'][0]).upper()}: {bad['msg']}") from None
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLines() if settings.log_format == "json" else Text())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    saved: dict[str, Any] = {
        "handlers": list(root.handlers),
        "level": root.level,
        "chatty": {name: logging.getLogger(name).level for name in CHATTY},
        "on_message": activity.logger.activity_info_on_message,
        "workflow_on_message": workflow.logger.workflow_info_on_message,
    }
    for old in saved["handlers"]:
        root.removeHandler(old)
    root.addHandler(handler)
    level = logging.getLevelName(settings.log_level)
    root.setLevel(level)
    for name in CHATTY:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    if settings.log_format == "json":
        activity.logger.activity_info_on_message = False
        workflow.logger.workflow_info_on_message = False

    def undo() -> None:
        root.removeHandler(handler)
        for old in saved["handlers"]:
            root.addHandler(old)
        root.setLevel(saved["level"])
        for name, was in saved["chatty"].items():
            logging.getLogger(name).setLevel(was)
        activity.logger.activity_info_on_message = saved["on_message"]
        workflow.logger.workflow_info_on_message = saved["workflow_on_message"]

    return undo
