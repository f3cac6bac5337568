"""``model-server`` entry point: one server, or with ``--processes N`` the supervisor of
N (:mod:`.pool`)."""

from __future__ import annotations

import sys

from model_rollout_flags.logs import fatal, setup_logging
from model_server.backends import BackendUnavailable
from model_server.config import ConfigError, parse_args
from model_server.pool.worker import end_with_supervisor
from model_server.serving import run


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    # one log stream for a pool: each line says which process wrote it
    process = None if config.worker_index is None else f"worker {config.worker_index}"
    if config.processes > 1:
        process = "pool"
    who = f"[{process}] " if process else ""
    setup_logging(
        config.log,
        "model-server",
        text_format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s",
        fields={"process": process} if process else None,
    )
    if config.in_pool:
        end_with_supervisor()
    if config.processes > 1:
        from model_server.pool.supervisor import run_pool

        return run_pool(config, list(sys.argv[1:] if argv is None else argv))
    try:
        run(config)
    except (BackendUnavailable, ConfigError) as exc:
        fatal(str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
