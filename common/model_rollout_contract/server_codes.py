"""The server's error codes (``model_server.errors``; the control socket's
``ErrorReply.code``), as the sidecar judges a load answered with one. Written here, once,
because both ends must agree: a test checks that every code the server can answer is in
exactly one of the two sets.

Permanent: the same load will be answered the same way until something else changes (the
bytes, the configuration); the sidecar reports the version ``refused``. Only for
:data:`REFUSED_BYTES` did the server refuse the version's bytes themselves (they failed
to verify, load or warm up), so only then is the download deleted.

Transient: the load was not done for a reason that passes — overtaken by a rollback
(``conflict``), a JSON worker lost or a queue full (``unavailable``), room in the memory
budget held by versions still finishing requests (``memory_budget_exceeded``), the
server starting (``not_ready``) or busy; the sidecar keeps the download, reports
``error`` and tries again with its backoff."""

from __future__ import annotations

REFUSED_BYTES = "load_refused"
PERMANENT = frozenset(
    {
        REFUSED_BYTES,
        "golden_mismatch",  # the version answers its own golden set wrongly
        "bad_request",  # the request itself is malformed
        "unauthorized",
        "forbidden",  # a path outside the server's repository
        "model_not_found",  # the server does not serve this model
        "version_not_found",
        "unsupported_media_type",
    }
)
TRANSIENT = frozenset(
    {
        "internal_error",
        "conflict",
        "memory_budget_exceeded",
        "not_ready",
        "unavailable",
        "busy",  # the control socket's connection bound (control.BUSY)
        "rate_limited",  # a tenant over its request rate: retry after Retry-After
        "request_timeout",  # an HTTP request's body did not arrive in time
    }
)


def is_permanent(code: str) -> bool:
    """A code not known to be permanent (an older or newer server's) is retried."""
    return code in PERMANENT
