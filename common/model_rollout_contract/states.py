"""Every state that crosses a process boundary or lands in ``.status``, as ``str`` enums:
they serialise as their plain value, and comparisons with strings read from JSON work."""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Phase(_StrEnum):
    """``ModelDeployment.status.phase``."""

    PROGRESSING = "Progressing"  # batches of a forward rollout
    CANARY = "Canary"  # canary pods loading, held or waiting for promotion
    ROLLING_BACK = "RollingBack"  # back to a version the pods still hold
    AVAILABLE = "Available"  # every pod serves the target
    DEGRADED = "Degraded"  # a rollout failed; nothing moves until spec.version changes
    INVALID = "Invalid"  # the spec was refused; nothing changed

    @property
    def rolling(self) -> bool:
        return self in (Phase.PROGRESSING, Phase.CANARY, Phase.ROLLING_BACK)


class RolloutStage(_StrEnum):
    """``status.rollout.stage``: where the planner is in one rollout."""

    CANARY = "canary"
    BATCHES = "batches"
    COMPLETE = "complete"
    FAILED = "failed"


class CanaryStep(_StrEnum):
    """``status.rollout.canaryStep``: the step of the canary stage. In ``shadow`` the
    candidate answers only mirrored requests (every user gets the stable version's
    answer); in ``live`` it has its live share (trafficPercent, or whole canary pods)."""

    SHADOW = "shadow"
    LIVE = "live"


class RolloutResult(_StrEnum):
    """``status.history[].result``: how one rollout of a version ended (or that it runs)."""

    PROGRESSING = "Progressing"  # still running
    SUCCEEDED = "Succeeded"  # every pod served the version
    ROLLED_BACK = "RolledBack"  # the canary analysis failed it; the pods went back to stable
    ABORTED = "Aborted"  # the abort annotation sent the pods back to stable
    FAILED = "Failed"  # a pod refused the version, or a deadline passed
    SUPERSEDED = "Superseded"  # spec.version changed before it ended

    @property
    def finished(self) -> bool:
        return self is not RolloutResult.PROGRESSING


class SidecarState(_StrEnum):
    """What a sidecar reports about its pod's target version."""

    OK = "ok"  # the server serves the target
    FETCHING = "fetching"  # downloading and verifying
    LOADING = "loading"  # the server is loading and warming it up
    REFUSED = "refused"  # verification or the server refused it: not retried for this target
    ERROR = "error"  # store or server unavailable: retried; the old version keeps serving


class ConditionType(_StrEnum):
    """``status.conditions[].type`` (each with a reason and message, as Argo Rollouts'
    ``utils/conditions``)."""

    SPEC_VALID = "SpecValid"  # False: the spec was refused (reason InvalidSpec)
    PROGRESSING = "Progressing"  # True while a rollout moves pods
    AVAILABLE = "Available"  # True when enough pods are ready
    DEGRADED = "Degraded"  # True after a failed rollout or a refused spec
    CHILDREN_READY = "ChildrenReady"  # False: an object it must create exists, not its own
    STORE_REACHABLE = "StoreReachable"  # False: the target could not be checked; holding
    SIGNATURES_VERIFIED = "SignaturesVerified"  # False: allowUnsigned, nothing is verified
    PAUSED = "Paused"  # True while spec.paused holds the rollout (kubectl model pause)
    PODS_SCHEDULABLE = "PodsSchedulable"  # False: the scheduler cannot place a pod (why)
    READY = "Ready"  # kstatus-style summary: Available, up to date, nothing failing
