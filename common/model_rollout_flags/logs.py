"""The programs' log lines, set up once for all three: ``--log-format text|json`` and
``--log-level debug|info|warning|error`` (also ``<PREFIX>LOG_FORMAT`` and
``<PREFIX>LOG_LEVEL``, as every flag).

One handler on the root logger writes every record to stderr, whichever library made it
(aiohttp, grpc, boto, kubernetes_asyncio, kopf): there is no second format on the
stream. ``text`` is the format the programs have always written; ``json`` is one object
per line (python-json-logger) that a cluster's log pipeline parses: ``time`` (RFC 3339,
UTC), ``level``, ``logger``, ``message``, the record's extras (``model``, ``version``,
``pod``... where the code has them) and ``exception`` (the traceback, one string). In
``json`` warnings and uncaught exceptions go through the same handler too, so nothing
else reaches the stream once logging is set up.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import IO, Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from model_rollout_contract import defaults

LOG_FORMATS = defaults.LOG_FORMATS
LOG_LEVELS = defaults.LOG_LEVELS
# the programs' text lines, as they have always been
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# the store's libraries, never below info: at debug botocore writes each request's
# parameters and each answer's body, STS's with IRSA (the web identity token, the
# temporary secret key) among them
CREDENTIAL_LOGGERS = ("botocore", "boto3", "s3transfer")


@dataclass(frozen=True)
class LogSettings:
    format: str = defaults.LOG_FORMAT  # text | json
    level: str = defaults.LOG_LEVEL  # debug | info | warning | error

    @property
    def json(self) -> bool:
        return self.format == "json"


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level`` (a sub-command's parser takes them after the
    sub-command's name, as its other flags)."""
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-format",
        type=str.lower,
        choices=LOG_FORMATS,
        default=defaults.LOG_FORMAT,
        help="text: for people; json: one JSON object per line (time, level, logger, "
        "message, extras such as model and version, exception) for a log pipeline",
    )
    group.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=defaults.LOG_LEVEL,
        help="the least severe records written",
    )


def log_settings(args: argparse.Namespace) -> LogSettings:
    return LogSettings(args.log_format, args.log_level)


def rfc3339(created: float) -> str:
    """A record's time as RFC 3339 in UTC, to the millisecond: ``2026-12-06T08:50:31.123Z``."""
    moment = datetime.fromtimestamp(created, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonLines(JsonFormatter):
    """One JSON object per record: time, level, logger, message first, then the fields
    every line carries (``fields``), the record's extras and the exception.

    ``rename`` renames extras (kopf's object reference, ``k8s_ref``, is ``object``);
    ``hide`` leaves extras out (kopf's settings object, its posting switch)."""

    def __init__(
        self,
        fields: Mapping[str, Any] | None = None,
        rename: Mapping[str, str] | None = None,
        hide: Iterable[str] = (),
    ) -> None:
        super().__init__(
            reserved_attrs=[*RESERVED_ATTRS, "taskName", *hide],
            rename_fields={"exc_info": "exception", "stack_info": "stack", **(rename or {})},
            static_fields=dict(fields or {}),
            json_ensure_ascii=False,
        )
        self._line_fields = dict(fields or {})

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        """The line's own fields first; an extra of the same name (a library's
        ``extra={"level": ...}``) is kept as ``extra.<name>``, never in their place."""
        own = {
            "time": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.message,
            **self._line_fields,
        }
        log_data.update(own)
        super().add_fields(log_data, record, message_dict)
        for key, value in own.items():
            if log_data.get(key) != value:
                log_data[f"extra.{key}"] = log_data[key]
                log_data[key] = value

    def format(self, record: logging.LogRecord) -> str:
        """The exception's text is the record's ``exc_text`` when a filter has set it
        (the sidecar's redaction does), as the standard formatter writes it."""
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)  # type: ignore[assignment]
            record = copy.copy(record)  # the other handlers still see exc_info
            record.exc_info = None
        return super().format(record)


class _ProgramHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`setup_logging` installs: replaced, never doubled, by a second
    call; the others on the root logger (a test runner's) are left alone."""


_current = LogSettings()
_program = ""


def setup_logging(
    settings: LogSettings,
    program: str,
    *,
    text_format: str = TEXT_FORMAT,
    fields: Mapping[str, Any] | None = None,
    rename: Mapping[str, str] | None = None,
    hide: Iterable[str] = (),
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Write every record at ``settings.level`` or above to ``stream`` (stderr) in
    ``settings.format``. ``program`` (``model-server``) prefixes :func:`fatal`'s text, and
    names, as its package's logger (``model_server``), the records of :func:`fatal` and of
    uncaught exceptions; ``fields`` are added to every JSON line (a sidecar's model, pod)."""
    global _current, _program
    handler = _ProgramHandler(stream)
    if settings.json:
        handler.setFormatter(JsonLines(fields, rename, hide))
    else:
        handler.setFormatter(logging.Formatter(text_format))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ProgramHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    for name in CREDENTIAL_LOGGERS:
        logging.getLogger(name).setLevel(max(root.level, logging.INFO))
    _current, _program = settings, program
    if settings.json:
        logging.captureWarnings(True)
        _log_uncaught(_logger())
    return handler


def _log_uncaught(logger: logging.Logger) -> None:
    """Uncaught exceptions, of the main thread and of others, as records."""

    def main_thread(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        logger.critical("uncaught exception", exc_info=(kind, value, tb))

    def other_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
        logger.error("uncaught exception in thread %s", name, exc_info=exc_info)  # type: ignore[arg-type]

    sys.excepthook = main_thread
    threading.excepthook = other_thread


def _logger() -> logging.Logger:
    return logging.getLogger(_program.replace("-", "_") or None)


def fatal(message: str) -> None:
    """Why the program stops, said once: ``model-server: message`` on stderr in text (as
    it always was), an error record in json."""
    if _current.json:
        _logger().error(message)
    else:
        print(f"{_program}: {message}" if _program else message, file=sys.stderr)
