"""A pool of GPU workers says at start when no CUDA MPS daemon answers: without one the
GPU time-slices the workers' contexts (on the H200, 8 torch workers served 4750 requests
a second at 1.9 ms each in the server; under MPS 6900 at 0.43 ms). The daemon is stood in
for by a seqpacket socket listening where CUDA looks, as the real one does."""

from __future__ import annotations

import logging
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_server.config import parse_args
from model_server.pool import supervisor as pool
from model_server.pool.gpu_sharing import (
    mps_control_pipe,
    mps_daemon_answers,
    pool_without_mps_warning,
)


@pytest.fixture
def pipe_dir() -> Iterator[Path]:
    """A directory short enough for a Unix socket's path."""
    with tempfile.TemporaryDirectory(prefix="mps-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    """A /dev with one GPU in it."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    (tmp_path / "dev" / "nvidiactl").touch()
    return tmp_path / "dev"


def listening(pipe_dir: Path, backlog: int = 8) -> socket.socket:
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    daemon.bind(str(pipe_dir / "control"))
    daemon.listen(backlog)
    return daemon


def test_a_gpu_pool_without_a_daemon_is_told_where_cuda_looked(pipe_dir: Path, dev: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    warning = pool_without_mps_warning("torch", 8, env, dev)
    assert warning is not None
    assert "8 torch workers" in warning and str(pipe_dir / "control") in warning


def test_a_listening_daemon_silences_it(pipe_dir: Path, dev: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    with listening(pipe_dir):
        assert mps_daemon_answers(pipe_dir / "control")
        assert pool_without_mps_warning("tensorrt", 4, env, dev) is None


def test_the_socket_a_quit_daemon_leaves_behind_does_not(pipe_dir: Path, dev: Path) -> None:
    """Seen on the H200: ``echo quit | nvidia-cuda-mps-control`` leaves ``control`` in
    place, so a check of the file alone took a stopped daemon for a running one."""
    listening(pipe_dir).close()
    assert (pipe_dir / "control").exists()
    assert not mps_daemon_answers(pipe_dir / "control")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    assert pool_without_mps_warning("torch", 2, env, dev) is not None


def test_cuda_default_pipe_directory_is_used_when_none_is_set() -> None:
    """(Not probed: a GPU host may run a daemon there.)"""
    assert mps_control_pipe({}) == Path("/tmp/nvidia-mps/control")
    assert mps_control_pipe({"CUDA_MPS_PIPE_DIRECTORY": ""}) == Path("/tmp/nvidia-mps/control")


@pytest.mark.parametrize(
    ("backend", "processes", "gpus"),
    [("torch", 1, True), ("onnxruntime", 8, True), ("torch", 8, False)],
    ids=["one process", "cpu backend", "no gpu"],
)
def test_nothing_to_say_where_no_gpu_is_shared(
    tmp_path: Path, pipe_dir: Path, backend: str, processes: int, gpus: bool
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    if gpus:
        (dev / "nvidia0").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    assert pool_without_mps_warning(backend, processes, env, dev) is None


def test_the_pool_logs_it_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    said: list[tuple[str, int]] = []

    def warning(backend: str, processes: int) -> str:
        said.append((backend, processes))
        return "no MPS here"

    async def ran(self: pool.Pool) -> int:
        return 0

    monkeypatch.setattr(pool, "pool_without_mps_warning", warning)
    monkeypatch.setattr(pool.Pool, "run", ran)
    argv = ["--repository", str(tmp_path), "--model", "m", "--backend", "torch"]
    config = parse_args([*argv, "--processes", "3"])
    with caplog.at_level(logging.WARNING, logger="model_server.pool.supervisor"):
        assert pool.run_pool(config, argv) == 0
    assert said == [("torch", 3)]
    assert "pool: no MPS here" in caplog.text


def test_a_daemon_whose_queue_is_full_still_answers(pipe_dir: Path) -> None:
    """A review found it: with a timeout set, a connect to a listener whose backlog is
    full fails at once with EAGAIN, which read as no daemon at all."""
    with listening(pipe_dir, backlog=0) as daemon:
        queued = []
        for _ in range(4):  # fill the backlog (the kernel's "0" holds one or two)
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            waiting.setblocking(False)
            try:
                waiting.connect(str(pipe_dir / "control"))
            except BlockingIOError:
                waiting.close()
                break
            queued.append(waiting)
        else:
            pytest.fail("the backlog never filled")
        assert mps_daemon_answers(pipe_dir / "control")
        for waiting in queued:
            waiting.close()
        assert daemon.fileno() >= 0
