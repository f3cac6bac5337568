"""Every error the sidecar raises, in one hierarchy (as httpx's ``_exceptions.py``), each
with a stable ``code`` that the report carries (:class:`~model_rollout_contract.report.
SidecarReport`)::

    SidecarError
    ├── StoreError             a store operation failed; ``transient`` ones are retried
    │   └── ObjectMissing      the key is not in the store (never transient)
    ├── VerificationError      a version is refused: ``code`` is the reason
    ├── KeysUnreadable         the trusted keys (the Secret) cannot be read or hold no key:
    │                          nothing is verified until they can (retried)
    ├── BadPins                the operator's pinned sequences cannot be read: nothing is
    │                          fetched until they can (retried)
    ├── VolumeError            the shared volume refused a write or holds something unsafe
    │   ├── VolumeFull         no space (or quota) left for it
    │   └── UnsafeVolume       a symbolic link (or another odd entry) where the sidecar
    │                          writes, reads or deletes: never followed
    ├── ServerUnavailable      the server's control socket does not answer: retried
    ├── LoadNotDone            the server did not load a version, for a reason that
    │                          passes (``model_rollout_contract.server_codes.TRANSIENT``)
    ├── ControlFailure         the control socket answered, but not usefully: denied,
    │                          timed out, or outside the protocol (not retried at once)
    ├── PublishRefused         ``publish`` would overwrite a published version
    ├── BadGolden              ``publish --golden``: a golden set a server could not run
    ├── PolicyNotApplied       the server did not take the pod's traffic policy
    ├── KubeError              the Kubernetes API refused or missed a call (``status``;
    │   │                      0 when it could not be reached or its answer was not one;
    │   │                      ``retry_after_s``: the answer's Retry-After)
    │   └── WatchExpired       a watch's resourceVersion is gone (410): read the pod again
    └── PodWatchEnded          following the pod ended by itself (a defect: it retries
                               every failure): the sidecar exits, the pod restarts

What each means to the pod: a ``VerificationError`` or a permanent ``StoreError`` (bad
credentials, a missing object) is reported ``refused`` and not retried for that target
until the longest backoff has passed; the others are reported ``error`` and retried with
backoff, while the old version keeps serving.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base class of the sidecar's errors."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoreError(SidecarError):
    """A store operation failed. ``transient`` ones are worth retrying."""

    def __init__(self, message: str, transient: bool, code: str | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.code = code or ("store_unreachable" if transient else "store_error")


class ObjectMissing(StoreError):
    def __init__(self, key: str) -> None:
        super().__init__(f"{key} is not in the model store", transient=False, code="not_found")


class VerificationError(SidecarError):
    """A version was refused. ``reason`` (also its ``code``) is a stable word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = reason


class KeysUnreadable(SidecarError):
    """The trusted keys cannot be read: no key is trusted meanwhile (never the last ones
    read: a key removed from the Secret must not stay trusted)."""

    code = "keys_unreadable"


class BadPins(SidecarError):
    """The publish sequences the operator pinned (pod annotation or ConfigMap) do not
    parse: without them an older build could pass, so nothing is fetched meanwhile."""

    code = "bad_pins"


class VolumeError(SidecarError):
    code = "volume_error"


class VolumeFull(VolumeError):
    code = "volume_full"


class UnsafeVolume(VolumeError):
    code = "unsafe_volume"


class ServerUnavailable(SidecarError):
    """The server's control socket is not answering."""

    code = "server_unavailable"


class LoadNotDone(SidecarError):
    """The server answered a load with a transient code (a rollback overtook it, its
    memory is still held by versions finishing requests, ...): retried with backoff, and
    the verified download is kept. ``code`` is ``server_<the server's code>``."""

    def __init__(self, server_code: str, message: str) -> None:
        super().__init__(message)
        self.server_code = server_code
        self.code = f"server_{server_code}"


class ControlFailure(SidecarError):
    """The control socket answered, but not usefully; ``code`` says how."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # control_denied | control_timeout | protocol_error


class PublishRefused(SidecarError):
    code = "already_published"


class BadGolden(SidecarError):
    code = "bad_golden"


class PolicyNotApplied(SidecarError):
    """The server answered the ``traffic`` op with an error (or could not hold the
    policy's stable version beside its candidate): reported ``error``, tried again with
    backoff. ``code`` is ``policy_<the server's code>``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = f"policy_{code}"


class KubeError(SidecarError):
    code = "kube_error"

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class WatchExpired(KubeError):
    def __init__(self, message: str) -> None:
        super().__init__(410, message)


class PodWatchEnded(SidecarError):
    """Following the pod ended though nobody stopped it: the view would stay frozen on
    the old target for good, so the sidecar exits non-zero (a restart is better)."""

    code = "pod_watch_ended"
