"""Every error the operator raises, in one hierarchy (as httpx's ``_exceptions.py``)::

OperatorError
├── SpecError              a ModelDeployment spec is refused; ``problems`` lists
│                          every problem (phase Invalid, condition SpecValid=False)
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
    """The API server refused a request; ``reason``: its own message (a Status's)."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason or message


class TransientApiError(ApiError):
    """Worth retrying: the API server is overloaded, restarting or unreachable."""
