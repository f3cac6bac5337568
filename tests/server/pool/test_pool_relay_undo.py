"""The pool's relay undoing a swap some workers refused, and the catch-up replay, against
scripted workers (issue 27 hostile review): every worker that moved is put back, a
version no longer held is loaded again from the file it was loaded from, and a retained
version whose directory is gone is skipped (not a restart loop)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from model_rollout_contract import control
from model_server.pool.relay import ControlRelay, WorkerLink, merged_swap
from model_server.pool.replay import replay


@dataclass
class Worker:
    """What a worker's control socket answers: a serving version, the versions held
    (``retain`` at most), loads refused or sent elsewhere, and every request asked."""

    serving: str
    held: list[str]
    retain: int = 2
    refuse: set[str] = field(default_factory=set)
    misroute: dict[str, str] = field(default_factory=dict)
    asked: list[control.Request] = field(default_factory=list)

    def status(self, model: str) -> control.StatusReply:
        return control.StatusReply(
            model, self.serving, f"sha-{self.serving}", tuple(self.held), None, True
        )

    def swap(self, model: str, to: str) -> control.SwapReply:
        before, self.serving = self.serving, to
        others = [v for v in self.held if v != to]
        self.held = [*others[len(others) - self.retain + 1 :], to]
        return control.SwapReply(model, before, to, 1.0, False)

    def answer(self, request: control.Request) -> control.Reply:
        self.asked.append(request)
        if isinstance(request, control.LoadRequest):
            if request.version in self.refuse or (
                request.path is not None and not Path(request.path).exists()
            ):
                return control.ErrorReply(f"cannot load {request.version}", "load_refused")
            return self.swap(request.model, self.misroute.get(request.version, request.version))
        if isinstance(request, control.RollbackRequest):
            if request.version not in self.held:
                return control.ErrorReply(f"{request.version} is not held", "conflict")
            assert request.version is not None
            return self.swap(request.model, request.version)
        assert isinstance(request, (control.StatusRequest, control.TrafficRequest))
        return self.status(request.model)


class ScriptedLink(WorkerLink):
    def __init__(self, index: int, worker: Worker) -> None:
        super().__init__(index, Path(f"/nonexistent/{index}.sock"))
        self.worker = worker
        self.healthy.set()

    async def ask(self, request: control.Request) -> control.Reply:
        return self.worker.answer(request)


def relay_of(*workers: Worker) -> ControlRelay:
    return ControlRelay([ScriptedLink(i, w) for i, w in enumerate(workers)], lambda k, v: None)


async def test_a_worker_that_swapped_elsewhere_is_put_back_too() -> None:
    """Worker 1 answers a load of v2 by swapping to v3: its reply is an error, but it
    moved, so it is put back with worker 0 (before: only worker 0 was, and worker 1
    served v3 for good)."""
    w0, w1 = Worker("v1", ["v1"]), Worker("v1", ["v1"], misroute={"v2": "v3"})
    reply = await relay_of(w0, w1).handle(control.LoadRequest("mlp", "v2", None, "sha-v2"))
    assert isinstance(reply, control.ErrorReply) and "not v2" in reply.error, reply
    assert (w0.serving, w1.serving) == ("v1", "v1")


async def test_undoing_a_swap_loads_a_version_no_longer_held_from_its_own_file(
    tmp_path: Path,
) -> None:
    """v1 was loaded through the relay from a file outside <model>/<version>/; a load
    of v2 that worker 1 refuses is undone on worker 0, which (retaining 1) no longer
    holds v1: it is loaded again from that file (before: with no path, so from a
    directory that has no such version)."""
    elsewhere = tmp_path / "announced" / "v1.onnx"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"model")
    w0, w1 = Worker("v0", ["v0"], retain=1), Worker("v0", ["v0"], refuse={"v2"})
    relay = relay_of(w0, w1)
    first = await relay.handle(control.LoadRequest("mlp", "v1", str(elsewhere), "sha-v1"))
    assert isinstance(first, control.SwapReply), first
    refused = await relay.handle(control.LoadRequest("mlp", "v2", None, "sha-v2"))
    assert isinstance(refused, control.ErrorReply), refused
    again = [r for r in w0.asked if isinstance(r, control.LoadRequest) and r.version == "v1"]
    assert [r.path for r in again] == [str(elsewhere)] * 2
    assert w0.serving == "v1"


async def test_the_replay_skips_a_retained_version_whose_directory_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A retained version the sidecar has removed since cannot be loaded again: skipped
    with a log line, the rest given (before: the replay failed, the worker was restarted
    and failed again, for ever)."""
    files = {}
    for version in ("v2", "v3"):
        files[version] = tmp_path / "mlp" / version / "model.onnx"
        files[version].parent.mkdir(parents=True)
        files[version].write_bytes(b"model")
    gone = tmp_path / "mlp" / "v1" / "model.onnx"

    def held(version: str, path: Path) -> dict[str, str]:
        return {"version": version, "path": str(path), "sha256": f"sha-{version}"}

    state = {
        "mlp": {
            "serving": held("v3", files["v3"]),
            "retained": [held("v1", gone), held("v2", files["v2"])],
            "policy": None,
        }
    }
    worker = Worker("v0", ["v0"], retain=3)
    with caplog.at_level(logging.WARNING, logger="model_server.pool.replay"):
        await replay(state, ScriptedLink(0, worker))
    loads = [r.version for r in worker.asked if isinstance(r, control.LoadRequest)]
    assert loads == ["v2", "v3"] and worker.serving == "v3"
    assert any("v1" in r.getMessage() and str(gone) in r.getMessage() for r in caplog.records)


def test_a_pools_swap_reply_gives_the_slowest_workers_duration_and_its_stages() -> None:
    fast = control.SwapReply("m", "v1", "v2", 10.0, False, (("read", 4.0), ("other", 6.0)))
    slow = control.SwapReply("m", "v1", "v2", 30.0, False, (("read", 20.0), ("other", 10.0)))
    merged = merged_swap([fast, slow])
    assert isinstance(merged, control.SwapReply)
    assert (merged.duration_ms, merged.stages_ms) == (30.0, slow.stages_ms)
