"""The contract package: one rule, one order, wire formats that round-trip, defaults
that match the CRD, command lines the real parsers accept, and a contract that needs only
the standard library."""

from __future__ import annotations

import argparse
import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from model_rollout_contract import argv, canary, defaults
from model_rollout_contract.control import (
    ErrorReply,
    LoadRequest,
    ProtocolError,
    RollbackRequest,
    StatusReply,
    StatusRequest,
    SwapReply,
    encode,
    parse_reply,
    parse_request,
)
from model_rollout_contract.names import (
    InvalidName,
    ModelKey,
    check_model_key,
    check_name,
    is_valid_name,
)
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import Phase, SidecarState
from model_rollout_contract.versions import newest, predecessor, sorted_versions

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "common" / "model_rollout_contract"


def imported_packages(source: Path) -> set[str]:
    """Top-level names of every absolute import in the files under ``source``."""
    names: set[str] = set()
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


# packaging: the canonical PEP 440 reading the version order needs (versions.py); pure
# Python, in the base install that every program's extra builds on (pyproject.toml)
CONTRACT_DEPENDENCIES = {"packaging"}


def test_the_contract_imports_only_the_standard_library_and_packaging() -> None:
    """Which program imports which is import-linter's (pyproject.toml); that the contract
    needs nothing but the standard library and its one declared dependency is not
    something it can say."""
    imported = imported_packages(CONTRACT) - {"model_rollout_contract", "__future__"}
    import sys

    outside = imported - set(sys.stdlib_module_names)
    assert outside <= CONTRACT_DEPENDENCIES, outside - CONTRACT_DEPENDENCIES


def test_the_contract_dependencies_are_in_the_base_install() -> None:
    """Each program installs the base (``.[server,sidecar]``, ``.[operator]``, ``.[cli]``):
    a dependency the contract imports must be there, not in one program's extra."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert names == CONTRACT_DEPENDENCIES


def test_the_import_check_sees_imports() -> None:  # the check above cannot pass vacuously
    operator = ROOT / "operator" / "model_operator"
    assert {"model_rollout_contract", "kopf"} <= imported_packages(operator)


@pytest.mark.parametrize("name", ["v1", "2026-11-30", "a_b.c", "A" * 128])
def test_valid_names(name: str) -> None:
    assert check_name("version", name) == name


@pytest.mark.parametrize("name", ["", "-x", "../v2", "v2\n", "v 2", "a/b", "A" * 129, None, 3])
def test_invalid_names_raise_value_errors(name: object) -> None:
    assert not is_valid_name(name)
    with pytest.raises(InvalidName, match="invalid version") as caught:
        check_name("version", name)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("text", "tenant", "name", "parts"),
    [
        ("resnet", None, "resnet", ("resnet",)),
        ("acme/resnet", "acme", "resnet", ("acme", "resnet")),
    ],
)
def test_model_key_round_trip(
    text: str, tenant: str | None, name: str, parts: tuple[str, ...]
) -> None:
    key = ModelKey.parse(text)
    assert (key.tenant, key.name, key.parts) == (tenant, name, parts)
    assert str(key) == text == check_model_key(text)
    assert key == ModelKey.of(name, tenant) == ModelKey(tenant, name)
    assert ModelKey.tenant_in(text) == tenant and ModelKey.name_in(text) == name


@pytest.mark.parametrize(
    "text", ["", "/m", "t/", "a/b/c", "t/../m", "../m", "m\n", "t /m", "A" * 129, None, 3]
)
def test_invalid_model_keys(text: object) -> None:
    with pytest.raises(InvalidName, match=r"invalid model .*'name' or 'tenant/name'"):
        ModelKey.parse(text)
    with pytest.raises(InvalidName):
        check_model_key(text)


def test_model_key_parts_are_checked_names() -> None:
    with pytest.raises(InvalidName, match="invalid model name"):
        ModelKey.of("a/b", "t")  # a name holds no slash: it cannot smuggle a tenant
    with pytest.raises(InvalidName, match="invalid tenant"):
        ModelKey.of("m", "../t")
    assert ModelKey.of("m", "") == ModelKey.of("m") and str(ModelKey.of("m", "t")) == "t/m"
    assert ModelKey.tenant_in("m") is None and ModelKey.tenant_in("/m") == ""  # unchecked


# where a slash is split or tested for a reason of its own, not a model key
NOT_MODEL_KEYS = {
    ("model_operator/leader.py", "self.path.rsplit('/', 1)"),  # an API path's parent
    ("model_operator/editor_policy.py", "ABORT.partition('/')"),  # annotation prefixes
    ("model_operator/editor_policy.py", "RETRY.partition('/')"),
    ("model_operator/editor_policy.py", "CHANGE_CAUSE.partition('/')"),
    ("model_sidecar/volume.py", "'/' in name"),  # one directory entry
}
SLASH_OPS = {"split", "rsplit", "partition", "rpartition", "startswith", "removeprefix"}


def _slash_uses(path: Path) -> list[str]:
    """Each place the file splits a text at ``/`` or asks whether it holds one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and node.func.attr in SLASH_OPS and node.args[:1]:  # type: ignore[union-attr]
            first = node.args[0]  # type: ignore[union-attr]
            if isinstance(first, ast.Constant) and first.value == "/":
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            found += [ast.unparse(node)] if node.left.value == "/" else []
    return found


def test_model_keys_are_read_only_by_model_key() -> None:
    """The ``tenant/name`` rule lives in ModelKey: no program splits a key itself, and
    the helpers that did are gone."""
    programs = ["server", "sidecar", "operator", "cli"]
    uses = {
        (str(path.relative_to(ROOT / program)), use)
        for program in programs
        for path in (ROOT / program).rglob("*.py")
        if "_pb2" not in path.name
        for use in _slash_uses(path)
    }
    assert uses <= NOT_MODEL_KEYS, uses - NOT_MODEL_KEYS
    assert _slash_uses(CONTRACT / "names.py")  # the scan sees what ModelKey itself does
    import model_rollout_contract.names as names
    from model_server.frontends.grpc import api as grpc_api
    from model_server.lifecycle import memory_budget

    for module, helper in ((names, "model_key"), (memory_budget, "tenant_of"),
                           (grpc_api, "admin_model_key")):  # fmt: skip
        assert not hasattr(module, helper), f"{module.__name__}.{helper}: use ModelKey"


def test_one_version_order() -> None:
    assert sorted_versions(["v10", "v9", "v2", "v1"]) == ["v1", "v2", "v9", "v10"]
    # dates with dashes follow no published rule: no date is newer than another, so they
    # show in text order (test_versions.py: the history orders them)
    assert sorted_versions(["2026-11-30", "2026-1-2", "2025-12-31"]) == [
        "2025-12-31",
        "2026-1-2",
        "2026-11-30",
    ]
    assert sorted_versions(["b", "a10", "a9", "10", "9"]) == ["10", "9", "a10", "a9", "b"]
    assert newest(["v2", "v10"]) == "v10" and newest([]) is None
    assert predecessor(["v1", "v2", "v10"], "v10") == "v2"
    assert predecessor(["v1", "v2"], "v1") is None


def test_sidecar_report_round_trip() -> None:
    report = SidecarReport(
        "m",
        "v2",
        "v1",
        SidecarState.REFUSED,
        "bad_signature: x",
        retained=("v0",),
        target_seen_at=4.5,
        updated_at=5.0,
    )
    text = report.to_json()
    assert json.loads(text)["state"] == "refused"
    assert SidecarReport.from_json(text) == report
    assert json.loads(text)["retained"] == ["v0"]
    assert report.same_as(replace(report, updated_at=99.0))
    assert not report.same_as(replace(report, retained=()))
    for junk in (None, "", "nope", "[]", '{"state": "exploded"}', '{"target": "v1"}', "[" * 5000):
        assert SidecarReport.from_json(junk) is None


def test_control_messages_round_trip() -> None:
    for request in (
        LoadRequest("m", "v2", "/models/m/v2/model.onnx", "a" * 64),
        LoadRequest("m", "v2", None, "a" * 64),
        RollbackRequest("m", "v1"),
        RollbackRequest("m"),
        StatusRequest("m"),
    ):
        assert parse_request(encode(request)) == request
    for reply in (
        SwapReply("m", "v1", "v2", 812.5, False),
        SwapReply("m", None, "v1", 1.0, True),
        SwapReply("m", "v1", "v2", 30.5, False, (("read", 10.0), ("hash", 20.5))),
        StatusReply("m", "v2", "a" * 64, ("v1", "v2")),
        StatusReply("m", None, None, ()),
        StatusReply("m", "v2", None, ("v1", "v2"), canary.TrafficPolicy("v1", "v2", 10, 20), True),
        StatusReply("m", "v1", None, ("v1",), None, True),  # says: no policy held
        ErrorReply("nope", "load_refused"),
    ):
        assert parse_reply(encode(reply)) == reply


def test_a_load_carries_a_traffic_policy_both_ways_and_only_its_own() -> None:
    from model_rollout_contract.canary import InvalidPolicy, TrafficPolicy

    policy = TrafficPolicy("v1", "v2", traffic_percent=10, shadow_percent=20)
    with_policy = LoadRequest("m", "v2", "/models/m/v2/model.onnx", "a" * 64, policy)
    assert parse_request(encode(with_policy)) == with_policy
    assert json.loads(encode(with_policy))["traffic_percent"] == 10
    plain = LoadRequest("m", "v2", None, "a" * 64)
    assert "candidate" not in json.loads(encode(plain))  # the message as it always was
    with pytest.raises(InvalidPolicy, match="the loaded version 'v2' as its candidate"):
        LoadRequest("m", "v2", None, "a" * 64, TrafficPolicy("v1", "v3"))
    load = {"op": "load", "model": "m", "version": "v2", "path": None, "sha256": "a" * 64}
    for bad, why in (
        ({"stable": "v1", "candidate": "v3"}, "as its candidate"),
        ({"stable": "v1"}, "needs 'candidate'"),
        ({"stable": "v1", "candidate": "v2", "traffic_percent": 101}, "trafficPercent"),
        ({"stable": "../v1", "candidate": "v2"}, "invalid version"),
    ):
        with pytest.raises(ProtocolError, match=why):
            parse_request(json.dumps({**load, **bad}).encode())


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1]",
        b'{"op": "load", "model": "m"}',
        b'{"op": "status"}',
        b'{"op": "status", "model": "../m"}',
        b'{"op": "rollback", "model": "m", "version": "v1\\n"}',
        b'{"op": "explode", "model": "m"}',
        b"[" * 5000,
    ],
)
def test_bad_control_requests_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_request(line)


def test_states_serialise_as_plain_values() -> None:
    assert json.dumps({"phase": Phase.AVAILABLE}) == '{"phase": "Available"}'
    assert f"{Phase.CANARY}" == "Canary" and str(SidecarState.OK) == "ok"
    assert Phase("Degraded") is Phase.DEGRADED and Phase.CANARY.rolling


# every `default:` in the CRD's spec, and the contract value it repeats. An object's `{}`
# makes the API server fill in its fields' defaults when the object is left out; a field
# not listed has no default (spec.canary.analysis: absent means no analysis)
CRD_DEFAULTS = {
    "replicas": defaults.REPLICAS,
    "backend": defaults.BACKEND,
    "precision": defaults.PRECISION,
    "resources.gpu": defaults.GPUS,
    "canary": {},
    "canary.percent": defaults.CANARY_PERCENT,
    "canary.pauseSeconds": defaults.CANARY_PAUSE_SECONDS,
    "canary.manualPromote": defaults.MANUAL_PROMOTE,
    "canary.trafficPercent": defaults.CANARY_TRAFFIC_PERCENT,
    "canary.shadowPercent": defaults.CANARY_SHADOW_PERCENT,
    "canary.shadow.percent": defaults.CANARY_SHADOW_STEP_PERCENT,
    "canary.analysis.intervalSeconds": defaults.ANALYSIS_INTERVAL_SECONDS,
    "canary.analysis.minRequests": defaults.ANALYSIS_MIN_REQUESTS,
    "canary.analysis.failureLimit": defaults.ANALYSIS_FAILURE_LIMIT,
    "canary.analysis.maxErrorRate": defaults.ANALYSIS_MAX_ERROR_RATE,
    "canary.analysis.maxLatencyRatio": defaults.ANALYSIS_MAX_LATENCY_RATIO,
    "canary.analysis.maxNonFinite": defaults.ANALYSIS_MAX_NON_FINITE,
    "canary.analysis.onInconclusive": defaults.ANALYSIS_ON_INCONCLUSIVE,
    "rollout": {},
    "rollout.jitterSeconds": defaults.JITTER_SECONDS,
    "rollout.maxUnavailable": defaults.MAX_UNAVAILABLE,
    "rollout.progressDeadlineSeconds": defaults.PROGRESS_DEADLINE_SECONDS,
    "retainVersions": defaults.RETAIN_VERSIONS,
    "allowUnsigned": defaults.ALLOW_UNSIGNED,
    "logging": {},
    "logging.format": defaults.LOG_FORMAT,
    "logging.level": defaults.LOG_LEVEL,
    "paused": defaults.PAUSED,
    "sidecar": {},
    "sidecar.startJitterSeconds": defaults.START_JITTER_SECONDS,
    "sidecar.backoffBaseSeconds": defaults.BACKOFF_BASE_SECONDS,
    "sidecar.backoffMaxSeconds": defaults.BACKOFF_MAX_SECONDS,
    "sidecar.maxConcurrentDownloads": defaults.MAX_CONCURRENT_DOWNLOADS,
    "server": {},
    "server.drainSeconds": defaults.DRAIN_SECONDS,
    "server.processes": defaults.SERVER_PROCESSES,
    "server.batching": {},
    "server.batching.maxBatchSize": defaults.MAX_BATCH_SIZE,
    "server.batching.maxQueueDelayMicroseconds": defaults.MAX_QUEUE_DELAY_MICROSECONDS,
}


def crd_defaults() -> dict[str, object]:
    """Every default of the CRD's spec, by the field's dotted path."""
    [crd] = [d for d in yaml.safe_load_all((ROOT / "deploy/crds/modeldeployment.yaml").read_text())]
    [version] = crd["spec"]["versions"]
    found: dict[str, object] = {}

    def walk(node: dict, path: str) -> None:
        if "default" in node:
            found[path] = node["default"]
        for name, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{name}" if path else name)
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], "")
    return found


def test_crd_defaults_are_the_contract_defaults() -> None:
    """The whole table at once: a wrong value, a default the CRD lacks and one the table
    does not know (a new field's, not in the contract) all fail it."""
    assert crd_defaults() == CRD_DEFAULTS


def test_the_operator_parses_an_empty_spec_to_the_contract_defaults() -> None:
    from model_operator.spec import parse_spec

    spec = parse_spec(
        {
            "model": "m",
            "version": "v1",
            "image": "i",
            "store": {"pvc": "c"},
            "signingPublicKeySecret": "k",
        }
    )
    assert (spec.replicas, spec.backend, spec.precision, spec.gpus, spec.retain_versions) == (
        defaults.REPLICAS,
        defaults.BACKEND,
        defaults.PRECISION,
        defaults.GPUS,
        defaults.RETAIN_VERSIONS,
    )
    assert spec.rollout.batch_percent == defaults.BATCH_PERCENT
    assert spec.rollout.progress_deadline_seconds == defaults.PROGRESS_DEADLINE_SECONDS
    assert spec.canary.pause_seconds == defaults.CANARY_PAUSE_SECONDS


@pytest.mark.parametrize("tenants", [False, True])
def test_server_argv_is_what_the_server_parses(tenants: bool) -> None:
    from model_server.config import parse_args

    line = argv.server_argv(argv.ServerArgs("resnet", "torch", 3, tenants, precision="fp32"))
    assert line[0] == "model-server"
    config = parse_args(line[1:])
    assert [m.key for m in config.models] == ["resnet"] and config.backend == "torch"
    assert config.tensorrt.precision == "fp32"
    assert (config.port, config.retain, str(config.repository)) == (
        defaults.SERVER_PORT,
        3,
        argv.MODELS_DIR,
    )
    assert str(config.control_socket) == argv.CONTROL_SOCKET
    assert str(config.tenants_file) == argv.TENANTS_FILE if tenants else config.tenants_file is None


@pytest.mark.parametrize("mode", ["init", "watch"])
@pytest.mark.parametrize("signed", [True, False])
def test_sidecar_argv_is_what_the_sidecar_parses(mode: str, signed: bool) -> None:
    from model_sidecar.config import InitConfig, WatchConfig, parse_args

    line = argv.sidecar_argv(mode, argv.SidecarArgs("resnet", "s3://b/p", signed, retain=2))
    assert line[:2] == ["model-sidecar", mode]
    config = parse_args(line[1:])
    assert isinstance(config, InitConfig if mode == "init" else WatchConfig)
    fetch = config.fetch
    assert (fetch.model, fetch.store.store, str(fetch.volume)) == (
        "resnet",
        "s3://b/p",
        argv.MODELS_DIR,
    )
    assert str(fetch.annotations_file) == argv.PODINFO_ANNOTATIONS
    assert str(fetch.configmap_file) == argv.CONFIGMAP_TARGET
    public_key = str(fetch.public_key) if fetch.public_key else None
    assert (public_key, fetch.allow_unsigned) == (
        (argv.KEYS_DIR, False) if signed else (None, True)
    )
    if isinstance(config, WatchConfig):
        assert str(config.control_socket) == argv.CONTROL_SOCKET and config.keep_versions == 3
        assert config.metrics_port == defaults.SIDECAR_METRICS_PORT


@pytest.mark.parametrize("full", [True, False])
def test_publish_argv_is_what_the_sidecar_parses(full: bool) -> None:
    """The release command's call of ``model-sidecar publish``."""
    from model_sidecar.config import PublishConfig, parse_args

    optional = ("http://s3:9000", "fp16", "golden.npz", True) if full else (None, None, None)
    args = argv.PublishArgs("s3://b/p", "resnet", "v2", "model.onnx", "signing.key", *optional)
    line = argv.publish_argv(args)
    assert line[:2] == ["model-sidecar", "publish"]
    config = parse_args(line[1:])
    assert isinstance(config, PublishConfig)
    assert (config.store.store, config.model, config.version) == ("s3://b/p", "resnet", "v2")
    assert (str(config.file), str(config.key)) == ("model.onnx", "signing.key")
    assert config.store.s3_endpoint == args.s3_endpoint and config.force is full
    assert config.precision == (args.precision or PublishConfig.precision)
    assert (str(config.golden) if config.golden else None) == args.golden


def test_sidecar_argv_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="init or watch"):
        argv.sidecar_argv("publish", argv.SidecarArgs("m", "s3://b/p"))


def test_the_operator_writes_the_contract_command_lines() -> None:
    from model_operator.manifests import deployment
    from model_operator.spec import parse_spec

    spec = parse_spec(
        {
            "model": "m",
            "version": "v1",
            "image": "i",
            "store": {"url": "s3://bucket/p"},
            "backend": "torch",
            "allowUnsigned": True,
        }
    )
    pod = deployment("m", "ns", spec)["spec"]["template"]["spec"]
    containers = {c["name"]: c["args"] for c in [*pod["initContainers"], *pod["containers"]]}
    sidecar = argv.SidecarArgs("m", "s3://bucket/p", signed=False, retain=spec.retain_versions)
    assert containers == {
        "prefetch": argv.sidecar_argv("init", sidecar),
        "server": argv.server_argv(argv.ServerArgs("m", "torch", spec.retain_versions)),
        "sidecar": argv.sidecar_argv("watch", sidecar),
    }
    mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
    assert {argv.MODELS_DIR, argv.CONTROL_DIR, argv.PODINFO_DIR, argv.CONFIG_DIR} <= mounts


def test_the_log_flags_reach_the_pods_programs_only_when_asked() -> None:
    """spec.logging: every program of the pod parses the flags; at the defaults none is
    written, so a template from before spec.logging stays the same (no restart)."""
    from model_operator.manifests import deployment
    from model_operator.spec import parse_spec
    from model_rollout_flags.logs import LogSettings
    from model_server.config import parse_args as server_args
    from model_sidecar.config import parse_args as sidecar_args

    raw = {"model": "m", "version": "v1", "image": "i", "store": {"url": "s3://bucket/p"},
           "allowUnsigned": True}  # fmt: skip
    quiet = parse_spec({**raw, "logging": {"format": "text", "level": "info"}})
    assert deployment("m", "ns", quiet) == deployment("m", "ns", parse_spec(raw))
    spec = parse_spec({**raw, "logging": {"format": "json", "level": "warning"}})
    pod = deployment("m", "ns", spec)["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        args = container["args"]
        parse = server_args if args[0] == "model-server" else sidecar_args
        assert parse(args[1:]).log == LogSettings("json", "warning"), container["name"]
    assert argv.log_argv(argv.LogArgs()) == []
    assert argv.log_argv(argv.LogArgs(level="debug")) == ["--log-level", "debug"]


def test_every_flag_is_also_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_operator.config import parse_args as operator_args
    from model_server.config import parse_args as server_args
    from model_sidecar.config import WatchConfig
    from model_sidecar.config import parse_args as sidecar_args

    monkeypatch.setenv("MODEL_SERVER_REPOSITORY", "/srv/models")  # a required flag
    monkeypatch.setenv("MODEL_SERVER_PORT", "9001")
    monkeypatch.setenv("MODEL_SERVER_MODEL", "a,b=v2")  # repeatable: comma-separated
    server = server_args([])
    assert (str(server.repository), server.port) == ("/srv/models", 9001)
    assert [(m.key, m.version) for m in server.models] == [("a", None), ("b", "v2")]
    assert server_args(["--port", "9002"]).port == 9002  # the command line wins

    for name, value in {
        "STORE": "s3://b/p",
        "VOLUME": "/models",
        "MODEL": "m",
        "ALLOW_UNSIGNED": "true",
        "CONTROL_SOCKET": "/run/c.sock",
        "POLL_SECONDS": "0.5",
        "POD_NAME": "pod-1",
    }.items():
        monkeypatch.setenv(f"MODEL_SIDECAR_{name}", value)
    watch = sidecar_args(["watch"])
    assert isinstance(watch, WatchConfig)
    assert (watch.fetch.store.store, watch.fetch.allow_unsigned, watch.poll_seconds) == (
        "s3://b/p",
        True,
        0.5,
    )
    assert watch.fetch.pod_name == "pod-1"

    monkeypatch.setenv("MODEL_OPERATOR_NO_STORE_CHECK", "yes")
    monkeypatch.setenv("MODEL_OPERATOR_INTERVAL", "0.5")
    operator = operator_args([])
    assert (operator.check_store, operator.interval_s) == (False, 0.5)


@pytest.mark.parametrize(
    ("name", "value", "complaint"),
    [
        ("MODEL_SERVER_PORT", "eighty", "not a valid value"),
        ("MODEL_SERVER_BACKEND", "tensorflow", "choose from"),
        ("MODEL_SERVER_WORKERS", "2.5", "not a valid value"),
    ],
)
def test_a_bad_environment_value_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
    complaint: str,
) -> None:
    from model_server.config import parse_args

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--repository", "/m"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert name in err and complaint in err, err


def _parser() -> argparse.ArgumentParser:
    from model_rollout_flags import FlagParser

    parser = FlagParser(prog="p", env_prefix="P_")
    parser.add_argument("--namespace", action="append", default=[])
    parser.add_argument("--loud", type=lambda text: text + "!")
    parser.add_argument("--port", type=int, default=1)
    parser.add_argument("--strict", type=_strict_int)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("keygen")
    watch = sub.add_parser("watch")
    watch.add_argument("--poll-seconds", type=float, default=2.0)
    watch.add_argument("--store", required=True)
    return parser


def _strict_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError("digits only")
    return int(text)


def test_environment_parsing_edge_cases(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def parse(argv: list[str], **env: str) -> argparse.Namespace:
        with monkeypatch.context() as patch:  # a sub-command reads the process's own
            for name, value in env.items():
                patch.setenv(name, value)
            return _parser().parse_args(argv)

    # a list from the environment is replaced, not extended, by the command line
    assert parse(["keygen"], P_NAMESPACE="a,b").namespace == ["a", "b"]
    assert parse(["--namespace", "c", "keygen"], P_NAMESPACE="a,b").namespace == ["c"]
    # an empty variable counts as unset; a type is applied once
    assert parse(["keygen"], P_PORT="").port == 1
    assert parse(["keygen"], P_LOUD="hi").loud == "hi!"
    # a required flag is satisfied by its variable, for the command that has it
    assert parse(["watch"], P_STORE="s3://b").store == "s3://b"
    # a bad variable of one command does not break another
    assert parse(["keygen"], P_POLL_SECONDS="soon").command == "keygen"
    for bad, complaint in (({"P_POLL_SECONDS": "soon"}, "P_POLL_SECONDS='soon'"),
                           ({"P_STRICT": "x1"}, "digits only")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(["watch", "--store", "s"] if "POLL" in next(iter(bad)) else ["keygen"], **bad)
        assert complaint in capsys.readouterr().err
    # a value on the command line is refused as argparse refuses it, naming no variable
    with pytest.raises(SystemExit):
        parse(["--port", "x", "keygen"], P_PORT="2")
    assert "argument --port: invalid int value: 'x'" in capsys.readouterr().err


def test_help_shows_each_flag_s_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    from model_server.config import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--port PORT [env var: MODEL_SERVER_PORT] (default: 8000)" in shown
    assert "default: no gRPC [env var: MODEL_SERVER_GRPC_PORT] --" in shown  # no default of None
    assert "--worker-index" not in shown.partition("options:")[2]  # hidden stays hidden


def test_the_contract_keeps_only_the_names_of_variables() -> None:
    """The flags are ConfigArgParse's (model_rollout_flags); the contract says only what
    the variables are called, which the operator writes into pods."""
    from model_rollout_contract import cli

    tree = ast.parse((CONTRACT / "cli.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported == {"__future__", "pathlib"}
    assert cli.env_name(cli.SIDECAR_ENV_PREFIX, "--pod-name") == "MODEL_SIDECAR_POD_NAME"


HUGE = "1" + "0" * 400  # a JSON integer no float holds
HUGER = "1" * 5000  # more digits than Python's int parser accepts
SWAP = '{"ok": true, "model": "m", "from": %s, "to": "v2", "duration_ms": %s, "instant": %s}'


@pytest.mark.parametrize(
    "text",
    [
        f'{{"state": "ok", "updated_at": {HUGE}}}',
        f'{{"state": "ok", "target_seen_at": {HUGE}}}',
        f'{{"state": "ok", "updated_at": {HUGER}}}',
        '{"state": "ok", "retained": "v1v2"}',
        '{"state": "ok", "updated_at": NaN}',
    ],
)
def test_a_malformed_report_is_ignored_not_raised(text: str) -> None:
    report = SidecarReport.from_json(text)
    assert report is None or (report.updated_at == 0.0 and report.retained == ())


@pytest.mark.parametrize(
    "line",
    [
        (SWAP % ('"v1"', HUGE, "false")).encode(),
        (SWAP % ('"v1"', HUGER, "false")).encode(),
        (SWAP % ('"v1"', "NaN", "false")).encode(),
        (SWAP % ('"v1"', "1", '"false"')).encode(),
        (SWAP % ("3", "1", "true")).encode(),
        b'{"ok": true, "model": "m", "version": "v1", "sha256": null, "loaded": "v1v2"}',
        b'{"ok": true, "model": "m", "version": 1, "sha256": null, "loaded": []}',
        b'{"ok": true}',
    ],
)
def test_malformed_replies_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_reply(line)


def test_tenant_model_keys_cross_the_control_socket() -> None:
    assert parse_request(b'{"op": "status", "model": "acme/mlp"}') == StatusRequest("acme/mlp")
    for key in ("a/b/c", "/m", "m/", "acme/../m"):
        with pytest.raises(ProtocolError):
            parse_request(json.dumps({"op": "status", "model": key}).encode())


def test_traffic_policies_round_trip_and_refuse_what_is_malformed() -> None:
    from model_rollout_contract.canary import InvalidPolicy, TrafficPolicy
    from model_rollout_contract.control import (
        ProtocolError,
        TrafficRequest,
        encode,
        parse_request,
    )

    policy = TrafficPolicy("v1", "v2", traffic_percent=10, shadow_percent=20)
    assert TrafficPolicy.from_annotation(policy.to_annotation()) == policy
    for request in (TrafficRequest("m", policy), TrafficRequest("m", None)):
        assert parse_request(encode(request)) == request
    for bad in (
        '{"stable": "v1"}',
        '{"stable": "v1", "candidate": "v2", "trafficPercent": 101}',
        '{"stable": "v1", "candidate": "v2", "shadowPercent": true}',
        '{"stable": "v1", "candidate": "../v2"}',
        "[1]",
        "not json",
    ):
        with pytest.raises(InvalidPolicy):
            TrafficPolicy.from_annotation(bad)
    line = (
        b'{"op": "traffic", "model": "m", "stable": "v1", "candidate": "v2",'
        b' "traffic_percent": -1}\n'
    )
    with pytest.raises(ProtocolError):
        parse_request(line)


def test_a_status_reply_says_which_policy_the_server_holds_or_not_at_all() -> None:
    """An older server's status has no ``policy``: not the same as one that holds none."""
    older = parse_reply(b'{"ok": true, "model": "m", "version": "v2", "sha256": null, '
                        b'"loaded": ["v1", "v2"]}')  # fmt: skip
    assert isinstance(older, StatusReply) and not older.policy_reported
    none = parse_reply(encode(StatusReply("m", "v2", None, ("v2",), None, True)))
    assert isinstance(none, StatusReply) and none.policy_reported and none.policy is None
    with pytest.raises(ProtocolError, match="'policy'"):
        parse_reply(b'{"ok": true, "model": "m", "version": "v2", "sha256": null, '
                    b'"loaded": ["v2"], "policy": {"stable": "v1"}}')  # fmt: skip


@pytest.mark.parametrize("jwks_url", [None, "https://issuer.example/jwks.json"])
def test_jwt_argv_is_what_the_server_parses(jwks_url: str | None) -> None:
    from model_server.config import parse_args

    jwt = argv.JwtArgs("https://i.example", "api", jwks_url, ("ES256", "EdDSA"), "org", 12.5)
    line = argv.server_argv(argv.ServerArgs("resnet", tenants=True, jwt=jwt))
    config = parse_args(line[1:])
    assert config.jwt is not None
    assert (config.jwt.issuer, config.jwt.audience) == ("https://i.example", "api")
    assert config.jwt.jwks_url == jwks_url
    assert config.jwt.jwks_file == (None if jwks_url else Path(argv.JWKS_FILE))
    assert (config.jwt.algorithms, config.jwt.tenant_claim, config.jwt.leeway_s) == (
        ("ES256", "EdDSA"),
        "org",
        12.5,
    )


def test_the_servers_jwt_defaults_are_the_contracts() -> None:
    from model_server.security import jwt_auth

    assert jwt_auth.DEFAULT_ALGORITHMS == defaults.JWT_ALGORITHMS
    assert set(defaults.JWT_ALGORITHMS) <= set(defaults.JWT_ASYMMETRIC_ALGORITHMS)
    assert not any(a.startswith("HS") or a == "none" for a in jwt_auth.ASYMMETRIC_ALGORITHMS)


def test_a_swap_replys_stages_are_diagnostics_a_malformed_one_is_dropped() -> None:
    swap = {"ok": True, "model": "m", "from": "v1", "to": "v2", "duration_ms": 3.0,
            "instant": False}  # fmt: skip
    assert "stages_ms" not in SwapReply("m", "v1", "v2", 3.0, False).to_json()
    for junk in ({"read": "fast"}, {"read": True}, [1, 2], "x", {"read": float("inf")}):
        reply = parse_reply(json.dumps({**swap, "stages_ms": junk}).encode())
        assert reply == SwapReply("m", "v1", "v2", 3.0, False)  # the swap itself is read
