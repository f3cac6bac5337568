"""``model-operator``: run the kopf operator."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import kopf

from model_rollout_flags.logs import fatal, setup_logging

from .config import OperatorConfig, parse_args
from .handlers import register
from .kube_client import KubeClient, NoApiServer, load_configuration
from .leader import FenceWatchdog, LeaderElection, LeaseFence, LeaseSettings


async def run(
    config: OperatorConfig,
    liveness: str | None = None,
    stop: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run the operator until ``stop``; with leader election, only while leading: its
    fence is checked before every pass and every write, and the process exits once the
    Lease is lost (see :mod:`.leader`). Raises :class:`NoApiServer` at once when nothing
    says where the API server is."""
    await load_configuration(config.kube_api, config.kubeconfig)
    stopping = asyncio.Event()
    watchers: list[asyncio.Future[Any]] = []
    if stop is not None:
        waiter = stop.wait() if isinstance(stop, asyncio.Event) else asyncio.to_thread(stop.wait)
        watchers.append(asyncio.ensure_future(waiter))
    fence: LeaseFence | None = None
    if config.leader_election:
        leading = asyncio.ensure_future(_lead(config))
        done, _ = await asyncio.wait([leading, *watchers], return_when=asyncio.FIRST_COMPLETED)
        if leading not in done:  # stopped while waiting to lead
            leading.cancel()
            return
        renewal, fence = leading.result()
        watchers.append(renewal)  # ends only when cancelled: a lost Lease ends the process
    for watcher in watchers:
        watcher.add_done_callback(lambda _: stopping.set())
    try:
        await kopf.operator(
            registry=register(config),
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=True,
            liveness_endpoint=liveness,
            memo=kopf.Memo(config=config, fence=fence),
            stop_flag=stopping,
        )
    finally:
        for watcher in watchers:
            watcher.cancel()


async def _lead(config: OperatorConfig) -> tuple[asyncio.Future[None], LeaseFence]:
    """Wait for the Lease; return the task that renews it (and runs the fence's
    watchdog), and the fence."""
    api = KubeClient(await load_configuration(config.kube_api, config.kubeconfig))
    settings = LeaseSettings.scaled(config.lease_namespace, config.identity, config.lease_seconds)
    election = LeaderElection(api, settings)
    await election.acquire()
    watchdog = FenceWatchdog(election.fence).start()

    async def hold() -> None:
        try:
            await election.hold()
        except Exception as exc:  # the renewal itself broke: no longer sure to lead
            election.fence.lose(f"lease renewal failed: {exc!r}")
        finally:
            watchdog.stop()
            await api.close()

    return asyncio.ensure_future(hold()), election.fence


# kopf's per-object records (the logger its handlers are given) carry the object as
# k8s_ref, written as kopf's own JSON writes it ("object"); its settings and posting
# switch are kopf's business. kopf.configure() is not called: it would put a second
# handler, in kopf's format, on the root logger. Its K8sPoster, the handler of the
# kopf.objects logger that posts those records as Events when posting is on, stays.
KOPF_RENAME = {"k8s_ref": "object"}
KOPF_HIDE = ("settings", "k8s_skip")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log, "model-operator", rename=KOPF_RENAME, hide=KOPF_HIDE)
    try:
        asyncio.run(run(config, config.liveness))
    except NoApiServer as exc:
        fatal(str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
