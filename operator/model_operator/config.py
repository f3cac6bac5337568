"""Operator configuration: a dataclass built from the command line, every flag also read
from ``MODEL_OPERATOR_<FLAG>`` (the contract's configuration scheme); handed to the
handlers through kopf's memo."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass, field

from model_rollout_contract.cli import OPERATOR_ENV_PREFIX
from model_rollout_flags import FlagParser
from model_rollout_flags.logs import LogSettings, add_log_flags, log_settings

from .constants import MIN_LEASE_S


@dataclass
class OperatorConfig:
    kube_api: str | None = None  # explicit API URL (tests, kmock); default: in-cluster/kubeconfig
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    interval_s: float = 30.0  # resync: the longest wait for a pass when nothing happens
    check_store: bool = True  # check that spec.version is in the S3 store before rolling out
    disable_scanning: bool = False  # API servers without full discovery (kmock)
    liveness: str | None = "http://0.0.0.0:8080/healthz"  # kopf's liveness endpoint
    metrics_port: int | None = None  # the operator's /metrics (None: not served)
    leader_election: bool = False  # several replicas: one leads, through a Lease
    lease_namespace: str = "default"  # where the Lease lives (the operator's namespace)
    identity: str = ""  # this replica in the Lease (its pod name; default: the host name)
    lease_seconds: float = 15.0  # a silent leader is replaced this long after its renewal
    kubeconfig: str | None = None  # default: KUBECONFIG, in-cluster, then ~/.kube/config
    log: LogSettings = field(default_factory=LogSettings)  # --log-format, --log-level


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        env_prefix=OPERATOR_ENV_PREFIX, prog="model-operator", description="run the kopf operator"
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable); default: all namespaces",
    )
    p.add_argument(
        "--kube-api", help="API server URL, no credentials (default: kubeconfig or in-cluster)"
    )
    p.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: KUBECONFIG, in-cluster, then ~/.kube/config)",
    )
    p.add_argument("--interval", type=float, default=OperatorConfig.interval_s)
    p.add_argument(
        "--no-store-check",
        action="store_true",
        help="do not check that spec.version exists in the model store",
    )
    p.add_argument(
        "--disable-scanning",
        action="store_true",
        help="skip API discovery scanning (for minimal API servers)",
    )
    p.add_argument(
        "--liveness", default=OperatorConfig.liveness, help="liveness endpoint URL ('' to disable)"
    )
    p.add_argument("--metrics-port", type=int, help="serve the operator's /metrics on this port")
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: only the holder of a Lease reconciles",
    )
    p.add_argument("--lease-namespace", default=OperatorConfig.lease_namespace)
    p.add_argument("--identity", help="this replica's name in the Lease (default: host name)")
    p.add_argument("--lease-seconds", type=float, default=OperatorConfig.lease_seconds)
    add_log_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> OperatorConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.lease_seconds < MIN_LEASE_S:  # the Lease holds whole seconds, at least one
        parser.error(f"--lease-seconds {a.lease_seconds:g}: at least {MIN_LEASE_S:g}")
    return OperatorConfig(
        kube_api=a.kube_api,
        kubeconfig=a.kubeconfig,
        namespaces=a.namespace,
        interval_s=a.interval,
        check_store=not a.no_store_check,
        disable_scanning=a.disable_scanning,
        liveness=a.liveness or None,
        metrics_port=a.metrics_port,
        leader_election=a.leader_election,
        lease_namespace=a.lease_namespace,
        identity=a.identity or socket.gethostname(),
        lease_seconds=a.lease_seconds,
        log=log_settings(a),
    )
