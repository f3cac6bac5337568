"""The pods the operator generates (issue 13, "Pod and RBAC"): API credentials only in the
containers that call the API, a drain before the kubelet's SIGKILL, the storm controls and
the drain time from the ModelDeployment, and signature checks unless the spec explicitly
opts out. Command lines are read back with the programs' own parsers."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes_asyncio.config import incluster_config

from model_operator.manifests import (
    API_ACCESS_DIR,
    API_ACCESS_VOLUME,
    TOKEN_SECONDS,
    children,
    deployment,
    termination_grace_seconds,
)
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_rollout_contract import argv, defaults
from model_rollout_e2e.processes import free_port
from model_server.config import parse_args as server_args
from model_sidecar.config import FetchConfig, InitConfig, WatchConfig
from model_sidecar.config import parse_args as sidecar_args
from model_sidecar.kube import PodApi

ROOT = Path(__file__).parent.parent
CALLS_THE_API = {"prefetch", "sidecar"}  # init reads its pod; watch follows and annotates it


def example_spec(**changes: Any) -> ModelDeploymentSpec:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    doc["spec"].update(changes)
    return parse_spec(doc["spec"])


def pod_of(spec: ModelDeploymentSpec) -> dict[str, Any]:
    return dict(deployment("resnet", "ml-serving", spec)["spec"]["template"]["spec"])


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*pod["initContainers"], *pod["containers"]]}


def test_only_the_containers_that_call_the_api_have_a_token() -> None:
    pod = pod_of(example_spec())
    assert pod["automountServiceAccountToken"] is False  # no token in every container
    [account] = [
        o
        for o in children("resnet", "ml-serving", example_spec(), "v1")
        if o["kind"] == "ServiceAccount"
    ]
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["name"] == pod["serviceAccountName"]
    [volume] = [v for v in pod["volumes"] if v["name"] == API_ACCESS_VOLUME]
    sources = volume["projected"]["sources"]
    [token] = [s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s]
    assert token == {"path": "token", "expirationSeconds": TOKEN_SECONDS}
    assert 600 <= TOKEN_SECONDS <= 3600  # the kubelet's minimum; rotated within the hour
    assert {
        "configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    } in sources
    [namespace] = [s["downwardAPI"]["items"] for s in sources if "downwardAPI" in s]
    assert namespace == [
        {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
    ]
    holders = {
        name
        for name, container in containers(pod).items()
        for mount in container["volumeMounts"]
        if mount["name"] == API_ACCESS_VOLUME
    }
    assert holders == CALLS_THE_API
    for name in CALLS_THE_API:
        [mount] = [
            m for m in containers(pod)[name]["volumeMounts"] if m["name"] == API_ACCESS_VOLUME
        ]
        assert mount == {"name": API_ACCESS_VOLUME, "mountPath": API_ACCESS_DIR, "readOnly": True}
    server = containers(pod)["server"]  # parses untrusted input: no credentials at all
    assert not any(m["mountPath"].startswith("/var/run/secrets") for m in server["volumeMounts"])
    assert all("secretKeyRef" not in e.get("valueFrom", {}) for e in server.get("env", []))


@pytest.mark.parametrize("drain", [None, 0, 2.5, 120])
def test_the_server_drains_before_the_kubelet_kills_it(drain: float | None) -> None:
    spec = example_spec(**({} if drain is None else {"server": {"drainSeconds": drain}}))
    pod = pod_of(spec)
    server = containers(pod)["server"]
    assert server["lifecycle"] == {
        "preStop": {"sleep": {"seconds": defaults.PRESTOP_SLEEP_SECONDS}}
    }
    config = server_args(server["args"][1:])  # what the real server makes of its command line
    expected = defaults.DRAIN_SECONDS if drain is None else drain
    assert config.drain_seconds == expected
    grace = pod["terminationGracePeriodSeconds"]
    assert isinstance(grace, int)
    assert grace >= defaults.PRESTOP_SLEEP_SECONDS + expected + defaults.INFLIGHT_GRACE_SECONDS
    if drain is None:
        assert grace == defaults.TERMINATION_GRACE_SECONDS
    assert termination_grace_seconds(defaults.DRAIN_SECONDS) == defaults.TERMINATION_GRACE_SECONDS


def _fetch_configs(pod: dict[str, Any]) -> dict[str, FetchConfig]:
    out = {}
    for name in ("prefetch", "sidecar"):
        config = sidecar_args(containers(pod)[name]["args"][1:])
        assert isinstance(config, InitConfig if name == "prefetch" else WatchConfig)
        out[name] = config.fetch
    return out


def test_storm_controls_reach_the_init_container_and_the_sidecar() -> None:
    settings = {
        "startJitterSeconds": 7.5,
        "backoffBaseSeconds": 0.5,
        "backoffMaxSeconds": 90,
        "maxConcurrentDownloads": 3,
    }
    for name, fetch in _fetch_configs(pod_of(example_spec(sidecar=settings))).items():
        assert (
            fetch.start_jitter_seconds,
            fetch.backoff_base_seconds,
            fetch.backoff_max_seconds,
            fetch.max_concurrent_downloads,
        ) == (7.5, 0.5, 90.0, 3), name
    for name, fetch in _fetch_configs(pod_of(example_spec())).items():  # the contract's defaults
        assert (
            fetch.start_jitter_seconds,
            fetch.backoff_base_seconds,
            fetch.backoff_max_seconds,
            fetch.max_concurrent_downloads,
        ) == (
            defaults.START_JITTER_SECONDS,
            defaults.BACKOFF_BASE_SECONDS,
            defaults.BACKOFF_MAX_SECONDS,
            defaults.MAX_CONCURRENT_DOWNLOADS,
        ), name


def test_signatures_are_checked_unless_the_spec_opts_out() -> None:
    signed = pod_of(example_spec())
    for name, fetch in _fetch_configs(signed).items():
        assert (str(fetch.public_key), fetch.allow_unsigned) == (argv.KEYS_DIR, False), name
    [key] = [v for v in signed["volumes"] if v["name"] == "signing-key"]
    assert key["secret"]["secretName"] == "model-signing-key"

    unsigned = pod_of(example_spec(signingPublicKeySecret=None, allowUnsigned=True))
    for name, fetch in _fetch_configs(unsigned).items():
        assert (fetch.public_key, fetch.allow_unsigned) == (None, True), name
    assert not [v for v in unsigned["volumes"] if v["name"] == "signing-key"]


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA (the cluster CA's stand-in)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "ca.crt", tmp_path / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_the_sidecars_client_reads_the_rotated_projected_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The projected token expires (TOKEN_SECONDS) and the kubelet replaces the file; the
    sidecar's one long-lived client (``PodApi.connect``, in-cluster config) must send the
    new token, not the one it started with. A real HTTPS server checks what arrives."""
    ca, server_key = _self_signed(tmp_path)
    seen: list[str] = []

    async def read_pod(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        meta = {"name": "p", "namespace": "ns", "resourceVersion": "1", "annotations": {}}
        return web.json_response({"kind": "Pod", "metadata": meta})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods/p", read_pod)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(ca, server_key)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    token = tmp_path / "token"
    token.write_text("token-1")
    # where the projected volume is mounted in the pod: here, files of this test
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    # the client reads the file again at most once a minute: a test does not wait a minute
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(0))
    api = PodApi.connect(None, "ns", "p")
    assert api is not None
    try:
        await api.read()
        rotated = tmp_path / "..token.new"  # the kubelet swaps the file atomically
        rotated.write_text("token-2")
        rotated.replace(token)
        await api.read()
    finally:
        await api.close()
        await runner.cleanup()
    assert seen == ["Bearer token-1", "Bearer token-2"]
