"""Sidecar configuration: one dataclass per command, built from the command line, every
flag also read from ``MODEL_SIDECAR_<FLAG>`` (the contract's configuration scheme)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from model_rollout_contract import defaults
from model_rollout_contract.cli import SIDECAR_ENV_PREFIX, optional_path
from model_rollout_contract.layout import InvalidStoreId, StoreUrl, check_store_id
from model_rollout_contract.names import InvalidName, check_model_key
from model_rollout_contract.tracks import InvalidTrack, check_track
from model_rollout_flags import FlagParser
from model_rollout_flags.logs import LogSettings, add_log_flags, log_settings


@dataclass(frozen=True)
class StoreConfig:
    store: str  # s3://bucket/prefix or file:///dir
    s3_endpoint: str | None = None  # non-AWS stores (default: AWS, or $AWS_ENDPOINT_URL)
    store_id: str | None = None  # a directory store's identity, bound by its manifests


@dataclass(frozen=True)
class KeygenConfig:
    private: Path
    public: Path
    # --log-format, --log-level (every command takes them)
    log: LogSettings = field(default_factory=LogSettings)


@dataclass(frozen=True)
class PublishConfig:
    store: StoreConfig
    model: str
    version: str
    file: Path
    key: Path  # Ed25519 private key (PEM)
    precision: str = "fp32"
    force: bool = False  # replace a version already published (a new publish sequence)
    golden: Path | None = None  # golden set (canary.py's format), named by the manifest
    log: LogSettings = field(default_factory=LogSettings)


@dataclass(frozen=True)
class FetchConfig:
    """What init and watch share: where versions come from, where they go, what to trust."""

    store: StoreConfig
    volume: Path  # the shared volume: the server's repository (the trusted directory)
    model: str  # 'name', or 'tenant/name' for a tenant's model
    public_key: Path | None = None  # trusted keys: a PEM bundle or a directory of PEM files
    allow_unsigned: bool = False  # development only
    allow_list: Path | None = None  # file of allowed SHA-256 digests, one per line
    annotations_file: Path | None = None  # Downward API file of the pod's annotations
    configmap_file: Path | None = None  # the deployment's default target version
    pins_file: Path | None = None  # the ConfigMap's pinned publish sequences (pins.py)
    max_concurrent_downloads: int = defaults.MAX_CONCURRENT_DOWNLOADS
    retries: int = defaults.STORE_ATTEMPTS  # attempts of one store operation
    start_jitter_seconds: float = defaults.START_JITTER_SECONDS  # before the first fetch
    backoff_base_seconds: float = defaults.BACKOFF_BASE_SECONDS  # failed cycles back off
    backoff_max_seconds: float = defaults.BACKOFF_MAX_SECONDS
    kube_api: str | None = None  # API server URL (default: in-cluster, when in a cluster)
    pod_name: str | None = None  # this pod, whose annotations carry the target
    pod_namespace: str | None = None
    # the pod annotations followed and written: a named track's (a tenant model's), or
    # the default track's (None); see model_rollout_contract.tracks
    track: str | None = None


@dataclass(frozen=True)
class InitConfig:
    fetch: FetchConfig
    version: str | None = None  # default: from the annotations or ConfigMap file
    previous: str | None = None  # default: annotation, else the version before in order
    log: LogSettings = field(default_factory=LogSettings)


@dataclass(frozen=True)
class WatchConfig:
    fetch: FetchConfig
    control_socket: Path
    status_file: Path | None = None
    poll_seconds: float = defaults.POLL_SECONDS
    jitter_seconds: float = defaults.POLL_JITTER_SECONDS
    keep_versions: int = defaults.KEEP_VERSIONS_ON_DISK
    metrics_port: int | None = None
    load_timeout_seconds: float = 300.0  # a load the server has not answered by then fails
    log: LogSettings = field(default_factory=LogSettings)


Config = KeygenConfig | PublishConfig | InitConfig | WatchConfig


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def _model_key(text: str) -> str:
    try:
        return check_model_key(text)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _track(text: str) -> str:
    try:
        return check_track(text)
    except InvalidTrack as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_id(text: str) -> str:
    try:
        return check_store_id(text)
    except InvalidStoreId as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="s3://bucket/prefix or file:///dir")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)")
    p.add_argument(
        "--store-id",
        type=_store_id,
        help="a directory store's identity, the same for its publisher and its pods: "
        "manifests bind it, so a version signed for another directory store is refused",
    )


def _fetch_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument(
        "--volume",
        required=True,
        help="shared volume: the server's model repository (the trusted directory)",
    )
    p.add_argument("--model", required=True, type=_model_key, help="name, or tenant/name")
    p.add_argument(
        "--track",
        type=_track,
        help="follow and write this named track's pod annotations (a tenant model listed in "
        "the ModelDeployment), not the deployment's own",
    )
    p.add_argument(
        "--public-key",
        help="trusted Ed25519 public keys for manifests: a PEM file (one key, or a bundle of "
        "several for rotation) or a directory of *.pem files; any of them may sign",
    )
    p.add_argument(
        "--allow-unsigned", action="store_true", help="accept unsigned manifests (development only)"
    )
    p.add_argument("--allow-list", help="file of allowed SHA-256 digests, one per line")
    p.add_argument("--annotations-file", help="Downward API file of the pod's annotations")
    p.add_argument("--configmap-file", help="file holding the deployment's default version")
    p.add_argument(
        "--pins-file",
        help="file holding the publish sequences the operator pinned (JSON), for a pod "
        "whose annotations do not carry them yet",
    )
    p.add_argument(
        "--max-concurrent-downloads",
        type=_positive_int,
        default=FetchConfig.max_concurrent_downloads,
        help="store transfers at once (init fetches the target and the previous version)",
    )
    p.add_argument(
        "--retries",
        type=_positive_int,
        default=FetchConfig.retries,
        help="attempts for store operations",
    )
    p.add_argument(
        "--start-jitter-seconds",
        type=_non_negative,
        default=FetchConfig.start_jitter_seconds,
        help="random pause of up to this before the first download or poll",
    )
    p.add_argument(
        "--backoff-base-seconds",
        type=_non_negative,
        default=FetchConfig.backoff_base_seconds,
        help="first pause after a failed cycle (doubles per failure, full jitter)",
    )
    p.add_argument(
        "--backoff-max-seconds",
        type=_non_negative,
        default=FetchConfig.backoff_max_seconds,
        help="longest pause after failed cycles; a refused version is tried again after it",
    )
    p.add_argument(
        "--kube-api", help="Kubernetes API URL for the pod's annotations (default: in-cluster)"
    )
    p.add_argument("--pod-name")
    p.add_argument("--pod-namespace")


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        env_prefix=SIDECAR_ENV_PREFIX,
        prog="model-sidecar",
        description="keygen | publish | init | watch",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    keygen.add_argument("--private", required=True)
    keygen.add_argument("--public", required=True)
    add_log_flags(keygen)

    pub = sub.add_parser("publish", help="upload a signed version to the store")
    _store_args(pub)
    pub.add_argument("--model", required=True, type=_model_key, help="name, or tenant/name")
    pub.add_argument("--version", required=True)
    pub.add_argument("--file", required=True)
    pub.add_argument("--key", required=True, help="Ed25519 private key (PEM)")
    pub.add_argument("--precision", default=PublishConfig.precision)
    pub.add_argument(
        "--force",
        action="store_true",
        help="replace a version that is published already (pods that accepted the old "
        "build take the new one; the old one is never accepted again by them)",
    )
    pub.add_argument(
        "--golden",
        help="golden set (.npz: input/<name>, output/<name>, optional atol and rtol) that "
        "servers run before swapping to the version; checked here, signed with the manifest",
    )
    add_log_flags(pub)

    init = sub.add_parser("init", help="pre-pull the target and previous versions, then exit")
    _fetch_args(init)
    init.add_argument("--version", help="target version (default: from the annotations file)")
    init.add_argument("--previous", help="previous version (default: annotation or store order)")
    add_log_flags(init)

    watch = sub.add_parser("watch", help="keep the server on the pod's target version")
    _fetch_args(watch)
    watch.add_argument("--control-socket", required=True)
    watch.add_argument("--status-file")
    watch.add_argument("--poll-seconds", type=float, default=WatchConfig.poll_seconds)
    watch.add_argument("--jitter-seconds", type=float, default=WatchConfig.jitter_seconds)
    watch.add_argument("--keep-versions", type=_positive_int, default=WatchConfig.keep_versions)
    watch.add_argument("--metrics-port", type=int)
    watch.add_argument(
        "--load-timeout-seconds",
        type=_non_negative,
        default=WatchConfig.load_timeout_seconds,
        help="how long the server may take to answer a load before it is reported failed",
    )
    add_log_flags(watch)
    return parser


def _store_config(a: argparse.Namespace) -> StoreConfig:
    try:
        StoreUrl.parse(a.store).bound_scope(a.store_id)
    except ValueError as exc:  # an unsupported URL, or an id given to an S3 store
        build_parser().error(f"--store {a.store}: {exc}")
    return StoreConfig(a.store, a.s3_endpoint, a.store_id)


def _fetch_config(a: argparse.Namespace) -> FetchConfig:
    return FetchConfig(
        store=_store_config(a),
        volume=Path(a.volume),
        model=a.model,
        public_key=optional_path(a.public_key),
        allow_unsigned=a.allow_unsigned,
        allow_list=optional_path(a.allow_list),
        annotations_file=optional_path(a.annotations_file),
        configmap_file=optional_path(a.configmap_file),
        pins_file=optional_path(a.pins_file),
        max_concurrent_downloads=a.max_concurrent_downloads,
        retries=a.retries,
        start_jitter_seconds=a.start_jitter_seconds,
        backoff_base_seconds=a.backoff_base_seconds,
        backoff_max_seconds=a.backoff_max_seconds,
        kube_api=a.kube_api,
        pod_name=a.pod_name,
        pod_namespace=a.pod_namespace,
        track=a.track,
    )


def parse_args(argv: list[str] | None = None) -> Config:
    a = build_parser().parse_args(argv)
    if a.command == "keygen":
        return KeygenConfig(Path(a.private), Path(a.public), log_settings(a))
    if a.command == "publish":
        return PublishConfig(
            _store_config(a), a.model, a.version, Path(a.file), Path(a.key),
            a.precision, a.force, optional_path(a.golden), log_settings(a),
        )  # fmt: skip
    if a.command == "init":
        return InitConfig(_fetch_config(a), a.version, a.previous, log_settings(a))
    return WatchConfig(
        fetch=_fetch_config(a),
        control_socket=Path(a.control_socket),
        status_file=optional_path(a.status_file),
        poll_seconds=a.poll_seconds,
        jitter_seconds=a.jitter_seconds,
        keep_versions=a.keep_versions,
        metrics_port=a.metrics_port,
        load_timeout_seconds=a.load_timeout_seconds,
        log=log_settings(a),
    )
