"""``<volume>/<model>/CURRENT``: the version a (re)started server loads first. Init writes
it for the version it pre-pulled, watch mode after every swap, so a server that restarts
serves what it served last, not what the pod started with."""

from __future__ import annotations

from pathlib import Path

from model_rollout_contract.layout import CURRENT_FILE

from .volume import SafeDir


def write_current(volume: Path, model: str, version: str) -> None:
    """Atomically, and never through a link (a link there is replaced by the file)."""
    with SafeDir.open(volume, create=True) as root, root.child(model, create=True) as model_dir:
        model_dir.write_atomic(CURRENT_FILE, f"{version}\n".encode())


def read_current(volume: Path, model: str) -> str | None:
    """What ``CURRENT`` says, or ``None`` when it is absent (a link there is refused)."""
    try:
        with SafeDir.open(volume) as root, root.child(model) as model_dir:
            return model_dir.read_bytes(CURRENT_FILE, 1024).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
