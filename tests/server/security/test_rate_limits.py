"""Per-tenant request rate limits (a token bucket per tenant: 429 with Retry-After over
HTTP, RESOURCE_EXHAUSTED with retry-after over gRPC, before the body is read) and the
per-tenant request series."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter, Histogram
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_pb_grpc

from model_server.app import SERVER, ModelServer
from model_server.config import ServerConfig
from model_server.errors import RateLimited
from model_server.observability.metrics import TenantRequests
from model_server.protocol.binary_codec import HEADER_LENGTH
from model_server.security.auth import parse_tenants
from model_server.security.rate_limits import RateLimit, TenantRateLimits, TokenBucket
from tests.support.server import (
    Version,
    add_version,
    infer_body,
    sample,
    samples,
    which_version,
    write_tenants,
)

X = np.ones((1, 8), np.float32)
ACME = {"X-API-Key": "key-acme"}
GLOBEX = {"X-API-Key": "key-globex"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_grants_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(RateLimit(requests_per_second=2.0, burst=3), clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # a token is back in 1/rate
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)  # half a token refilled
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 3600  # an idle hour refills to the burst, no more
    taken = [bucket.take() for _ in range(4)]
    assert taken[:3] == [0.0, 0.0, 0.0] and taken[3] == pytest.approx(0.5)


def test_retry_after_is_whole_seconds_rounded_up_and_counted() -> None:
    clock, limited = Clock(), []
    limits = TenantRateLimits(
        {"slow": RateLimit(0.4, 1), "fast": RateLimit(50, 1)}, clock, limited.append
    )
    limits.admit("slow")
    with pytest.raises(RateLimited) as caught:
        limits.admit("slow")
    assert caught.value.retry_after_s == 3 and caught.value.status == 429  # 2.5 s -> 3
    limits.admit("fast")
    with pytest.raises(RateLimited) as caught:
        limits.admit("fast")
    assert caught.value.retry_after_s == 1  # 20 ms -> 1, never 0
    for _ in range(100):
        limits.admit("unlimited")  # a tenant without a limit
        limits.admit(None)  # the default namespace
    assert limited == ["slow", "fast"]


@pytest.mark.parametrize(
    "limit",
    [
        {"requests_per_second": 0},
        {"requests_per_second": -1, "burst": 2},
        {"requests_per_second": "fast"},
        {"requests_per_second": 5, "burst": 0},
        {"requests_per_second": 5, "burst": 1.5},
        {"requests_per_second": 5, "brust": 10},
        {"requests_per_second": float("inf")},
        "10/s",
    ],
)
def test_a_bad_rate_limit_is_refused_at_start(limit: object) -> None:
    with pytest.raises(ValueError, match="rate_limit"):
        parse_tenants({"tenants": {"acme": {"api_key": "k", "rate_limit": limit}}})


def test_the_burst_defaults_to_the_rate_rounded_up() -> None:
    raw = {"tenants": {"acme": {"api_key": "k", "rate_limit": {"requests_per_second": 2.5}}}}
    assert parse_tenants(raw)["acme"].rate_limit == RateLimit(2.5, 3)


@dataclass
class Limited:
    client: TestClient
    server: ModelServer
    acme: dict[str, Version]
    globex: dict[str, Version]


@pytest.fixture
async def limited(tmp_path: Path) -> AsyncIterator[Limited]:
    """acme: a burst of 3 and about no refill during a test (one token per 1000 s);
    globex: unlimited."""
    root = tmp_path / "models"
    acme = {"v1": add_version(root, "acme/mlp", "v1", seed=11)}
    globex = {"v1": add_version(root, "globex/mlp", "v1", seed=22)}
    tenants = write_tenants(
        tmp_path / "tenants.yaml",
        rate_limits={"acme": {"requests_per_second": 0.001, "burst": 3}},
    )
    config = ServerConfig(
        repository=root, tenants_file=tenants, grpc_port=0, cache_dir=tmp_path / "cache"
    )
    app = ModelServer(config).make_app()
    async with TestClient(TestServer(app)) as client:
        yield Limited(client, app[SERVER], acme, globex)


async def test_a_tenant_over_its_burst_is_429_with_retry_after_and_others_are_not(
    limited: Limited,
) -> None:
    client = limited.client
    for _ in range(3):
        response = await client.post("/v2/models/mlp/infer", json=infer_body(X), headers=ACME)
        which_version(limited.acme, X, await response.json())
    # refused before the body is read: neither its malformed binary header length (else
    # 400 before reading) nor its malformed JSON (else 400 after) is looked at
    bad = {**ACME, HEADER_LENGTH: "not-a-length"}
    response = await client.post("/v2/models/mlp/infer", data=b"{not json", headers=bad)
    assert response.status == 429
    assert await response.json() == {
        "code": "rate_limited",
        "error": "tenant 'acme' is over its request rate limit (0.001/s, burst 3)",
    }
    assert 1 <= int(response.headers["Retry-After"]) <= 1000
    for _ in range(5):  # the other tenant is unaffected
        response = await client.post("/v2/models/mlp/infer", json=infer_body(X), headers=GLOBEX)
        which_version(limited.globex, X, await response.json())
    response = await client.get("/v2/models/mlp", headers=ACME)  # metadata is not limited
    assert response.status == 200
    found = samples(await (await client.get("/metrics")).text())
    assert sample(found, "model_server_tenant_rate_limited_total", tenant="acme") == 1
    assert (
        "model_server_tenant_rate_limited_total",
        frozenset({("tenant", "globex")}),
    ) not in found
    assert sample(found, "model_server_inference_requests_total", model="acme/mlp", code="429") == 1
    assert (
        sample(found, "model_server_tenant_inference_requests_total", tenant="acme", code="200")
        == 3
    )
    assert (
        sample(found, "model_server_tenant_inference_requests_total", tenant="acme", code="429")
        == 1
    )
    assert (
        sample(found, "model_server_tenant_inference_requests_total", tenant="globex", code="200")
        == 5
    )
    count = "model_server_tenant_inference_request_duration_seconds_count"
    assert sample(found, count, tenant="acme") == 4
    assert sample(found, count, tenant="globex") == 5


async def test_over_grpc_a_tenant_over_its_burst_is_resource_exhausted(limited: Limited) -> None:
    grpc_api = limited.server.grpc
    assert grpc_api is not None
    request = triton_pb.ModelInferRequest(
        model_name="mlp",
        inputs=[
            triton_pb.ModelInferRequest.InferInputTensor(
                name="input", datatype="FP32", shape=[1, 8]
            )
        ],
        raw_input_contents=[X.tobytes()],
    )
    metadata = (("x-api-key", "key-acme"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_api.port}") as channel:
        stub = triton_pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(3):
            await stub.ModelInfer(request, metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(request, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(caught.value.trailing_metadata() or ())
        assert trailers["error-code"] == "rate_limited"
        assert 1 <= int(trailers["retry-after"]) <= 1000
        await stub.ModelInfer(request, metadata=(("x-api-key", "key-globex"),))


async def test_the_default_namespace_is_the_empty_tenant(client: TestClient) -> None:
    response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
    assert response.status == 200
    found = samples(await (await client.get("/metrics")).text())
    assert sample(found, "model_server_tenant_inference_requests_total", tenant="", code="200") == 1
    assert (
        sample(found, "model_server_tenant_inference_request_duration_seconds_count", tenant="")
        == 1
    )


def test_tenant_labels_come_from_the_configuration_only() -> None:
    registry = CollectorRegistry()
    requests = Counter("r", "r", ["model", "code"], registry=registry)
    latency = Histogram("l", "l", ["model"], registry=registry)
    for model in ("acme/mlp", "acme/other", "evil/mlp", "mlp"):
        requests.labels(model, "401").inc()
        latency.labels(model).observe(0.01)
    families = list(TenantRequests(requests, latency, {"acme"}).collect())
    totals = {tuple(s.labels.values()): s.value for s in families[0].samples}
    assert totals == {("", "401"): 2.0, ("acme", "401"): 2.0}
    tenants = {s.labels["tenant"] for s in families[1].samples}
    assert tenants == {"", "acme"}
