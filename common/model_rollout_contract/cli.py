"""How the three programs are configured: command-line flags, each also read from the
environment under one prefix scheme — ``--some-flag`` of ``model-server`` is
``MODEL_SERVER_SOME_FLAG`` — with the command line winning. The operator relies on the
scheme when it sets variables in the pods it generates, so its names belong to the
contract; each program declares its flags with :mod:`model_rollout_flags`
(ConfigArgParse), which reads them."""

from __future__ import annotations

from pathlib import Path

SERVER_ENV_PREFIX = "MODEL_SERVER_"
SIDECAR_ENV_PREFIX = "MODEL_SIDECAR_"
OPERATOR_ENV_PREFIX = "MODEL_OPERATOR_"


def env_name(prefix: str, flag: str) -> str:
    """``env_name("MODEL_SIDECAR_", "--kube-api") == "MODEL_SIDECAR_KUBE_API"``."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def optional_path(value: str | None) -> Path | None:
    return Path(value) if value else None
