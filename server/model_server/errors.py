"""Errors that carry the HTTP status a client should see."""

from __future__ import annotations


class ServingError(Exception):
    """Base class: an error with an HTTP status and a stable machine-readable code."""

    status = 500
    code = "internal_error"

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


class Conflict(ServingError):
    status = 409
    code = "conflict"


class LoadRefused(ServingError):
    """A new version was not swapped in: it failed to load, verify or warm up."""

    status = 422
    code = "load_refused"


class MemoryBudgetExceeded(LoadRefused):
    status = 507
    code = "memory_budget_exceeded"


class NotReady(ServingError):
    status = 503
    code = "not_ready"
