"""``model-sidecar``: keygen | publish | init | watch."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .control_client import ServerControl
from .fetcher import Fetcher
from .init_mode import pre_pull
from .kube import KubeApi
from .metrics import SidecarMetrics
from .publish import publish
from .retry import Backoff
from .signing import generate_keypair, load_public_key
from .status import StatusReporter
from .store import open_store
from .target import TargetSource
from .verify import Verifier
from .watch import Watcher, WatchSettings

log = logging.getLogger("model_sidecar")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SIDECAR_{name}", default)


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=_env("STORE"),
        required=_env("STORE") is None,
        help="s3://bucket/prefix or file:///dir",
    )
    p.add_argument(
        "--s3-endpoint",
        default=_env("S3_ENDPOINT"),
        help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)",
    )


def _fetch_args(p: argparse.ArgumentParser) -> None:
    _store_args(p)
    p.add_argument(
        "--volume",
        default=_env("VOLUME"),
        required=_env("VOLUME") is None,
        help="shared volume: the server's model repository (the trusted directory)",
    )
    p.add_argument("--model", default=_env("MODEL"), required=_env("MODEL") is None)
    p.add_argument(
        "--public-key",
        default=_env("PUBLIC_KEY"),
        help="trusted Ed25519 public key (PEM) that manifests must be signed with",
    )
    p.add_argument(
        "--allow-unsigned", action="store_true", help="accept unsigned manifests (development only)"
    )
    p.add_argument(
        "--allow-list",
        default=_env("ALLOW_LIST"),
        help="file of allowed SHA-256 digests, one per line",
    )
    p.add_argument(
        "--annotations-file",
        default=_env("ANNOTATIONS_FILE"),
        help="Downward API file of the pod's annotations",
    )
    p.add_argument(
        "--configmap-file",
        default=_env("CONFIGMAP_FILE"),
        help="file holding the deployment's default target version",
    )
    p.add_argument("--max-concurrent-downloads", type=int, default=1)
    p.add_argument("--retries", type=int, default=5, help="attempts for store operations")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="model-sidecar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    keygen.add_argument("--private", required=True)
    keygen.add_argument("--public", required=True)

    pub = sub.add_parser("publish", help="upload a signed version to the store")
    _store_args(pub)
    pub.add_argument("--model", required=True)
    pub.add_argument("--version", required=True)
    pub.add_argument("--file", required=True)
    pub.add_argument("--key", required=True, help="Ed25519 private key (PEM)")
    pub.add_argument("--precision", default="fp32")

    init = sub.add_parser("init", help="pre-pull the target and previous versions, then exit")
    _fetch_args(init)
    init.add_argument("--version", help="target version (default: from the annotations file)")
    init.add_argument("--previous", help="previous version (default: annotation or store order)")

    watch = sub.add_parser("watch", help="keep the server on the pod's target version")
    _fetch_args(watch)
    watch.add_argument(
        "--control-socket",
        default=_env("CONTROL_SOCKET"),
        required=_env("CONTROL_SOCKET") is None,
    )
    watch.add_argument("--status-file", default=_env("STATUS_FILE"))
    watch.add_argument("--poll-seconds", type=float, default=float(_env("POLL_SECONDS", "2") or 2))
    watch.add_argument(
        "--jitter-seconds", type=float, default=float(_env("JITTER_SECONDS", "1") or 1)
    )
    watch.add_argument("--keep-versions", type=int, default=3)
    watch.add_argument("--metrics-port", type=int, default=None)
    watch.add_argument(
        "--kube-api",
        default=_env("KUBE_API"),
        help="Kubernetes API URL for annotating the pod (default: in-cluster)",
    )
    watch.add_argument("--pod-name", default=os.environ.get("POD_NAME"))
    watch.add_argument("--pod-namespace", default=os.environ.get("POD_NAMESPACE"))
    return parser


def _fetcher(args: argparse.Namespace) -> Fetcher:
    if args.public_key:
        public_key = load_public_key(Path(args.public_key).read_bytes())
    elif args.allow_unsigned:
        log.warning("signature checks are OFF (--allow-unsigned): development only")
        public_key = None
    else:
        raise SystemExit("model-sidecar: --public-key is required (or --allow-unsigned)")
    allowed = None
    if args.allow_list:
        allowed = frozenset(
            line.strip().lower()
            for line in Path(args.allow_list).read_text().splitlines()
            if line.strip()
        )
    volume = Path(args.volume)
    volume.mkdir(parents=True, exist_ok=True)
    return Fetcher(
        open_store(args.store, args.s3_endpoint),
        Verifier(public_key, volume, allowed),
        volume,
        Backoff(attempts=args.retries),
        max_concurrent_downloads=args.max_concurrent_downloads,
    )


def _source(args: argparse.Namespace) -> TargetSource:
    return TargetSource(
        Path(args.annotations_file) if args.annotations_file else None,
        Path(args.configmap_file) if args.configmap_file else None,
    )


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


async def _watch(args: argparse.Namespace) -> int:
    metrics = SidecarMetrics()
    reporter = StatusReporter(
        Path(args.status_file) if args.status_file else None,
        KubeApi.from_url_or_cluster(args.kube_api),
        args.pod_namespace,
        args.pod_name,
    )
    watcher = Watcher(
        WatchSettings(args.model, args.poll_seconds, args.jitter_seconds, args.keep_versions),
        _source(args),
        _fetcher(args),
        ServerControl(Path(args.control_socket)),
        reporter,
        metrics,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = await _serve_metrics(metrics, args.metrics_port) if args.metrics_port else None
    try:
        await watcher.run(stop)
    finally:
        if runner is not None:
            await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    if args.command == "keygen":
        generate_keypair(Path(args.private), Path(args.public))
        print(f"wrote {args.private} (keep secret) and {args.public}")
        return 0
    if args.command == "publish":
        manifest = publish(
            open_store(args.store, args.s3_endpoint),
            args.model,
            args.version,
            Path(args.file),
            Path(args.key),
            args.precision,
        )
        print(f"published {manifest.model}:{manifest.version} sha256={manifest.sha256}")
        return 0
    if args.command == "init":
        target = args.version or _source(args).target()
        if not target:
            log.error("no target version: pass --version or an annotations/configmap file")
            return 2
        previous = args.previous or _source(args).previous()
        return asyncio.run(pre_pull(_fetcher(args), args.model, target, previous))
    return asyncio.run(_watch(args))


if __name__ == "__main__":
    sys.exit(main())
