"""The pods the operator generates (issue 13, "Pod and RBAC"): API credentials only in the
containers that call the API, a drain before the kubelet's SIGKILL, the storm controls and
the drain time from the ModelDeployment, and signature checks unless the spec explicitly
opts out. Command lines are read back with the programs' own parsers."""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import json
import shutil
import signal
import ssl
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
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
    RUN_AS,
    TOKEN_SECONDS,
    children,
    deployment,
    termination_grace_seconds,
)
from model_operator.spec import ModelDeploymentSpec, SpecError, parse_spec
from model_rollout_contract import argv, defaults
from model_rollout_e2e.processes import ChildProcess, free_port, http_ok, wait_until
from model_server.config import parse_args as server_args
from model_sidecar.config import FetchConfig, InitConfig, WatchConfig
from model_sidecar.config import parse_args as sidecar_args
from model_sidecar.kube import PodApi
from tests.support.helm_chart import render_chart
from tests.support.pod_security import violations
from tests.support.server import add_version, ask, infer_body, output_of
from tests.support.sidecar import snapshot

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-rollout"
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
    # the server gives requests in flight what the grace leaves after the drain, no more
    assert config.inflight_grace_seconds == defaults.INFLIGHT_GRACE_SECONDS
    assert grace >= defaults.PRESTOP_SLEEP_SECONDS + expected + config.inflight_grace_seconds
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


# --- pod security (issue 13 follow-up) ----------------------------------------------


def _every_pod() -> list[dict[str, Any]]:
    """The generated pod for each example, signed and unsigned."""
    pods = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                pods.append(pod_of(parse_spec(doc["spec"])))
    pods.append(pod_of(example_spec(signingPublicKeySecret=None, allowUnsigned=True)))
    pods.append(pod_of(example_spec(tenants=TENANT_MODELS)))
    return pods


def test_the_pod_meets_pod_security_restricted() -> None:
    for pod in _every_pod():
        assert violations(pod) == []
        assert pod["securityContext"]["runAsUser"] == RUN_AS
        assert pod["securityContext"]["fsGroup"] == RUN_AS  # the volumes are the user's
        for name, container in containers(pod).items():
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
    dockerfile = (ROOT / "Dockerfile.server").read_text()
    assert f"useradd --uid {RUN_AS} " in dockerfile and f"USER {RUN_AS}" in dockerfile


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["a"]}], ids=["default", "namespaced"])
def test_the_operators_pod_meets_pod_security_restricted(values: dict[str, Any]) -> None:
    [operator] = [d for d in render_chart(CHART, values) if d["kind"] == "Deployment"]
    assert violations(operator["spec"]["template"]["spec"]) == []


def _server(pod: dict[str, Any]) -> dict[str, Any]:
    return containers(pod)["server"]


# each breaks one control of the standard: the check must see every one
BREAKS_RESTRICTED: dict[str, Any] = {
    "root user": lambda pod: pod["securityContext"].update(runAsUser=0),
    "root allowed": lambda pod: pod["securityContext"].pop("runAsNonRoot"),
    "a container as root": lambda pod: _server(pod)["securityContext"].update(runAsNonRoot=False),
    "privilege escalation": lambda pod: _server(pod)["securityContext"].update(
        allowPrivilegeEscalation=True
    ),
    "capabilities kept": lambda pod: _server(pod)["securityContext"].update(capabilities={}),
    "a capability added": lambda pod: _server(pod)["securityContext"]["capabilities"].update(
        add=["SYS_ADMIN"]
    ),
    "NET_RAW added": lambda pod: _server(pod)["securityContext"]["capabilities"].update(
        add=["NET_RAW"]
    ),
    "no seccomp profile": lambda pod: pod["securityContext"].pop("seccompProfile"),
    "seccomp unconfined": lambda pod: _server(pod)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}
    ),
    "privileged": lambda pod: _server(pod)["securityContext"].update(privileged=True),
    "host network": lambda pod: pod.update(hostNetwork=True),
    "host PID": lambda pod: pod.update(hostPID=True),
    "a hostPath volume": lambda pod: pod["volumes"].append(
        {"name": "h", "hostPath": {"path": "/"}}
    ),
    "a host port": lambda pod: _server(pod)["ports"][0].update(hostPort=8000),
    "an unmasked /proc": lambda pod: _server(pod)["securityContext"].update(procMount="Unmasked"),
    "an SELinux user": lambda pod: pod["securityContext"].update(seLinuxOptions={"user": "root"}),
    "an unsafe sysctl": lambda pod: pod["securityContext"].update(
        sysctls=[{"name": "kernel.msgmax", "value": "1"}]
    ),
    "AppArmor unconfined": lambda pod: _server(pod)["securityContext"].update(
        appArmorProfile={"type": "Unconfined"}
    ),
}


@pytest.mark.parametrize("mutate", BREAKS_RESTRICTED.values(), ids=BREAKS_RESTRICTED.keys())
def test_the_pod_security_check_sees_each_broken_control(mutate: Any) -> None:
    pod = copy.deepcopy(pod_of(example_spec()))
    mutate(pod)
    assert violations(pod)


def _mount_of(container: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The mount that holds ``path`` in ``container`` (the longest mount path above it)."""
    holders = [
        m
        for m in container["volumeMounts"]
        if Path(path) == Path(m["mountPath"]) or Path(path).is_relative_to(m["mountPath"])
    ]
    assert holders, f"{path} is on no volume of {container['name']}"
    return max(holders, key=lambda m: len(m["mountPath"]))


def test_the_server_keeps_its_state_off_the_shared_volume_and_only_reads_it() -> None:
    """The engine cache and the audit log are on volumes only the server mounts (a writer
    of the shared volume planted cache entries the server loaded); the model volume is
    read-only in the server; everything the server writes is on a volume of its own
    (its root filesystem is read-only)."""
    pod = pod_of(example_spec())
    server = _server(pod)
    config = server_args(server["args"][1:])
    assert config.cache_dir is not None and config.audit_log is not None
    holders: dict[str, set[str]] = {}
    for name, container in containers(pod).items():
        for mount in container["volumeMounts"]:
            holders.setdefault(mount["name"], set()).add(name)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (config.cache_dir, config.audit_log, Path("/tmp/x")):
        mount = _mount_of(server, path)
        assert holders[mount["name"]] == {"server"}, (path, mount)
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), path
    assert config.control_socket is not None
    assert not _mount_of(server, config.control_socket).get("readOnly")  # shared: the socket
    assert _mount_of(server, config.repository) == {
        "name": "models",
        "mountPath": argv.MODELS_DIR,
        "readOnly": True,
    }
    for name in ("prefetch", "sidecar"):  # they write the versions
        assert not _mount_of(containers(pod)[name], argv.MODELS_DIR).get("readOnly"), name


def _local_args(container: dict[str, Any], root: Path, port: int) -> list[str]:
    """The container's command line with every mount path under ``root/<volume>`` (as
    the e2e kubelet stand-in maps them) and the port given."""
    mounts = sorted(container["volumeMounts"], key=lambda m: len(m["mountPath"]), reverse=True)
    out = []
    args = container["args"][1:]
    for i, arg in enumerate(args):
        flag = args[i - 1] if i else ""
        if flag == "--port":
            arg = str(port)
        elif flag == "--host":
            arg = "127.0.0.1"
        for mount in mounts:
            path = mount["mountPath"]
            if arg == path or arg.startswith(path + "/"):
                arg = str(root / mount["name"]) + arg[len(path) :]
                break
        out.append(arg)
    return out


async def test_the_server_writes_nothing_on_the_shared_volume(tmp_path: Path) -> None:
    """The real server, from the pod's own command line: start, serve, load a version and
    roll back over the control socket, SIGTERM. The model volume (the sidecar's to write)
    is byte for byte as it was; the cache and the audit log are in the server's own."""
    spec = example_spec(backend="onnxruntime", precision="model")
    server = _server(pod_of(spec))
    root = Path(tempfile.mkdtemp(prefix="pod-", dir="/tmp"))  # a short socket path
    try:
        models = root / "models"
        v1 = add_version(models, spec.model, "v1", seed=1)
        v2 = add_version(models, spec.model, "v2", seed=2)
        (models / spec.model / "CURRENT").write_text("v1\n")
        for mount in server["volumeMounts"]:
            (root / mount["name"]).mkdir(exist_ok=True)
        before = snapshot(models)
        port = free_port()
        process = ChildProcess(
            "model_server", _local_args(server, root, port), tmp_path / "server.log"
        ).start()
        try:
            url = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(
                wait_until, lambda: http_ok(f"{url}/v2/health/ready"), 60, what="the server"
            )
            socket = root / "control" / Path(argv.CONTROL_SOCKET).name
            load = {"op": "load", "model": spec.model, "version": "v2",
                    "path": str(v2.path), "sha256": v2.sha256}  # fmt: skip
            assert (await ask(socket, load))["ok"] is True
            answer = await ask(socket, {"op": "rollback", "model": spec.model, "version": "v1"})
            assert answer["ok"] is True, answer
            infer = f"{url}/v2/models/{spec.model}/infer"
            x = np.ones((2, 8), np.float32)
            async with (
                aiohttp.ClientSession() as session,
                session.post(infer, json=infer_body(x)) as response,
            ):
                assert response.status == 200
                np.testing.assert_allclose(
                    output_of(await response.json()), v1.expected(x), atol=1e-5
                )
            assert process.proc is not None
            process.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.run_to_end, 120) == 0, process.log_tail()
        finally:
            process.kill()
        assert snapshot(models) == before
        cache = root / _mount_of(server, argv.ENGINE_CACHE)["name"]
        assert any(p.suffix == ".onnx" for p in cache.iterdir())  # both versions optimised
        audit = root / _mount_of(server, argv.AUDIT_LOG)["name"] / Path(argv.AUDIT_LOG).name
        actions = [json.loads(line)["action"] for line in audit.read_text().splitlines()]
        assert actions == ["load", "load", "rollback"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


JWT = {"issuer": "https://issuer.example", "audience": "model-api", "jwksSecret": "issuer-jwks"}


def test_tenants_jwts_reach_the_server_and_only_the_server_mounts_the_jwks() -> None:
    tenants = {"secretName": "resnet-tenants", "jwt": {**JWT, "algorithms": ["ES256"]}}
    pod = pod_of(example_spec(tenants=tenants))
    server = containers(pod)["server"]
    assert server["args"][0] == "model-server"
    config = server_args(server["args"][1:])
    assert config.jwt is not None and config.tenants_file == Path(argv.TENANTS_FILE)
    assert (config.jwt.issuer, config.jwt.audience) == ("https://issuer.example", "model-api")
    assert config.jwt.jwks_file == Path(argv.JWKS_FILE) and config.jwt.jwks_url is None
    assert config.jwt.algorithms == ("ES256",)
    assert config.jwt.leeway_s == defaults.JWT_LEEWAY_SECONDS
    assert config.jwt.tenant_claim == defaults.JWT_TENANT_CLAIM
    [volume] = [v for v in pod["volumes"] if v["name"] == "jwks"]
    assert volume["secret"] == {
        "secretName": "issuer-jwks",
        "items": [{"key": argv.JWKS_KEY, "path": argv.JWKS_KEY}],
    }
    mounted = {
        name for name, c in containers(pod).items()
        if any(m["name"] == "jwks" for m in c.get("volumeMounts", []))
    }  # fmt: skip
    assert mounted == {"server"}
    by_url = {**JWT, "jwksUrl": "https://issuer.example/jwks.json", "leewaySeconds": 5}
    del by_url["jwksSecret"]
    pod = pod_of(example_spec(tenants={"secretName": "t", "jwt": by_url}))
    config = server_args(containers(pod)["server"]["args"][1:])
    assert config.jwt is not None and config.jwt.jwks_file is None
    assert (config.jwt.jwks_url, config.jwt.leeway_s) == ("https://issuer.example/jwks.json", 5)
    assert not [v for v in pod["volumes"] if v["name"] == "jwks"]
    assert server_args(containers(pod_of(example_spec()))["server"]["args"][1:]).jwt is None


@pytest.mark.parametrize(
    ("tenants", "problem"),
    [
        ({"jwt": JWT}, "needs spec.tenants.secretName"),
        ({"secretName": "t", "jwt": {**JWT, "jwksUrl": "https://h/j"}}, "exactly one of"),
        ({"secretName": "t", "jwt": {"issuer": "i", "audience": "a"}}, "exactly one of"),
        ({"secretName": "t", "jwt": {**JWT, "algorithms": ["HS256"]}}, "never none or HS*"),
        ({"secretName": "t", "jwt": {**JWT, "algorithms": ["none"]}}, "never none or HS*"),
        ({"secretName": "t", "jwt": {**JWT, "issuer": ""}}, "issuer must be 1-1024"),
        ({"secretName": "t", "jwt": {**JWT, "audience": None}}, "audience is required"),
        ({"secretName": "t", "jwt": {**JWT, "leewaySeconds": 3600}}, "leewaySeconds"),
    ]
    + [
        ({"secretName": "t", "jwt": {"issuer": "i", "audience": "a", "jwksUrl": url}}, "https URL")
        for url in ("http://h/jwks", "https://ops:pw@h/jwks", "https://", "https://h x")
    ],
)
def test_a_malformed_jwt_setting_is_a_condition_not_a_pod(
    tenants: dict[str, Any], problem: str
) -> None:
    with pytest.raises(SpecError) as refused:
        example_spec(tenants=tenants)
    assert problem in str(refused.value)
    assert "pw" not in str(refused.value)


TENANT_MODELS = {
    "secretName": "resnet-tenants",
    "models": [
        {"name": "acme-resnet", "tenant": "acme", "model": "resnet", "version": "a7"},
        {
            "name": "globex-resnet",
            "tenant": "globex",
            "model": "resnet",
            "version": "g2",
            "signingPublicKeySecret": "globex-keys",
        },
    ],
}


def test_each_tenant_model_has_its_own_sidecar_following_its_own_track() -> None:
    spec = example_spec(tenants=TENANT_MODELS)
    pod = pod_of(spec)
    by_name = containers(pod)
    ports = set()
    for track, model, keys in (
        ("acme-resnet", "acme/resnet", argv.KEYS_DIR),  # the deployment's key
        ("globex-resnet", "globex/resnet", f"{argv.KEYS_DIR}-globex-resnet"),  # its own
    ):
        init = sidecar_args(by_name[f"prefetch-{track}"]["args"][1:])
        watch = sidecar_args(by_name[f"sidecar-{track}"]["args"][1:])
        assert isinstance(init, InitConfig) and isinstance(watch, WatchConfig)
        for fetch in (init.fetch, watch.fetch):
            assert (fetch.model, fetch.track, fetch.public_key) == (model, track, Path(keys))
            assert fetch.configmap_file == Path(argv.CONFIG_DIR) / f"target-version.{track}"
        assert watch.status_file == Path(argv.status_file(track))
        ports.add(watch.metrics_port)
        mounts = {m["mountPath"] for m in by_name[f"sidecar-{track}"]["volumeMounts"]}
        assert keys in mounts and (keys == argv.KEYS_DIR or argv.KEYS_DIR not in mounts)
    own = sidecar_args(by_name["sidecar"]["args"][1:])
    assert isinstance(own, WatchConfig) and own.fetch.track is None
    ports.add(own.metrics_port)
    assert len(ports) == 3  # every sidecar its own metrics port
    [keys] = [v for v in pod["volumes"] if v["name"] == "keys-globex-resnet"]
    assert keys["secret"] == {"secretName": "globex-keys"}
    objects = children("resnet", "ml-serving", spec, "v1")
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    assert configmap["data"] == {
        "target-version": "v1",
        "target-version.acme-resnet": "a7",
        "target-version.globex-resnet": "g2",
    }
    assert violations(pod) == []


@pytest.mark.parametrize(
    ("models", "problem"),
    [
        ([{"name": "Acme", "tenant": "a", "model": "m", "version": "v"}], "name must be"),
        ([{"name": "a", "tenant": "a", "model": "m", "version": "v"}] * 2, "each name once"),
        (
            [
                {"name": "a", "tenant": "t", "model": "m", "version": "v"},
                {"name": "b", "tenant": "t", "model": "m", "version": "w"},
            ],
            "each tenant and model once",
        ),
        ([{"name": "a", "tenant": "resnet50", "model": "m", "version": "v"}], "deployment's model"),
        ([{"name": "a", "tenant": "t", "model": "m"}], "version must be a name"),
    ],
)
def test_a_malformed_tenant_model_is_a_condition_not_a_pod(
    models: list[dict[str, str]], problem: str
) -> None:
    with pytest.raises(SpecError) as refused:
        example_spec(tenants={"secretName": "t", "models": models})
    assert problem in str(refused.value)


def test_server_processes_reach_the_server() -> None:
    for processes in (1, 4):
        pod = pod_of(example_spec(server={"processes": processes}))
        assert server_args(containers(pod)["server"]["args"][1:]).processes == processes
    assert server_args(containers(pod_of(example_spec()))["server"]["args"][1:]).processes == 1


def test_a_tenant_with_its_own_key_is_signed_even_when_the_deployment_allows_unsigned() -> None:
    """Issue 15: ``allowUnsigned`` is the deployment's key's opt-out; a tenant that names
    its own signingPublicKeySecret ran ``--allow-unsigned`` anyway, its key unused."""
    spec = example_spec(signingPublicKeySecret=None, allowUnsigned=True, tenants=TENANT_MODELS)
    by_name = containers(pod_of(spec))
    for name in ("prefetch-globex-resnet", "sidecar-globex-resnet"):  # its own key
        config = sidecar_args(by_name[name]["args"][1:])
        assert isinstance(config, InitConfig | WatchConfig)
        assert (config.fetch.public_key, config.fetch.allow_unsigned) == (
            Path(f"{argv.KEYS_DIR}-globex-resnet"),
            False,
        ), name
    for name in ("prefetch-acme-resnet", "sidecar-acme-resnet", "sidecar"):  # no key of its own
        config = sidecar_args(by_name[name]["args"][1:])
        assert isinstance(config, InitConfig | WatchConfig)
        assert (config.fetch.public_key, config.fetch.allow_unsigned) == (None, True), name
