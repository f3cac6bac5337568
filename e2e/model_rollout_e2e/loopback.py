"""Each simulated pod gets an IP of its own, as in a cluster: an address of the loopback
range 127.0.0.0/8 (all of it reaches this machine on Linux), so that every pod's server
listens on the pod spec's own port (8000), and the operator reads ``podIP:8000`` exactly
as it does in a cluster."""

from __future__ import annotations

import random
import socket
import threading

_lock = threading.Lock()
_handed_out: set[str] = set()  # by this process: never the same address twice at once
_rng = random.Random()


def _free(address: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:  # in use (another test run, another pod), or in TIME_WAIT
            return False
    return True


def allocate(port: int) -> str:
    """A loopback address (never 127.0.0.1) on which ``port`` is free now."""
    with _lock:
        start = _rng.randrange(1 << 16)  # concurrent test runs start far apart
        for i in range(1 << 16):
            n = (start + i) % (1 << 16)
            address = f"127.0.{n >> 8}.{n & 0xFF}"
            if n & 0xFF in (0, 1, 255) or address in _handed_out:
                continue
            if _free(address, port):
                _handed_out.add(address)
                return address
    raise RuntimeError(f"no loopback address with port {port} free")


def release(address: str) -> None:
    with _lock:
        _handed_out.discard(address)
