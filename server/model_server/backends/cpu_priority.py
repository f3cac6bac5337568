"""Which threads get the CPU first when every core is busy: Linux schedules each thread
by its own nice value, and a process may raise a thread's (lower its priority) but, as
pods run (no CAP_SYS_NICE), never lower it again. So work that should yield is started
on threads that lower their own priority once, for good: the ONNX Runtime cache's
builds, and (``--inference-nice``) the inference threads, so that a version loading
beside the serving one takes the CPU first (its stages are measured in
``model_server_load_stage_duration_seconds``)."""

from __future__ import annotations

import contextlib
import os
import threading


def lower_this_thread(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (lower its CPU priority), where
    the platform allows it; nothing for ``by`` <= 0."""
    if by <= 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + by)


def thread_nice() -> int | None:
    """The calling thread's nice value (None where it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return None
