"""Every error the operator raises, in one hierarchy (as httpx's ``_exceptions.py``)::

OperatorError
├── SpecError              a ModelDeployment spec is refused; ``problems`` lists
│                          every problem (phase Invalid, condition SpecValid=False)
├── ResourceGone           the resource a task follows was deleted, or deleted and
│                          created again (another uid): the task ends
└── ApiError               the Kubernetes API refused a call (``status``)
    └── TransientApiError  overloaded, restarting or unreachable: the resource's
                           passes start again a little later
"""

from __future__ import annotations


class OperatorError(Exception):
    """Base class of the operator's errors."""


class SpecError(OperatorError, ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class ApiError(OperatorError):
    """The API server refused a request; ``reason``: its own message (a Status's);
    ``retry_after_s``: its ``Retry-After`` (a 429's, a 503's), if any."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason or message
        self.retry_after_s = retry_after_s


class TransientApiError(ApiError):
    """Worth retrying: the API server is overloaded, restarting or unreachable."""


class ResourceGone(OperatorError):
    """The ModelDeployment a task follows is gone: deleted, or replaced by a new one of
    the same name (another ``metadata.uid``), which is none of this task's business."""
