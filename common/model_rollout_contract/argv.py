"""The server's and the sidecar's command lines, as the operator writes them into pod
specs. Built here so that the flags the operator writes and the flags the programs parse
cannot drift apart: a test parses these with the programs' own parsers."""

from __future__ import annotations

from dataclasses import dataclass

from . import defaults
from .tracks import CONFIGMAP_VERSION_KEY, track_keys

# paths inside a pod: mount points (the operator's volumeMounts) and the files in them
MODELS_DIR = "/models"  # the shared volume: the sidecar writes it, the server reads it only
CONTROL_DIR = "/run/model-rollout"  # shared by server and sidecar
CONTROL_SOCKET = f"{CONTROL_DIR}/control.sock"
PODINFO_DIR = "/etc/podinfo"  # Downward API volume
PODINFO_ANNOTATIONS = f"{PODINFO_DIR}/annotations"
CONFIG_DIR = "/etc/model-rollout/config"  # the ModelDeployment's ConfigMap
# its key (CONFIGMAP_VERSION_KEY, a named track's: tracks.TrackKeys.configmap_key): the
# default version for new pods
CONFIGMAP_TARGET = f"{CONFIG_DIR}/{CONFIGMAP_VERSION_KEY}"
# the signing keys' Secret: every *.pem in it is trusted (several during a key rotation),
# so the sidecar is given the directory
KEYS_DIR = "/etc/model-rollout/keys"
TENANTS_DIR = "/etc/model-rollout/tenants"  # the tenants Secret
TENANTS_FILE = f"{TENANTS_DIR}/tenants.yaml"
JWKS_DIR = "/etc/model-rollout/jwks"  # the issuer's JWKS Secret
JWKS_KEY = "jwks.json"  # its key
JWKS_FILE = f"{JWKS_DIR}/{JWKS_KEY}"
STORE_DIR = "/store"  # a volume (PVC) store
STATUS_FILE = f"{MODELS_DIR}/.sidecar-status.json"
# the server's own state, on volumes only the server mounts: what the server loads from
# its engine cache, and what it records, must not be writable by the sidecar (or by
# anything that can write the shared volume)
ENGINE_CACHE = "/var/cache/model-server"  # engines (optimised models) it built
AUDIT_DIR = "/var/log/model-server"
AUDIT_LOG = f"{AUDIT_DIR}/audit.jsonl"
TMP_DIR = "/tmp"  # the server's scratch space (the root filesystem is read-only)


@dataclass(frozen=True)
class JwtArgs:
    """Tenants' JWTs: the server's ``--jwt-*`` flags. The issuer's keys are a JWKS Secret
    (mounted at JWKS_FILE, re-read when the kubelet updates it) or a URL."""

    issuer: str
    audience: str
    jwks_url: str | None = None  # None: the mounted JWKS file
    algorithms: tuple[str, ...] = defaults.JWT_ALGORITHMS
    tenant_claim: str = defaults.JWT_TENANT_CLAIM
    leeway_seconds: float = defaults.JWT_LEEWAY_SECONDS


def jwt_argv(a: JwtArgs) -> list[str]:
    jwks = ["--jwks-url", a.jwks_url] if a.jwks_url else ["--jwks-file", JWKS_FILE]
    return [
        *jwks,
        "--jwt-issuer", a.issuer,
        "--jwt-audience", a.audience,
        "--jwt-algorithms", ",".join(a.algorithms),
        "--jwt-tenant-claim", a.tenant_claim,
        "--jwt-leeway-seconds", str(a.leeway_seconds),
    ]  # fmt: skip


@dataclass(frozen=True)
class LogArgs:
    """``--log-format`` and ``--log-level`` of every program in the pod (spec.logging)."""

    format: str = defaults.LOG_FORMAT
    level: str = defaults.LOG_LEVEL


def log_argv(a: LogArgs) -> list[str]:
    """Only what differs from the programs' defaults: a pod template written before these
    flags existed stays the same (an operator upgrade restarts no pod)."""
    argv = [] if a.format == defaults.LOG_FORMAT else ["--log-format", a.format]
    return argv + ([] if a.level == defaults.LOG_LEVEL else ["--log-level", a.level])


@dataclass(frozen=True)
class ServerArgs:
    model: str
    backend: str = defaults.BACKEND
    retain: int = defaults.RETAIN_VERSIONS
    tenants: bool = False  # mount and pass TENANTS_FILE
    drain_seconds: float = defaults.DRAIN_SECONDS  # after SIGTERM, before the listener closes
    # after the drain: how long requests in flight may still take (the pod's grace period
    # leaves exactly this after the preStop pause and the drain)
    inflight_grace_seconds: float = defaults.INFLIGHT_GRACE_SECONDS
    precision: str = defaults.PRECISION  # what the TensorRT backend builds
    max_batch_size: int = defaults.MAX_BATCH_SIZE  # dynamic batching: rows per run, 0 = off
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_MICROSECONDS
    # the models opted in to dynamic batching (--batch-model): none unless named
    batch_models: tuple[str, ...] = ()
    # the models' own bounds on rows per request (--max-rows); the others' are derived
    max_rows: tuple[tuple[str, int], ...] = ()
    jwt: JwtArgs | None = None  # with tenants only
    processes: int = defaults.SERVER_PROCESSES  # behind the one port (model_server.pool.supervisor)
    log: LogArgs = LogArgs()


def server_argv(a: ServerArgs) -> list[str]:
    argv = [
        "model-server",
        "--repository", MODELS_DIR,
        "--model", a.model,
        "--host", "0.0.0.0",
        "--port", str(defaults.SERVER_PORT),
        "--grpc-port", str(defaults.SERVER_GRPC_PORT),
        "--backend", a.backend,
        "--control-socket", CONTROL_SOCKET,
        "--retain", str(a.retain),
        "--cache-dir", ENGINE_CACHE,
        "--audit-log", AUDIT_LOG,
        "--drain-seconds", str(a.drain_seconds),
        "--inflight-grace-seconds", str(a.inflight_grace_seconds),
        "--precision", a.precision,
        "--max-batch-size", str(a.max_batch_size),
        "--max-queue-delay-us", str(a.max_queue_delay_us),
        "--processes", str(a.processes),
    ]  # fmt: skip
    for model in a.batch_models:
        argv += ["--batch-model", model]
    for model, rows in a.max_rows:
        argv += ["--max-rows", f"{model}={rows}"]
    if a.tenants:
        argv += ["--tenants-file", TENANTS_FILE]
    if a.jwt is not None:
        argv += jwt_argv(a.jwt)
    return argv + log_argv(a.log)


@dataclass(frozen=True)
class SidecarArgs:
    model: str
    store: str  # s3://bucket/prefix or file:///dir
    signed: bool = True  # False: --allow-unsigned (development only)
    retain: int = defaults.RETAIN_VERSIONS  # the server's; the volume keeps one more
    start_jitter_seconds: float = defaults.START_JITTER_SECONDS
    backoff_base_seconds: float = defaults.BACKOFF_BASE_SECONDS
    backoff_max_seconds: float = defaults.BACKOFF_MAX_SECONDS
    max_concurrent_downloads: int = defaults.MAX_CONCURRENT_DOWNLOADS
    # a named track (a tenant model: see tracks), followed by a sidecar of its own; None:
    # the deployment's own model
    track: str | None = None
    own_keys: bool = False  # the track's own signing keys (keys_dir), not the deployment's
    metrics_port: int = defaults.SIDECAR_METRICS_PORT  # each sidecar of a pod has its own
    store_id: str | None = None  # a directory store's identity (layout.StoreUrl.bound_scope)
    log: LogArgs = LogArgs()


def keys_dir(track: str | None = None, own_keys: bool = False) -> str:
    """Where a track's sidecar finds the public keys it trusts: its own Secret's mount for
    a track with keys of its own, else the deployment's."""
    return f"{KEYS_DIR}-{track}" if track is not None and own_keys else KEYS_DIR


def status_file(track: str | None = None) -> str:
    """Each sidecar's status file: several share the volume."""
    return STATUS_FILE if track is None else f"{MODELS_DIR}/.sidecar-status.{track}.json"


def sidecar_argv(mode: str, a: SidecarArgs) -> list[str]:
    """``mode`` is ``init`` (the init container) or ``watch`` (the sidecar container)."""
    if mode not in ("init", "watch"):
        raise ValueError(f"sidecar mode must be init or watch, not {mode!r}")
    keys = track_keys(a.track)
    argv = [
        "model-sidecar", mode,
        "--store", a.store,
        "--volume", MODELS_DIR,
        "--model", a.model,
        "--annotations-file", PODINFO_ANNOTATIONS,
        "--configmap-file", f"{CONFIG_DIR}/{keys.configmap_key}",
        "--pins-file", f"{CONFIG_DIR}/{keys.configmap_pins_key}",
        "--start-jitter-seconds", str(a.start_jitter_seconds),
        "--backoff-base-seconds", str(a.backoff_base_seconds),
        "--backoff-max-seconds", str(a.backoff_max_seconds),
        "--max-concurrent-downloads", str(a.max_concurrent_downloads),
    ]  # fmt: skip
    if a.store_id is not None:
        argv += ["--store-id", a.store_id]
    if a.track is not None:
        argv += ["--track", a.track]
    argv += ["--public-key", keys_dir(a.track, a.own_keys)] if a.signed else ["--allow-unsigned"]
    if mode == "watch":
        argv += [
            "--control-socket", CONTROL_SOCKET,
            "--status-file", status_file(a.track),
            "--keep-versions", str(a.retain + 1),
            "--metrics-port", str(a.metrics_port),
        ]  # fmt: skip
    return argv + log_argv(a.log)


@dataclass(frozen=True)
class PublishArgs:
    """What ``model-sidecar publish`` takes, as the release command passes it on."""

    store: str  # s3://bucket/prefix or file:///dir
    model: str
    version: str
    file: str
    key: str  # Ed25519 private key (PEM)
    s3_endpoint: str | None = None
    precision: str | None = None  # None: the publisher's default
    golden: str | None = None
    force: bool = False
    store_id: str | None = None  # a directory store's identity


def publish_argv(a: PublishArgs) -> list[str]:
    """``model-sidecar publish ...`` (the program name first, as the other builders)."""
    argv = [
        "model-sidecar", "publish",
        "--store", a.store,
        "--model", a.model,
        "--version", a.version,
        "--file", a.file,
        "--key", a.key,
    ]  # fmt: skip
    for flag, value in (
        ("--store-id", a.store_id),
        ("--s3-endpoint", a.s3_endpoint),
        ("--precision", a.precision),
        ("--golden", a.golden),
    ):
        if value is not None:
            argv += [flag, value]
    if a.force:
        argv.append("--force")
    return argv
