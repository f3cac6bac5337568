"""Wires the engine manager, HTTP API and control socket into one aiohttp application."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web

from model_rollout_contract.names import InvalidName, ModelKey, is_valid_name
from model_rollout_contract.versions import newest
from model_server.backends import Backend, make_backend
from model_server.backends.cpu_priority import lower_this_thread
from model_server.config import MAX_REQUEST_BYTES, ModelSpec, ServerConfig, check_named_models
from model_server.dataplane.data_plane import DataPlane
from model_server.files.spare_copies import SpareCopies
from model_server.files.trusted_files import UntrustedPath
from model_server.frontends.control_socket import ControlSocketServer
from model_server.frontends.http.api import (
    BODY_TIMEOUT,
    JSON_CODEC,
    METRICS,
    PLANE,
    POLICY,
    add_routes,
    json_errors,
)
from model_server.frontends.http.codec_workers import JsonCodec
from model_server.frontends.http.in_flight import InFlightRequests
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.lifecycle.request_limits import RowLimits
from model_server.lifecycle.startup import load_at_start, resumed_policy
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.pool.worker import PoolPeers, install_pool_handlers, worker_rate_limits
from model_server.scheduling.batching import BatchPolicy
from model_server.scheduling.runner import Runner
from model_server.scheduling.shadow import ShadowRunner
from model_server.scheduling.traffic import TrafficRouter
from model_server.security.auth import AccessPolicy

if TYPE_CHECKING:
    from model_server.frontends.grpc.api import GrpcServer

log = logging.getLogger(__name__)


class ModelServer:
    def __init__(self, config: ServerConfig, backend: Backend | None = None) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.policy = AccessPolicy.from_files(
            config.admin_token_file,
            config.tenants_file,
            config.jwt,
            on_rate_limited=lambda tenant: self.metrics.rate_limited.labels(tenant).inc(),
        )
        share = config.pool_size  # a worker of a pool holds 1/N of what the pod may use
        if share > 1:
            self.policy.rate_limits = worker_rate_limits(self.policy.rate_limits, share)
        self.metrics.watch_tenants(self.policy.tenants, self.policy.rate_limits.buckets)
        self.audit = AuditLog(config.audit_log)
        self.repository = ModelRepository(
            config.repository, SpareCopies(config.spare_copy_mb * 2**20 // share)
        )
        self.executor = ThreadPoolExecutor(
            config.workers,
            thread_name_prefix="infer",
            initializer=lower_this_thread,
            initargs=(config.inference_nice,),
        )
        budget = config.memory_budget_mb
        row_limits = RowLimits(config.request_memory_mb * 2**20, config.max_rows)
        self.runner = Runner(
            self.metrics,
            row_limits,
            executor=self.executor,
            batching=BatchPolicy.from_flags(
                config.max_batch_size,
                config.max_queue_delay_us,
                config.workers,
                config.batch_models,
            ),
            quick_run_s=config.quick_run_us / 1e6,
        )
        self.manager = EngineManager(
            backend or make_backend(config.backend, config.cache_dir, **config.backend_options()),
            self.repository,
            self.metrics,
            self.audit,
            retain=config.retain,
            memory_budget_bytes=int(budget * 2**20 / share) if budget else None,
            row_limits=row_limits,
            tenant_memory_caps={
                t.name: int(t.memory_mb * 2**20 / share)
                for t in self.policy.tenants.values()
                if t.memory_mb is not None
            },
        )
        self.codec = JsonCodec(config.json_workers, max_pending_decodes=config.json_max_pending)
        self.shadows = ShadowRunner(config.shadow_max_in_flight)
        seed = config.traffic_seed
        if seed is not None and config.worker_index is not None:
            seed += config.worker_index  # the same seed would split alike in every worker
        self.plane = DataPlane(
            self.manager, self.runner, self.metrics, TrafficRouter(seed), self.shadows
        )
        self.peers: PoolPeers | None = None
        if config.worker_index is not None and config.pool_dir is not None:
            self.peers = PoolPeers(config.pool_dir, config.worker_index, config.pool_size)
            self.plane.admin_swaps_refused = (
                f"this server runs {config.pool_size} processes: versions are swapped through "
                "its control socket (the sidecar), which reaches every process"
            )
        check_named_models(
            (spec.key for spec in self.model_specs()), config.batch_models, config.max_rows
        )
        self.in_flight = InFlightRequests()
        self.control = (
            ControlSocketServer(self.plane, config.control_socket)
            if config.control_socket
            else None
        )
        self.grpc: GrpcServer | None = None
        if config.grpc_port is not None:
            from model_server.frontends.grpc.api import (
                GrpcServer,  # grpcio is needed only with the gRPC API on
            )

            self.grpc = GrpcServer(
                self.plane,
                self.policy,
                config.host,
                config.grpc_port,
                MAX_REQUEST_BYTES,
                reuse_port=config.in_pool,
            )

    def model_specs(self) -> list[ModelSpec]:
        specs = list(self.config.models)
        for tenant in self.policy.tenants.values():
            specs += [ModelSpec(str(ModelKey(tenant.name, m))) for m in tenant.models]
        if not specs:  # serve every model found at the top of the repository
            root = self.repository.root
            specs = (
                [
                    ModelSpec(p.name)
                    for p in sorted(root.iterdir())
                    if is_valid_name(p.name) and p.is_dir() and self.repository.versions(p.name)
                ]
                if root.is_dir()
                else []
            )
        return specs

    def initial_version(self, spec: ModelSpec) -> str | None:
        if spec.version:
            return spec.version
        return self.repository.current_version(spec.key) or newest(
            self.repository.versions(spec.key)
        )

    async def start(self, app: web.Application) -> None:
        for spec in self.model_specs():
            self.manager.register(spec.key)
            try:
                version = self.initial_version(spec)
            except (InvalidName, UntrustedPath) as exc:  # a CURRENT naming nothing, or a link
                log.error("model %s: %s; not ready until a version is loaded", spec.key, exc)
                continue
            if version is None:  # none on disk, or versions without an order and no CURRENT
                log.warning(
                    "model %s has no version to start with (versions on disk: %s, none in "
                    "CURRENT, and no order says which is newest); not ready until one is loaded",
                    spec.key,
                    self.repository.versions(spec.key) or "none",
                )
                continue
            # a version named by the flags is not CURRENT: TRAFFIC, written beside it, is not
            # for it
            policy = None if spec.version else resumed_policy(self.repository, spec.key, version)
            await load_at_start(self.manager, spec.key, version, policy)
        if self.control is not None:
            await self.control.start()
        if not self.config.in_pool:  # a pool's worker: once its supervisor opens it
            await self.start_grpc()

    async def start_grpc(self) -> None:
        """Listen for gRPC: once the models are loaded, as HTTP listens only then."""
        if self.grpc is not None:
            await self.grpc.start()

    async def stop(self, app: web.Application) -> None:
        if self.grpc is not None:  # calls still running after the grace are cancelled
            await self.grpc.stop(0)
        if self.control is not None:
            await self.control.stop()
        self.shadows.close()
        self.runner.close()
        self.manager.close()
        self.codec.close()
        self.repository.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.peers is not None:
            await self.peers.close()

    def make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self.in_flight.middleware, json_errors], client_max_size=MAX_REQUEST_BYTES
        )
        app[PLANE] = self.plane
        app[POLICY] = self.policy
        app[METRICS] = self.metrics
        app[BODY_TIMEOUT] = self.config.body_read_timeout_seconds
        app[SERVER] = self
        app[JSON_CODEC] = self.codec
        if self.peers is not None:
            install_pool_handlers(app, self.peers)
        add_routes(app)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


SERVER = web.AppKey("server", ModelServer)


def create_app(config: ServerConfig, backend: Backend | None = None) -> web.Application:
    return ModelServer(config, backend).make_app()
