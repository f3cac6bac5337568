"""``model-operator``: run the kopf operator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

import kopf

from .config import OperatorConfig
from .handlers import register


def parse_args(argv: list[str] | None = None) -> tuple[OperatorConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="model-operator", description=__doc__)
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable); default: all namespaces",
    )
    p.add_argument(
        "--kube-api",
        default=os.environ.get("MODEL_OPERATOR_KUBE_API"),
        help="API server URL (default: in-cluster or kubeconfig)",
    )
    p.add_argument(
        "--interval", type=float, default=float(os.environ.get("MODEL_OPERATOR_INTERVAL", "2"))
    )
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
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL ('' to disable)",
    )
    a = p.parse_args(argv)
    return OperatorConfig(
        a.kube_api, a.namespace, a.interval, not a.no_store_check, a.disable_scanning
    ), a


async def run(
    config: OperatorConfig,
    liveness: str | None = None,
    stop: asyncio.Event | threading.Event | None = None,
) -> None:
    await kopf.operator(
        registry=register(config),
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        standalone=True,
        liveness_endpoint=liveness,
        memo=kopf.Memo(config=config),
        stop_flag=stop,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config, args = parse_args(argv)
    asyncio.run(run(config, args.liveness or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
