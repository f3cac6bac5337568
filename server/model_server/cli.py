"""``model-server`` entry point: one server, or with ``--processes N`` the supervisor of
N (:mod:`.pool`)."""

from __future__ import annotations

import logging
import sys

from model_server.backends import BackendUnavailable
from model_server.config import ConfigError, parse_args
from model_server.pool.worker import end_with_supervisor
from model_server.serving import run


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    # one log stream for a pool: each line says which process wrote it
    who = "" if config.worker_index is None else f"[worker {config.worker_index}] "
    if config.processes > 1:
        who = "[pool] "
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    )
    if config.in_pool:
        end_with_supervisor()
    if config.processes > 1:
        from model_server.pool.supervisor import run_pool

        return run_pool(config, list(sys.argv[1:] if argv is None else argv))
    try:
        run(config)
    except (BackendUnavailable, ConfigError) as exc:
        print(f"model-server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
