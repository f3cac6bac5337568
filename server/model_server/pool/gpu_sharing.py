"""Whether the processes of a pool that share a GPU run under CUDA MPS.

Without MPS the GPU gives each process's context a time slice in turn, so one worker's
CUDA graph replay waits out the others' slices and the server's time per request grows
several-fold (docs/benchmarks.md, "The GPU path"). The server cannot start MPS itself
(its control daemon is one per GPU node, run by the NVIDIA device plugin's MPS sharing
or by hand), so the pool says so at start instead."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # CUDA's default; CUDA_MPS_PIPE_DIRECTORY names another
GPU_BACKENDS = frozenset({"torch", "tensorrt"})


def mps_control_pipe(environ: Mapping[str, str] = os.environ) -> Path:
    """The pipe a CUDA client uses to reach the MPS control daemon."""
    return Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY) / "control"


def mps_daemon_answers(pipe: Path, timeout_s: float = 0.5) -> bool:
    """Whether an MPS control daemon accepts a connection on ``pipe`` (a seqpacket
    socket; one that sends nothing is logged by the daemon and dropped): the socket file
    outlives a daemon told to quit, so its presence proves nothing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect(str(pipe))
        except BlockingIOError:  # EAGAIN: listening, its queue full (busy, not absent)
            return True
        except OSError:  # refused (quit), no such file, not a socket, ...
            return False
        return True


def has_gpu(dev: Path = Path("/dev")) -> bool:
    return any(dev.glob("nvidia[0-9]*"))


def pool_without_mps_warning(
    backend: str,
    processes: int,
    environ: Mapping[str, str] = os.environ,
    dev: Path = Path("/dev"),
) -> str | None:
    """What to log when ``processes`` workers of a GPU backend will share a GPU without
    MPS; None when they will not (one process, a CPU backend, no GPU, MPS reachable)."""
    if processes < 2 or backend not in GPU_BACKENDS or not has_gpu(dev):
        return None
    pipe = mps_control_pipe(environ)
    if mps_daemon_answers(pipe):
        return None
    return (
        f"{processes} {backend} workers will share the GPU without CUDA MPS (no daemon "
        f"answers at {pipe}): the GPU time-slices their contexts, so each request waits for the "
        "others' slices; run the pod with MPS (the NVIDIA device plugin's sharing.mps) "
        "or with one process"
    )
