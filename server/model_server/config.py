"""Server configuration: a dataclass built from the command line, every flag also read
from ``MODEL_SERVER_<FLAG>`` (the contract's configuration scheme)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from model_rollout_contract import defaults
from model_rollout_contract.cli import SERVER_ENV_PREFIX, optional_path, parse_with_environment

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
    repository: Path  # <root>/[<tenant>/]<model>/<version>/model.onnx
    models: list[ModelSpec] = field(default_factory=list)  # empty: every model found
    host: str = defaults.SERVER_HOST
    port: int = defaults.SERVER_PORT
    backend: str = defaults.SERVER_BACKEND
    cache_dir: Path | None = None  # engine cache, shared by the pods of a node
    retain: int = defaults.RETAIN_VERSIONS  # versions kept loaded per model, serving included
    memory_budget_mb: float | None = None  # refuse loads that would hold more in total
    control_socket: Path | None = None  # where the sidecar announces new versions
    admin_token_file: Path | None = None  # without it the admin API is off
    tenants_file: Path | None = None  # tenants.yaml: API keys and models per tenant
    audit_log: Path | None = None  # JSON lines, one per load, swap, rollback or refusal
    workers: int = defaults.INFERENCE_WORKERS  # inference threads
    drain_seconds: float = defaults.DRAIN_SECONDS  # SIGTERM: serve this long unready


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="model-server",
        description="Inference server with atomic, double-buffered model hot-swap.",
    )
    p.add_argument(
        "--repository",
        required=True,
        help="model repository root: <root>/[<tenant>/]<model>/<version>/model.onnx",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[TENANT/]NAME[=VERSION]",
        help="a model to serve (repeatable); default: every model in the repository",
    )
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--backend", choices=BACKEND_NAMES, default=ServerConfig.backend)
    p.add_argument("--cache-dir", help="engine cache directory (shared by the pods of a node)")
    p.add_argument(
        "--retain",
        type=int,
        default=ServerConfig.retain,
        help="versions kept loaded per model, the serving one included",
    )
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        help="refuse loads that would hold more than this in total",
    )
    p.add_argument(
        "--control-socket", help="Unix socket on which the sidecar announces new versions"
    )
    p.add_argument("--admin-token-file")
    p.add_argument("--tenants-file")
    p.add_argument("--audit-log", help="JSON-lines audit file")
    p.add_argument("--workers", type=int, default=ServerConfig.workers, help="inference threads")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=ServerConfig.drain_seconds,
        help="after SIGTERM: readiness 503 at once, keep serving this long, then finish",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = build_parser()
    a = parse_with_environment(p, SERVER_ENV_PREFIX, argv)
    if a.retain < 1:
        p.error("--retain must be at least 1")
    if a.drain_seconds < 0:
        p.error("--drain-seconds must not be negative")
    return ServerConfig(
        repository=Path(a.repository),
        models=[ModelSpec.parse(m) for m in a.model],
        host=a.host,
        port=a.port,
        backend=a.backend,
        cache_dir=optional_path(a.cache_dir),
        retain=a.retain,
        memory_budget_mb=a.memory_budget_mb,
        control_socket=optional_path(a.control_socket),
        admin_token_file=optional_path(a.admin_token_file),
        tenants_file=optional_path(a.tenants_file),
        audit_log=optional_path(a.audit_log),
        workers=a.workers,
        drain_seconds=a.drain_seconds,
    )
