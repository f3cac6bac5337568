"""Every YAML we ship is checked: kubernetes-validate against the Kubernetes schemas, real
kubectl (client dry-run, with the session's real API server for discovery), the Helm chart
rendered and linted by real Helm (with its default values and each example's values),
and ModelDeployments against the CRD as the API server applies it (defaults, the
openAPIV3Schema and its CEL rules: ``crd_validation``)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_operator import spec as spec_module
from model_operator.manifests import children
from model_operator.spec import SpecError, parse_spec
from model_rollout_contract import defaults
from model_rollout_contract.layout import STORE_ID_PATTERN
from model_rollout_e2e.control_plane import ControlPlane
from tests.support.crd_validation import ResourceSchema
from tests.support.helm_chart import lint_chart, render_chart

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
CHART = ROOT / "deploy" / "helm" / "model-rollout"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CHART_VALUES = {"defaults": {}} | {  # the chart's defaults, then each example's values
    p.name: yaml.safe_load(p.read_text()) for p in sorted(ROOT.glob("examples/helm/*.yaml"))
}
K8S_VERSION = "1.37.0"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


SCHEMA = ResourceSchema.load(CRD)
_core = importlib.util.spec_from_file_location("core_schemas", ROOT / "tools" / "core_schemas.py")
assert _core is not None and _core.loader is not None
core_schemas = importlib.util.module_from_spec(_core)
_core.loader.exec_module(core_schemas)
CORE_PATHS = {tuple(path.split(".")) for path, *_ in core_schemas.FRAGMENTS}


def problems(doc: dict[str, Any]) -> list[str]:
    """Why the API server would refuse ``doc`` (a ModelDeployment), if it would."""
    return SCHEMA.problems(doc)


def spec_schema() -> dict[str, Any]:
    return dict(SCHEMA.schema["properties"]["spec"])


def rendered_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return render_chart(CHART, values)


def operator_children() -> list[dict[str, Any]]:
    [example] = [d for d in load_all(EXAMPLES[0])]
    spec = parse_spec(example["spec"])
    return children("resnet", "ml-serving", spec, spec.version)


def k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    objects = [("crd", d) for d in load_all(CRD)]
    for values_name, values in CHART_VALUES.items():
        objects += [(f"chart[{values_name}]:{d['kind']}", d) for d in rendered_chart(values)]
    objects += [(f"operator:{d['kind']}", d) for d in operator_children()]
    return objects


@pytest.mark.parametrize(
    ("where", "obj"), k8s_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_kubernetes_schema(where: str, obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_chart_ships_the_same_crd() -> None:
    assert (CHART / "crds" / CRD.name).read_text() == CRD.read_text()
    crds = [d for d in rendered_chart() if d["kind"] == "CustomResourceDefinition"]
    assert crds == load_all(CRD)  # and Helm installs it from there


def test_example_values_exist() -> None:
    assert len(CHART_VALUES) >= 3, "examples/helm/*.yaml: chart values to render and lint"


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_helm_lint_is_clean(values_name: str) -> None:
    assert lint_chart(CHART, CHART_VALUES[values_name]) == []


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_chart_renders_what_the_values_ask(values_name: str) -> None:
    values = CHART_VALUES[values_name]
    docs = rendered_chart(values)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    namespaces = [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"]
    assert namespaces == list(values.get("watchNamespaces") or [])
    assert ("--no-store-check" in args) == (values.get("storeCheck") is False)
    assert args[args.index("--interval") + 1] == str(values.get("interval", 30))
    secret = values.get("storeCredentialsSecret")
    assert container.get("envFrom", []) == ([{"secretRef": {"name": secret}}] if secret else [])
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    watched = set(values.get("watchNamespaces") or [])
    operator_bindings = [b for b in bindings if b["roleRef"]["kind"] == "ClusterRole"]
    assert {b["metadata"]["namespace"] for b in operator_bindings} == watched
    # leader election: a Lease, in the release's namespace, and nothing else
    [election] = [d for d in docs if d["kind"] == "Role"]
    assert election["metadata"]["namespace"] == "model-rollout-system"
    assert election["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "patch", "update"],
        }
    ]
    assert "--leader-election" in args and deployment["spec"]["replicas"] >= 2


def test_helm_refuses_values_of_the_wrong_shape() -> None:
    import helm_python as helm

    # refused by values.schema.json before any template runs, naming the field
    with pytest.raises(helm.HelmValuesError, match="at '/image': got string, want object"):
        rendered_chart({"image": "not-a-map"})


def test_chart_rbac_is_least_privilege() -> None:
    docs = rendered_chart()
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    verbs = {verb for role in roles.values() for rule in role["rules"] for verb in rule["verbs"]}
    assert "*" not in verbs and "deletecollection" not in verbs
    # delete: only the Deployment of a pod template no rollout or rollback needs any more
    deleted = {
        (group, resource)
        for role in roles.values()
        for rule in role["rules"]
        if "delete" in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert deleted == {("apps", "deployments")}
    # secrets: only get, for the store credentials a ModelDeployment names; never listed,
    # watched or written
    secret_verbs = {
        verb
        for role in roles.values()
        for rule in role["rules"]
        if "secrets" in rule["resources"]
        for verb in rule["verbs"]
    }
    assert secret_verbs == {"get"}
    namespaced = rendered_chart({"watchNamespaces": ["a"]})
    assert {d["kind"] for d in namespaced} >= {"RoleBinding", "ClusterRoleBinding"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_crd_schema_and_operator(example: Path) -> None:
    for doc in load_all(example):
        assert problems(doc) == []
        parse_spec(doc["spec"])  # the operator accepts it too


BAD_SPECS = {
    "negative replicas": {"replicas": -1},
    "canary over 100%": {"canary": {"percent": 150}},
    "both batch settings": {"rollout": {"batchSize": 1, "batchPercent": 10}},
    "version with a slash": {"version": "../v2"},
    "two stores": {"store": {"url": "s3://bucket/p", "pvc": "claim"}},
    "no store": {"store": {}},
    "unknown backend": {"backend": "tensorflow"},
    "zero retained": {"retainVersions": 0},
    # issue 13: each of these was accepted by the operator (and all but the first two by
    # the CRD) before
    "malformed signing key": {"signingPublicKeySecret": 42},
    "signing key not a name": {"signingPublicKeySecret": "Not_A_Name"},
    "no key and not allowUnsigned": {"signingPublicKeySecret": None},
    "key and allowUnsigned": {"allowUnsigned": True},
    "allowUnsigned not a boolean": {"signingPublicKeySecret": None, "allowUnsigned": "yes"},
    "cpu a list": {"resources": {"cpu": ["2"]}},
    "cpu negative": {"resources": {"cpu": "-1"}},
    "memory not a quantity": {"resources": {"memory": "16 GB"}},
    "memory a fraction": {"resources": {"memory": 0.5}},
    "start jitter negative": {"sidecar": {"startJitterSeconds": -1}},
    "backoff max below base": {"sidecar": {"backoffBaseSeconds": 30, "backoffMaxSeconds": 10}},
    "no download at all": {"sidecar": {"maxConcurrentDownloads": 0}},
    "drain for ever": {"server": {"drainSeconds": 86400}},
    # issue 12: dynamic batching
    "a batch of a million rows": {"server": {"batching": {"maxBatchSize": 1_000_000}}},
    "a negative batch size": {"server": {"batching": {"maxBatchSize": -1}}},
    "a queue delay of an hour": {
        "server": {"batching": {"maxBatchSize": 8, "maxQueueDelayMicroseconds": 3_600_000_000}}
    },
    "a fractional batch size": {"server": {"batching": {"maxBatchSize": 2.5}}},
    "batching not an object": {"server": {"batching": 8}},
    "sidecar settings not an object": {"sidecar": "fast"},
    # issue 32: log lines
    "a log format no pipeline reads": {"logging": {"format": "logfmt"}},
    "a log level Python has but the programs do not take": {"logging": {"level": "critical"}},
    "logging not an object": {"logging": "json"},
    # issue 13 follow-up: credentials in the endpoint would be in the Deployment's env
    "credentials in the endpoint": {
        "store": {"url": "s3://models-prod/vision", "endpoint": "http://ops:hunter2@minio:9000"}
    },
    "a user in the endpoint": {
        "store": {"url": "s3://models-prod/vision", "endpoint": "https://ops@s3.example.com/"}
    },
    "endpoint not a URL": {"store": {"url": "s3://models-prod/vision", "endpoint": "minio:9000"}},
    "model storage not a quantity": {"resources": {"modelStorage": "2 GB"}},
    # issue 11: canary traffic and analysis
    "traffic share over 100%": {"canary": {"percent": 10, "trafficPercent": 101}},
    "traffic share without canary pods": {"canary": {"trafficPercent": 10}},
    "shadow with one version retained": {
        "canary": {"percent": 10, "shadowPercent": 5},
        "retainVersions": 1,
    },
    "analysis every 0.1 s": {"canary": {"percent": 10, "analysis": {"intervalSeconds": 0.1}}},
    "error rate over 1": {"canary": {"percent": 10, "analysis": {"maxErrorRate": 2}}},
    "a drift threshold no drift can exceed": {
        "canary": {"percent": 10, "shadowPercent": 10, "analysis": {"maxOutputDrift": 10}}
    },
    "no failure allowed": {"canary": {"percent": 10, "analysis": {"failureLimit": 0}}},
    "drift without shadow": {"canary": {"percent": 10, "analysis": {"maxOutputDrift": 0.1}}},
    "prometheus without url": {"canary": {"percent": 10, "analysis": {"prometheus": {}}}},
    # issue 31: the shadow step, asked for where it cannot run
    "a shadow step without canary pods": {
        "canary": {"shadow": {"enabled": True}, "analysis": {"minRequests": 10}}
    },
    "a shadow step with one version retained": {
        "canary": {"percent": 10, "shadow": {"enabled": True}, "analysis": {}},
        "retainVersions": 1,
    },
    "a shadow step without analysis": {"canary": {"percent": 10, "shadow": {"enabled": True}}},
    "a shadow step mirroring nothing": {
        "canary": {"percent": 10, "shadow": {"percent": 0}, "analysis": {}}
    },
    "prometheus url with credentials": {
        "canary": {"percent": 10, "analysis": {"prometheus": {"url": "http://u:p@prom:9090"}}}
    },
    "query without {version}": {
        "canary": {
            "percent": 10,
            "analysis": {
                "prometheus": {"url": "http://prom:9090", "queries": {"errors": "up"}},
            },
        }
    },
}


@pytest.mark.parametrize("change", BAD_SPECS.values(), ids=BAD_SPECS.keys())
def test_bad_specs_are_rejected_by_schema_and_operator(change: dict[str, Any]) -> None:
    [doc] = load_all(EXAMPLES[0])
    bad = copy.deepcopy(doc)
    bad["spec"].update(change)
    assert problems(bad), "the API server would accept it"
    with pytest.raises(SpecError):
        parse_spec(bad["spec"])


def test_a_missing_signing_key_is_a_problem_with_the_same_words_on_both_sides() -> None:
    [doc] = load_all(EXAMPLES[0])
    del doc["spec"]["signingPublicKeySecret"]
    [refusal] = problems(doc)
    assert spec_module.NO_SIGNING_KEY in refusal
    with pytest.raises(SpecError) as caught:
        parse_spec(doc["spec"])
    assert caught.value.problems == [spec_module.NO_SIGNING_KEY]


def test_a_malformed_signing_key_is_reported_not_dropped() -> None:
    [doc] = load_all(EXAMPLES[0])
    for bad in (42, ["key"], "Key"):
        doc["spec"]["signingPublicKeySecret"] = bad
        with pytest.raises(SpecError) as caught:
            parse_spec(doc["spec"])
        assert caught.value.problems[0].startswith("spec.signingPublicKeySecret must be"), bad
        assert spec_module.NO_SIGNING_KEY not in caught.value.problems  # one reason, the right one


def test_credentials_in_the_endpoint_are_refused_and_not_repeated() -> None:
    [doc] = load_all(EXAMPLES[0])
    doc["spec"]["store"] = {"url": "s3://models-prod/v", "endpoint": "http://ops:hunter2@m:9000"}
    assert problems(doc)  # refused by the API server (which answers its sender only)
    with pytest.raises(SpecError) as caught:  # what the operator writes into conditions
        parse_spec(doc["spec"])
    [problem] = caught.value.problems
    assert problem.startswith("spec.store.endpoint must be an http(s) URL with no credentials")
    assert "hunter2" not in problem and "http://***@m:9000" in problem


def test_the_model_volume_gets_the_size_limit_asked_for() -> None:
    [doc] = load_all(EXAMPLES[0])
    for limit, expected in (("2Gi", {"sizeLimit": "2Gi"}), (None, {})):
        doc["spec"]["resources"]["modelStorage"] = limit
        spec = parse_spec({k: v for k, v in doc["spec"].items()})
        objects = children("x", "ns", spec, spec.version)
        [deployment] = [o for o in objects if o["kind"] == "Deployment"]
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        [models] = [v for v in volumes if v["name"] == "models"]
        assert models == {"name": "models", "emptyDir": expected}


def test_the_crd_patterns_are_the_operators() -> None:
    schema = spec_schema()
    resources = schema["properties"]["resources"]["properties"]
    for field in ("cpu", "memory", "modelStorage"):
        assert resources[field]["pattern"] == f"^{spec_module.QUANTITY.pattern}$"
    url = schema["properties"]["store"]["properties"]["url"]["pattern"]
    assert url == f"^{spec_module.S3_URL.pattern}$"
    endpoint = schema["properties"]["store"]["properties"]["endpoint"]["pattern"]
    assert endpoint == f"^{spec_module.ENDPOINT_URL.pattern}$"
    store_id = schema["properties"]["store"]["properties"]["id"]["pattern"]
    assert store_id == f"^{STORE_ID_PATTERN.pattern}$"
    names = [
        schema["properties"]["signingPublicKeySecret"],
        schema["properties"]["store"]["properties"]["credentialsSecret"],
        schema["properties"]["store"]["properties"]["pvc"],
        schema["properties"]["tenants"]["properties"]["secretName"],
        schema["properties"]["tenants"]["properties"]["jwt"]["properties"]["jwksSecret"],
    ]
    for field in names:
        assert field["pattern"] == f"^{spec_module.OBJECT_NAME.pattern}$"
        assert field["maxLength"] == spec_module.OBJECT_NAME_MAX
    jwt = schema["properties"]["tenants"]["properties"]["jwt"]["properties"]
    assert jwt["jwksUrl"]["pattern"] == f"^{spec_module.JWKS_URL.pattern}$"
    assert jwt["algorithms"]["items"]["enum"] == list(defaults.JWT_ASYMMETRIC_ALGORITHMS)
    for text in ("issuer", "audience", "tenantClaim", "jwksUrl"):
        assert jwt[text]["maxLength"] == spec_module.JWT_TEXT_MAX
    assert jwt["leewaySeconds"]["maximum"] == spec_module.MAX_JWT_LEEWAY_SECONDS


def test_the_crd_log_settings_are_the_programs() -> None:
    logging = spec_schema()["properties"]["logging"]["properties"]
    assert tuple(logging["format"]["enum"]) == defaults.LOG_FORMATS
    assert tuple(logging["level"]["enum"]) == defaults.LOG_LEVELS


def test_the_crd_limits_and_query_names_are_the_operators() -> None:
    """(Its defaults are the contract's: tests/contract/test_contract.py.)"""
    props = spec_schema()["properties"]
    sidecar, server = props["sidecar"]["properties"], props["server"]["properties"]
    analysis = props["canary"]["properties"]["analysis"]["properties"]
    assert (analysis["intervalSeconds"]["maximum"], analysis["failureLimit"]["maximum"]) == (
        spec_module.MAX_ANALYSIS_INTERVAL_SECONDS,
        spec_module.MAX_FAILURE_LIMIT,
    )
    assert (
        analysis["inconclusiveLimit"]["maximum"],
        analysis["inconclusiveDeadlineSeconds"]["maximum"],
        tuple(analysis["onInconclusive"]["enum"]),
        analysis["onInconclusive"]["default"],
    ) == (
        spec_module.MAX_INCONCLUSIVE_LIMIT,
        spec_module.MAX_INCONCLUSIVE_DEADLINE_SECONDS,
        spec_module.ON_INCONCLUSIVE,
        spec_module.AnalysisSpec.on_inconclusive,
    )
    queries = analysis["prometheus"]["properties"]["queries"]["properties"]
    assert tuple(queries) == spec_module.PROMETHEUS_QUERIES
    assert analysis["prometheus"]["properties"]["url"]["pattern"] == (
        f"^{spec_module.ENDPOINT_URL.pattern}$"
    )
    assert (
        server["drainSeconds"]["maximum"],
        sidecar["startJitterSeconds"]["maximum"],
        sidecar["backoffMaxSeconds"]["maximum"],
        sidecar["maxConcurrentDownloads"]["maximum"],
    ) == (
        spec_module.MAX_DRAIN_SECONDS,
        spec_module.MAX_START_JITTER_SECONDS,
        spec_module.MAX_BACKOFF_SECONDS,
        spec_module.MAX_CONCURRENT_DOWNLOADS,
    )
    batching = server["batching"]["properties"]
    assert (
        batching["maxBatchSize"]["maximum"],
        batching["maxQueueDelayMicroseconds"]["maximum"],
    ) == (spec_module.MAX_BATCH_SIZE, spec_module.MAX_QUEUE_DELAY_MICROSECONDS)
    assert server["processes"]["maximum"] == spec_module.MAX_SERVER_PROCESSES
    assert server["maxRowsPerRequest"]["maximum"] == spec_module.MAX_ROWS_PER_REQUEST


def test_kubectl_parses_everything(control_plane: ControlPlane, tmp_path: Path) -> None:
    """Client-side dry runs, with the session's API server for discovery (the CRD
    installed, so that kubectl knows ModelDeployment); ``create``, which reads no live
    object, so that what other tests applied to the session's cluster plays no part
    (a client-side ``apply`` over an object that ``apply --server-side`` wrote fails
    in kubectl itself: "applying patch locally: expected a struct, but received a
    nil")."""
    admin = control_plane.kubectl
    admin("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    admin("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
    files = [CRD, *EXAMPLES]
    charts = []
    for values_name, values in CHART_VALUES.items():
        charts.append(tmp_path / f"chart-{values_name}")
        charts[-1].write_text(yaml.safe_dump_all(rendered_chart(values)))
    children_out = tmp_path / "children.yaml"
    children_out.write_text(yaml.safe_dump_all(operator_children()))
    for path in [*files, *charts, children_out]:
        result = admin.run(
            "--request-timeout=20s", "create", "--dry-run=client", "--validate=false",
            "-o", "json", "-f", str(path),
        )  # fmt: skip
        assert result.code == 0, f"{path.name}: {result}"
        assert len(_json_documents(result.out)) == len(load_all(path)), path.name


def _json_documents(text: str) -> list[Any]:
    """The JSON documents ``kubectl create -o json`` prints one after another."""
    decoder, documents, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
        while at < len(text) and text[at].isspace():
            at += 1
    return documents


@dataclass(frozen=True)
class Field:
    """One field of the spec: values a person would write, and values of any kind."""

    typical: st.SearchStrategy[Any]
    arbitrary: st.SearchStrategy[Any]


def _field(typical: st.SearchStrategy[Any], *wrong: Any) -> Field:
    return Field(typical, st.one_of(typical, st.sampled_from([*wrong, None])))


def _integer(low: int, high: int) -> Field:
    fractions = st.floats(low - 2, high + 2).filter(lambda f: not f.is_integer())
    return Field(
        st.integers(low, high),
        st.one_of(st.integers(low - 3, high + 3), fractions, st.sampled_from([True, "1", None])),
    )


def _number(low: float, high: float) -> Field:
    typical = st.one_of(st.integers(math.ceil(low), math.floor(high)), st.floats(low, high))
    wider = st.one_of(
        st.integers(math.floor(low) - 5, math.ceil(high) + 5), st.floats(low - 5, high + 5)
    )
    return Field(typical, st.one_of(wider, st.sampled_from([False, "1", None])))


NAMES = _field(
    st.sampled_from(["m", "resnet50", "v2", "2026-11-30", "a_b.c"]),
    *["../x", "", "-x", "v2\n", "a/b", "A" * 129, 3],
)
OBJECT_NAMES = _field(
    st.sampled_from(["model-store", "signing-key", "a.b-c", "x" * 253]),
    *["Key", "-a", "a_b", "", "a" * 254, "a.", "key\n", 5],
)
QUANTITIES = _field(
    st.one_of(
        st.sampled_from(["500m", "2", "16Gi", "1.5", ".5", "1e3", "4Mi", "0", "1."]),
        st.integers(0, 64),
    ),
    *["-1", "1GB", "abc", "", "1.5.2", "2 Gi", "1Gi\n", "+1", -1, 1.5, True, []],
)
STRINGS = _field(st.sampled_from(["img:1", "registry.example/x:0.1"]), "", 5, ["img"])
ENDPOINTS = _field(
    st.sampled_from(["http://seaweed:8333", "https://s3.example.com", "http://10.0.0.1:9000/x"]),
    *["http://ops:pw@h:9000", "https://ops@h/", "http://h/a@b", "minio:9000", "ftp://h"],
    *["http://", "http://h x", "", 5],
)
BOOLEANS = _field(st.booleans(), "true", 1)
QUERIES = _field(
    st.sampled_from(
        [
            'sum(increase(model_server_version_requests_total{model="{model}",version="{version}"}[1m]))',
            "my_recording_rule{version='{version}'}",
        ]
    ),
    *['sum(model_server_version_requests_total{model="{model}"})', "{Version}", "", 3],
)
JWT_TEXTS = _field(
    st.sampled_from(["https://issuer.example", "model-api", "tenant", "org_id", "x" * 1024]),
    *["", "x" * 1025, 5, ["a"]],
)
JWKS_URLS = _field(
    st.sampled_from(["https://issuer.example/.well-known/jwks.json", "https://10.0.0.1:8443"]),
    *["http://issuer/jwks", "https://", "https://u:p@h/jwks", "https://h x", "ftp://h", 5],
    *["https://" + "h" * 1020, ""],
)
JWT_ALGORITHMS = _field(
    st.lists(st.sampled_from(["RS256", "ES256", "EdDSA", "PS512"]), min_size=1, unique=True),
    *[[], ["HS256"], ["none"], ["RS256", "RS256"], "RS256", [5]],
)
_TENANT_MODEL = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["acme-mlp", "globex", "a" * 40]),
        "tenant": st.sampled_from(["acme", "globex", "m"]),  # "m": also a model name
        "model": st.sampled_from(["mlp", "resnet50"]),
        "version": st.sampled_from(["v1", "2026-12-03"]),
    },
    optional={"signingPublicKeySecret": st.sampled_from(["acme-keys", "Bad_Key"])},
)
TENANT_MODELS = _field(
    st.lists(_TENANT_MODEL, max_size=3),
    *[[{"name": "Acme", "tenant": "a", "model": "m", "version": "v"}], [{"tenant": "a"}]],
    *[[{"name": "a" * 41, "tenant": "a", "model": "m", "version": "v"}], ["x"], "x", {}],
    [{"name": f"t{i}", "tenant": "a", "model": f"m{i}", "version": "v"} for i in range(17)],
)
NOT_AN_OBJECT = st.sampled_from([{}, 5, "x", [], True, None])
# the core types' fields (tools/core_schemas.py): their values are the API server's to
# judge, the operator checks their shape; so only wrong shapes are drawn as wrong values
REQUIREMENTS = _field(
    st.sampled_from([
        {"limits": {"cpu": "1", "memory": "512Mi"}, "requests": {"cpu": "100m", "memory": 1 << 20}},
        {"requests": {"memory": "64Mi"}}, {},
    ]),
    *["1", [], {"limits": "1"}, {"limits": {"cpu": "1 core"}}, {"requests": {"cpu": 0.5}}],
    *[{"limits": {"memory": True}}, {"limits": {"memory": "1GB"}}],
)  # fmt: skip
GPU_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
            ]
        }
    }
}
POD_FIELDS = {
    "nodeSelector": _field(st.sampled_from([{"gpu": "a100"}, {}]), {"gpu": 5}, [], "x"),
    "tolerations": _field(
        st.sampled_from([[{"key": "nvidia.com/gpu", "operator": "Exists"}], []]),
        *[{}, "x", [5], ["a"]],
    ),
    "affinity": _field(st.sampled_from([GPU_AFFINITY, {}]), [], "x", 5),
    "topologySpreadConstraints": _field(
        st.sampled_from(
            [
                [
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                    }
                ],
                [],
            ]
        ),
        *[{}, "x", [5]],
    ),
    "imagePullSecrets": _field(st.sampled_from([[{"name": "registry"}], []]), ["r"], "x", {}),
    "priorityClassName": OBJECT_NAMES,
    "runtimeClassName": OBJECT_NAMES,
    "labels": _field(
        st.sampled_from([{"team": "vision", "example.com/tier": "gold"}, {}]),
        *[{"serving.model-rollout.io/deployment": "x"}, {"app.kubernetes.io/name": "x"}],
        *[{"bad key!": "x"}, {"team": "not a value!"}, {"team": 5}, [], "x"],
    ),
    "annotations": _field(
        st.sampled_from([{"prometheus.io/scrape": "true", "note": "any text at all"}, {}]),
        *[{"serving.model-rollout.io/target-version": "v9"}, {"bad key!": "x"}, {"a": 5}, []],
    ),
    "serviceAccountAnnotations": _field(
        st.sampled_from([{"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/models"}, {}]),
        *[{"serving.model-rollout.io/x": "y"}, {"bad key!": "x"}, {"a": 5}, "x"],
    ),
}

# every field of the spec, as the CRD nests them (a test checks that none is missing)
SPEC_FIELDS: dict[str, Any] = {
    "model": NAMES,
    "version": NAMES,
    "image": STRINGS,
    "sidecarImage": STRINGS,
    "replicas": _integer(0, 1000),
    "backend": _field(st.sampled_from(spec_module.BACKENDS), "tensorflow", "", 3),
    "precision": _field(st.sampled_from(spec_module.PRECISIONS), "bf16", 16),
    "store": {
        "url": _field(
            st.sampled_from(["s3://bucket/p", "s3://models-prod"]),
            *["http://x", "s3://B/p", "s3://b", "s3://bucket/p\n", "", 5],
        ),
        "endpoint": ENDPOINTS,
        "credentialsSecret": OBJECT_NAMES,
        "pvc": OBJECT_NAMES,
        "id": _field(
            st.sampled_from(["team-a", "models.prod", "x", "a" * 63]),
            *["Team-A", "-a", "a.", "a_b", "", "a" * 64, "a\n", 5],
        ),
    },
    "resources": {
        "gpu": _integer(0, 16),
        "cpu": QUANTITIES,
        "memory": QUANTITIES,
        "modelStorage": QUANTITIES,
        "gpuResource": _field(
            st.sampled_from(["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu"]),
            *["gpu", "kubernetes.io/gpu", "x.kubernetes.io/gpu", "Nvidia.com/gpu", "nvidia.com/"],
            *["", 5],
        ),
        "sidecar": REQUIREMENTS,
        "prefetch": REQUIREMENTS,
    },
    "pod": POD_FIELDS,
    "canary": {
        "percent": _integer(0, 100),
        "pauseSeconds": _number(0, 4000),
        "manualPromote": BOOLEANS,
        "trafficPercent": _integer(0, 100),
        "shadowPercent": _integer(0, 100),
        "shadow": {"enabled": BOOLEANS, "percent": _integer(1, 100)},
        "analysis": {
            "intervalSeconds": _number(1, 3600),
            "minRequests": _integer(1, 100_000),
            "failureLimit": _integer(1, 100),
            "maxErrorRate": _number(0, 1),
            "maxLatencyRatio": _number(1, 100),
            "maxOutputDrift": _number(0, 100),  # above 5: refused by both
            "minArgmaxAgreement": _number(0, 1),
            "maxNonFinite": _integer(0, 100_000),
            "inconclusiveLimit": _integer(1, 1000),
            "inconclusiveDeadlineSeconds": _number(1, 86400),
            "onInconclusive": _field(
                st.sampled_from(spec_module.ON_INCONCLUSIVE), "Rollback", "wait", "", 3
            ),
            "prometheus": {
                "url": ENDPOINTS,
                "queries": {name: QUERIES for name in spec_module.PROMETHEUS_QUERIES},
            },
        },
    },
    "rollout": {
        "batchSize": _integer(1, 1000),
        "batchPercent": _integer(1, 100),
        "jitterSeconds": _number(0, 3600),
        "maxUnavailable": _integer(0, 1000),
        "maxConcurrentLoads": _integer(1, 1000),
        "progressDeadlineSeconds": _number(1, 4000),
    },
    "retainVersions": _integer(1, 8),
    "signingPublicKeySecret": OBJECT_NAMES,
    "allowUnsigned": BOOLEANS,
    "paused": BOOLEANS,
    "tenants": {
        "secretName": OBJECT_NAMES,
        "models": TENANT_MODELS,
        "jwt": {
            "issuer": JWT_TEXTS,
            "audience": JWT_TEXTS,
            "jwksSecret": OBJECT_NAMES,
            "jwksUrl": JWKS_URLS,
            "algorithms": JWT_ALGORITHMS,
            "tenantClaim": JWT_TEXTS,
            "leewaySeconds": _number(0, 300),
        },
    },
    "sidecar": {
        "startJitterSeconds": _number(0, 600),
        "backoffBaseSeconds": _number(0.1, 3600),
        "backoffMaxSeconds": _number(1, 3600),
        "maxConcurrentDownloads": _integer(1, 16),
    },
    "logging": {
        "format": _field(st.sampled_from(defaults.LOG_FORMATS), "JSON", "logfmt", "", 1),
        "level": _field(st.sampled_from(defaults.LOG_LEVELS), "INFO", "trace", "", 10),
    },
    "server": {
        "drainSeconds": _number(0, 300),
        "processes": _integer(1, 16),
        "maxRowsPerRequest": _integer(1, 1 << 20),
        "batching": {
            "maxBatchSize": _integer(0, 4096),
            "maxQueueDelayMicroseconds": _integer(0, 1_000_000),
        },
    },
}
REQUIRED = ("model", "version", "image", "store")


def _paths(fields: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field's path, objects and what they hold, however deep."""
    paths = []
    for key, node in fields.items():
        paths.append((*prefix, key))
        if isinstance(node, dict):
            paths += _paths(node, (*prefix, key))
    return paths


FIELD_PATHS = _paths(SPEC_FIELDS)
DELETE = object()


def _arbitrary(path: tuple[str, ...]) -> st.SearchStrategy[Any]:
    node: Any = SPEC_FIELDS
    for key in path:
        node = node[key]
    return NOT_AN_OBJECT if isinstance(node, dict) else node.arbitrary


def _typical(data: st.DataObject, fields: dict[str, Any], required: tuple[str, ...]) -> dict:
    """Some of ``fields`` (all of ``required``), each a value a person would write."""
    out: dict[str, Any] = {}
    for key, node in fields.items():
        if key not in required and not data.draw(st.booleans()):
            continue
        out[key] = _typical(data, node, ()) if isinstance(node, dict) else data.draw(node.typical)
    return out


def _set(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    *parents, key = path
    target = spec
    for parent in parents:
        if not isinstance(target.get(parent), dict):
            target[parent] = {}
        target = target[parent]
    if value is DELETE:
        target.pop(key, None)
    else:
        target[key] = value


def draw_spec(data: st.DataObject) -> dict[str, Any]:
    """A spec a person could write (one store, a key or allowUnsigned), then up to three
    fields set to anything or removed: both accepted and refused specs are common."""
    spec = _typical(data, SPEC_FIELDS, REQUIRED)
    store = spec["store"]
    kept = data.draw(st.sampled_from(["url", "pvc"]))
    store.pop("pvc" if kept == "url" else "url", None)
    store.setdefault(kept, data.draw(SPEC_FIELDS["store"][kept].typical))
    if data.draw(st.booleans()):
        spec.setdefault("signingPublicKeySecret", "signing-key")
        spec.pop("allowUnsigned", None)
    else:
        spec.pop("signingPublicKeySecret", None)
        spec["allowUnsigned"] = True
    for _ in range(data.draw(st.integers(0, 3))):
        path = data.draw(st.sampled_from(FIELD_PATHS))
        _set(spec, path, data.draw(st.one_of(_arbitrary(path), st.just(DELETE))))
    return spec


def _crd_paths(schema: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every field's path; a core type's field is one (its inside is the API server's)."""
    paths = set()
    for key, field in (schema.get("properties") or {}).items():
        paths.add((*prefix, key))
        if (*prefix, key) not in CORE_PATHS:
            paths |= _crd_paths(field, (*prefix, key))
    return paths


def test_the_property_test_generates_every_field_of_the_crd() -> None:
    assert set(FIELD_PATHS) == _crd_paths(spec_schema())


def _operator_accepts(spec: Any) -> bool:
    try:
        parse_spec(spec)
    except SpecError:
        return False
    return True


def test_crd_schema_and_operator_agree() -> None:
    """Whatever the API server accepts the operator accepts, and vice versa: on the spec
    as sent and on the spec as the API server stores it (defaults applied)."""
    verdicts: Counter[bool] = Counter()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        spec = draw_spec(data)
        doc = {
            "apiVersion": "serving.model-rollout.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "x"},
            "spec": spec,
        }
        refusal = problems(doc)
        accepted = not refusal
        assert _operator_accepts(spec) == accepted, (spec, refusal)
        if accepted:
            assert _operator_accepts(SCHEMA.stored(doc)["spec"]), spec
        verdicts[accepted] += 1

    check()
    # neither side of the comparison was left almost untested
    assert min(verdicts[True], verdicts[False]) >= 40, verdicts


def test_store_credentials_are_passed_key_by_key_never_a_whole_secret() -> None:
    [example] = load_all(ROOT / "examples" / "modeldeployment.yaml")
    spec = parse_spec(example["spec"])
    assert spec.store.credentials_secret
    objects = children("resnet", "ml-serving", spec, spec.version)
    [deployment] = [d for d in objects if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert "envFrom" not in container, container["name"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "sidecar")
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in sidecar["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert set(refs) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert {r["name"] for r in refs.values()} == {spec.store.credentials_secret}


def test_kubectl_get_shows_the_last_analysis_result() -> None:
    """The printer column reads what the operator writes (``status.analysis.lastResult``,
    one of the analysis' results); both copies of the CRD are the same file (above)."""
    from model_operator.analysis import Result

    [crd] = load_all(CRD)
    [version] = crd["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Analysis"]["jsonPath"] == ".status.analysis.lastResult"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["analysis"]["properties"]["lastResult"]["enum"] == [str(r) for r in Result]
