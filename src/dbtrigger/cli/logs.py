"""Log output of the command line: a level, text or JSON lines, secrets masked.

The library never configures logging (it only logs with ``extra=`` fields);
the CLI does it here, once. Both formats pass every line through
:func:`~dbtrigger.state.stores.factory.redact`, so a password in a database
error or an account key in a storage error never reaches the terminal or a
log collector.

JSON lines carry the record's structured fields (``event``, ``poller``,
``batch_id``, ``outcome``, ...) next to ``time``, ``level``, ``logger`` and
``message``, and the traceback as ``exc_info`` text when there is one.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any, TextIO

from dbtrigger.redaction import protect_handlers, redact

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")

#: Attributes every LogRecord has; anything else came in through ``extra=``.
_STANDARD = set(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {
    "message",
    "asctime",
    "taskName",
}

#: Loggers that are very chatty at INFO and say nothing an operator of a
#: poller needs: azure-core logs each HTTP request and response of the blob
#: and table stores as a 10-20 line record.
QUIET_LOGGERS = ("azure.core.pipeline.policies.http_logging_policy", "azure.identity")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return redact(json.dumps(out, default=str, sort_keys=False))


def _quiet_chatty_loggers(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith(QUIET_LOGGERS)


#: Runtime events logged just before the error they name leaves the tick.
TICK_FAILURE_EVENTS = frozenset(
    {
        "handler_failed",
        "state_read_failed",
        "fetch_failed",
        "lease_acquire_failed",
        "serialization_failed",
        "commit_failed",
        "failure_uncounted",
    }
)


def _reported_by_the_error_line(record: logging.LogRecord) -> bool:
    """False for a tick's record of its own failure: the command says it.

    Every command that ticks reports a failed tick itself - ``dbtrigger run``
    in its one line per tick (with the traceback once per failing batch or
    outage), ``backfill`` in its retry line - so the runtime's record of the
    same failure, logged just before the error leaves the tick, would make a
    database outage cost two lines per tick. Such records stay visible at
    DEBUG (``-vv``) with the rest of the details.

    An :class:`~dbtrigger.errors.OperatorError` out of a tick becomes the
    command's single ``error:`` line and exit code 2 (the runtime marks its
    record ``operator_error=True``); a retryable one the command's own line.
    """
    return getattr(record, "event", None) not in TICK_FAILURE_EVENTS


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at write time (a progress display may redirect it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str, fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every log record at ``level`` and above to ``stream`` (default stderr)."""
    handler: logging.Handler = logging.StreamHandler(stream or _CurrentStderr())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # On the handler, not the loggers: with DEBUG, urllib3 and azure-core log
    # request URLs (SAS signatures included) through their own loggers.
    protect_handlers([handler])
    handler._dbtrigger_cli = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    # Replace only a handler an earlier main() set up: a program that configured
    # logging before calling main() keeps its own handlers as it made them.
    for old in [h for h in root.handlers if getattr(h, "_dbtrigger_cli", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    _unquiet()
    if level != "DEBUG":
        # A filter on our handler, not a level on those loggers: the process's
        # other handlers (a host's, a test's) keep seeing them.
        handler.addFilter(_quiet_chatty_loggers)
        handler.addFilter(_reported_by_the_error_line)
        if root.handlers == [handler]:
            _quiet_at_the_source()


#: The chatty loggers whose level configure_logging raised (and lowers again).
_RAISED: set[str] = set()


def _quiet_at_the_source() -> None:
    """With no other handler to see them (a ``dbtrigger run`` worker), the chatty
    loggers need not build their records at all: azure-core formats the headers
    of every request and response, 0.3-0.7 ms of CPU per store operation of a
    Blob or Table store, only for the handler's filter to drop it."""
    for name in QUIET_LOGGERS:
        chatty = logging.getLogger(name)
        if chatty.level == logging.NOTSET:
            chatty.setLevel(logging.WARNING)
            _RAISED.add(name)


def _unquiet() -> None:
    while _RAISED:
        logging.getLogger(_RAISED.pop()).setLevel(logging.NOTSET)


__all__ = [
    "FORMATS",
    "LEVELS",
    "QUIET_LOGGERS",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
]
