"""How often a leader lets go of its Lease when the API server fails a share of the
Lease requests (issue 29): a leader holds a Lease on a real control plane through the
fault proxy, which answers 503 to ``--fail`` of the Lease requests at random; each time
its fence is lost it is counted, and the leader takes the Lease again. Two algorithms
run side by side, each on a Lease of its own: ``before`` (the renewal loop of the commit
given by ``--before``, 688f1c9's by default: renew every duration/3, a failed renewal again
after duration/5, the fence the duration less one renewal period) and ``now``
(:class:`model_operator.leader.LeaderElection` with :meth:`LeaseSettings.scaled`).

Time is scaled: a Lease of ``--lease-seconds`` stands for a 15 s one, every period
scaled alike, so a run of T seconds stands for T * 15 / lease-seconds seconds of a
15 s Lease; the losses per hour are given at that scale.

    python bench/lease_flaky.py --minutes 8 --lease-seconds 1.5 --fail 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from bench_support import write_json
from model_operator import leader as now_leader
from model_operator.kube_client import KubeClient
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.fault_proxy import Fault, FaultProxy

ROOT = Path(__file__).parent.parent


class Lost(Exception):
    pass


def lost(why: str) -> NoReturn:
    raise Lost(why)


def before_module(commit: str) -> ModuleType:
    """``operator/model_operator/leader.py`` as of ``commit``, in the operator package
    (its relative imports: the errors and the client of today, the same classes)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:operator/model_operator/leader.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "leader_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("model_operator.leader_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def elections(kind: str, api: KubeClient, namespace: str, lease_s: float, commit: str) -> Any:
    name = f"bench-{kind}"
    if kind == "now":
        settings = now_leader.LeaseSettings.scaled(namespace, name, lease_s)
        settings = dataclasses.replace(settings, name=name)
        return now_leader.LeaderElection(
            api, settings, now_leader.LeaseFence(settings.valid_s, lost)
        )
    old = before_module(commit)
    settings = old.LeaseSettings(
        namespace,
        name=name,
        identity=name,
        duration_s=lease_s,
        renew_s=max(0.2, lease_s / 3),
        retry_s=max(0.2, lease_s / 5),
    )  # fmt: skip (as main's cli._lead)
    return old.LeaderElection(api, settings, old.LeaseFence(settings.valid_s, lost))


async def hold(election: Any, seconds: float, losses: list[float]) -> None:
    """Lead for ``seconds``; each loss is recorded and the Lease taken again."""
    end = time.monotonic() + seconds
    await election.acquire()
    while time.monotonic() < end:
        try:
            await asyncio.wait_for(election.hold(), end - time.monotonic())
        except Lost:
            losses.append(time.monotonic())
            election.fence._renewed = None
            await election.acquire()
        except asyncio.TimeoutError:
            return


async def run(args: argparse.Namespace, cluster: ControlPlane) -> dict[str, Any]:
    namespace = f"lease-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    identity = cluster.service_account(namespace, "bench", cluster_role="cluster-admin")
    rng = random.Random(args.seed)
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        proxy.fault = Fault("status", 503)
        proxy.only = lambda method, path: "/leases" in path and rng.random() < args.fail
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=str(identity.kubeconfig), client_configuration=configuration
        )
        configuration.host = proxy.url
        seconds = args.minutes * 60
        report: dict[str, Any] = {}
        apis = {kind: KubeClient(configuration, timeout_s=args.lease_seconds) for kind in KINDS}
        losses: dict[str, list[float]] = {kind: [] for kind in KINDS}
        try:
            await asyncio.gather(*(
                hold(elections(kind, apis[kind], namespace, args.lease_seconds, args.before),
                     seconds, losses[kind])
                for kind in KINDS
            ))  # fmt: skip
        finally:
            for api in apis.values():
                await api.close()
        scaled_hours = seconds * (15.0 / args.lease_seconds) / 3600
        lease_calls = [c for c in proxy.calls if "/leases" in c.path]
        for kind in KINDS:
            report[kind] = {
                "losses": len(losses[kind]),
                "losses_per_hour_of_15s_lease": round(len(losses[kind]) / scaled_hours, 2),
            }
        report["lease_requests"] = len(lease_calls)
        report["failed_share"] = round(
            sum(c.faulted for c in lease_calls) / max(1, len(lease_calls)), 4
        )
        report["scaled_hours"] = round(scaled_hours, 3)
    return report


KINDS = ("before", "now")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--lease-seconds", type=float, default=1.5)
    p.add_argument("--fail", type=float, default=0.1, help="share of Lease requests failed")
    p.add_argument(
        "--before",
        default="688f1c9",
        help="the commit whose leader.py is 'before' (default: the one before the retries)",
    )
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "lease_flaky.json"))
    args = p.parse_args(argv)
    with ControlPlane(Path(tempfile.mkdtemp(prefix="lease-bench-"))) as cluster:
        report = asyncio.run(run(args, cluster))
    report["args"] = vars(args)
    print(report)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
