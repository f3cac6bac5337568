"""The day-2 tools' pure parts: the status view (terminal and plain), the history table
and the rollback choice, how a followed rollout is judged, error messages, the
change-cause, argument parsing; and the CRD's history schema and LAST-RESULT column."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from model_rollout_cli import commands, errors, plugin, release
from model_rollout_cli.cause import change_cause, ci_job
from model_rollout_cli.commands import watch_code
from model_rollout_cli.errors import OK, ROLLOUT_FAILED, TIMED_OUT, USAGE, api_error
from model_rollout_cli.follow import INVALID, judge, rollout_on
from model_rollout_cli.history import history_table, keys, known_versions, previous_success
from model_rollout_cli.overview import held_versions, list_table, tree
from model_rollout_cli.table import age
from model_rollout_cli.track import checked_keys, track_view
from model_rollout_cli.view import Progress, progress_line, render
from model_rollout_contract.annotations import ABORT, RETRY, change_cause_for, is_timed_cause
from model_rollout_contract.defaults import HISTORY_LIMIT
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import RolloutResult, SidecarState
from model_rollout_contract.tracks import track_keys
from tests.support.cli import TENANT_MODELS

CRD = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "modeldeployment.yaml"
NOW = datetime(2026, 12, 3, 9, 0, 0, tzinfo=timezone.utc)


def entry(version: str, result: str, started: str, **more: str) -> dict[str, str]:
    return {"version": version, "result": result, "startedAt": started, **more}


def md(history: list[dict[str, Any]], version: str = "v3", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "mlp", "namespace": "ml", "generation": 4},
        "spec": {"model": "mlp", "version": version, "replicas": 2},
        "status": {"history": history, **status},
    }


def pod(name: str, serving: str, target: str, state: SidecarState, ready: bool = True) -> dict:
    report = SidecarReport("mlp", target, serving, state, reason="why" if not ready else None)
    return {
        "metadata": {
            "name": name,
            "annotations": {
                "serving.model-rollout.io/target-version": target,
                "serving.model-rollout.io/sidecar-status": report.to_json(),
            },
        },
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


HISTORY = [
    entry("v3", "RolledBack", "2026-12-03T08:50:00Z", reason="canary analysis of v3 failed"),
    entry("v2", "Succeeded", "2026-12-03T08:00:00Z", finishedAt="2026-12-03T08:03:20Z"),
    entry("v1", "Succeeded", "2026-12-02T08:00:00Z", triggeredBy="spec.version edit"),
]


def test_the_view_shows_phase_pods_per_version_analysis_history_and_events() -> None:
    resource = md(
        HISTORY,
        phase="Degraded",
        message="canary analysis of v3 failed",
        currentVersion="v2",
        versions={"v2": 2},
        analysis={"lastResult": "Failed", "checks": 2, "failures": 2, "message": "NaN"},
        conditions=[{"type": "Degraded", "status": "True", "reason": "AnalysisFailed"}],
    )
    pods = [
        pod("mlp-b", "v2", "v2", SidecarState.OK),
        pod("mlp-a", "v2", "v3", SidecarState.REFUSED, ready=False),
    ]
    events = [
        {
            "type": "Warning",
            "reason": "AnalysisFailed",
            "message": "x",
            "lastTimestamp": "2026-12-03T08:59:00Z",
        }
    ]
    plain = render(resource, pods, events, NOW)
    assert "Phase:       Degraded (AnalysisFailed)" in plain
    assert "Analysis:    Failed (2 checks, 2 failed): NaN" in plain
    assert "by version: v2=2" in plain
    lines = plain.splitlines()
    first_pod = next(i for i, line in enumerate(lines) if line.strip().startswith("NAME"))
    assert lines[first_pod + 1].split()[:5] == ["mlp-a", "False", "v2", "v3", "refused"]
    row = next(line for line in lines if line.strip().startswith("v3 "))
    assert row.split()[:4] == ["v3", "10m", "ago", "RolledBack"] and "60s   Warning" in plain
    assert "\x1b[" not in plain
    coloured = render(resource, pods, events, NOW, colour=True)
    assert "\x1b[31mDegraded\x1b[0m" in coloured
    line = progress_line(resource, 12.34)
    assert line.startswith("[  12.3s] Degraded/AnalysisFailed: canary analysis")
    assert line.endswith("pods serving v2=2")


def test_history_table_and_the_version_a_rollback_goes_to() -> None:
    table = history_table(md(HISTORY), 10, NOW).splitlines()
    assert table[0].split()[:4] == ["VERSION", "FROM", "STARTED", "FINISHED"]
    assert "3m20s" in table[2] and "Succeeded" in table[2]
    assert len(history_table(md(HISTORY), 1, NOW).splitlines()) == 2
    assert history_table(md([]), 10, NOW) == "no rollouts recorded yet"
    assert previous_success(md(HISTORY, version="v3")) == "v2"  # during or after a failure
    assert previous_success(md(HISTORY, version="v2")) == "v1"  # after a success
    assert previous_success(md(HISTORY[:1])) is None
    assert (age(59), age(150), age(4000), age(200000)) == ("59s", "2m30s", "1h6m", "2d")


def test_a_followed_rollout_is_judged_by_its_own_entry() -> None:
    before = keys(md(HISTORY))
    done = {"phase": "Available", "currentVersion": "v4", "versions": {"v4": 2}}
    running = md([entry("v4", "Progressing", "2026-12-03T09:00:00Z"), *HISTORY], "v4", **done)
    assert judge(running, "v4", before, RolloutResult.SUCCEEDED, None) is None
    ok = md(
        [entry("v4", "Succeeded", "2026-12-03T09:00:00Z", reason="2/2"), *HISTORY], "v4", **done
    )
    outcome = judge(ok, "v4", before, RolloutResult.SUCCEEDED, None)
    assert outcome is not None and (outcome.result, outcome.code) == ("Succeeded", OK)
    assert outcome.to_json()["versions"] == {"v4": 2}
    # an old rollout of the same version is not this one
    assert judge(md(HISTORY), "v3", before, RolloutResult.SUCCEEDED, None) is None
    failed = judge(md(HISTORY), "v3", set(), RolloutResult.SUCCEEDED, None)
    assert failed is not None and failed.code == ROLLOUT_FAILED
    assert failed.reason == "canary analysis of v3 failed"
    # Succeeded (recorded only once Available), then a pod restarts: still a success
    starting = md(
        [entry("v4", "Succeeded", "2026-12-03T09:00:00Z")], version="v4", phase="Progressing"
    )
    decided = judge(starting, "v4", set(), RolloutResult.SUCCEEDED, None)
    assert decided is not None and (decided.result, decided.code) == ("Succeeded", OK)
    invalid = md(
        HISTORY, version="v9", phase="Invalid", message="not in the store", observedGeneration=4
    )
    refused = judge(invalid, "v9", before, RolloutResult.SUCCEEDED, generation=4)
    assert refused is not None and (refused.result, refused.reason) == (INVALID, "not in the store")
    assert judge(invalid, "v9", before, RolloutResult.SUCCEEDED, generation=5) is None


V2_DONE = entry("v2", "Succeeded", "2026-12-03T08:10:00Z", finishedAt="2026-12-03T08:11:00Z")
V1_DONE = entry("v1", "Succeeded", "2026-12-03T08:00:00Z")
BEFORE_V2 = {("v1", "2026-12-03T08:00:00Z")}


def test_this_rollouts_own_entry_decides_before_a_later_spec_change() -> None:
    v3 = entry("v3", "Progressing", "2026-12-03T08:11:01Z")
    moved = md([v3, V2_DONE, V1_DONE], version="v3", phase="Canary", observedGeneration=6)
    outcome = judge(moved, "v2", BEFORE_V2, RolloutResult.SUCCEEDED, 5)
    assert outcome is not None and (outcome.result, outcome.code) == ("Succeeded", OK)
    refused = md([V2_DONE, V1_DONE], version="v9", phase="Invalid", observedGeneration=6)
    outcome = judge(refused, "v2", BEFORE_V2, RolloutResult.SUCCEEDED, 5)
    assert outcome is not None and (outcome.result, outcome.code) == ("Succeeded", OK)


def test_a_rollout_the_spec_left_before_it_ended_or_started_is_superseded() -> None:
    v3 = entry("v3", "Progressing", "2026-12-03T08:11:01Z")
    never = md([v3, V1_DONE], version="v3", phase="Canary", observedGeneration=6)
    outcome = judge(never, "v2", BEFORE_V2, RolloutResult.SUCCEEDED, 5)
    assert outcome is not None and (outcome.result, outcome.code) == ("Superseded", 1)
    assert "changed to v3 before the rollout of v2 started" in outcome.reason
    v2_running = entry("v2", "Progressing", "2026-12-03T08:10:00Z")
    left = md([v2_running, V1_DONE], version="v9", phase="Invalid", observedGeneration=6)
    outcome = judge(left, "v2", BEFORE_V2, RolloutResult.SUCCEEDED, 5)
    assert outcome is not None and (outcome.result, outcome.code) == ("Superseded", 1)


def test_back_to_the_version_the_operator_is_on_succeeds_without_a_new_entry() -> None:
    """spec.version v9 refused (Invalid), then set back to v2: the operator's rollout state
    is complete on v2 already, so it starts nothing and adds no entry."""
    rollout = {"toVersion": "v2", "stage": "complete"}
    refused = md(
        [V2_DONE, V1_DONE], version="v9", phase="Invalid", observedGeneration=3, rollout=rollout
    )
    assert rollout_on(refused, "v2") and not rollout_on(refused, "v1")
    known = keys(refused)
    back = md(
        [V2_DONE, V1_DONE], version="v2", phase="Available", currentVersion="v2",
        versions={"v2": 2}, observedGeneration=4, rollout=rollout,
    )  # fmt: skip
    outcome = judge(back, "v2", known, RolloutResult.SUCCEEDED, 4, new_entry=False)
    assert outcome is not None and (outcome.result, outcome.code) == ("Succeeded", OK)
    assert outcome.entry == V2_DONE
    stale = {**back, "status": {**back["status"], "observedGeneration": 3}}
    assert judge(stale, "v2", known, RolloutResult.SUCCEEDED, 4, new_entry=False) is None
    assert judge(back, "v2", known, RolloutResult.SUCCEEDED, 4) is None  # an entry expected


def test_api_errors_say_what_to_do() -> None:
    resource = "modeldeployments.serving.model-rollout.io"
    rbac = (f'{resource} "m" is forbidden: User "alice" cannot patch resource "modeldeployments"'
            ' in API group "serving.model-rollout.io" in the namespace "ml"')  # fmt: skip
    e = api_error(403, json.dumps({"kind": "Status", "message": rbac}), "patch", resource, "ml",
                  "m", "modeldeployment")  # fmt: skip
    assert e.message.startswith(f"forbidden: patch {resource} in namespace ml: ask for RBAC")
    assert e.message.endswith(f"there ({rbac})") and e.code == 4
    # forbidden by an admission policy, which more RBAC would not lift: its words alone
    policy = f"{resource} \"m\" is forbidden: ValidatingAdmissionPolicy 'p' ... denied request: no"
    e = api_error(403, json.dumps({"kind": "Status", "message": policy}), "patch", resource,
                  "ml", "m", "modeldeployment")  # fmt: skip
    assert (e.message, e.code) == (f"patch modeldeployment m refused: {policy}", 4)
    e = api_error(404, "", "get", "modeldeployments.x", "ml", "m", "modeldeployment")
    assert e.message == "modeldeployment m not found in namespace ml"
    assert "HTTP 500" in api_error(500, "boom", "get", "pods", "ml").message


def test_the_change_cause_names_the_ci_job_or_the_user() -> None:
    github = {
        "GITHUB_ACTIONS": "true",
        "GITHUB_REPOSITORY": "org/models",
        "GITHUB_RUN_ID": "42",
        "GITHUB_ACTOR": "bob",
    }
    cause = change_cause("rollback", "v1", github, now=1796412001.25)
    why = "rollback by GitHub Actions org/models run 42 (bob) at 2026-12-04T19:20:01.250Z"
    assert cause == f"v1: {why}"
    assert change_cause_for(cause, "v1") == why
    assert change_cause_for(cause, "v2") is None  # another version's: stale for v2
    assert change_cause_for("release of v2 by x", "v2") is None  # names no version
    assert change_cause_for(None, "v2") is None
    gitlab = {"GITLAB_CI": "true", "CI_PROJECT_PATH": "g/p", "CI_JOB_ID": "7"}
    assert ci_job(gitlab) == "GitLab CI g/p job 7"
    assert ci_job({"BUILD_URL": "https://jenkins/job/1/"}) == "CI https://jenkins/job/1/"
    assert ci_job({"CI": "true"}) is None
    mine = change_cause("release", "v2", {})
    assert mine.startswith("v2: release by ") and "@" in mine
    # two uses by one user differ (the operator takes a cause already in the history for
    # a stale one), down to the millisecond
    assert change_cause("rollback", "v1", {}, now=10.0) != change_cause(
        "rollback", "v1", {}, now=10.001
    )
    # a long CI job is cut, the time kept (the operator keeps 300 characters of a cause)
    long = change_cause("release", "v2", {"BUILD_URL": "https://ci/" + "x" * 500}, now=10.0)
    why = change_cause_for(long, "v2")
    assert why is not None and len(why) <= 300 and is_timed_cause(why)
    assert why.endswith("… at 1970-01-01T00:00:10.000Z")
    assert not is_timed_cause("rollback by alice@laptop")  # an older CLI's: untimed


def test_arguments_parse_as_kubectl_passes_them() -> None:
    parser = plugin.build_parser()
    args = parser.parse_args(["-n", "a", "status", "mlp", "--watch"])
    assert (args.namespace, args.name, args.watch, args.kubeconfig) == ("a", "mlp", True, None)
    args = parser.parse_args(["rollback", "mlp", "--to", "v1", "--kubeconfig", "k", "-n", "b"])
    assert (args.to, args.kubeconfig, args.namespace, args.wait) == ("v1", "k", "b", False)
    assert plugin.main(["status"]) == 2
    assert plugin.main(["promote", "mlp", "--timeout", "-1"]) == 2
    args = release.build_parser().parse_args(
        ["release", "--model", "m", "--version", "v2", "--file", "f", "--key", "k",
         "--deployment", "d", "--store", "file:///s", "--wait", "-o", "json"]
    )  # fmt: skip
    assert (args.wait, args.output, args.timeout, args.force) == (True, "json", 900.0, False)
    assert release.main(["release", "--model", "m"]) == 2


def test_every_exit_code_is_distinct_and_documented_with_its_number() -> None:
    codes = {n: v for n, v in vars(errors).items() if n.isupper() and isinstance(v, int)}
    assert len(set(codes.values())) == len(codes) == 7 and codes["NOTHING_TO_DO"] == 6
    documented = re.findall(r"^\* (\d+): (.+)$", errors.__doc__ or "", re.MULTILINE)
    assert sorted(int(n) for n, _ in documented) == sorted(codes.values())
    assert dict(documented)["6"].startswith("nothing to do")
    assert plugin.main(["history", "mlp", "--limit", "0"]) == USAGE
    assert plugin.main(["status", "mlp", "--watch", "-o", "json"]) == USAGE


def test_the_crd_keeps_a_bounded_history_and_shows_the_last_result() -> None:
    [crd] = list(yaml.safe_load_all(CRD.read_text()))
    [version] = crd["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Last-Result"]["jsonPath"] == ".status.history[0].result"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    history = status["history"]
    assert history["maxItems"] == HISTORY_LIMIT
    assert history["items"]["properties"]["result"]["enum"] == [str(r) for r in RolloutResult]


@pytest.mark.parametrize("missing", ["--store", "--deployment"])
def test_release_needs_its_store_and_deployment(missing: str) -> None:
    argv = ["release", "--model", "m", "--version", "v", "--file", "f", "--key", "k",
            "--deployment", "d", "--store", "s"]  # fmt: skip
    at = argv.index(missing)
    assert release.main(argv[:at] + argv[at + 2 :]) == 2


def test_a_release_of_the_version_already_set_reports_its_last_rollout() -> None:
    serving = md(HISTORY[1:], version="v2", phase="Available", currentVersion="v2")
    outcome = release._already(serving, "v2")
    assert outcome is not None and (outcome.code, outcome.reason) == (OK, "already serving v2")
    failed = release._already(md(HISTORY, phase="Degraded", currentVersion="v2"), "v3")
    assert failed is not None and failed.code == ROLLOUT_FAILED
    assert "kubectl model retry" in failed.reason
    running = md([entry("v4", "Progressing", "2026-12-03T09:00:00Z")], version="v4")
    assert release._already(running, "v4") is None  # followed
    # it succeeded, and a pod restarts: followed until Available, never "retry it"
    restarting = md(HISTORY[1:], version="v2", phase="Progressing", currentVersion="v2")
    assert release._already(restarting, "v2") is None


def test_progress_prints_a_line_only_when_its_words_change() -> None:
    out = io.StringIO()
    show = Progress(out)
    canary = md([], phase="Canary", message="canary: 0/1 pods serve v2", versions={"v1": 2})
    show(canary)
    show(canary)
    show(md([], phase="Available", message="2/2 pods serve v2", versions={"v2": 2}))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith("Available: 2/2 pods serve v2 | pods serving v2=2")


# --- tenant models: a track each, in status.tenants and the track's pod annotations ---
def tenant_pod(name: str, tracks: dict[str, str | None]) -> dict[str, Any]:
    """A pod serving v2 on the default track and, per tenant track, the version its
    sidecar reports serving (``None``: that sidecar has not reported yet)."""
    raw = pod(name, "v2", "v2", SidecarState.OK)
    annotations = raw["metadata"]["annotations"]
    for track, serving in tracks.items():
        keys = track_keys(track)
        model = {"acme-mlp": "acme/mlp", "globex-mlp": "globex/mlp"}[track]
        if serving is not None:
            annotations[keys.target] = serving
            report = SidecarReport(model, serving, serving, SidecarState.OK)
            annotations[keys.sidecar_status] = report.to_json()
    return raw


ACME_CANARY = {
    "phase": "Canary",
    "message": "canary healthy; promote with annotation",
    "currentVersion": "a1",
    "model": "acme/mlp",
    "versions": {"a1": 1, "a2": 1},
    "rollout": {"toVersion": "a2", "fromVersion": "a1", "stage": "canary", "startedAt": 1e9},
    "analysis": {"lastResult": "Passed", "checks": 3, "failures": 0},
    "conditions": [{"type": "Progressing", "status": "True", "reason": "AwaitingPromotion"}],
}
GLOBEX_REFUSED = {
    "phase": "Invalid",
    "message": "globex/mlp g1 not in the model store",
    "model": "globex/mlp",
    "conditions": [{"type": "Degraded", "status": "True", "reason": "InvalidSpec"}],
}


def with_tenants(resource: dict[str, Any], tenants: dict[str, Any]) -> dict[str, Any]:
    spec = {**resource["spec"], "tenants": {"secretName": "keys", "models": TENANT_MODELS}}
    return {**resource, "spec": spec, "status": {**resource["status"], "tenants": tenants}}


def test_the_view_shows_every_tenant_track_with_its_own_phase_and_pods() -> None:
    base = md([], version="v2", phase="Available", currentVersion="v2", versions={"v2": 2})
    resource = with_tenants(base, {"acme-mlp": ACME_CANARY, "globex-mlp": GLOBEX_REFUSED})
    pods = [
        tenant_pod("mlp-a", {"acme-mlp": "a2", "globex-mlp": None}),
        tenant_pod("mlp-b", {"acme-mlp": "a1", "globex-mlp": None}),
    ]
    lines = render(resource, pods, [], NOW).splitlines()
    at = lines.index("Tenants:")
    assert lines[at + 1].split() == [
        "TRACK", "TENANT/MODEL", "DESIRED", "STABLE", "PHASE", "PODS", "MESSAGE"
    ]  # fmt: skip
    acme, globex = lines[at + 2].split(), lines[at + 3].split()
    assert acme[:8] == ["acme-mlp", "acme/mlp", "a2", "a1", "Canary", "(AwaitingPromotion)",
                        "a1=1", "a2=1"]  # fmt: skip
    assert globex[:6] == ["globex-mlp", "globex/mlp", "g1", "-", "Invalid", "(InvalidSpec)"]
    assert globex[6:8] == ["-=2", "globex/mlp"]  # no sidecar report yet; then its message
    assert lines[at + 4] == (
        "  promote acme-mlp: kubectl model promote mlp --track acme-mlp   "
        "(serving.model-rollout.io/promote.acme-mlp=a2@1000000000)"
    )
    assert lines[at + 5] == "  analysis acme-mlp: Passed (3 checks, 0 failed)"
    assert lines[at + 6 : at + 8] == ["", "Pods:"]
    # the default track is read through its own keys only: its rows are unchanged
    pod_header = lines.index("  NAME    READY   SERVING   TARGET   STATE   REASON")
    assert lines[pod_header + 1].split() == ["mlp-a", "True", "v2", "v2", "ok"]
    assert "Promote:" not in "\n".join(lines[:at])  # the deployment's own is not held
    # a tenant model the operator has not reached yet, and one gone from the spec whose
    # status the operator has not dropped yet, are shown too
    pending = with_tenants(base, {"old-mlp": {**GLOBEX_REFUSED, "model": "old/mlp"}})
    rows = render(pending, [], [], NOW).splitlines()
    at = rows.index("Tenants:")
    assert [r.split()[:5] for r in rows[at + 2 : at + 5]] == [
        ["acme-mlp", "acme/mlp", "a2", "-", "Pending"],
        ["globex-mlp", "globex/mlp", "g1", "-", "Pending"],
        ["old-mlp", "old/mlp", "-", "-", "Invalid"],
    ]


NO_TENANTS_VIEW = """\
Name:        mlp
Namespace:   ml
Model:       mlp
Phase:       Canary (AwaitingPromotion)
Message:     canary healthy
Stable:      v2   (previous v1)
Target:      v3
Replicas:    2 desired | 2 ready | 1 updated
Serving:     v2: 1 pods  v3: 1 pods
Promote:     kubectl model promote mlp   (serving.model-rollout.io/promote=v3@1000000000)
Analysis:    Passed (1 checks, 0 failed)

Pods:
  NAME    READY   SERVING   TARGET   STATE   REASON
  mlp-a   True    v3        v3       ok
  mlp-b   True    v2        v2       ok
  by version: v2=1  v3=1

History (most recent first):
  VERSION   STARTED    RESULT       TRIGGERED BY        REASON
  v3        10m ago    RolledBack   -                   canary analysis of v3 failed
  v2        1h0m ago   Succeeded    -
  v1        1d ago     Succeeded    spec.version edit

Events:
  AGE   TYPE     REASON          MESSAGE
  60s   Normal   CanaryStarted   x"""


def test_a_resource_without_tenant_models_renders_as_it_always_did() -> None:
    """The view, word for word, as it was before tenant tracks were shown: with no
    spec.tenants, and with tenants (API keys) but no tenant models."""
    resource = md(
        HISTORY, phase="Canary", message="canary healthy", currentVersion="v2",
        previousVersion="v1", readyReplicas=2, updatedReplicas=1, versions={"v2": 1, "v3": 1},
        rollout={"toVersion": "v3", "startedAt": 1e9},
        analysis={"lastResult": "Passed", "checks": 1, "failures": 0},
        conditions=[{"type": "Progressing", "status": "True", "reason": "AwaitingPromotion"}],
    )  # fmt: skip
    pods = [pod("mlp-a", "v3", "v3", SidecarState.OK), pod("mlp-b", "v2", "v2", SidecarState.OK)]
    events = [
        {"type": "Normal", "reason": "CanaryStarted", "message": "x",
         "lastTimestamp": "2026-12-03T08:59:00Z"}
    ]  # fmt: skip
    assert render(resource, pods, events, NOW) == NO_TENANTS_VIEW
    keys_only = {**resource, "spec": {**resource["spec"], "tenants": {"secretName": "keys"}}}
    assert render(keys_only, pods, events, NOW) == NO_TENANTS_VIEW


def test_a_tenant_track_is_seen_as_the_resource_its_commands_act_on() -> None:
    """``--track``: the track's version as spec.version, its status.tenants entry as the
    status, the deployment's canary settings kept; a track gone from the spec mid-wait
    ends the wait as superseded; a track the spec does not list is a usage error."""
    resource = with_tenants(md([], version="v2", phase="Available"), {"acme-mlp": ACME_CANARY})
    resource["spec"]["canary"] = {"manualPromote": True}
    view = track_view(resource, "acme-mlp")
    assert view["spec"] == {
        "model": "mlp", "version": "a2", "replicas": 2, "canary": {"manualPromote": True}
    }  # fmt: skip
    assert view["status"] == ACME_CANARY and track_view(resource, None) is resource
    assert track_view(resource, "globex-mlp")["status"] == {}  # not reached by the operator yet
    assert checked_keys(resource, "mlp", "acme-mlp") == track_keys("acme-mlp")
    gone = {**resource, "spec": {**resource["spec"], "tenants": {"models": TENANT_MODELS[1:]}}}
    outcome = judge(track_view(gone, "acme-mlp"), "a2", set(), RolloutResult.SUCCEEDED, None)
    assert outcome is not None and outcome.result == RolloutResult.SUPERSEDED
    with pytest.raises(errors.CliError) as refused:
        checked_keys(gone, "mlp", "acme-mlp")
    assert refused.value.code == USAGE and "its tracks are globex-mlp" in refused.value.message
    with pytest.raises(errors.CliError) as none:
        checked_keys(md([]), "mlp", "acme-mlp")
    assert none.value.message.endswith("its tracks are none (no spec.tenants.models)")


# --- issue 31: refusals, watch exit codes, list and tree views, completion, version ---


def test_the_versions_a_rollback_may_go_to_without_force() -> None:
    resource = md(HISTORY, currentVersion="v2", previousVersion="v1", verifiedVersions=["v3", "v4"])
    assert known_versions(resource) == ["v1", "v2", "v3", "v4"]
    assert "v3" not in known_versions(md(HISTORY))  # RolledBack: no pod of it was kept
    assert known_versions(md([])) == []


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ({"phase": "Available", "currentVersion": "v3", "observedGeneration": 4}, OK),
        ({"phase": "Available", "currentVersion": "v3", "observedGeneration": 3}, TIMED_OUT),
        ({"phase": "Available", "currentVersion": "v2", "observedGeneration": 4}, TIMED_OUT),
        ({"phase": "Degraded", "observedGeneration": 4}, ROLLOUT_FAILED),
        ({"phase": "Invalid", "observedGeneration": 4}, ROLLOUT_FAILED),
        ({"phase": "Canary", "observedGeneration": 4}, TIMED_OUT),
        ({"phase": "Degraded", "observedGeneration": 3}, TIMED_OUT),  # an older spec's
    ],
)
def test_a_watch_ends_with_the_exit_code_wait_would_give(status: dict, code: int) -> None:
    assert watch_code(md([], **status)) == code


def test_the_tree_shows_each_pods_versions_newest_first() -> None:
    resource = md(HISTORY, phase="Canary", currentVersion="v2")
    serving = pod("mlp-a", "v2", "v2", SidecarState.OK)
    report = SidecarReport("mlp", "v3", "v2", SidecarState.LOADING, retained=("v1",))
    loading = pod("mlp-b", "v2", "v3", SidecarState.OK)
    loading["metadata"]["annotations"]["serving.model-rollout.io/sidecar-status"] = report.to_json()
    refused = pod("mlp-c", "v2", "v3", SidecarState.REFUSED, ready=False)
    assert tree(resource, [loading, serving, refused]).splitlines() == [
        "modeldeployment/mlp  Canary  model mlp  target v3  stable v2",
        "├── pod/mlp-a  ready",
        "│   └── v2  serving",
        "├── pod/mlp-b  ready",
        "│   ├── v3  loading (loading)",
        "│   ├── v2  serving",
        "│   └── v1  retained",
        "└── pod/mlp-c  not ready",
        "    ├── v3  refused: why",
        "    └── v2  serving",
    ]
    assert tree(resource, []).splitlines()[-1] == "└── no pods"


def test_held_versions_without_an_order_follow_the_history() -> None:
    """Git SHAs: newest first as the rollouts came, not as text sorts them."""
    shown = held_versions(
        {"serving": "e5a0c2f", "retained": ["9f2c1e7"], "target": "03b1d4a", "state": "fetching"},
        ["9f2c1e7", "e5a0c2f", "03b1d4a"],
    )
    assert shown == [
        ("03b1d4a", "loading (fetching)"),
        ("e5a0c2f", "serving"),
        ("9f2c1e7", "retained"),
    ]


def test_list_shows_one_line_per_deployment_and_a_namespace_column_with_all() -> None:
    a = md(HISTORY, phase="Available", currentVersion="v3", readyReplicas=2)
    b = {**md([]), "metadata": {"name": "b", "namespace": "aa"}}
    lines = list_table([a, b], NOW, namespaces=True).splitlines()
    assert lines[0].split() == [
        "NAMESPACE", "NAME", "MODEL", "STABLE", "TARGET", "READY", "PHASE", "ANALYSIS",
        "LAST", "AGE",
    ]  # fmt: skip
    assert lines[1].split()[:2] == ["aa", "b"]  # by namespace, then name
    assert lines[2].split()[:8] == ["ml", "mlp", "mlp", "v3", "v3", "2/2", "Available", "-"]
    assert list_table([a], NOW, namespaces=False).splitlines()[1].split()[0] == "mlp"
    assert list_table([], NOW, namespaces=False) == "no modeldeployments found"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_each_shells_code(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plugin.main(["completion", shell]) == OK
    code = capsys.readouterr().out
    assert "kubectl-model" in code and "model-rollout" in code
    assert plugin.main(["completion", "tcsh"]) == USAGE


def test_version_needs_no_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    assert plugin.main(["version", "--kubeconfig", "/nowhere"]) == OK
    assert capsys.readouterr().out == f"kubectl-model {metadata.version('model-rollout')}\n"


def test_a_status_the_operator_has_not_caught_up_with_is_never_shown_as_the_specs() -> None:
    """spec.version edited to v3 (generation 4), the operator still on generation 3: its
    Available (of v2) must not stand beside Target: v3."""
    resource = md(
        [], phase="Available", currentVersion="v2", targetVersion="v2", observedGeneration=3,
        conditions=[{"type": "Ready", "status": "True", "reason": "Available"}],
    )  # fmt: skip
    lines = render(resource, [], [], NOW).splitlines()
    phase = next(line for line in lines if line.startswith("Phase:"))
    assert phase == (
        "Phase:       Pending (the operator has not yet acted on generation 4 (status of 3);"
        " it said Available)"
    )
    target = next(line for line in lines if line.startswith("Target:"))
    assert target == "Target:      v3   (the operator still works toward v2)"
    caught_up = md([], phase="Available", currentVersion="v3", targetVersion="v3",
                   observedGeneration=4)  # fmt: skip
    lines = render(caught_up, [], [], NOW).splitlines()
    assert "Phase:       Available" in lines and "Target:      v3" in lines


class PatchedCluster:
    """A resource read and merge-patched in memory: what a day-2 command writes."""

    def __init__(self, resource: dict[str, Any]) -> None:
        self.resource, self.patches = resource, []  # type: list[dict[str, Any]]

    def get(self, name: str) -> dict[str, Any]:
        return self.resource

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches.append(patch)
        return self.resource


def template_rollout(stage: str, started: float = 200.0) -> dict[str, Any]:
    return {
        "kind": "template", "stage": stage, "startedAt": started,
        "from": {"deployment": "mlp", "digest": "a" * 16},
        "to": {"deployment": "mlp-bbbbbbbbbb", "digest": "b" * 16},
        "promoteWith": f"mlp-bbbbbbbbbb@{int(started)}",
    }  # fmt: skip


def day2(command: str, resource: dict[str, Any]) -> tuple[PatchedCluster, str]:
    cluster, out = PatchedCluster(resource), io.StringIO()
    run = commands.abort if command == "abort" else commands.retry
    assert run(cluster, "mlp", commands.Follow(out=out)) == OK  # type: ignore[arg-type]
    return cluster, out.getvalue()


def test_abort_and_retry_act_on_the_pod_template_rollout_and_say_so() -> None:
    running = md(
        [], phase="Canary", currentVersion="v3", templateRollout=template_rollout("canary")
    )
    cluster, out = day2("abort", running)
    assert cluster.patches == [{"metadata": {"annotations": {ABORT: "mlp-bbbbbbbbbb@200"}}}]
    assert "pod template rollout to mlp-bbbbbbbbbb aborted" in out and "back to mlp" in out
    failed = md(
        [], phase="Degraded", currentVersion="v3", templateRollout=template_rollout("failed")
    )
    cluster, out = day2("retry", failed)
    assert cluster.patches == [{"metadata": {"annotations": {RETRY: "mlp-bbbbbbbbbb@200"}}}]
    assert "pod template rollout to mlp-bbbbbbbbbb retried" in out


def test_retry_with_a_version_and_a_template_rollout_failed_takes_the_later_one() -> None:
    rollout = {"toVersion": "v3", "fromVersion": "v2", "stage": "failed", "startedAt": 300.0}
    both = md([], phase="Degraded", currentVersion="v2", rollout=rollout,
              templateRollout=template_rollout("failed", started=200.0))  # fmt: skip
    cluster, out = day2("retry", both)
    assert cluster.patches[0]["metadata"]["annotations"][RETRY] == "v3"
    assert "version rollout of v3 retried" in out
    both["status"]["templateRollout"] = template_rollout("failed", started=400.0)
    cluster, out = day2("retry", both)
    assert cluster.patches[0]["metadata"]["annotations"] == {RETRY: "mlp-bbbbbbbbbb@400"}
