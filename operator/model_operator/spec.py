"""ModelDeployment spec: parsed into typed values and validated beyond the CRD schema
(the API server enforces the schema; the operator re-checks everything so that a bad
object never changes anything, whatever API server it runs against)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from model_rollout_contract import defaults
from model_rollout_contract.argv import STORE_DIR, LogArgs
from model_rollout_contract.canary import MAX_DRIFT_THRESHOLD
from model_rollout_contract.layout import STORE_ID_PATTERN, STORE_ID_RULE
from model_rollout_contract.names import NAME_RULE, ModelKey, is_valid_name
from model_rollout_contract.redact import redact
from model_rollout_contract.states import CanaryStep
from model_rollout_contract.tracks import TRACK_PATTERN, TRACK_RULE

from .errors import SpecError
from .placement import ContainerResources, PodSettings, parse_pod, parse_resources

PRECISIONS = defaults.PRECISIONS
BACKENDS = ("tensorrt", "onnxruntime", "torch")
# a Kubernetes resource quantity ("500m", "16Gi", "2", "1e3"), never negative; the CRD
# repeats it as the `pattern` of resources.cpu and resources.memory (a test compares them)
QUANTITY = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?")
# the name of a Secret or PersistentVolumeClaim: a DNS-1123 subdomain (the CRD's pattern)
OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
OBJECT_NAME_MAX = 253
S3_URL = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,62}(/.*)?")  # bucket, then any prefix
# an S3 endpoint, http(s)://host[:port][/path], with no "@" anywhere: credentials written
# into it (user:password@) would be shown to anyone who can read the Deployment, and
# quoted by errors; they belong in credentialsSecret (the CRD's pattern: a test compares)
ENDPOINT_URL = re.compile(r"https?://[^/?#@\s]+([/?#][^@\s]*)?")
# limits the CRD repeats as its maximum:s (the property test checks that both agree)
MAX_DRAIN_SECONDS = 300
MAX_SERVER_PROCESSES = 16  # spec.server.processes: each holds its own copy of the engines
MAX_START_JITTER_SECONDS = 600
MAX_BACKOFF_SECONDS = 3600
MAX_CONCURRENT_DOWNLOADS = 16
MAX_BATCH_SIZE = 4096  # spec.server.batching.maxBatchSize, rows
MAX_QUEUE_DELAY_MICROSECONDS = 1_000_000  # spec.server.batching: one second
MAX_ROWS_PER_REQUEST = 1 << 20  # spec.server.maxRowsPerRequest
NO_SIGNING_KEY = (
    "spec.signingPublicKeySecret is required: a Secret holding public.pem, the Ed25519 key"
    " model versions must be signed with (or spec.allowUnsigned: true, for development only)"
)


@dataclass(frozen=True)
class StoreSpec:
    url: str | None = None  # s3://bucket/prefix
    endpoint: str | None = None
    credentials_secret: str | None = None
    pvc: str | None = None  # claim name: the store is a volume mounted at /store
    # a volume store's identity, which its manifests bind (StoreUrl.bound_scope); none:
    # versions signed for any directory store pass
    id: str | None = None

    @property
    def sidecar_url(self) -> str:
        return self.url if self.url else f"file://{STORE_DIR}"


# limits of spec.canary.analysis the CRD repeats (the property test checks both agree)
MAX_ANALYSIS_INTERVAL_SECONDS = 3600
MAX_FAILURE_LIMIT = 100
MAX_INCONCLUSIVE_LIMIT = 1000
MAX_INCONCLUSIVE_DEADLINE_SECONDS = 86400
# spec.canary.analysis.onInconclusive: what an analysis that cannot conclude leads to
ON_INCONCLUSIVE = ("rollback", "hold")
# the figures a Prometheus query template may ask for, and its placeholders: every
# template names {version}, so that it reads the candidate and the stable version apart
PROMETHEUS_QUERIES = (
    "requests",
    "errors",
    "latencyP99",
    "shadowRequests",
    "shadowLatencyP99",
    "engineLatencyP99",
    "drift",
    "argmaxAgreement",
    "nonFinite",
)
VERSION_PLACEHOLDER = "{version}"


@dataclass(frozen=True)
class PrometheusSpec:
    """Read the analysis figures with PromQL from a Prometheus server instead of
    scraping the pods; ``queries`` overrides some of the templates (query name -> text)."""

    url: str
    queries: tuple[tuple[str, str], ...] = ()

    def query(self, name: str) -> str | None:
        return dict(self.queries).get(name)


@dataclass(frozen=True)
class AnalysisSpec:
    """``spec.canary.analysis``: judge the canary on its own figures every interval."""

    interval_seconds: float = defaults.ANALYSIS_INTERVAL_SECONDS
    min_requests: int = defaults.ANALYSIS_MIN_REQUESTS
    failure_limit: int = defaults.ANALYSIS_FAILURE_LIMIT
    max_error_rate: float = defaults.ANALYSIS_MAX_ERROR_RATE
    max_latency_ratio: float = defaults.ANALYSIS_MAX_LATENCY_RATIO
    max_output_drift: float | None = None  # p99 of the shadow's max |stable - candidate|
    min_argmax_agreement: float | None = None  # share of shadowed class scores that agree
    max_non_finite: int = defaults.ANALYSIS_MAX_NON_FINITE
    prometheus: PrometheusSpec | None = None
    # an analysis that cannot conclude (no traffic, its figures unreadable) ends: after
    # this many inconclusive checks in a row (None: no count), or this long without a
    # conclusive one (None: spec.rollout.progressDeadlineSeconds), the canary is rolled
    # back ("rollback") or held, Degraded, until a check concludes ("hold")
    inconclusive_limit: int | None = None
    inconclusive_deadline_seconds: float | None = None
    on_inconclusive: str = defaults.ANALYSIS_ON_INCONCLUSIVE

    def inconclusive_deadline(self, rollout: RolloutSettings) -> float:
        return self.inconclusive_deadline_seconds or rollout.progress_deadline_seconds


@dataclass(frozen=True)
class ShadowStepSpec:
    """``spec.canary.shadow``: the canary's first step, in which the candidate answers
    only mirrored requests (``percent`` % of the canary pods' stable answers); its
    analysis must pass before the candidate gets any live share. ``enabled`` is resolved
    when parsed: absent, it is on wherever it can be (analysis, canary pods, two versions
    retained); ``explicit`` says whether the spec said so itself."""

    enabled: bool = False
    percent: int = defaults.CANARY_SHADOW_STEP_PERCENT
    explicit: bool = False


@dataclass(frozen=True)
class CanarySpec:
    percent: int = defaults.CANARY_PERCENT  # share of the pods
    pause_seconds: float = defaults.CANARY_PAUSE_SECONDS
    manual_promote: bool = defaults.MANUAL_PROMOTE
    traffic_percent: int = defaults.CANARY_TRAFFIC_PERCENT  # share of a canary pod's requests
    shadow_percent: int = defaults.CANARY_SHADOW_PERCENT
    analysis: AnalysisSpec | None = None  # None: a healthy canary is promoted after the pause
    shadow: ShadowStepSpec = field(default_factory=ShadowStepSpec)

    @property
    def in_pod(self) -> bool:
        """The canary pods hold both versions and split (or mirror) requests themselves."""
        return self.traffic_percent > 0 or self.shadow_percent > 0

    def holds_both(self, step: CanaryStep) -> bool:
        """Whether the canary pods hold both versions in ``step`` (in the shadow step they
        always do: the stable version answers, the candidate runs the mirrored requests)."""
        return step is CanaryStep.SHADOW or self.in_pod

    def first_step(self) -> CanaryStep:
        """The step a new canary starts in."""
        return CanaryStep.SHADOW if self.shadow.enabled else CanaryStep.LIVE


@dataclass(frozen=True)
class RolloutSettings:
    batch_size: int | None = None
    batch_percent: int | None = defaults.BATCH_PERCENT
    jitter_seconds: float = defaults.JITTER_SECONDS
    max_unavailable: int = defaults.MAX_UNAVAILABLE
    max_concurrent_loads: int | None = None
    progress_deadline_seconds: float = defaults.PROGRESS_DEADLINE_SECONDS

    def batch(self, replicas: int) -> int:
        size = self.batch_size or math.ceil(replicas * (self.batch_percent or 100) / 100)
        if self.max_concurrent_loads:
            size = min(size, self.max_concurrent_loads)
        return max(1, size)


@dataclass(frozen=True)
class SidecarSettings:
    """Storm controls: a fleet that starts, or is told a new version, at once must not
    hit the model store at once (passed to init and watch as their flags)."""

    start_jitter_seconds: float = defaults.START_JITTER_SECONDS
    backoff_base_seconds: float = defaults.BACKOFF_BASE_SECONDS
    backoff_max_seconds: float = defaults.BACKOFF_MAX_SECONDS
    max_concurrent_downloads: int = defaults.MAX_CONCURRENT_DOWNLOADS


@dataclass(frozen=True)
class BatchingSettings:
    """spec.server.batching: the server's dynamic batching (model_server.scheduling.batching)."""

    max_batch_size: int = defaults.MAX_BATCH_SIZE  # rows per engine run; 0 = off
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_MICROSECONDS


@dataclass(frozen=True)
class ServerSettings:
    drain_seconds: float = defaults.DRAIN_SECONDS  # SIGTERM: serve unready this long
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    processes: int = defaults.SERVER_PROCESSES  # behind the pod's one port
    # the model's bound on rows per request (None: the server derives it from the model)
    max_rows_per_request: int | None = None


@dataclass(frozen=True)
class JwtSpec:
    """``spec.tenants.jwt``: tenants' JWTs beside their API keys; the issuer's keys from a
    JWKS Secret (key ``jwks.json``) or an https URL."""

    issuer: str
    audience: str
    jwks_secret: str | None = None
    jwks_url: str | None = None
    algorithms: tuple[str, ...] = defaults.JWT_ALGORITHMS
    tenant_claim: str = defaults.JWT_TENANT_CLAIM
    leeway_seconds: float = defaults.JWT_LEEWAY_SECONDS


MAX_JWT_LEEWAY_SECONDS = 300  # more would let an expired token live on for minutes
JWT_TEXT_MAX = 1024  # issuer, audience, claim, URL: short text on a command line
# an https URL with a host and no user-info (the CRD's pattern too)
JWKS_URL = re.compile(r"https://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[^\s]*)?")


@dataclass(frozen=True)
class TenantModelSpec:
    """One of ``spec.tenants.models``: a tenant's model with its own version and rollout
    (a named track: model_rollout_contract.tracks), on the same pods, under the
    deployment's canary and rollout settings."""

    track: str
    tenant: str
    model: str
    version: str
    signing_public_key_secret: str | None = None  # None: the deployment's key
    # opted in to dynamic batching (under spec.server.batching's sizes): --batch-model
    batching: bool = False
    # its bound on rows per request (None: the server derives it): --max-rows
    max_rows_per_request: int | None = None

    @property
    def key(self) -> str:
        """The server's and the store's name for it: ``tenant/model``."""
        return str(ModelKey(self.tenant, self.model))


MAX_TENANT_MODELS = 16  # a sidecar container each


@dataclass(frozen=True)
class ModelDeploymentSpec:
    model: str
    version: str
    image: str
    store: StoreSpec
    replicas: int = defaults.REPLICAS
    sidecar_image: str | None = None
    backend: str = defaults.BACKEND
    precision: str = defaults.PRECISION
    gpus: int = defaults.GPUS
    cpu: str | int | None = None  # a quantity
    memory: str | int | None = None
    model_storage: str | int | None = None  # a quantity: the model volume's size limit
    canary: CanarySpec = field(default_factory=CanarySpec)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    retain_versions: int = defaults.RETAIN_VERSIONS
    # exactly one of the two: the key manifests must be signed with, or an explicit
    # opt-out of signature checks (development only)
    signing_public_key_secret: str | None = None
    allow_unsigned: bool = defaults.ALLOW_UNSIGNED
    paused: bool = defaults.PAUSED  # kubectl model pause: no rollout step starts (planner.py)
    tenants_secret: str | None = None  # Secret with tenants.yaml (see model-server)
    jwt: JwtSpec | None = None  # with tenants_secret only
    tenant_models: tuple[TenantModelSpec, ...] = ()  # with tenants_secret only
    sidecar: SidecarSettings = field(default_factory=SidecarSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    logging: LogArgs = field(default_factory=LogArgs)  # spec.logging: the pod's server and sidecars
    # where the pods run and what their other containers ask for (placement.py)
    pod: PodSettings = field(default_factory=PodSettings)
    containers: ContainerResources = field(default_factory=ContainerResources)

    def canary_pods(self) -> int:
        if self.canary.percent <= 0 or self.replicas == 0:
            return 0
        return min(self.replicas, max(1, math.ceil(self.replicas * self.canary.percent / 100)))


def _get(
    raw: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    problems: list[str],
    where: str,
    default: Any = None,
) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        problems.append(f"{where}{key} must be a number, not {value!r}")
        return default
    if not isinstance(value, kind):
        problems.append(f"{where}{key} has the wrong type ({type(value).__name__})")
        return default
    return value


def _name(raw: dict[str, Any], key: str, problems: list[str], where: str = "spec.") -> str:
    value = raw.get(key)
    if not is_valid_name(value):
        problems.append(f"{where}{key} must be a name of {NAME_RULE} (got {value!r})")
        return ""
    assert isinstance(value, str)
    return value


def _object_name(raw: dict[str, Any], key: str, problems: list[str], where: str) -> str | None:
    """A Secret's or a claim's name, or ``None`` when absent; a malformed one is a problem
    (never dropped: a dropped signing key would mean unsigned pods)."""
    value = raw.get(key)
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or len(value) > OBJECT_NAME_MAX
        or not OBJECT_NAME.fullmatch(value)
    ):
        problems.append(
            f"{where}{key} must be the name of an object (a DNS subdomain: lower-case letters,"
            f" digits, '-' and '.', at most {OBJECT_NAME_MAX}), not {value!r}"
        )
        return None
    return value


def _store_id(raw: dict[str, Any], problems: list[str]) -> str | None:
    """``spec.store.id``: a volume store's identity (an S3 store is named by its bucket
    and prefix: an id beside url is refused, never ignored)."""
    value = raw.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not STORE_ID_PATTERN.fullmatch(value):
        problems.append(f"spec.store.id must be {STORE_ID_RULE}, not {value!r}")
        return None
    if raw.get("url") is not None:
        problems.append("spec.store.id names a volume store (pvc); an S3 store is named by its url")
        return None
    return value


def _endpoint(raw: dict[str, Any], problems: list[str]) -> str | None:
    """The store's endpoint URL, or ``None``; one with credentials in it is refused, and
    the refusal does not repeat them."""
    value = raw.get("endpoint")
    if value is None:
        return None
    if isinstance(value, str) and ENDPOINT_URL.fullmatch(value):
        return value
    shown = redact(value) if isinstance(value, str) else value
    problems.append(
        "spec.store.endpoint must be an http(s) URL with no credentials in it (no"
        f" user:password@: put them in spec.store.credentialsSecret), not {shown!r}"
    )
    return None


def _quantity(raw: dict[str, Any], key: str, problems: list[str], where: str) -> str | int | None:
    """A resource quantity: a string such as ``500m`` or ``16Gi``, or a whole number."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and QUANTITY.fullmatch(value):
        return value
    problems.append(
        f'{where}{key} must be a Kubernetes quantity such as "500m", "16Gi" or a whole'
        f" number, not {value!r}"
    )
    return None


def _number(
    raw: dict[str, Any], key: str, problems: list[str], where: str, default: float
) -> float:
    return float(_get(raw, key, (int, float), problems, where, default))


def _range(
    problems: list[str], where: str, value: float | None, low: float, high: float | None = None
) -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        problems.append(f"{where} must be {bound} (got {value})")


def parse_spec(raw: Any) -> ModelDeploymentSpec:
    """Parse and validate; raises ``SpecError`` listing every problem found."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise SpecError(["spec must be an object"])
    model, version = _name(raw, "model", problems), _name(raw, "version", problems)
    image = _get(raw, "image", str, problems, "spec.")
    if not image:
        problems.append("spec.image is required")
    replicas = _get(raw, "replicas", int, problems, "spec.", defaults.REPLICAS)
    _range(problems, "spec.replicas", replicas, 0, 1000)

    store_raw = _get(raw, "store", dict, problems, "spec.", {})
    url = _get(store_raw, "url", str, problems, "spec.store.")
    pvc = _object_name(store_raw, "pvc", problems, "spec.store.")
    if (url is None) == (pvc is None):
        problems.append("spec.store needs exactly one of url (s3://bucket/prefix) or pvc")
    elif url is not None and not S3_URL.fullmatch(url):
        problems.append(f"spec.store.url must be s3://bucket/prefix (got {url!r})")
    store = StoreSpec(
        url,
        _endpoint(store_raw, problems),
        _object_name(store_raw, "credentialsSecret", problems, "spec.store."),
        pvc,
        _store_id(store_raw, problems),
    )

    canary = _canary(_get(raw, "canary", dict, problems, "spec.", {}), raw, problems)

    ro = _get(raw, "rollout", dict, problems, "spec.", {})
    batch_size = _get(ro, "batchSize", int, problems, "spec.rollout.")
    batch_percent = _get(ro, "batchPercent", int, problems, "spec.rollout.")
    if batch_size is not None and batch_percent is not None:
        problems.append("spec.rollout takes batchSize or batchPercent, not both")
    rollout = RolloutSettings(
        batch_size=batch_size,
        batch_percent=(batch_percent or defaults.BATCH_PERCENT) if batch_size is None else None,
        jitter_seconds=float(
            _get(
                ro,
                "jitterSeconds",
                (int, float),
                problems,
                "spec.rollout.",
                RolloutSettings.jitter_seconds,
            )
        ),
        max_unavailable=_get(
            ro, "maxUnavailable", int, problems, "spec.rollout.", RolloutSettings.max_unavailable
        ),
        max_concurrent_loads=_get(ro, "maxConcurrentLoads", int, problems, "spec.rollout."),
        progress_deadline_seconds=float(
            _get(
                ro,
                "progressDeadlineSeconds",
                (int, float),
                problems,
                "spec.rollout.",
                RolloutSettings.progress_deadline_seconds,
            )
        ),
    )
    _range(problems, "spec.rollout.batchSize", batch_size, 1)
    _range(problems, "spec.rollout.batchPercent", batch_percent, 1, 100)
    _range(problems, "spec.rollout.jitterSeconds", rollout.jitter_seconds, 0, 3600)
    _range(problems, "spec.rollout.maxUnavailable", rollout.max_unavailable, 0)
    _range(problems, "spec.rollout.maxConcurrentLoads", rollout.max_concurrent_loads, 1)
    _range(problems, "spec.rollout.progressDeadlineSeconds", rollout.progress_deadline_seconds, 1)

    resources = _get(raw, "resources", dict, problems, "spec.", {})
    gpus = _get(resources, "gpu", int, problems, "spec.resources.", defaults.GPUS)
    _range(problems, "spec.resources.gpu", gpus, 0, 16)
    backend = _get(raw, "backend", str, problems, "spec.", defaults.BACKEND)
    if backend not in BACKENDS:
        problems.append(f"spec.backend must be one of {BACKENDS} (got {backend!r})")
    precision = _get(raw, "precision", str, problems, "spec.", defaults.PRECISION)
    if precision not in PRECISIONS:
        problems.append(f"spec.precision must be one of {PRECISIONS} (got {precision!r})")
    elif precision in ("fp16", "int8") and backend != "tensorrt":
        problems.append(
            f"spec.precision {precision} needs backend tensorrt (onnxruntime and torch run "
            "the graph as it is: use model or fp32)"
        )
    retain = _get(raw, "retainVersions", int, problems, "spec.", defaults.RETAIN_VERSIONS)
    _range(problems, "spec.retainVersions", retain, 1, 8)

    cpu = _quantity(resources, "cpu", problems, "spec.resources.")
    memory = _quantity(resources, "memory", problems, "spec.resources.")
    model_storage = _quantity(resources, "modelStorage", problems, "spec.resources.")
    containers = parse_resources(resources, problems)
    pod = parse_pod(raw.get("pod"), problems)

    tenants = _get(raw, "tenants", dict, problems, "spec.", {})
    tenants_secret = _object_name(tenants, "secretName", problems, "spec.tenants.")
    jwt = _jwt(_get(tenants, "jwt", dict, problems, "spec.tenants."), problems)
    if jwt is not None and tenants_secret is None:
        problems.append("spec.tenants.jwt needs spec.tenants.secretName: a token names a tenant")
    tenant_models = _tenant_models(tenants, model, problems)
    if tenant_models and tenants_secret is None:
        problems.append(
            "spec.tenants.models needs spec.tenants.secretName: the tenants file says whose "
            "keys and tokens reach them"
        )
    sidecar_image = _get(raw, "sidecarImage", str, problems, "spec.")
    signing_key, allow_unsigned = _signing(raw, problems)
    paused = _get(raw, "paused", bool, problems, "spec.", defaults.PAUSED)
    sidecar = _sidecar_settings(_get(raw, "sidecar", dict, problems, "spec.", {}), problems)
    server_raw = _get(raw, "server", dict, problems, "spec.", {})
    server = ServerSettings(
        _number(server_raw, "drainSeconds", problems, "spec.server.", defaults.DRAIN_SECONDS),
        _batching(_get(server_raw, "batching", dict, problems, "spec.server.", {}), problems),
        _get(server_raw, "processes", int, problems, "spec.server.", defaults.SERVER_PROCESSES),
        _get(server_raw, "maxRowsPerRequest", int, problems, "spec.server."),
    )
    _range(
        problems, "spec.server.maxRowsPerRequest", server.max_rows_per_request, 1,
        MAX_ROWS_PER_REQUEST,
    )  # fmt: skip
    _range(problems, "spec.server.drainSeconds", server.drain_seconds, 0, MAX_DRAIN_SECONDS)
    for i, tenant_model in enumerate(tenant_models):
        if tenant_model.batching and not server.batching.max_batch_size:
            problems.append(
                f"spec.tenants.models[{i}].batching needs spec.server.batching.maxBatchSize "
                "above 0 (the sizes every batched model runs under)"
            )
    _range(problems, "spec.server.processes", server.processes, 1, MAX_SERVER_PROCESSES)
    log_args = _logging(_get(raw, "logging", dict, problems, "spec.", {}), problems)

    if problems:
        raise SpecError(problems)
    return ModelDeploymentSpec(
        model=model,
        version=version,
        image=image,
        store=store,
        replicas=replicas,
        sidecar_image=sidecar_image,
        backend=backend,
        precision=precision,
        gpus=gpus,
        cpu=cpu,
        memory=memory,
        model_storage=model_storage,
        canary=canary,
        rollout=rollout,
        retain_versions=retain,
        signing_public_key_secret=signing_key,
        allow_unsigned=allow_unsigned,
        paused=bool(paused),
        tenants_secret=tenants_secret,
        jwt=jwt,
        tenant_models=tenant_models,
        sidecar=sidecar,
        server=server,
        logging=log_args,
        pod=pod,
        containers=containers,
    )


def _tenant_models(
    tenants: dict[str, Any], model: str, problems: list[str]
) -> tuple[TenantModelSpec, ...]:
    """``spec.tenants.models``: each a track of its own, a tenant/model once."""
    raw = _get(tenants, "models", list, problems, "spec.tenants.", [])
    if len(raw) > MAX_TENANT_MODELS:
        problems.append(f"spec.tenants.models holds at most {MAX_TENANT_MODELS} models")
        return ()
    out: list[TenantModelSpec] = []
    for i, entry in enumerate(raw):
        where = f"spec.tenants.models[{i}]."
        if not isinstance(entry, dict):
            problems.append(f"{where[:-1]} must be an object")
            continue
        track = entry.get("name")
        if not isinstance(track, str) or TRACK_PATTERN.fullmatch(track) is None:
            problems.append(f"{where}name must be {TRACK_RULE} (got {track!r})")
            track = None
        tenant = _name(entry, "tenant", problems, where)
        name = _name(entry, "model", problems, where)
        version = _name(entry, "version", problems, where)
        key_secret = _object_name(entry, "signingPublicKeySecret", problems, where)
        batching = _get(entry, "batching", bool, problems, where, False)
        rows = _get(entry, "maxRowsPerRequest", int, problems, where)
        _range(problems, f"{where}maxRowsPerRequest", rows, 1, MAX_ROWS_PER_REQUEST)
        if tenant and tenant == model:
            problems.append(
                f"{where}tenant {tenant!r} is the deployment's model: its directory would hold both"
            )
        if track and tenant and name and version:
            out.append(TenantModelSpec(track, tenant, name, version, key_secret, batching, rows))
    for what, values in (
        ("name", [t.track for t in out]),
        ("tenant and model", [t.key for t in out]),
    ):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            problems.append(f"spec.tenants.models: each {what} once (repeated: {repeated})")
    return tuple(out)


def _jwt_text(raw: dict[str, Any], key: str, problems: list[str], required: bool) -> str | None:
    where = "spec.tenants.jwt."
    value = _get(raw, key, str, problems, where)
    if value is None:
        if required:
            problems.append(f"{where}{key} is required")
        return None
    if not 0 < len(value) <= JWT_TEXT_MAX:
        problems.append(f"{where}{key} must be 1-{JWT_TEXT_MAX} characters")
        return None
    return value


def _jwt(raw: dict[str, Any] | None, problems: list[str]) -> JwtSpec | None:
    """``spec.tenants.jwt``, or ``None`` without one; every field checked here, so the
    server never starts with a configuration it refuses."""
    if raw is None:
        return None
    where = "spec.tenants.jwt."
    issuer = _jwt_text(raw, "issuer", problems, required=True)
    audience = _jwt_text(raw, "audience", problems, required=True)
    secret = _object_name(raw, "jwksSecret", problems, where)
    url = _get(raw, "jwksUrl", str, problems, where)
    if url is not None and (len(url) > JWT_TEXT_MAX or not JWKS_URL.fullmatch(url)):
        problems.append(
            f"{where}jwksUrl must be an https URL with a host and no credentials, "
            f"not {redact(url)[:200]!r}"
        )
        url = None
    if (raw.get("jwksSecret") is None) == (raw.get("jwksUrl") is None):
        problems.append("spec.tenants.jwt needs exactly one of jwksSecret and jwksUrl")
    algorithms = _get(raw, "algorithms", list, problems, where, list(defaults.JWT_ALGORITHMS))
    allowed = defaults.JWT_ASYMMETRIC_ALGORITHMS
    if (
        not algorithms
        or len(set(map(str, algorithms))) != len(algorithms)
        or not all(a in allowed for a in algorithms)
    ):
        problems.append(
            f"{where}algorithms must be distinct asymmetric algorithms of {', '.join(allowed)}"
            f" (never none or HS*), not {algorithms!r}"
        )
    claim = _jwt_text(raw, "tenantClaim", problems, required=False)
    leeway = _number(raw, "leewaySeconds", problems, where, defaults.JWT_LEEWAY_SECONDS)
    _range(problems, f"{where}leewaySeconds", leeway, 0, MAX_JWT_LEEWAY_SECONDS)
    return JwtSpec(
        issuer=issuer or "",
        audience=audience or "",
        jwks_secret=secret,
        jwks_url=url,
        algorithms=tuple(str(a) for a in algorithms),
        tenant_claim=claim or defaults.JWT_TENANT_CLAIM,
        leeway_seconds=leeway,
    )


def _batching(raw: dict[str, Any], problems: list[str]) -> BatchingSettings:
    where = "spec.server.batching."
    settings = BatchingSettings(
        _get(raw, "maxBatchSize", int, problems, where, defaults.MAX_BATCH_SIZE),
        _get(
            raw, "maxQueueDelayMicroseconds", int, problems, where,
            defaults.MAX_QUEUE_DELAY_MICROSECONDS,
        ),
    )  # fmt: skip
    _range(problems, f"{where}maxBatchSize", settings.max_batch_size, 0, MAX_BATCH_SIZE)
    _range(
        problems, f"{where}maxQueueDelayMicroseconds", settings.max_queue_delay_us, 0,
        MAX_QUEUE_DELAY_MICROSECONDS,
    )  # fmt: skip
    return settings


def _logging(raw: dict[str, Any], problems: list[str]) -> LogArgs:
    """``spec.logging``: the format and level of the pod's programs' log lines."""
    where = "spec.logging."
    settings = LogArgs(
        _get(raw, "format", str, problems, where, defaults.LOG_FORMAT),
        _get(raw, "level", str, problems, where, defaults.LOG_LEVEL),
    )
    for key, value, allowed in (
        ("format", settings.format, defaults.LOG_FORMATS),
        ("level", settings.level, defaults.LOG_LEVELS),
    ):
        if value not in allowed:
            problems.append(f"{where}{key} must be one of {allowed} (got {value!r})")
    return settings


def _signing(raw: dict[str, Any], problems: list[str]) -> tuple[str | None, bool]:
    """Signature checks are on unless the spec says ``allowUnsigned: true``, and then
    there must be no key (a key that would be ignored is a mistake worth saying)."""
    key = _object_name(raw, "signingPublicKeySecret", problems, "spec.")
    malformed = raw.get("signingPublicKeySecret") is not None and key is None
    allow = bool(_get(raw, "allowUnsigned", bool, problems, "spec.", defaults.ALLOW_UNSIGNED))
    if key is not None and allow:
        problems.append("spec takes signingPublicKeySecret or allowUnsigned: true, not both")
    elif key is None and not allow and not malformed:
        problems.append(NO_SIGNING_KEY)
    return key, allow


def _sidecar_settings(raw: dict[str, Any], problems: list[str]) -> SidecarSettings:
    where = "spec.sidecar."
    settings = SidecarSettings(
        start_jitter_seconds=_number(
            raw, "startJitterSeconds", problems, where, defaults.START_JITTER_SECONDS
        ),
        backoff_base_seconds=_number(
            raw, "backoffBaseSeconds", problems, where, defaults.BACKOFF_BASE_SECONDS
        ),
        backoff_max_seconds=_number(
            raw, "backoffMaxSeconds", problems, where, defaults.BACKOFF_MAX_SECONDS
        ),
        max_concurrent_downloads=_get(
            raw, "maxConcurrentDownloads", int, problems, where, defaults.MAX_CONCURRENT_DOWNLOADS
        ),
    )
    for key, value, low, high in (
        ("startJitterSeconds", settings.start_jitter_seconds, 0, MAX_START_JITTER_SECONDS),
        ("backoffBaseSeconds", settings.backoff_base_seconds, 0.1, MAX_BACKOFF_SECONDS),
        ("backoffMaxSeconds", settings.backoff_max_seconds, 1, MAX_BACKOFF_SECONDS),
        ("maxConcurrentDownloads", settings.max_concurrent_downloads, 1, MAX_CONCURRENT_DOWNLOADS),
    ):
        _range(problems, f"{where}{key}", value, low, high)
    if settings.backoff_max_seconds < settings.backoff_base_seconds:
        problems.append(
            f"{where}backoffMaxSeconds ({settings.backoff_max_seconds}) must be at least"
            f" backoffBaseSeconds ({settings.backoff_base_seconds})"
        )
    return settings


def _canary(raw: dict[str, Any], spec: dict[str, Any], problems: list[str]) -> CanarySpec:
    """``spec.canary``; ``spec`` for the settings an in-pod canary depends on."""
    where = "spec.canary."
    canary = CanarySpec(
        percent=_get(raw, "percent", int, problems, where, CanarySpec.percent),
        pause_seconds=_number(raw, "pauseSeconds", problems, where, CanarySpec.pause_seconds),
        manual_promote=bool(
            _get(raw, "manualPromote", bool, problems, where, CanarySpec.manual_promote)
        ),
        traffic_percent=_get(
            raw, "trafficPercent", int, problems, where, CanarySpec.traffic_percent
        ),
        shadow_percent=_get(raw, "shadowPercent", int, problems, where, CanarySpec.shadow_percent),
        analysis=_analysis(raw, problems),
    )
    _range(problems, f"{where}percent", canary.percent, 0, 100)
    _range(problems, f"{where}pauseSeconds", canary.pause_seconds, 0)
    _range(problems, f"{where}trafficPercent", canary.traffic_percent, 0, 100)
    _range(problems, f"{where}shadowPercent", canary.shadow_percent, 0, 100)
    if canary.in_pod:
        if canary.percent <= 0:
            problems.append(IN_POD_NEEDS_PODS)
        retain = spec.get("retainVersions", defaults.RETAIN_VERSIONS)
        if isinstance(retain, int) and not isinstance(retain, bool) and retain < 2:
            problems.append(IN_POD_NEEDS_TWO_VERSIONS)
    analysis = canary.analysis
    shadow_only = analysis is not None and (
        analysis.max_output_drift is not None or analysis.min_argmax_agreement is not None
    )
    if shadow_only and canary.shadow_percent <= 0:
        problems.append(SHADOW_THRESHOLDS_NEED_SHADOW)
    return replace(canary, shadow=_shadow_step(raw, canary, spec, problems))


def _shadow_step(
    canary_raw: dict[str, Any], canary: CanarySpec, spec: dict[str, Any], problems: list[str]
) -> ShadowStepSpec:
    """``spec.canary.shadow``: explicitly enabled where it cannot run is refused; absent,
    it is on wherever it can run (analysis to end it, canary pods to hold both versions,
    servers that keep two versions)."""
    where = "spec.canary.shadow."
    raw = _get(canary_raw, "shadow", dict, problems, "spec.canary.", {})
    enabled = _get(raw, "enabled", bool, problems, where)
    percent = _get(raw, "percent", int, problems, where, defaults.CANARY_SHADOW_STEP_PERCENT)
    _range(problems, f"{where}percent", percent, 1, 100)
    retain = spec.get("retainVersions", defaults.RETAIN_VERSIONS)
    two_versions = not isinstance(retain, int) or isinstance(retain, bool) or retain >= 2
    possible = canary.analysis is not None and canary.percent > 0 and two_versions
    if enabled:
        if canary.percent <= 0:
            problems.append(SHADOW_STEP_NEEDS_PODS)
        if not two_versions:
            problems.append(SHADOW_STEP_NEEDS_TWO_VERSIONS)
        if canary.analysis is None:
            problems.append(SHADOW_STEP_NEEDS_ANALYSIS)
    on = possible if enabled is None else bool(enabled)
    return ShadowStepSpec(on, percent, explicit=enabled is not None)


SHADOW_STEP_NEEDS_PODS = (
    "spec.canary.shadow.enabled needs spec.canary.percent above 0: the canary pods run the"
    " mirrored requests"
)
SHADOW_STEP_NEEDS_TWO_VERSIONS = (
    "spec.canary.shadow.enabled needs spec.retainVersions of at least 2: the canary pods"
    " keep the stable version answering beside the candidate"
)
SHADOW_STEP_NEEDS_ANALYSIS = (
    "spec.canary.shadow.enabled needs spec.canary.analysis: the shadow step ends on a passed check"
)


IN_POD_NEEDS_PODS = (
    "spec.canary.trafficPercent and shadowPercent need spec.canary.percent above 0: the"
    " canary pods are the ones that hold both versions"
)
IN_POD_NEEDS_TWO_VERSIONS = (
    "spec.canary.trafficPercent and shadowPercent need spec.retainVersions of at least 2:"
    " the canary pods keep the stable version loaded beside the candidate"
)
SHADOW_THRESHOLDS_NEED_SHADOW = (
    "spec.canary.analysis.maxOutputDrift and minArgmaxAgreement need"
    " spec.canary.shadowPercent above 0: only shadowed requests compare the two versions"
)


def _analysis(canary: dict[str, Any], problems: list[str]) -> AnalysisSpec | None:
    raw = _get(canary, "analysis", dict, problems, "spec.canary.")
    if raw is None:
        return None
    where = "spec.canary.analysis."
    drift, agreement = raw.get("maxOutputDrift"), raw.get("minArgmaxAgreement")
    analysis = AnalysisSpec(
        interval_seconds=_number(
            raw, "intervalSeconds", problems, where, defaults.ANALYSIS_INTERVAL_SECONDS
        ),
        min_requests=_get(raw, "minRequests", int, problems, where, defaults.ANALYSIS_MIN_REQUESTS),
        failure_limit=_get(
            raw, "failureLimit", int, problems, where, defaults.ANALYSIS_FAILURE_LIMIT
        ),
        max_error_rate=_number(
            raw, "maxErrorRate", problems, where, defaults.ANALYSIS_MAX_ERROR_RATE
        ),
        max_latency_ratio=_number(
            raw, "maxLatencyRatio", problems, where, defaults.ANALYSIS_MAX_LATENCY_RATIO
        ),
        max_output_drift=None
        if drift is None
        else _number(raw, "maxOutputDrift", problems, where, 0.0),
        min_argmax_agreement=(
            None if agreement is None else _number(raw, "minArgmaxAgreement", problems, where, 0.0)
        ),
        max_non_finite=_get(
            raw, "maxNonFinite", int, problems, where, defaults.ANALYSIS_MAX_NON_FINITE
        ),
        prometheus=_prometheus(raw, problems),
        inconclusive_limit=_get(raw, "inconclusiveLimit", int, problems, where),
        inconclusive_deadline_seconds=(
            None
            if raw.get("inconclusiveDeadlineSeconds") is None
            else _number(raw, "inconclusiveDeadlineSeconds", problems, where, 0.0)
        ),
        on_inconclusive=_get(
            raw, "onInconclusive", str, problems, where, AnalysisSpec.on_inconclusive
        ),
    )
    if analysis.on_inconclusive not in ON_INCONCLUSIVE:
        problems.append(
            f"{where}onInconclusive must be one of {list(ON_INCONCLUSIVE)},"
            f" not {analysis.on_inconclusive!r}"
        )
    for key, value, low, high in (
        ("intervalSeconds", analysis.interval_seconds, 1, MAX_ANALYSIS_INTERVAL_SECONDS),
        ("minRequests", analysis.min_requests, 1, None),
        ("failureLimit", analysis.failure_limit, 1, MAX_FAILURE_LIMIT),
        ("maxErrorRate", analysis.max_error_rate, 0, 1),
        ("maxLatencyRatio", analysis.max_latency_ratio, 1, None),
        ("maxOutputDrift", analysis.max_output_drift, 0, MAX_DRIFT_THRESHOLD),
        ("minArgmaxAgreement", analysis.min_argmax_agreement, 0, 1),
        ("maxNonFinite", analysis.max_non_finite, 0, None),
        ("inconclusiveLimit", analysis.inconclusive_limit, 1, MAX_INCONCLUSIVE_LIMIT),
        (
            "inconclusiveDeadlineSeconds",
            analysis.inconclusive_deadline_seconds,
            1,
            MAX_INCONCLUSIVE_DEADLINE_SECONDS,
        ),
    ):
        _range(problems, f"{where}{key}", value, low, high)
    return analysis


def _prometheus(analysis: dict[str, Any], problems: list[str]) -> PrometheusSpec | None:
    where = "spec.canary.analysis.prometheus."
    raw = _get(analysis, "prometheus", dict, problems, "spec.canary.analysis.")
    if raw is None:
        return None
    url = raw.get("url")
    if not isinstance(url, str) or not ENDPOINT_URL.fullmatch(url):
        shown = redact(url) if isinstance(url, str) else url
        problems.append(
            f"{where}url must be an http(s) URL with no credentials in it, not {shown!r}"
        )
    queries_raw = _get(raw, "queries", dict, problems, where, {})
    queries: list[tuple[str, str]] = []
    for name in PROMETHEUS_QUERIES:
        text = _get(queries_raw, name, str, problems, f"{where}queries.")
        if text is None:
            continue
        if VERSION_PLACEHOLDER not in text:
            problems.append(
                f"{where}queries.{name} must name {VERSION_PLACEHOLDER} (it is asked once per"
                f" version), not {text!r}"
            )
        queries.append((name, text))
    return PrometheusSpec(url if isinstance(url, str) else "", tuple(queries))


def track_spec(spec: ModelDeploymentSpec, tenant_model: TenantModelSpec) -> ModelDeploymentSpec:
    """The spec a tenant model's rollout is planned with: the deployment's settings, the
    tenant's model (``tenant/model``) and version, and its signing key if it has one."""
    return replace(
        spec,
        model=tenant_model.key,
        version=tenant_model.version,
        signing_public_key_secret=(
            tenant_model.signing_public_key_secret or spec.signing_public_key_secret
        ),
        tenant_models=(),
    )
