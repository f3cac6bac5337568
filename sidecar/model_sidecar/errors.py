"""Every error the sidecar raises, in one hierarchy (as httpx's ``_exceptions.py``)::

    SidecarError
    ├── StoreError             a store operation failed; ``transient`` ones are retried
    │   └── ObjectMissing      the key is not in the store (never transient)
    ├── VerificationError      a version is refused: ``reason`` is a stable code
    ├── ServerUnavailable      the server's control socket does not answer: retried
    └── KubeError              the Kubernetes API refused or missed a call (``status``;
        │                      0 when it could not be reached)
        └── WatchExpired       a watch's resourceVersion is gone (410): read the pod again

What each means to the pod: a ``VerificationError`` is reported ``refused`` and not
retried for that target; the others are reported ``error`` and retried, while the old
version keeps serving.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base class of the sidecar's errors."""


class StoreError(SidecarError):
    """A store operation failed. ``transient`` ones are worth retrying."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class ObjectMissing(StoreError):
    def __init__(self, key: str) -> None:
        super().__init__(f"{key} is not in the model store", transient=False)


class VerificationError(SidecarError):
    """A version was refused. ``reason`` is a stable code for metrics and status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ServerUnavailable(SidecarError):
    """The server's control socket is not answering (or not in the protocol)."""


class KubeError(SidecarError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class WatchExpired(KubeError):
    def __init__(self, message: str) -> None:
        super().__init__(410, message)
