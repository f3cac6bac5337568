"""``model-sidecar``: keygen | publish | init | watch."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from model_rollout_contract.canary import InvalidPolicy
from model_rollout_contract.redact import redact
from model_rollout_contract.tracks import TrackKeys, track_keys
from model_rollout_flags.logs import fatal, setup_logging

from .config import (
    Config,
    FetchConfig,
    InitConfig,
    KeygenConfig,
    PublishConfig,
    WatchConfig,
    parse_args,
)
from .control_client import ServerControl
from .errors import KubeError, PodWatchEnded, SidecarError
from .fetcher import Fetcher
from .init_mode import pre_pull
from .kube import PodApi
from .metrics import SidecarMetrics
from .pod_watch import PodWatch
from .publish import publish
from .redact import install_log_redaction
from .retry import Backoff
from .signing import Ed25519PublicKey, TrustedKeys, generate_keypair
from .status import StatusReporter
from .store import LocalStore, open_store
from .target import TargetSource
from .verify import Verifier
from .watch import Watcher, WatchSettings

log = logging.getLogger("model_sidecar")


def _fetcher(config: FetchConfig, pins: Callable[[], Mapping[str, int]] | None = None) -> Fetcher:
    """``pins``: the operator's pinned publish sequences (:meth:`TargetSource.pins`)."""
    keys: TrustedKeys | tuple[Ed25519PublicKey, ...] = ()
    if config.public_key:
        try:  # read again before each verification: the Secret changes under a running pod
            keys = TrustedKeys(config.public_key)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"model-sidecar: cannot load --public-key: {exc}") from exc
        log.info("trusting %d signing key(s) from %s", len(keys.current()), config.public_key)
    elif config.allow_unsigned:
        log.warning("signature checks are OFF (--allow-unsigned): development only")
    else:
        raise SystemExit("model-sidecar: --public-key is required (or --allow-unsigned)")
    allowed = None
    if config.allow_list:
        allowed = frozenset(
            line.strip().lower()
            for line in config.allow_list.read_text().splitlines()
            if line.strip()
        )
    store = open_store(config.store.store, config.store.s3_endpoint, config.store.store_id)
    if isinstance(store, LocalStore) and store.store_id is None:
        log.warning(
            "the directory store %s has no --store-id: versions signed for any directory "
            "store are accepted from it",
            store.description,
        )
    return Fetcher(
        store,
        Verifier(keys, store.scope, allowed),
        config.volume,
        Backoff(
            attempts=config.retries,
            base_s=config.backoff_base_seconds,
            max_s=config.backoff_max_seconds,
        ),
        max_concurrent_downloads=config.max_concurrent_downloads,
        pins=pins,
    )


def _pod_api(config: FetchConfig, metrics: SidecarMetrics | None = None) -> PodApi | None:
    return PodApi.connect(config.kube_api, config.pod_namespace, config.pod_name, metrics)


def _source(config: FetchConfig, pod_watch: PodWatch | None = None) -> TargetSource:
    live = pod_watch.view if pod_watch is not None else None
    return TargetSource(
        config.annotations_file, config.configmap_file, live, _keys(config), config.pins_file
    )


def _keys(config: FetchConfig) -> TrackKeys:
    return track_keys(config.track)


async def _init(config: InitConfig) -> int:
    """Pre-pull the target: the pod's annotations from the API when it can be read (the
    Downward API file may not show them yet), else the files."""
    fetch = config.fetch
    source = _source(fetch)
    pod = _pod_api(fetch)
    if pod is not None:
        try:
            annotations = (await pod.read()).annotations
            source = TargetSource(
                None, fetch.configmap_file, lambda: annotations, _keys(fetch), fetch.pins_file
            )
        except KubeError as exc:
            log.warning("cannot read the pod's annotations (%s); using the files", exc)
        finally:
            await pod.close()
    target = config.version or source.target()
    if not target:
        log.error("no target version: pass --version or an annotations/configmap file")
        return 2
    previous = config.previous or source.previous()
    try:
        policy = source.policy()
    except InvalidPolicy as exc:  # the watch loop reports it (bad_policy)
        log.warning("pod annotation %s ignored: %s", _keys(fetch).traffic, exc)
        policy = None
    code = await pre_pull(
        _fetcher(fetch, source.pins), fetch.model, target, previous, fetch.start_jitter_seconds,
        policy=policy,
    )  # fmt: skip
    if code != 0 and fetch.track is not None:
        # a tenant model's pre-pull never holds the pod back: the deployment's model and
        # the other tenants' serve meanwhile, and this track's watch sidecar tries again
        # and reports the failure
        log.warning("%s: not pre-pulled (exit %d); the pod starts without it", fetch.model, code)
        return 0
    return code


async def _serve_metrics(metrics: SidecarMetrics, port: int) -> web.AppRunner:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def _watch(config: WatchConfig) -> int:
    metrics = SidecarMetrics()
    fetch = config.fetch
    pod = _pod_api(fetch, metrics)
    pod_watch = None
    if pod is not None:
        pod_watch = PodWatch(pod, keys=_keys(fetch), fallback_file=fetch.annotations_file)
        metrics.pod_view_stale.labels(fetch.model).set_function(pod_watch.stale_seconds)
    source = _source(fetch, pod_watch)
    fetcher = _fetcher(fetch, source.pins)
    metrics.downloads.labels(fetch.model).set_function(lambda: fetcher.downloading)
    watcher = Watcher(
        WatchSettings(
            fetch.model,
            config.poll_seconds,
            config.jitter_seconds,
            config.keep_versions,
            start_jitter_s=fetch.start_jitter_seconds,
            backoff=Backoff(base_s=fetch.backoff_base_seconds, max_s=fetch.backoff_max_seconds),
            refused_retry_s=fetch.backoff_max_seconds,
        ),
        source,
        fetcher,
        ServerControl(config.control_socket, load_timeout_s=config.load_timeout_seconds),
        StatusReporter(config.status_file, pod, keys=_keys(fetch)),
        metrics,
        wake=pod_watch.changed if pod_watch is not None else None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = await _serve_metrics(metrics, config.metrics_port) if config.metrics_port else None
    watching = asyncio.create_task(watcher.run(stop))
    following = asyncio.create_task(pod_watch.run(stop)) if pod_watch is not None else None
    code = 0
    try:  # supervised: following the pod ends only with the watch loop
        await asyncio.wait(
            [watching] if following is None else [watching, following],
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        stop.set()
        try:
            await watching
        finally:
            if following is not None:
                try:
                    await following
                except PodWatchEnded as exc:  # a defect: never serve a view frozen for good
                    log.error("%s (%r): exiting, so that the pod restarts", exc, exc.__cause__)
                    code = 1
            if pod is not None:
                await pod.close()
            if runner is not None:
                await runner.cleanup()
    return code


def _log_fields(config: Config) -> dict[str, str]:
    """What every JSON line of init and watch carries: the model followed, its track, and
    the pod."""
    if not isinstance(config, InitConfig | WatchConfig):
        return {}
    fetch = config.fetch
    fields = {"model": fetch.model, "track": fetch.track, "pod": fetch.pod_name}
    return {key: value for key, value in fields.items() if value is not None}


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    install_log_redaction([setup_logging(config.log, "model-sidecar", fields=_log_fields(config))])
    if isinstance(config, KeygenConfig):
        generate_keypair(config.private, config.public)
        print(f"wrote {config.private} (keep secret) and {config.public}")
        return 0
    if isinstance(config, PublishConfig):
        try:
            manifest = publish(
                open_store(config.store.store, config.store.s3_endpoint, config.store.store_id),
                config.model,
                config.version,
                config.file,
                config.key,
                config.precision,
                force=config.force,
                golden=config.golden,
            )
        except SidecarError as exc:
            print(f"model-sidecar publish: {redact(exc.message)}", file=sys.stderr)
            return 1
        golden = f" golden sha256={manifest.golden.sha256}" if manifest.golden else ""
        print(
            f"published {manifest.model}:{manifest.version} sha256={manifest.sha256} "
            f"sequence={manifest.sequence}{golden}"
        )
        return 0
    try:
        return asyncio.run(_init(config) if isinstance(config, InitConfig) else _watch(config))
    except SystemExit as exc:  # a refusal at start: said as every other line
        if not isinstance(exc.code, str):
            raise
        fatal(exc.code.removeprefix("model-sidecar: "))
        return 1


if __name__ == "__main__":
    sys.exit(main())
