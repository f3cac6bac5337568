"""Server configuration, from the command line (each flag also has an environment variable)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from .backends import BACKEND_NAMES


@dataclass(frozen=True)
class ModelSpec:
    key: str  # "name" or "tenant/name"
    version: str | None = None  # None: CURRENT file of the model, else the newest version

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        key, _, version = text.partition("=")
        return cls(key.strip(), version.strip() or None)


@dataclass
class ServerConfig:
    repository: Path
    models: list[ModelSpec] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "onnxruntime"
    cache_dir: Path | None = None
    retain: int = 2
    memory_budget_mb: float | None = None
    control_socket: Path | None = None
    admin_token_file: Path | None = None
    tenants_file: Path | None = None
    audit_log: Path | None = None
    workers: int = 4


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"MODEL_SERVER_{name}", default)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(
        prog="model-server",
        description="Inference server with atomic, double-buffered model hot-swap.",
    )
    p.add_argument(
        "--repository",
        default=_env("REPOSITORY"),
        required=_env("REPOSITORY") is None,
        help="model repository root: <root>/[<tenant>/]<model>/<version>/model.onnx",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[TENANT/]NAME[=VERSION]",
        help="a model to serve (repeatable); default: every model in the repository",
    )
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000") or 8000))
    p.add_argument("--backend", choices=BACKEND_NAMES, default=_env("BACKEND", "onnxruntime"))
    p.add_argument(
        "--cache-dir",
        default=_env("CACHE_DIR"),
        help="engine cache directory (shared by the pods of a node)",
    )
    p.add_argument(
        "--retain",
        type=int,
        default=int(_env("RETAIN", "2") or 2),
        help="versions kept loaded per model, the serving one included (default 2)",
    )
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        default=_env("MEMORY_BUDGET_MB"),
        help="refuse loads that would hold more than this in total",
    )
    p.add_argument(
        "--control-socket",
        default=_env("CONTROL_SOCKET"),
        help="Unix socket on which the sidecar announces new versions",
    )
    p.add_argument("--admin-token-file", default=_env("ADMIN_TOKEN_FILE"))
    p.add_argument("--tenants-file", default=_env("TENANTS_FILE"))
    p.add_argument("--audit-log", default=_env("AUDIT_LOG"), help="JSON-lines audit file")
    p.add_argument(
        "--workers", type=int, default=int(_env("WORKERS", "4") or 4), help="inference threads"
    )
    a = p.parse_args(argv)
    if a.retain < 1:
        p.error("--retain must be at least 1")
    return ServerConfig(
        repository=Path(a.repository),
        models=[ModelSpec.parse(m) for m in a.model],
        host=a.host,
        port=a.port,
        backend=a.backend,
        cache_dir=_path(a.cache_dir),
        retain=a.retain,
        memory_budget_mb=float(a.memory_budget_mb) if a.memory_budget_mb else None,
        control_socket=_path(a.control_socket),
        admin_token_file=_path(a.admin_token_file),
        tenants_file=_path(a.tenants_file),
        audit_log=_path(a.audit_log),
        workers=a.workers,
    )
