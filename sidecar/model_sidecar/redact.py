"""Credentials written into a URL (``https://user:secret@host/``) never reach a log line
or the status: the store's endpoint can carry them, and both boto3's errors and ours
quote the endpoint."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

# scheme://userinfo@ — userinfo is anything up to the first "@" before the host that has
# no "/", whitespace or quote in it (RFC 3986 forbids "/" there)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@\"'<>]+@")


def redact(text: str) -> str:
    """``https://user:secret@host/`` -> ``https://***@host/``, wherever it appears."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's final message (arguments included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction(handlers: Iterable[logging.Handler] | None = None) -> None:
    """Redact on these handlers, by default every handler of the root logger (call after
    logging is configured): the filter sees records of every logger, boto's included."""
    for handler in logging.getLogger().handlers if handlers is None else handlers:
        handler.addFilter(RedactingFilter())
