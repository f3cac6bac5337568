"""``model-operator``: run the kopf operator."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import kopf

from .config import OperatorConfig, parse_args
from .handlers import register


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
    config = parse_args(argv)
    asyncio.run(run(config, config.liveness))
    return 0


if __name__ == "__main__":
    sys.exit(main())
