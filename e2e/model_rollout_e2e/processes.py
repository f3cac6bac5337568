"""Start and stop the project's programs as real child processes (as a kubelet would)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL the child when the thread that started it ends (the test
    process dies), so no run leaves a process behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class ChildProcess:
    """A Python module run as ``python -m module args``, its output sent to a log file."""

    def __init__(
        self, module: str, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.module = module
        self.args = list(args)
        self.log_path = log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run_to_end(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServerProcess(ChildProcess):
    def __init__(
        self,
        repository: Path,
        models: Sequence[str],
        log_path: Path,
        port: int | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        args = ["--repository", str(repository), "--port", str(self.port)]
        for model in models:
            args += ["--model", model]
        super().__init__("model_server", [*args, *extra], log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Block until /v2/health/ready answers 200; returns the seconds it took."""
        started = time.monotonic()

        def ready() -> bool:
            if not self.running():
                raise RuntimeError(f"server exited:\n{self.log_tail()}")
            return http_ok(f"{self.url}/v2/health/ready")

        wait_until(ready, timeout_s, what=f"server on port {self.port}")
        return time.monotonic() - started
