"""Credentials written into a URL never reach a log line: a filter on the log handlers
applies the contract's :func:`~model_rollout_contract.redact.redact` to every record
(the status is redacted where it is written, :mod:`.status`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from model_rollout_contract.redact import redact

# the record's own attributes that are its message: redacted once it is formatted
_MESSAGE_PARTS = frozenset({"msg", "args", "message"})


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's final message (arguments included),
    its exception, and its other text: a JSON line (--log-format json) writes every
    extra and the stack, which a text line never did."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in list(vars(record).items()):
            if isinstance(value, str) and key not in _MESSAGE_PARTS and redact(value) != value:
                setattr(record, key, redact(value))
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
