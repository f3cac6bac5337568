"""``<volume>/<model>/CURRENT``: the version a (re)started server loads first. Init writes
it for the version it pre-pulled, watch mode after every swap, so a server that restarts
serves what it served last, not what the pod started with.

``<volume>/<model>/TRAFFIC`` beside it: the traffic policy the server holds with that
version on a canary pod (the pod annotation's JSON), so that a restarted server loads the
stable version and the candidate under the policy before it answers anything, instead of
answering every request from the candidate (``CURRENT``) until this sidecar gives it the
stable version back. Absent when the pod has no policy in force. It is written before
``CURRENT`` names the candidate, and a server only applies a policy whose candidate is
``CURRENT``, so no crash between the two writes can leave a candidate serving alone
under a policy meant for it.
"""

from __future__ import annotations

from pathlib import Path

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.layout import CURRENT_FILE, TRAFFIC_FILE

from .volume import SafeDir

MAX_BYTES = 4096  # larger files in their place are not the sidecar's


def write_current(volume: Path, model: str, version: str) -> None:
    """Atomically, and never through a link (a link there is replaced by the file)."""
    with SafeDir.open(volume, create=True) as root, root.model_dir(model, create=True) as model_dir:
        model_dir.write_atomic(CURRENT_FILE, f"{version}\n".encode())


def read_current(volume: Path, model: str) -> str | None:
    """What ``CURRENT`` says, or ``None`` when it is absent (a link there is refused)."""
    text = _read(volume, model, CURRENT_FILE)
    return None if text is None else text.strip()


def traffic_text(policy: TrafficPolicy | None) -> str | None:
    """What ``TRAFFIC`` holds for ``policy`` (``None``: no file)."""
    return None if policy is None else policy.to_annotation() + "\n"


def write_traffic(volume: Path, model: str, policy: TrafficPolicy | None) -> None:
    """``TRAFFIC`` replaced atomically by ``policy``, or removed for ``None``; never
    through a link (a link there is replaced, or removed, itself)."""
    text = traffic_text(policy)
    with SafeDir.open(volume, create=True) as root, root.model_dir(model, create=True) as model_dir:
        if text is None:
            if model_dir.kind(TRAFFIC_FILE) is not None:
                model_dir.remove(TRAFFIC_FILE)
                model_dir.fsync()
        else:
            model_dir.write_atomic(TRAFFIC_FILE, text.encode())


def read_traffic(volume: Path, model: str) -> str | None:
    """``TRAFFIC`` as it is, or ``None`` when it is absent (a link there is refused)."""
    return _read(volume, model, TRAFFIC_FILE)


def _read(volume: Path, model: str, name: str) -> str | None:
    try:
        with SafeDir.open(volume) as root, root.model_dir(model) as model_dir:
            return model_dir.read_bytes(name, MAX_BYTES).decode(errors="replace")
    except FileNotFoundError:
        return None
