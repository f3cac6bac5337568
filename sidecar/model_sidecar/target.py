"""Where the pod's target version comes from: the pod's annotations as the API shows them
(followed by :class:`~model_sidecar.pod_watch.PodWatch`, which keeps its last view while
the API is lost), else — before the API has answered once, or when the file changed
after the API was lost — the same annotations in the Downward API file (refreshed only
on the kubelet's periodic sync), else a ConfigMap file (the deployment's default). The canary's
traffic policy comes from the same annotations (no ConfigMap default: no policy). A
sidecar of a named track (a tenant model) reads that track's annotations only. The
publish sequences the operator pinned come from the same annotations and from the
ConfigMap's pins file (a pod the operator has not annotated yet), the higher of the two."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.annotations import parse_downward_annotations
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.names import is_valid_name
from model_rollout_contract.pins import InvalidPins, parse_pins
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys


def _valid(value: str | None) -> str | None:
    return value if is_valid_name(value) else None


@dataclass(frozen=True)
class TargetSource:
    annotations_file: Path | None = None
    configmap_file: Path | None = None
    live: Callable[[], dict[str, str] | None] | None = None  # the API's view; None: the file's
    keys: TrackKeys = DEFAULT_TRACK  # whose annotations: this sidecar's track's
    pins_file: Path | None = None  # the ConfigMap's pinned sequences (this track's key)

    def _annotations(self) -> dict[str, str]:
        live = self.live() if self.live is not None else None
        if live is not None:
            return live
        if self.annotations_file is None:
            return {}
        try:
            return parse_downward_annotations(self.annotations_file.read_text())
        except OSError:
            return {}

    def target(self) -> str | None:
        """The pod annotation if it is a valid version name, else the ConfigMap's."""
        value = _valid(self._annotations().get(self.keys.target))
        if value is None and self.configmap_file is not None:
            try:
                value = _valid(self.configmap_file.read_text().strip())
            except OSError:
                value = None
        return value

    def previous(self) -> str | None:
        return _valid(self._annotations().get(self.keys.previous))

    def policy(self) -> TrafficPolicy | None:
        """The pod's traffic policy, ``None`` without one; raises ``InvalidPolicy`` for an
        annotation that is not one."""
        text = self._annotations().get(self.keys.traffic)
        return None if text is None else TrafficPolicy.from_annotation(text)

    def pins(self) -> dict[str, int]:
        """The publish sequences the operator pinned, by version (none: ``{}``); raises
        ``InvalidPins`` for pins that cannot be read (no pin could be told from none)."""
        texts = [self._annotations().get(self.keys.pins)]
        if self.pins_file is not None:
            try:
                texts.append(self.pins_file.read_text())
            except FileNotFoundError:  # an operator of an earlier release: no pins
                pass
            except OSError as exc:
                raise InvalidPins(f"cannot read {self.pins_file}: {exc}") from exc
        pinned: dict[str, int] = {}
        for text in texts:
            for version, sequence in (parse_pins(text) if text is not None else {}).items():
                pinned[version] = max(sequence, pinned.get(version, sequence))
        return pinned
