"""Tracks: each model a pod serves follows its own version, through its own annotations.

A ModelDeployment's pods serve its own model (the *default track*) and, for a platform
with tenants, tenant models listed in the resource (each a *named track*). Every track has
its own rollout, so every track has its own pod annotations (the operator's target,
previous version, traffic policy and pinned publish sequences; its sidecar's report), its
own keys in the deployment's ConfigMap (the default version for new pods, and the pins),
its own ModelDeployment annotations for promote, abort and retry, and its own sidecar,
which follows only its track's keys. The default track keeps the keys it always had, so
pods of a deployment without tenant models are unchanged.

A named track's keys are the default ones with ``.<track>`` appended to the name part
(``serving.model-rollout.io/target-version.acme-resnet``). A track is named, not keyed by
its ``tenant/model``, because names may contain dots, so ``tenant.model`` would be
ambiguous, and because an annotation's name part is at most 63 characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .annotations import (
    ABORT,
    PINNED_SEQUENCES,
    PREVIOUS_VERSION,
    PROMOTE,
    RETRY,
    SIDECAR_STATUS,
    TARGET_VERSION,
)
from .canary import TRAFFIC_POLICY

# a DNS label of at most 40 characters: it ends annotation names (63 at most, the
# longest default one is 16 before the dot) and the sidecar container's name
TRACK_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")
TRACK_RULE = "1-40 lowercase letters, digits or '-', starting and ending with a letter or digit"
CONFIGMAP_VERSION_KEY = "target-version"  # the default track's ConfigMap key
CONFIGMAP_PINS_KEY = "pinned-sequences"  # and of its pinned publish sequences


class InvalidTrack(ValueError):
    """A track name that breaks :data:`TRACK_RULE`."""


def check_track(value: object) -> str:
    if not isinstance(value, str) or TRACK_PATTERN.fullmatch(value) is None:
        raise InvalidTrack(f"invalid track {value!r}: {TRACK_RULE}")
    return value


@dataclass(frozen=True)
class TrackKeys:
    """The annotation and ConfigMap keys of one track."""

    track: str | None  # None: the default track
    target: str  # operator -> sidecar: the version to serve
    previous: str  # operator -> sidecar: pre-pulled for a rollback
    traffic: str  # operator -> sidecar -> server: a canary pod's traffic policy
    sidecar_status: str  # sidecar -> operator: its SidecarReport
    configmap_key: str  # the deployment's default version for new pods
    # ModelDeployment annotations of this track's rollout: promote, abort, retry
    promote: str = PROMOTE
    abort: str = ABORT
    retry: str = RETRY
    # operator -> sidecar: publish sequences pinned at rollout starts (pins.py), on the
    # pod and, for pods not annotated yet, in the ConfigMap
    pins: str = PINNED_SEQUENCES
    configmap_pins_key: str = CONFIGMAP_PINS_KEY

    @property
    def followed(self) -> tuple[str, str, str]:
        """The keys a sidecar acts on when they change (not its own report)."""
        return (self.target, self.previous, self.traffic)


def track_keys(track: str | None = None) -> TrackKeys:
    """The keys of ``track`` (``None``: the default track's, as they always were)."""
    suffix = "" if track is None else f".{check_track(track)}"
    return TrackKeys(
        track=track,
        target=TARGET_VERSION + suffix,
        previous=PREVIOUS_VERSION + suffix,
        traffic=TRAFFIC_POLICY + suffix,
        sidecar_status=SIDECAR_STATUS + suffix,
        configmap_key=CONFIGMAP_VERSION_KEY + suffix,
        promote=PROMOTE + suffix,
        abort=ABORT + suffix,
        retry=RETRY + suffix,
        pins=PINNED_SEQUENCES + suffix,
        configmap_pins_key=CONFIGMAP_PINS_KEY + suffix,
    )


DEFAULT_TRACK = track_keys()
