"""Server configuration: a dataclass built from the command line, every flag also read
from ``MODEL_SERVER_<FLAG>`` (the contract's configuration scheme)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from model_rollout_contract import defaults
from model_rollout_contract.cli import SERVER_ENV_PREFIX, optional_path
from model_rollout_contract.names import InvalidName, check_model_key, check_name
from model_rollout_flags import FlagParser
from model_rollout_flags.logs import LogSettings, add_log_flags, log_settings
from model_server.backends import BACKEND_NAMES
from model_server.dataplane.data_plane import SHADOW_MAX_IN_FLIGHT
from model_server.security.jwt_auth import (
    DEFAULT_ALGORITHMS,
    DEFAULT_LEEWAY_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MIN_REFRESH_S,
    DEFAULT_TENANT_CLAIM,
    JwtConfig,
)

# Python's own switch interval (5 ms): shorter ones did not help steadily on the GPU
GIL_SWITCH_INTERVAL_US = 5000
# the longest engine run the event loop makes itself (only torch's graph replays qualify);
# every answer stays its version's with them on
# (tests/server/backends/test_torch_swap_answers_gpu.py)
QUICK_RUN_US = 300


class ConfigError(ValueError):
    """Flags that parse but contradict the models the server serves (known once the
    tenants file and the repository are read): refused at startup, exit status 2."""


def check_named_models(served: Iterable[str], batch_models: Iterable[str],
                       max_rows: Iterable[str]) -> None:  # fmt: skip
    """Refuse a ``--batch-model`` or ``--max-rows`` naming no model served (a typo would
    leave the model it meant unbatched or unbounded, silently)."""
    keys = set(served)
    for flag, names in (("--batch-model", batch_models), ("--max-rows", max_rows)):
        unknown = sorted(set(names) - keys)
        if unknown:
            raise ConfigError(
                f"{flag} names {', '.join(map(repr, unknown))}, which this server does not "
                f"serve (its models: {', '.join(sorted(keys)) or 'none'})"
            )


@dataclass(frozen=True)
class ModelSpec:
    key: str  # "name" or "tenant/name"
    version: str | None = None  # None: CURRENT file of the model, else the newest version

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``[tenant/]name[=version]``, each part a valid name (``InvalidName`` if not)."""
        key, sep, version = text.partition("=")
        return cls(check_model_key(key), check_name("version", version) if sep else None)


Bounds = tuple[int, int, int]
# the largest request: an HTTP body (413 beyond) or a gRPC message (RESOURCE_EXHAUSTED)
MAX_REQUEST_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorRTConfig:
    """What the TensorRT backend builds and how many requests an engine runs at once."""

    precision: str = defaults.PRECISION  # model | fp32 | fp16 | int8
    contexts: int = 2  # pooled execution contexts per engine, one optimization profile each
    batch: Bounds = (1, 8, 64)  # min/opt/max of a dynamic first axis
    dims: Bounds = (1, 128, 512)  # min/opt/max of any other dynamic axis
    workspace_mb: int = 1024
    host_code_allowed: bool = False  # version-compatible plans: trusted repositories only
    plugin_libraries: tuple[Path, ...] = ()

    def backend_options(self) -> dict[str, object]:
        from model_server.backends.tensorrt_build import DynamicBounds, ShapeProfile

        return {
            "precision": self.precision,
            "profile": ShapeProfile(bounds=DynamicBounds(batch=self.batch, other=self.dims)),
            "contexts": self.contexts,
            "workspace_bytes": self.workspace_mb << 20,
            "host_code_allowed": self.host_code_allowed,
            "plugin_libraries": self.plugin_libraries,
        }


def _model_rows(text: str) -> tuple[str, int]:
    """``[tenant/]name=ROWS``: a model's key and a positive number of rows (``ValueError``,
    ``InvalidName`` being one, if not)."""
    key, sep, rows = text.partition("=")
    if not sep or not rows.isdigit() or int(rows) < 1:
        raise ValueError(f"want [TENANT/]NAME=ROWS with ROWS at least 1, not {text!r}")
    return check_model_key(key), int(rows)


def _bounds(text: str) -> Bounds:
    try:
        lo, opt, hi = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want MIN,OPT,MAX, not {text!r}") from None
    if not 1 <= lo <= opt <= hi:
        raise argparse.ArgumentTypeError(f"want 1 <= MIN <= OPT <= MAX, not {text!r}")
    return lo, opt, hi


@dataclass
class ServerConfig:
    repository: Path  # <root>/[<tenant>/]<model>/<version>/model.onnx
    models: list[ModelSpec] = field(default_factory=list)  # empty: every model found
    host: str = defaults.SERVER_HOST
    port: int = defaults.SERVER_PORT
    grpc_port: int | None = None  # KServe v2 gRPC beside HTTP; None: none, 0: any free port
    backend: str = defaults.SERVER_BACKEND
    cache_dir: Path | None = None  # engine cache: the server's own, never a shared volume
    retain: int = defaults.RETAIN_VERSIONS  # versions kept loaded per model, serving included
    memory_budget_mb: float | None = None  # refuse loads that would hold more in total
    # the last private copies kept for the next read of a file of their size
    # (model_server.files.spare_copies): a load fills pages already there; 0: none kept
    spare_copy_mb: int = 1024
    # torch: a kept private copy registered with CUDA and uploaded from with no staging
    pin_private_copies: bool = False
    control_socket: Path | None = None  # where the sidecar announces new versions
    admin_token_file: Path | None = None  # without it the admin API is off
    tenants_file: Path | None = None  # tenants.yaml: API keys and models per tenant
    jwt: JwtConfig | None = None  # tenants' JWTs beside their API keys (None: API keys only)
    audit_log: Path | None = None  # JSON lines, one per load, swap, rollback or refusal
    workers: int = defaults.INFERENCE_WORKERS  # inference threads
    drain_seconds: float = defaults.DRAIN_SECONDS  # SIGTERM: serve this long unready
    # then: how long requests in flight may still take (what the pod's grace leaves)
    inflight_grace_seconds: float = defaults.INFLIGHT_GRACE_SECONDS
    # how long a request's body may take to arrive (408 and the connection closed after)
    body_read_timeout_seconds: float = 30.0
    json_workers: int = 2  # processes that decode and encode large JSON bodies
    json_max_pending: int | None = None  # large bodies decoding or queued (None: 2/worker)
    traffic_seed: int | None = None  # seeds the per-request split of a traffic policy
    shadow_max_in_flight: int = SHADOW_MAX_IN_FLIGHT  # shadow runs at once; more are skipped
    # dynamic batching (model_server.scheduling.batching): rows per engine run, 0 = off (the model
    # configuration's max_batch_size); how long a request may wait for others
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_MICROSECONDS
    batch_models: tuple[str, ...] = ()  # the models that batch (keys): opted in, none else
    # rows per request (model_server.lifecycle.request_limits): a model's configured bound, by its
    # key, else what ``request_memory_mb`` over its memory per row allows
    max_rows: dict[str, int] = field(default_factory=dict)
    request_memory_mb: int = defaults.REQUEST_MEMORY_MB
    # how long a thread may hold the GIL while another waits (sys.setswitchinterval): a
    # load's Python steps then delay a request by at most this (Python's default: 5 ms)
    gil_switch_interval_us: int = GIL_SWITCH_INTERVAL_US
    # how much lower than the process's the inference threads' CPU priority is (nice):
    # with every core busy, a version loading beside the serving one gets the CPU first
    inference_nice: int = 0
    # an engine run known to take at most this (a CUDA graph replay, timed at warm-up)
    # runs on the event loop rather than on an inference thread; 0: never
    quick_run_us: int = QUICK_RUN_US
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    # several processes behind one port (model_server.pool.supervisor): the supervisor has
    # ``processes`` > 1; each worker it starts has its index, the pool's size and the
    # pool's private directory (its sockets), and is an ordinary server otherwise
    processes: int = 1
    worker_index: int | None = None
    pool_size: int = 1
    pool_dir: Path | None = None
    log: LogSettings = field(default_factory=LogSettings)  # --log-format, --log-level

    @property
    def in_pool(self) -> bool:
        """A worker of a pool: shares its port and answers for the whole pool."""
        return self.worker_index is not None

    def backend_options(self) -> dict[str, object]:
        """What ``make_backend`` is given for this configuration's backend."""
        if self.backend == "torch":
            return {"pin_copies": self.pin_private_copies}
        return self.tensorrt.backend_options() if self.backend == "tensorrt" else {}


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(
        env_prefix=SERVER_ENV_PREFIX,
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
    p.add_argument(
        "--grpc-port",
        type=int,
        help="serve the KServe v2 gRPC API (inference.GRPCInferenceService) on this port too "
        f"(pods: {defaults.SERVER_GRPC_PORT}); default: no gRPC",
    )
    p.add_argument("--backend", choices=BACKEND_NAMES, default=ServerConfig.backend)
    p.add_argument(
        "--cache-dir",
        help="engine cache directory: the server's own (what is loaded from it must not be "
        "writable by others)",
    )
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
        "--spare-copy-mb",
        type=int,
        default=ServerConfig.spare_copy_mb,
        help="host memory kept between loads for the next version's private copy: a "
        "version of a size loaded before is read into pages already there (for 400 MiB "
        "on an H100 host, 65 ms rather than 235); the pod's, shared by --processes "
        "workers; 0: give each copy back",
    )
    p.add_argument(
        "--pin-private-copies",
        action="store_true",
        help="torch backend: register a private copy kept for later versions "
        "(--spare-copy-mb) with CUDA at its first load, and upload the next versions' "
        "weights straight from its pages, with no staging copy on the host",
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
    p.add_argument(
        "--inflight-grace-seconds",
        type=float,
        default=ServerConfig.inflight_grace_seconds,
        help="after the drain: how long requests in flight may still take before they are "
        "cancelled (the pod's grace period leaves this much)",
    )
    p.add_argument(
        "--body-read-timeout-seconds",
        type=float,
        default=ServerConfig.body_read_timeout_seconds,
        help="how long a request's body may go without a byte arriving; past it 408 and the "
        "connection is closed (a stalled client holds no descriptor for ever; a large "
        "upload that keeps moving is never cut)",
    )
    p.add_argument(
        "--json-workers",
        type=int,
        default=ServerConfig.json_workers,
        help="processes that decode and encode large JSON bodies, off the event loop",
    )
    p.add_argument(
        "--json-max-pending",
        type=int,
        help="large bodies being decoded or waiting for a JSON worker; past it 503 with "
        "Retry-After (default: 2 per worker)",
    )
    jwt = p.add_argument_group(
        "tenants' JWTs (beside API keys; a bearer token shaped as a JWT is verified as one)"
    )
    jwks = jwt.add_mutually_exclusive_group()
    jwks.add_argument("--jwks-file", help="JWKS file of the issuer's keys (re-read on change)")
    jwks.add_argument("--jwks-url", help="JWKS URL of the issuer's keys (cached)")
    jwt.add_argument(
        "--jwks-min-refresh-seconds",
        type=float,
        default=DEFAULT_MIN_REFRESH_S,
        help="a JWKS URL is fetched at most this often (an unknown kid asks for a fetch)",
    )
    jwt.add_argument(
        "--jwks-max-age-seconds",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help="a JWKS URL's keys are fetched again once this old",
    )
    jwt.add_argument("--jwt-issuer", help="the tokens' iss (required with a JWKS)")
    jwt.add_argument("--jwt-audience", help="the tokens' aud (required with a JWKS)")
    jwt.add_argument(
        "--jwt-algorithms",
        default=",".join(DEFAULT_ALGORITHMS),
        help="allowed signature algorithms, comma-separated (asymmetric only)",
    )
    jwt.add_argument(
        "--jwt-leeway-seconds",
        type=float,
        default=DEFAULT_LEEWAY_S,
        help="clock skew allowed on exp and nbf",
    )
    jwt.add_argument(
        "--jwt-tenant-claim", default=DEFAULT_TENANT_CLAIM, help="the claim naming the tenant"
    )
    canary = p.add_argument_group("canary traffic policy")
    canary.add_argument(
        "--traffic-seed",
        type=int,
        help="seed of the per-request draw that splits requests under a traffic policy "
        "(default: unpredictable)",
    )
    canary.add_argument(
        "--shadow-max-in-flight",
        type=int,
        default=ServerConfig.shadow_max_in_flight,
        help="shadow runs on the candidate at once (on threads of their own); one more is "
        "skipped and counted",
    )
    batching = p.add_argument_group("dynamic batching")
    batching.add_argument(
        "--max-batch-size",
        type=int,
        default=ServerConfig.max_batch_size,
        help="run queued requests of one version together, up to this many rows (the first "
        "axis) per engine run, and at most a model's rows per request; 0: off. Only the "
        "models --batch-model names batch: a size without one is refused",
    )
    batching.add_argument(
        "--batch-model",
        action="append",
        default=[],
        metavar="[TENANT/]NAME",
        help="a model whose requests may run together (repeatable; none by default): its "
        "inputs and outputs all have a dynamic first axis, and its rows are independent "
        "(no output row depends on another row: else clients get answers mixed with "
        "others' rows). A name the server does not serve (--model, the tenants file, or "
        "the repository) is refused at startup",
    )
    batching.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=ServerConfig.max_queue_delay_us,
        help="the longest a request waits for others to fill its batch, in microseconds "
        "(Triton's max_queue_delay_microseconds); while every inference thread is busy, "
        "requests queue regardless",
    )
    limits = p.add_argument_group("request limits")
    limits.add_argument(
        "--max-rows",
        action="append",
        default=[],
        metavar="[TENANT/]NAME=ROWS",
        help="the most rows (the first axis) one request may give this model (repeatable); "
        "more are refused with 400 before any run. Default: --request-memory-mb over the "
        "model's estimated memory per row (ONNX Runtime's, from its graph). A name the "
        "server does not serve is refused at startup",
    )
    limits.add_argument(
        "--request-memory-mb",
        type=int,
        default=ServerConfig.request_memory_mb,
        help="the memory one request may take while it runs: a model's most rows per request "
        "unless --max-rows names it, and, for a model with an estimate per row, its rows "
        "times the product of its other dynamic dims (a sequence length) whatever --max-rows "
        "says (each inference thread may run such a request). A model with no estimate "
        "(torch) is bounded by the element limit alone, said once in the log",
    )
    p.add_argument(
        "--gil-switch-interval-us",
        type=int,
        default=ServerConfig.gil_switch_interval_us,
        help="the longest one thread holds the GIL while another waits, in microseconds "
        "(Python's sys.setswitchinterval; its default is 5000): a version loading beside "
        "the serving one then delays a request's Python steps by at most this",
    )
    p.add_argument(
        "--inference-nice",
        type=int,
        default=ServerConfig.inference_nice,
        help="how many steps lower than the server's the inference threads' CPU priority "
        "is (0 to 19, their nice value above the process's): when every core is busy, a "
        "version loading beside the serving one takes the CPU first, and its switch is "
        "shorter, while requests wait the longer during it (0: same priority)",
    )
    p.add_argument(
        "--quick-run-us",
        type=int,
        default=ServerConfig.quick_run_us,
        help="an engine run known to take at most this many microseconds (the torch "
        "backend's CUDA graph replays, timed at warm-up) runs on the event loop instead "
        "of an inference thread, whose hand-off costs more; 0: never",
    )
    pool = p.add_argument_group("processes")
    pool.add_argument(
        "--processes",
        type=int,
        default=ServerConfig.processes,
        help="server processes behind the one port (SO_REUSEPORT), one supervisor relaying "
        "the control socket to all: more requests per second than one event loop; each "
        "holds its own copy of the models, with 1/N of the memory budget and rate limits",
    )
    # set by the supervisor on the workers it starts
    pool.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    pool.add_argument("--pool-size", type=int, default=1, help=argparse.SUPPRESS)
    pool.add_argument("--pool-dir", help=argparse.SUPPRESS)
    add_log_flags(p)
    trt = p.add_argument_group("TensorRT backend")
    trt.add_argument(
        "--precision",
        choices=defaults.PRECISIONS,
        default=TensorRTConfig.precision,
        help="model: what the ONNX graph carries (TensorRT 11 builds only this way); fp16 on "
        "an fp32 graph needs TensorRT 10; int8 needs Q/DQ nodes",
    )
    trt.add_argument("--trt-contexts", type=int, default=TensorRTConfig.contexts)
    trt.add_argument(
        "--trt-batch",
        type=_bounds,
        default=TensorRTConfig.batch,
        metavar="MIN,OPT,MAX",
        help="optimization profile of a dynamic first axis",
    )
    trt.add_argument(
        "--trt-dims",
        type=_bounds,
        default=TensorRTConfig.dims,
        metavar="MIN,OPT,MAX",
        help="optimization profile of other dynamic axes",
    )
    trt.add_argument("--trt-workspace-mb", type=int, default=TensorRTConfig.workspace_mb)
    trt.add_argument(
        "--trt-host-code-allowed",
        action="store_true",
        help="let version-compatible plans run their host code (trusted repositories only)",
    )
    trt.add_argument(
        "--trt-plugin-library",
        action="append",
        default=[],
        help="TensorRT plugin library to load (repeatable)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = build_parser()
    a = p.parse_args(argv)
    if a.grpc_port is not None and not 0 <= a.grpc_port <= 65535:
        p.error("--grpc-port must be a TCP port (0: any free one)")
    if a.retain < 1:
        p.error("--retain must be at least 1")
    if a.drain_seconds < 0:
        p.error("--drain-seconds must not be negative")
    if a.inflight_grace_seconds < 0:
        p.error("--inflight-grace-seconds must not be negative")
    if a.body_read_timeout_seconds <= 0:
        p.error("--body-read-timeout-seconds must be positive")
    if a.json_workers < 1:
        p.error("--json-workers must be at least 1")
    if a.json_max_pending is not None and a.json_max_pending < 1:
        p.error("--json-max-pending must be at least 1")
    if a.shadow_max_in_flight < 1:
        p.error("--shadow-max-in-flight must be at least 1")
    if a.max_batch_size < 0:
        p.error("--max-batch-size must not be negative (0: no batching)")
    if a.max_queue_delay_us < 0:
        p.error("--max-queue-delay-us must not be negative")
    if not 0 <= a.quick_run_us <= 10_000:
        p.error("--quick-run-us must be between 0 and 10000")
    if not 0 <= a.inference_nice <= 19:
        p.error("--inference-nice must be between 0 and 19")
    if not 50 <= a.gil_switch_interval_us <= 100_000:
        p.error("--gil-switch-interval-us must be between 50 and 100000")
    if a.precision in ("fp16", "int8") and a.backend != "tensorrt":
        p.error(f"--precision {a.precision} needs --backend tensorrt")
    if a.trt_contexts < 1:
        p.error("--trt-contexts must be at least 1")
    if a.processes < 1:
        p.error("--processes must be at least 1")
    if a.processes > 1 and (a.port == 0 or a.grpc_port == 0):
        p.error("--processes above 1 needs fixed ports: every process binds the same one")
    if a.worker_index is not None and not (0 <= a.worker_index < a.pool_size and a.pool_dir):
        p.error("--worker-index needs --pool-dir and a --pool-size above it")
    try:
        models = [ModelSpec.parse(m) for m in a.model]
    except InvalidName as exc:
        p.error(f"--model: {exc}")
    if a.request_memory_mb < 1:
        p.error("--request-memory-mb must be at least 1")
    try:
        max_rows = dict(_model_rows(text) for text in a.max_rows)
    except ValueError as exc:
        p.error(f"--max-rows: {exc}")
    try:
        batch_models = tuple(dict.fromkeys(check_model_key(m) for m in a.batch_model))
    except InvalidName as exc:
        p.error(f"--batch-model: {exc}")
    if a.max_batch_size > 0 and not batch_models:
        p.error(
            f"--max-batch-size {a.max_batch_size} batches only the models --batch-model names "
            "(batching is opt-in per model): name one, or give --max-batch-size 0"
        )
    jwt: JwtConfig | None = None
    if a.jwks_file or a.jwks_url:
        if not a.tenants_file:
            p.error("--jwks-file/--jwks-url need --tenants-file (a token names a tenant)")
        try:
            jwt = JwtConfig(
                issuer=a.jwt_issuer or "",
                audience=a.jwt_audience or "",
                jwks_file=optional_path(a.jwks_file),
                jwks_url=a.jwks_url,
                algorithms=tuple(x.strip() for x in a.jwt_algorithms.split(",") if x.strip()),
                leeway_s=a.jwt_leeway_seconds,
                tenant_claim=a.jwt_tenant_claim,
                min_refresh_s=a.jwks_min_refresh_seconds,
                max_age_s=a.jwks_max_age_seconds,
            )
        except ValueError as exc:
            p.error(str(exc))
    elif a.jwt_issuer or a.jwt_audience:
        p.error("--jwt-issuer/--jwt-audience need --jwks-file or --jwks-url")
    return ServerConfig(
        repository=Path(a.repository),
        models=models,
        host=a.host,
        port=a.port,
        grpc_port=a.grpc_port,
        backend=a.backend,
        cache_dir=optional_path(a.cache_dir),
        retain=a.retain,
        memory_budget_mb=a.memory_budget_mb,
        spare_copy_mb=a.spare_copy_mb,
        pin_private_copies=a.pin_private_copies,
        control_socket=optional_path(a.control_socket),
        admin_token_file=optional_path(a.admin_token_file),
        tenants_file=optional_path(a.tenants_file),
        jwt=jwt,
        audit_log=optional_path(a.audit_log),
        workers=a.workers,
        drain_seconds=a.drain_seconds,
        inflight_grace_seconds=a.inflight_grace_seconds,
        body_read_timeout_seconds=a.body_read_timeout_seconds,
        json_workers=a.json_workers,
        json_max_pending=a.json_max_pending,
        traffic_seed=a.traffic_seed,
        shadow_max_in_flight=a.shadow_max_in_flight,
        max_batch_size=a.max_batch_size,
        max_queue_delay_us=a.max_queue_delay_us,
        batch_models=batch_models,
        max_rows=max_rows,
        request_memory_mb=a.request_memory_mb,
        gil_switch_interval_us=a.gil_switch_interval_us,
        inference_nice=a.inference_nice,
        quick_run_us=a.quick_run_us,
        processes=a.processes,
        worker_index=a.worker_index,
        pool_size=a.pool_size,
        pool_dir=optional_path(a.pool_dir),
        log=log_settings(a),
        tensorrt=TensorRTConfig(
            precision=a.precision,
            contexts=a.trt_contexts,
            batch=a.trt_batch,
            dims=a.trt_dims,
            workspace_mb=a.trt_workspace_mb,
            host_code_allowed=a.trt_host_code_allowed,
            plugin_libraries=tuple(Path(x) for x in a.trt_plugin_library),
        ),
    )
