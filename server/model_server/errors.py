"""Every error the server raises to a client, in one hierarchy (as httpx's
``_exceptions.py``); each carries the HTTP status and a stable ``code`` that the JSON
body, the control socket's error reply and the metrics' ``reason`` label use::

    ServingError (500 internal_error)
    ├── BadRequest (400 bad_request)            malformed body, name, dtype or shape
    ├── Unauthorized (401 unauthorized)         missing or wrong token / API key
    ├── Forbidden (403 forbidden)               admin API off; path outside the repository
    ├── ModelNotFound (404 model_not_found)
    ├── VersionNotFound (404 version_not_found)
    ├── RequestTimeout (408 request_timeout)    the body did not arrive in time (the
    │                                           connection is closed)
    ├── Conflict (409 conflict)                 nothing retained to roll back to
    ├── UnsupportedMediaType (415 unsupported_media_type)   an unknown body charset
    ├── LoadRefused (422 load_refused)          a version failed to verify, load or warm up;
    │   │                                       the serving one is untouched
    │   ├── GoldenMismatch (422 golden_mismatch)   its answers to its golden set are
    │   │                                       outside the set's tolerance
    │   └── MemoryBudgetExceeded (507 memory_budget_exceeded)
    ├── RateLimited (429 rate_limited)          a tenant over its request rate (with
    │                                           Retry-After)
    ├── NotReady (503 not_ready)                no version loaded yet
    └── Unavailable (503 unavailable)           a JSON worker process was lost, or the
                                                queue of large bodies is full (with
                                                Retry-After)

A name that breaks the contract's rule (``model_rollout_contract.names.InvalidName``,
a ``ValueError``) is answered as ``BadRequest``; any other exception (an engine failing
at run time, a bug) as ``ServingError`` itself, through :func:`internal_error`.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class: an error with an HTTP status and a stable machine-readable code."""

    status = 500
    code = "internal_error"
    retry_after_s: int | None = None  # when set, HTTP answers carry Retry-After

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServingError):
    status = 400
    code = "bad_request"


class Unauthorized(ServingError):
    status = 401
    code = "unauthorized"


class Forbidden(ServingError):
    status = 403
    code = "forbidden"


class ModelNotFound(ServingError):
    status = 404
    code = "model_not_found"


class VersionNotFound(ServingError):
    status = 404
    code = "version_not_found"


class UnsupportedMediaType(ServingError):
    status = 415
    code = "unsupported_media_type"


class RequestTimeout(ServingError):
    status = 408
    code = "request_timeout"


class Conflict(ServingError):
    status = 409
    code = "conflict"


class LoadRefused(ServingError):
    """A new version was not swapped in: it failed to load, verify or warm up."""

    status = 422
    code = "load_refused"


class GoldenMismatch(LoadRefused):
    """A version loaded and warmed up, but answered its golden set's inputs outside the
    set's tolerance: it is not swapped in."""

    code = "golden_mismatch"


class MemoryBudgetExceeded(LoadRefused):
    status = 507
    code = "memory_budget_exceeded"


class RateLimited(ServingError):
    """A tenant sent more requests than its rate limit allows; retry after
    ``retry_after_s`` seconds."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(ServingError):
    status = 503
    code = "not_ready"


class Unavailable(ServingError):
    """The request could not be served now, through no fault of its own; retry (after
    ``retry_after_s`` seconds, when given)."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


INTERNAL_MESSAGE_CHARS = 300  # of an unexpected exception's message, told to the client


def internal_error(exc: Exception) -> ServingError:
    """What a client is told of an exception that is no ``ServingError``: 500
    ``internal_error`` with the exception's message (cut short), not its type or
    traceback, which the transport logs."""
    message = str(exc) or "no message"
    if len(message) > INTERNAL_MESSAGE_CHARS:
        message = message[: INTERNAL_MESSAGE_CHARS - 3] + "..."
    return ServingError(f"internal error: {message}")
