"""The server loads exactly the bytes it hashed (issue 13): a model file or a version
directory swapped while the server loads never makes it serve weights other than those
of the digest it reports, no link below the repository is followed, and a version it
already holds is swapped to only after the same checks as a load."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from aiohttp.test_utils import TestClient

from model_server.app import ModelServer
from tests.support.server import Version, add_version, ask, infer_body, output_of

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
LOADS = 40


@contextmanager
def swapping(swap: Callable[[int], None]) -> Iterator[list[int]]:
    """Run ``swap(i)`` for i = 0, 1, 2, … on a thread until the block ends."""
    stop, done = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            swap(done[0])
            done[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join()


def replace_with_link(source: Path, target: Path) -> None:
    """Make ``target`` the inode of ``source`` in one rename (a hard link)."""
    staged = target.with_name(f".{target.name}.{source.parent.name}")
    staged.unlink(missing_ok=True)
    os.link(source, staged)
    os.replace(staged, target)


def replace_with_symlink(points_to: Path, link: Path, tag: str) -> None:
    staged = link.with_name(f".{link.name}.{tag}")
    staged.unlink(missing_ok=True)
    os.symlink(points_to, staged)
    os.replace(staged, link)


async def served(client: TestClient) -> tuple[np.ndarray, str]:
    """The serving version's output for ``X`` and the digest health reports for it."""
    answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
    health = await (await client.get("/v1/models/mlp/health")).json()
    assert health["version"] == answer["model_version"]
    return output_of(answer), health["sha256"]


async def swapped_past(swaps: list[int], count: int) -> None:
    """Wait until the swapping thread has swapped more than ``count`` times, so every load
    meets a link changed since the last one, however busy the machine is."""
    while swaps[0] <= count:
        await asyncio.sleep(0.001)


def weights_of(versions: dict[str, Version], output: np.ndarray) -> list[str]:
    return [n for n, v in versions.items() if np.allclose(output, v.expected(X), atol=1e-4)]


async def test_a_file_swapped_during_loads_never_serves_other_weights(
    client: TestClient, repo, server_config
) -> None:
    _, versions = repo
    good, other = versions["v2"], versions["v3"]
    target = good.path.parent.parent / "race" / "model.onnx"
    target.parent.mkdir()
    sources = (good.path, other.path)
    replace_with_link(good.path, target)
    loaded, mismatched = 0, []
    with swapping(lambda i: replace_with_link(sources[i % 2], target)) as swaps:
        for i in range(LOADS):
            await swapped_past(swaps, i)
            answer = await ask(
                server_config.control_socket,
                {"op": "load", "model": "mlp", "version": f"r{i}", "path": str(target),
                 "sha256": good.sha256},
            )  # fmt: skip
            if not answer["ok"]:
                assert "sha256" in answer["error"], answer  # it read the other file: refused
                continue
            loaded += 1
            output, digest = await served(client)
            if digest != good.sha256 or weights_of(versions, output) != ["v2"]:
                mismatched.append((i, digest, weights_of(versions, output)))
    assert swaps[0] >= LOADS  # the file really changed under the loads
    assert 0 < loaded < LOADS, loaded  # both files were read: the race was on
    assert mismatched == []


async def test_a_directory_link_swapped_during_loads_never_loads_from_outside(
    client: TestClient, model_server: ModelServer, repo, server_config, tmp_path: Path
) -> None:
    root, versions = repo
    inside = root / "mlp" / "v2"
    outside = add_version(tmp_path / "elsewhere", "mlp", "v9", seed=9)
    link = root / "mlp" / "rdir"
    targets = (inside, outside.path.parent)
    replace_with_symlink(inside, link, "0")
    answers = []
    with swapping(lambda i: replace_with_symlink(targets[i % 2], link, str(i % 2))) as swaps:
        for i in range(LOADS):
            await swapped_past(swaps, i)
            answers.append(
                await ask(
                    server_config.control_socket,
                    {
                        "op": "load",
                        "model": "mlp",
                        "version": f"d{i}",
                        "path": str(link / "model.onnx"),
                        "sha256": outside.sha256,
                    },
                )
            )
    assert swaps[0] >= LOADS
    assert [a for a in answers if a["ok"]] == []
    assert {a["code"] for a in answers} == {"forbidden"}, answers
    assert all("symbolic link" in a["error"] for a in answers), answers
    output, digest = await served(client)
    assert weights_of(versions, output) == ["v1"] and digest == versions["v1"].sha256


async def test_links_below_the_repository_are_refused(
    client: TestClient, model_server: ModelServer, repo, server_config, tmp_path: Path
) -> None:
    root, versions = repo
    outside = add_version(tmp_path / "elsewhere", "mlp", "v9", seed=9)
    (root / "mlp" / "out").symlink_to(outside.path.parent)  # a version directory outside
    (root / "mlp" / "in").symlink_to(root / "mlp" / "v2")  # and one inside: not followed
    (root / "mlp" / "file").mkdir()
    (root / "mlp" / "file" / "model.onnx").symlink_to(versions["v3"].path)
    fifo = root / "mlp" / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.onnx")  # never blocks the load: refused as not a regular file
    for version, reason in (
        ("out", "symbolic link"),
        ("in", "symbolic link"),
        ("file", "symbolic link"),
        ("fifo", "not a regular file"),
    ):
        path = root / "mlp" / version / "model.onnx"
        answer = await ask(
            server_config.control_socket,
            {"op": "load", "model": "mlp", "version": version, "path": str(path),
             "sha256": outside.sha256},
        )  # fmt: skip
        assert (answer["ok"], answer["code"]) == (False, "forbidden"), (version, answer)
        assert reason in answer["error"], (version, answer)
        response = await client.post(
            f"/v1/reload?target_version={version}",
            headers={"Authorization": "Bearer test-admin-token"},
        )
        assert response.status == 403, (version, await response.text())
    output, digest = await served(client)
    assert weights_of(versions, output) == ["v1"] and digest == versions["v1"].sha256


async def test_a_held_version_is_swapped_to_only_after_the_checks_of_a_load(
    client: TestClient, model_server: ModelServer, repo, server_config, tmp_path: Path
) -> None:
    versions = repo[1]
    sock, v2 = server_config.control_socket, versions["v2"]
    load_v2 = {
        "op": "load",
        "model": "mlp",
        "version": "v2",
        "path": str(v2.path),
        "sha256": v2.sha256,
    }
    assert (await ask(sock, load_v2))["ok"]
    assert (await ask(sock, {"op": "rollback", "model": "mlp"}))["to"] == "v1"  # v2 retained
    copy = tmp_path / "elsewhere" / "mlp" / "v2" / "model.onnx"
    copy.parent.mkdir(parents=True)
    shutil.copy(v2.path, copy)  # the same bytes, outside the repository
    answer = await ask(sock, {**load_v2, "path": str(copy)})
    assert (answer["ok"], answer["code"]) == (False, "forbidden"), answer
    answer = await ask(sock, {**load_v2, "sha256": "not-a-digest"})
    assert (answer["ok"], answer["code"]) == (False, "bad_request"), answer
    assert model_server.manager.slot("mlp").current.version == "v1"  # type: ignore[union-attr]

    slot = model_server.manager.slot("mlp")
    held = slot.get("v2")
    answer = await ask(sock, {**load_v2, "sha256": v2.sha256.upper()})  # the same digest
    assert answer["ok"] and answer["instant"], answer  # a pointer swap, no second load
    assert slot.current is held and slot.closed_versions == []
    output, digest = await served(client)
    assert weights_of(versions, output) == ["v2"] and digest == v2.sha256
