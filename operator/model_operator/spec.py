"""ModelDeployment spec: parsed into typed values and validated beyond the CRD schema
(the API server enforces the schema; the operator re-checks everything so that a bad
object never changes anything, whatever API server it runs against)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from model_rollout_contract import defaults
from model_rollout_contract.argv import STORE_DIR
from model_rollout_contract.names import NAME_RULE, is_valid_name

from .errors import SpecError

PRECISIONS = ("fp32", "fp16", "int8")
BACKENDS = ("tensorrt", "onnxruntime", "torch")


@dataclass(frozen=True)
class StoreSpec:
    url: str | None = None  # s3://bucket/prefix
    endpoint: str | None = None
    credentials_secret: str | None = None
    pvc: str | None = None  # claim name: the store is a volume mounted at /store

    @property
    def sidecar_url(self) -> str:
        return self.url if self.url else f"file://{STORE_DIR}"


@dataclass(frozen=True)
class CanarySpec:
    percent: int = defaults.CANARY_PERCENT
    pause_seconds: float = defaults.CANARY_PAUSE_SECONDS
    manual_promote: bool = defaults.MANUAL_PROMOTE


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
    cpu: str | None = None
    memory: str | None = None
    canary: CanarySpec = field(default_factory=CanarySpec)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    retain_versions: int = defaults.RETAIN_VERSIONS
    signing_public_key_secret: str | None = None
    tenants_secret: str | None = None  # Secret with tenants.yaml (see model-server)

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
    pvc = _get(store_raw, "pvc", str, problems, "spec.store.")
    if bool(url) == bool(pvc):
        problems.append("spec.store needs exactly one of url (s3://bucket/prefix) or pvc")
    elif url and not url.startswith("s3://"):
        problems.append(f"spec.store.url must be s3://bucket/prefix (got {url!r})")
    store = StoreSpec(
        url,
        _get(store_raw, "endpoint", str, problems, "spec.store."),
        _get(store_raw, "credentialsSecret", str, problems, "spec.store."),
        pvc,
    )

    canary_raw = _get(raw, "canary", dict, problems, "spec.", {})
    canary = CanarySpec(
        percent=_get(canary_raw, "percent", int, problems, "spec.canary.", CanarySpec.percent),
        pause_seconds=float(
            _get(
                canary_raw,
                "pauseSeconds",
                (int, float),
                problems,
                "spec.canary.",
                CanarySpec.pause_seconds,
            )
        ),
        manual_promote=bool(
            _get(
                canary_raw,
                "manualPromote",
                bool,
                problems,
                "spec.canary.",
                CanarySpec.manual_promote,
            )
        ),
    )
    _range(problems, "spec.canary.percent", canary.percent, 0, 100)
    _range(problems, "spec.canary.pauseSeconds", canary.pause_seconds, 0)

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
    retain = _get(raw, "retainVersions", int, problems, "spec.", defaults.RETAIN_VERSIONS)
    _range(problems, "spec.retainVersions", retain, 1, 8)

    tenants = _get(raw, "tenants", dict, problems, "spec.", {})
    tenants_secret = _get(tenants, "secretName", str, problems, "spec.tenants.")

    if problems:
        raise SpecError(problems)
    return ModelDeploymentSpec(
        model=model,
        version=version,
        image=image,
        store=store,
        replicas=replicas,
        sidecar_image=_get(raw, "sidecarImage", str, problems, "spec."),
        backend=backend,
        precision=precision,
        gpus=gpus,
        cpu=resources.get("cpu"),
        memory=resources.get("memory"),
        canary=canary,
        rollout=rollout,
        retain_versions=retain,
        signing_public_key_secret=_get(raw, "signingPublicKeySecret", str, problems, "spec."),
        tenants_secret=tenants_secret,
    )
