"""Issue 13, "Sidecar behaviour": ``CURRENT`` follows every swap, every failure reaches the
report with its own code (none is left at fetching or loading), the report's heartbeat,
storm controls (start jitter, backoff across cycles, a download limit that holds),
retention, and credentials redacted from logs and status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_contract import server_codes
from model_rollout_contract.annotations import SIDECAR_STATUS
from model_rollout_contract.control import BUSY, StatusReply, encode
from model_rollout_contract.redact import redact
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_e2e.processes import free_port
from model_rollout_e2e.seaweed import SeaweedFS
from model_server.app import SERVER, ModelServer
from model_server.config import ModelSpec, ServerConfig
from model_server.errors import LoadRefused, ServingError
from model_sidecar.config import parse_args
from model_sidecar.control_client import ServerControl
from model_sidecar.current import read_current
from model_sidecar.init_mode import pre_pull
from model_sidecar.publish import publish
from model_sidecar.redact import install_log_redaction
from model_sidecar.retry import Backoff
from model_sidecar.status import StatusReporter
from model_sidecar.store import LocalStore, S3Store
from tests.support.sidecar import (
    Keys,
    downloads_left,
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    read_status,
    set_target,
    sidecar_cli,
    start_server,
)


async def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


def local_versions(tmp_path: Path, seeds: dict[str, int], **dims: int) -> tuple[LocalStore, Keys]:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, seeds, **dims)
    return store, keys


# --- CURRENT follows the swaps ------------------------------------------------------


async def test_every_swap_updates_current_so_a_restarted_server_serves_it(
    tmp_path: Path,
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    fetcher = make_fetcher(store, keys, volume)
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, tmp_path / "a.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "a.sock", podinfo, tmp_path / "status.json")
        set_target(podinfo, "v1")
        assert await watcher.step() == "ok"
        set_target(podinfo, "v2")
        assert await watcher.step() == "ok"
        assert read_current(volume, "mlp") == "v2"
        set_target(podinfo, "v1")  # a rollback: a pointer swap to the retained version
        assert await watcher.step() == "ok"
        assert read_current(volume, "mlp") == "v1"
        set_target(podinfo, "v2")
        assert await watcher.step() == "ok"
    finally:
        await server.close()
    restarted = await start_server(volume, tmp_path / "b.sock")  # the server crashed
    try:
        assert (await ServerControl(tmp_path / "b.sock").status("mlp")).version == "v2"
        (volume / "mlp" / "CURRENT").write_text("v1\n")  # changed behind the sidecar's back
        watcher.control = ServerControl(tmp_path / "b.sock")
        assert await watcher.step() == "ok"
        assert read_current(volume, "mlp") == "v2"  # put right on the next cycle
    finally:
        await restarted.close()


async def test_a_rollback_reports_the_versions_digest_so_the_next_cycle_is_no_news(
    tmp_path: Path,
) -> None:
    """A pointer swap back to a retained version reports its sha256 at once, as every
    later cycle does: otherwise the next cycle's report differs and each pod patches its
    annotation once more after every rollback (1000 writes at 1000 pods)."""
    store, keys = local_versions(tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo, status = tmp_path / "volume", tmp_path / "annotations", tmp_path / "s.json"
    fetcher = make_fetcher(store, keys, volume)
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, tmp_path / "a.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "a.sock", podinfo, status)
        for version in ("v1", "v2", "v1"):  # the last: a rollback, a pointer swap
            set_target(podinfo, version)
            assert await watcher.step() == "ok"
        swapped = SidecarReport.from_json(status.read_text())
        assert await watcher.step() == "ok"  # the next cycle, nothing changed
        next_cycle = SidecarReport.from_json(status.read_text())
    finally:
        await server.close()
    assert swapped is not None and swapped.serving == "v1" and swapped.sha256
    assert swapped.same_as(next_cycle)


# --- every failure is reported ------------------------------------------------------


@contextlib.asynccontextmanager
async def stand_in_server(
    path: Path, answer: Callable[[dict[str, object]], Awaitable[bytes]]
) -> AsyncIterator[None]:
    """A control-socket peer that misbehaves as told (the sidecar is what is tested)."""
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            writer.write(await answer(json.loads(await reader.readline())))
            await writer.drain()
        finally:
            writer.close()
            handlers.discard(task)

    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await server.wait_closed()


def serving_v1(request: dict[str, object]) -> bytes | None:
    """A peer that serves v1 and answers status (and traffic, with a status) well."""
    if request["op"] in ("status", "traffic"):
        return encode(StatusReply("mlp", "v1", None, ("v1",)))
    return None


async def never_loads(request: dict[str, object]) -> bytes:
    answer = serving_v1(request)
    if answer is None:
        await asyncio.Event().wait()  # a load that never finishes
    assert answer is not None
    return answer


async def answers_garbage(request: dict[str, object]) -> bytes:
    return serving_v1(request) or b"<html>" + b"x" * 70_000 + b"</html>\n"


async def answers_not_json(request: dict[str, object]) -> bytes:
    return serving_v1(request) or b"Internal Server Error\n"


@pytest.mark.parametrize(
    "peer, code",
    [
        (never_loads, "load_timeout"),
        (answers_garbage, "protocol_error"),
        (answers_not_json, "protocol_error"),
    ],
)
async def test_a_server_that_misbehaves_is_reported_not_left_at_loading(
    tmp_path: Path, peer: Callable[[dict[str, object]], Awaitable[bytes]], code: str
) -> None:
    store, keys = local_versions(tmp_path, {"v2": 2})
    podinfo, status_file = tmp_path / "annotations", tmp_path / "status.json"
    set_target(podinfo, "v2")
    async with stand_in_server(tmp_path / "ctl.sock", peer):
        watcher = make_watcher(
            make_fetcher(store, keys, tmp_path / "volume"),
            tmp_path / "ctl.sock",
            podinfo,
            status_file,
            load_timeout_s=0.5,
        )
        assert await watcher.step() == "error"
    status = read_status(status_file)
    assert (status["state"], status["code"], status["serving"]) == ("error", code, "v1"), status
    assert status["reason"].startswith(f"{code}: ")


def without_permission_overrides() -> list[str]:
    """As root, drop the capabilities that ignore file permissions (setpriv), so that a
    socket of mode 000 is refused as it is to any other user."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


async def test_a_control_socket_without_permission_is_reported(tmp_path: Path) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1})
    volume, podinfo, status_file = tmp_path / "volume", tmp_path / "annotations", tmp_path / "s"
    set_target(podinfo, "v1")
    server = await start_server(volume, tmp_path / "ctl.sock")
    os.chmod(tmp_path / "ctl.sock", 0)
    watch = subprocess.Popen(
        [
            *without_permission_overrides(), sys.executable, "-m", "model_sidecar", "watch",
            "--store", f"file://{store.root}", "--volume", str(volume), "--model", "mlp",
            "--public-key", str(keys.public), "--annotations-file", str(podinfo),
            "--control-socket", str(tmp_path / "ctl.sock"), "--status-file", str(status_file),
            "--poll-seconds", "0.1", "--start-jitter-seconds", "0",
            "--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        await until(lambda: status_file.exists() and read_status(status_file)["state"] == "error")
        status = read_status(status_file)
        assert status["code"] == "control_denied" and "Permission denied" in status["reason"]
    finally:
        watch.terminate()
        _, stderr = watch.communicate(timeout=30)
        await server.close()
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr


# --- the heartbeat --------------------------------------------------------------------


async def test_an_unchanged_report_is_rewritten_once_the_heartbeat_is_due(
    tmp_path: Path,
) -> None:
    path = tmp_path / "status.json"
    reporter = StatusReporter(path, heartbeat_s=3600)
    report = SidecarReport("mlp", "v1", "v1", SidecarState.OK)
    await reporter.report(report)
    first = read_status(path)["updated_at"]
    await reporter.report(report)
    await reporter.heartbeat()
    assert read_status(path)["updated_at"] == first  # not due: nothing written
    reporter.heartbeat_s = 0.0
    await reporter.heartbeat()
    assert read_status(path)["updated_at"] > first


class AnnotationCounter:
    """A pod's API as far as the reporter uses it: each annotation patch counted."""

    def __init__(self) -> None:
        self.patches: list[dict[str, str]] = []

    async def annotate(self, annotations: dict[str, str]) -> None:
        self.patches.append(annotations)


async def test_a_heartbeat_refreshes_the_file_but_patches_the_pod_only_for_news(
    tmp_path: Path,
) -> None:
    """An idle pod costs the API server no writes (issue 28: 0 idle writes): the
    heartbeat keeps the status file's ``updated_at`` fresh, and the pod's annotation is
    patched again only when the report says something new."""
    path, pod = tmp_path / "status.json", AnnotationCounter()
    reporter = StatusReporter(path, pod, heartbeat_s=0.0)  # type: ignore[arg-type]
    report = SidecarReport("mlp", "v1", "v1", SidecarState.OK)
    await reporter.report(report)
    first = read_status(path)["updated_at"]
    for _ in range(3):
        await reporter.heartbeat()
        await reporter.report(report)
    assert read_status(path)["updated_at"] > first
    assert len(pod.patches) == 1
    await reporter.report(SidecarReport("mlp", "v2", "v1", SidecarState.LOADING))
    assert len(pod.patches) == 2
    assert json.loads(pod.patches[-1][SIDECAR_STATUS])["state"] == "loading"


async def test_the_watch_loop_keeps_the_report_fresh_between_cycles(tmp_path: Path) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1})
    volume, podinfo, status_file = tmp_path / "volume", tmp_path / "annotations", tmp_path / "s"
    set_target(podinfo, "v1")
    fetcher = make_fetcher(store, keys, volume)
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, tmp_path / "ctl.sock")
    watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, status_file)
    watcher.settings.poll_s = 3600.0  # one cycle, then only heartbeats
    watcher.reporter.heartbeat_s = 0.05
    stop = asyncio.Event()
    running = asyncio.create_task(watcher.run(stop))
    try:
        await until(lambda: status_file.exists())
        seen = {read_status(status_file)["updated_at"]}
        await until(lambda: len(seen | {read_status(status_file)["updated_at"]}) > 1)
        status = read_status(status_file)
        assert (status["state"], status["serving"]) == ("ok", "v1")
    finally:
        stop.set()
        await running
        await server.close()


# --- storm controls -----------------------------------------------------------------


def test_init_pauses_before_its_first_store_request_unless_the_version_is_there(
    tmp_path: Path,
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1})

    def init() -> subprocess.CompletedProcess[str]:
        return sidecar_cli(
            "init", "--store", f"file://{store.root}", "--volume", str(tmp_path / "volume"),
            "--model", "mlp", "--public-key", str(keys.public), "--version", "v1",
            "--previous", "v1", "--start-jitter-seconds", "0.3",
        )  # fmt: skip

    first = init()
    assert first.returncode == 0, first.stderr
    pause = re.search(
        r"start jitter: waiting ([0-9.]+) s before the first store request", first.stderr
    )
    assert pause is not None and 0 <= float(pause.group(1)) <= 0.3
    again = init()  # a restarted pod: everything is on the volume, nothing to spread
    assert again.returncode == 0 and "start jitter" not in again.stderr


async def test_watch_pauses_before_its_first_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1})
    watcher = make_watcher(
        make_fetcher(store, keys, tmp_path / "volume"),
        tmp_path / "ctl.sock",
        tmp_path / "annotations",
        tmp_path / "s",
    )
    watcher.settings.start_jitter_s = 0.2
    caplog.set_level(logging.INFO)
    await watcher.start(asyncio.Event())
    pause = re.search(r"start jitter: waiting ([0-9.]+) s before the first poll", caplog.text)
    assert pause is not None and 0 <= float(pause.group(1)) <= 0.2


async def test_failed_cycles_back_off_up_to_the_max_and_a_good_one_resets(
    tmp_path: Path,
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1})
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    set_target(podinfo, "v1")
    fetcher = make_fetcher(store, keys, volume)
    watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "s")
    watcher.settings.poll_s, watcher.settings.jitter_s = 0.05, 0.0
    watcher.settings.backoff = backoff = Backoff(base_s=0.1, max_s=0.8)
    for failed in range(1, 7):  # no server yet: every cycle fails
        assert await watcher.step() == "error"
        assert watcher.failures == failed
        delays = [watcher.next_delay() for _ in range(200)]
        assert all(0.05 <= d <= max(0.05, backoff.cap(failed - 1)) for d in delays)
    assert backoff.cap(watcher.failures - 1) == 0.8
    assert max(delays) > 0.4  # the longer waits are really drawn, up to the max
    assert read_status(tmp_path / "s")["code"] == "server_unavailable"
    await fetcher.fetch("mlp", "v1")
    server = await start_server(volume, tmp_path / "ctl.sock")
    try:
        assert await watcher.step() == "ok"
        assert watcher.failures == 0 and watcher.next_delay() == 0.05
    finally:
        await server.close()


def test_a_download_limit_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["init", "--store", "file:///s", "--volume", "/v", "--model", "m", "--allow-unsigned"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--max-concurrent-downloads", "0"])
    assert "not at least 1" in capsys.readouterr().err
    config = parse_args([*base, "--max-concurrent-downloads", "2", "--backoff-max-seconds", "9"])
    assert config.fetch.max_concurrent_downloads == 2  # type: ignore[union-attr]
    assert config.fetch.backoff_max_seconds == 9.0  # type: ignore[union-attr]


class ThrottledProxy:
    """A TCP forwarder to S3 that sends each response slowly (about 0.6 MB/s a
    connection), so that downloads overlap for long enough to be seen."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ThrottledProxy:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            try:
                while data := await src.read(16384):
                    dst.write(data)
                    await dst.drain()
                    if slow:
                        await asyncio.sleep(0.025)
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


@pytest.mark.s3
async def test_the_download_limit_holds_even_for_a_cancelled_fetch(
    s3_env: SeaweedFS, tmp_path: Path
) -> None:
    s3_env.create_bucket("models")
    prefix = f"team-{uuid.uuid4().hex[:10]}"
    direct = S3Store("models", prefix, endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")
    publish_versions(direct, keys, tmp_path, {"v1": 1, "v2": 2, "v3": 3}, hidden=400, depth=4)
    async with ThrottledProxy(int(s3_env.endpoint.rsplit(":", 1)[1])) as proxy:
        slow = S3Store("models", prefix, endpoint_url=proxy.endpoint)
        one = make_fetcher(slow, keys, tmp_path / "one", max_concurrent_downloads=1)
        cancelled = asyncio.create_task(one.fetch("mlp", "v1"))
        await until(lambda: one.downloading == 1)
        cancelled.cancel()
        await one.fetch("mlp", "v2")  # waits for the cancelled transfer's thread to stop
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert one.most_downloading == 1 and one.downloading == 0
        assert not (tmp_path / "one" / "mlp" / "v1").exists()
        assert downloads_left(tmp_path / "one") == []

        two = make_fetcher(slow, keys, tmp_path / "two", max_concurrent_downloads=2)
        results = await asyncio.gather(*(two.fetch("mlp", v) for v in ("v1", "v2", "v3")))
        assert all(r.downloaded_bytes > 0 for r in results)
        assert two.most_downloading == 2  # side by side, and never more


async def test_init_fetches_target_and_previous_side_by_side_within_the_limit(
    tmp_path: Path,
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1, "v2": 2})
    fetcher = make_fetcher(store, keys, tmp_path / "volume", max_concurrent_downloads=2)
    assert await pre_pull(fetcher, "mlp", "v2", None) == 0
    assert sorted(p.name for p in (tmp_path / "volume" / "mlp").iterdir() if p.is_dir()) == [
        "v1",
        "v2",
    ]
    assert 1 <= fetcher.most_downloading <= 2


# --- retention ----------------------------------------------------------------------


async def test_retention_keeps_the_previous_good_version_and_deletes_refused_ones(
    tmp_path: Path,
) -> None:
    store, keys = local_versions(tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    broken = tmp_path / "broken.bin"
    broken.write_bytes(os.urandom(4096))  # signed and intact, but no model the server loads
    publish(store, "mlp", "v9", broken, keys.private)
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    fetcher = make_fetcher(store, keys, volume)
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "s")
        outcomes = []
        for version in ("v1", "v2", "v9", "v3"):
            set_target(podinfo, version)
            outcomes.append(await watcher.step())
            if version == "v9":
                assert read_status(tmp_path / "s")["code"] == "server_refused"
                assert not (volume / "mlp" / "v9").exists()  # deleted at once
        assert outcomes == ["ok", "ok", "refused", "ok"]
        on_disk = sorted(p.name for p in (volume / "mlp").iterdir() if p.is_dir())
        assert on_disk == ["v2", "v3"]  # keep 2: the serving one and the previous good one
    finally:
        await server.close()


# --- the server's transient answers (issue 13 follow-up) ---------------------------


def _server_error_classes() -> list[type[ServingError]]:
    found, todo = [], [ServingError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_every_server_error_code_is_judged_permanent_or_transient() -> None:
    codes = {cls.code for cls in _server_error_classes()} | {BUSY}
    assert codes == server_codes.PERMANENT | server_codes.TRANSIENT
    assert not server_codes.PERMANENT & server_codes.TRANSIENT
    assert LoadRefused.code == server_codes.REFUSED_BYTES
    for transient in ("conflict", "unavailable", "memory_budget_exceeded"):
        assert not server_codes.is_permanent(transient)


async def test_a_transient_answer_to_a_load_keeps_the_download_and_is_retried(
    tmp_path: Path,
) -> None:
    """With --retain 1 and a budget of two and a half versions, v1 and v2 are each still
    running a request when v3 is announced: the real server answers
    memory_budget_exceeded, which passes when the requests end. The verified download
    stays and the next cycle loads it (it used to be deleted and refused)."""
    store, keys = local_versions(tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    volume, podinfo, socket = tmp_path / "volume", tmp_path / "annotations", tmp_path / "c.sock"
    fetcher = make_fetcher(store, keys, volume)
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    one = (volume / "mlp" / "v1" / "model.onnx").stat().st_size * 2  # ONNX Runtime's estimate
    config = ServerConfig(
        repository=volume, models=[ModelSpec("mlp")], control_socket=socket, retain=1,
        memory_budget_mb=one * 2.5 / 2**20,
    )  # fmt: skip
    server = TestClient(TestServer(ModelServer(config).make_app()))
    await server.start_server()
    try:
        slot = server.app[SERVER].manager.slot("mlp")
        watcher = make_watcher(fetcher, socket, podinfo, tmp_path / "s")
        with slot.pin():  # a long request on v1
            set_target(podinfo, "v2")
            assert await watcher.step() == "ok"
            with slot.pin():  # and one on v2
                set_target(podinfo, "v3")
                assert await watcher.step() == "error"
                status = read_status(tmp_path / "s")
                assert (status["state"], status["code"]) == (
                    "error",
                    "server_memory_budget_exceeded",
                )
                assert status["serving"] == "v2"
                assert fetcher.verified_local("mlp", "v3") is not None  # kept, verified
        received = fetcher.received_bytes
        assert await watcher.step() == "ok"  # the requests ended: the retry loads it
        assert read_status(tmp_path / "s")["serving"] == "v3"
        assert fetcher.received_bytes == received  # from the volume, not downloaded again
    finally:
        await server.close()


# --- credentials in URLs ------------------------------------------------------------


def test_credentials_in_the_endpoint_are_redacted_from_the_logs(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    endpoint = f"http://ops:hunter2@127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    proc = subprocess.run(
        [
            sys.executable, "-m", "model_sidecar", "init", "--store", "s3://models/team",
            "--s3-endpoint", endpoint, "--volume", str(tmp_path / "volume"), "--model", "mlp",
            "--public-key", str(keys.public), "--version", "v1", "--previous", "v1",
            "--retries", "2", "--start-jitter-seconds", "0", "--backoff-base-seconds", "0.01",
        ],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "hunter2" not in proc.stderr and "ops:" not in proc.stderr
    assert "http://***@127.0.0.1" in proc.stderr


async def test_credentials_in_the_endpoint_are_redacted_from_the_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    keys = make_keys(tmp_path / "keys")
    store = S3Store("models", "team", endpoint_url=f"http://ops:hunter2@127.0.0.1:{free_port()}")
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    set_target(podinfo, "v1")
    server = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(
            make_fetcher(store, keys, volume), tmp_path / "ctl.sock", podinfo, tmp_path / "s"
        )
        assert await watcher.step() == "error"
    finally:
        await server.close()
    status = (tmp_path / "s").read_text()
    assert json.loads(status)["code"] == "store_unreachable"
    assert "hunter2" not in status and "http://***@127.0.0.1" in status


def test_log_lines_of_any_logger_are_redacted(tmp_path: Path) -> None:
    assert redact("GET https://a:b@h/x and s3://k@h2/y") == "GET https://***@h/x and s3://***@h2/y"
    assert (
        redact("https://host/path?x=1 user@example.com") == "https://host/path?x=1 user@example.com"
    )
    log_file = tmp_path / "log"
    handler = logging.FileHandler(log_file)
    install_log_redaction([handler])
    logger = logging.getLogger("redaction-test")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("sending to %s", "http://u:pw@h:9/b")
        try:
            raise RuntimeError("connect http://u:pw@h:9/b failed")
        except RuntimeError:
            logger.exception("boom")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = log_file.read_text()
    assert "u:pw" not in text and text.count("http://***@h:9/b") == 3  # message, source, error
