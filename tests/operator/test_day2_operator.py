"""The operator's side of day-2 operations: as pure functions (the abort and retry
annotations in the planner, the rollout history kept in ``.status.history``), and end to
end on a real API server, where the real operator process, the day-2 tools run as a
user bound to the chart's rollout-editor role, and simulated pods
(``model_rollout_e2e.simulated_sidecar``: their sidecars' reports faked as the sidecar
writes them, no model store or server) go through a release, a refused version, a
retry, a promotion, a rollback and an abort (the real pods and the canary analysis are
``tests/cli/test_release.py``'s)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from model_operator.history import RETRY_ANNOTATION, SPEC_EDIT, record, started
from model_operator.planner import BATCHES, CANARY, COMPLETE, FAILED, Event, Plan, RolloutState
from model_operator.status import build_status, iso
from model_rollout_cli.cause import change_cause
from model_rollout_contract.annotations import ABORT, PROMOTE, RETRY, change_cause_value
from model_rollout_contract.defaults import HISTORY_LIMIT
from model_rollout_contract.states import Phase, RolloutResult
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.simulated_sidecar import (
    SidecarBehaviour,
    SimulatedModelContainers,
    model_store_claim,
)
from model_rollout_e2e.simulation import SimCluster
from tests.operator.test_planner import spec
from tests.support.cli import (
    EDITOR,
    Admin,
    bound_user,
    install_sidecar_policy,
    install_tools,
    run_tool,
)
from tests.support.control_plane_operator import Operator, install_chart, model_deployment
from tests.support.crd_validation import ResourceSchema
from tests.support.namespaces import namespace_of_its_own
from tests.support.sidecar import make_keys

ROOT = Path(__file__).resolve().parents[2]


def canary_held(cluster: SimCluster, version: str = "v2"):  # type: ignore[no-untyped-def]
    sp = spec(version=version, canary={"percent": 25, "manualPromote": True})
    for _ in range(10):
        plan = cluster.step(sp)
    assert plan.reason == "AwaitingPromotion" and cluster.serving() == {"v1": 3, version: 1}
    return sp, plan


def test_abort_sends_every_pod_of_the_running_rollout_back_to_stable() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    plan = cluster.step(sp, aborted="v2")
    assert plan.phase is Phase.DEGRADED and plan.reason == "Aborted"
    assert plan.state.stage == FAILED and plan.state.aborted and plan.state.rolled_back
    assert [e.reason for e in plan.events] == ["RolloutAborted"] and plan.events[0].warning
    assert [(a.version) for a in plan.actions] == ["v1"] and ABORT in plan.cleared
    for _ in range(5):  # stays back, the reason stays Aborted
        plan = cluster.step(sp)
    assert cluster.serving() == {"v1": 4} and plan.reason == "Aborted"
    assert cluster.stable == "v1"


def test_an_abort_of_another_version_is_ignored_with_an_event() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    plan = cluster.step(sp, aborted="v3")
    assert plan.reason == "AwaitingPromotion" and plan.state.stage == CANARY
    assert [e.reason for e in plan.events] == ["AbortIgnored"]
    assert "current rollout is of v2" in plan.events[0].message and ABORT in plan.cleared
    # the same abort read again after it acted (its removal not seen yet): no event
    plan = cluster.step(sp, aborted="v2")
    plan = cluster.step(sp, aborted="v2")
    assert plan.reason == "Aborted" and plan.events == ()


def test_an_abort_that_arrives_after_its_rollout_completed_says_so() -> None:
    cluster = SimCluster(4)
    sp = spec(version="v2")
    assert cluster.run(sp).phase is Phase.AVAILABLE
    plan = cluster.step(sp, aborted="v2")
    assert [e.reason for e in plan.events] == ["AbortIgnored"] and plan.events[0].warning
    assert "completed; use kubectl model rollback" in plan.events[0].message
    assert ABORT in plan.cleared and cluster.serving() == {"v2": 4}
    assert plan.state.stage == COMPLETE and plan.phase is Phase.AVAILABLE


def test_an_abort_of_a_failed_rollout_is_ignored_with_an_event() -> None:
    cluster = SimCluster(4, refuse=frozenset({"v2"}))
    sp = spec(version="v2")
    assert cluster.run(sp).state.stage == FAILED
    plan = cluster.step(sp, aborted="v2")
    assert [e.reason for e in plan.events] == ["AbortIgnored"]
    assert "is not running" in plan.events[0].message


def test_retry_forgets_a_failure_and_runs_the_rollout_again() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    cluster.step(sp, aborted="v2")
    failed = cluster.run(sp)
    assert failed.state.stage == FAILED
    plan = cluster.step(sp, retried="v2")
    assert [e.reason for e in plan.events[:2]] == ["RolloutRetried", "RolloutStarted"]
    assert plan.state.stage == CANARY and not plan.state.aborted and RETRY in plan.cleared
    assert plan.state.started_at > failed.state.started_at
    plan = cluster.step(sp, retried="v2")  # read again while it runs: ignored quietly
    assert plan.state.stage == CANARY
    assert not {"RolloutRetried", "RetryIgnored", "RolloutStarted"} & {
        e.reason for e in plan.events
    }
    for _ in range(5):
        plan = cluster.step(sp)
    assert cluster.serving() == {"v1": 3, "v2": 1} and plan.reason == "AwaitingPromotion"
    plan = cluster.step(sp, promoted=plan.state.promotion)
    assert cluster.run(sp).phase is Phase.AVAILABLE and cluster.serving() == {"v2": 4}


def test_a_retry_of_another_version_or_of_a_success_is_ignored_with_an_event() -> None:
    cluster = SimCluster(4)
    sp = spec(version="v2")
    cluster.run(sp)
    plan = cluster.step(sp, retried="v2")
    assert [e.reason for e in plan.events] == ["RetryIgnored"] and "succeeded" in plan.events[
        0
    ].message
    plan = cluster.step(sp, retried="v9")
    assert "not spec.version v2" in plan.events[0].message
    assert plan.state.stage == COMPLETE and RETRY in plan.cleared


def _plan(state: RolloutState, *events: str, reason: str = "BatchLoading") -> Plan:
    """A plan of ``state``; Available once the rollout is complete."""
    phase = Phase.AVAILABLE if state.stage == COMPLETE else Phase.PROGRESSING
    return Plan(state, "v1", None, (), tuple(Event(e, e) for e in events), phase, reason, "msg")


def test_history_records_one_entry_per_rollout_most_recent_first() -> None:
    v2 = RolloutState("v2", "v1", BATCHES, started_at=100.0)
    cause = change_cause_value("v2", "release by ci")
    history = record([], _plan(v2, "RolloutStarted"), 101.0, cause)
    assert history == [
        {
            "version": "v2",
            "fromVersion": "v1",
            "startedAt": started(100.0),
            "result": "Progressing",
            "reason": "BatchLoading",
            "triggeredBy": "release by ci",
        }
    ]
    # the same pass again (a restart, a crash before the status write): the same entry
    assert record(history, _plan(v2, "RolloutStarted"), 101.0, cause) == history
    assert record(history, _plan(v2), 102.0, None) == history
    complete = replace(v2, stage=COMPLETE)  # a pod still starting: not Succeeded yet
    starting = replace(_plan(complete), phase=Phase.PROGRESSING, reason="PodsStarting")
    assert record(history, starting, 120.0, None)[0]["result"] == "Progressing"
    done = record(history, _plan(complete), 130.0, None)
    assert done[0]["result"] == "Succeeded" and done[0]["finishedAt"] == iso(130.0)
    assert done[0]["triggeredBy"] == "release by ci"
    v3 = RolloutState("v3", "v2", CANARY, started_at=200.0)
    running = record(done, _plan(v3, "RolloutStarted"), 200.0, cause)  # v2's: stale
    assert [e["version"] for e in running] == ["v3", "v2"]
    assert running[0]["triggeredBy"] == SPEC_EDIT
    v4 = RolloutState("v4", "v2", CANARY, started_at=300.0)
    superseded = record(running, _plan(v4, "RolloutStarted"), 300.0, None)
    assert [e["result"] for e in superseded] == ["Progressing", "Superseded", "Succeeded"]
    assert superseded[1]["finishedAt"] == iso(300.0)


def test_history_results_and_bound() -> None:
    cases = {
        RolloutResult.ABORTED: {"aborted": True, "rolled_back": True},
        RolloutResult.ROLLED_BACK: {"rolled_back": True},
        RolloutResult.FAILED: {},
    }
    for result, flags in cases.items():
        state = RolloutState("v2", "v1", FAILED, started_at=5.0, failure="why", **flags)
        [entry] = record([], _plan(state, "RolloutStarted"), 9.0, None)
        assert (entry["result"], entry["reason"]) == (result, "why")
    history: list = []
    for i in range(HISTORY_LIMIT + 5):
        state = RolloutState(f"v{i}", None, COMPLETE, started_at=float(i * 10))
        history = record(history, _plan(state, "RolloutStarted"), i * 10.0 + 1, None)
    assert len(history) == HISTORY_LIMIT
    assert history[0]["version"] == f"v{HISTORY_LIMIT + 4}"
    # a steady state (no rollout started) adds nothing; garbage in the status is dropped
    steady = RolloutState("v1", None, COMPLETE, started_at=1.0)
    assert record(["junk", {"version": "v0"}], _plan(steady), 2.0, None) == [{"version": "v0"}]
    assert record("junk", _plan(steady), 2.0, None) == []


def test_triggered_by_is_the_change_cause_only_when_it_names_the_new_version() -> None:
    """The change-cause annotation stays until changed: a later edit of spec.version by
    hand (or a GitOps sync) must not be recorded as the last release."""
    v3 = RolloutState("v3", "v2", CANARY, started_at=200.0)
    for cause, expected in [
        (change_cause_value("v3", "rollback by alice@laptop"), "rollback by alice@laptop"),
        (change_cause_value("v2", "release by ci"), SPEC_EDIT),  # the last release's
        ("release of v3 by ci", SPEC_EDIT),  # names no version
        (None, SPEC_EDIT),
    ]:
        [entry] = record([], _plan(v3, "RolloutStarted"), 201.0, cause)
        assert entry["triggeredBy"] == expected, cause
    [entry] = record([], _plan(v3, "RolloutStarted"), 201.0, change_cause_value("v3", "x" * 999))
    assert len(entry["triggeredBy"]) == 300 and entry["triggeredBy"].endswith("…")
    cluster = SimCluster(4)  # through the planner: a plain edit after a release
    release = change_cause_value("v2", "release by GitHub Actions org/models run 42 (bob)")
    history: list[dict[str, Any]] = []
    for version, steps in (("v2", 30), ("v3", 3)):
        for _ in range(steps):
            history = record(history, cluster.step(spec(version=version)), cluster.now, release)
    assert [(e["version"], e["triggeredBy"]) for e in history] == [
        ("v3", SPEC_EDIT),
        ("v2", "release by GitHub Actions org/models run 42 (bob)"),
    ]


def test_a_hand_edit_back_to_a_version_the_tools_once_set_is_not_theirs() -> None:
    """A rollback to v1 by the tools, a hand edit to v2, one back to v1: the annotation,
    left alone by both edits, still names v1, and the second v1 rollout was recorded as
    the tools' rollback (a leftover of an earlier review). A cause already carried by an
    earlier rollout of the version is stale; the tools' next one has its own time."""
    alice = change_cause_value("v1", "rollback by alice@laptop at 2026-12-04T10:00:00.000Z")
    history: list[dict[str, Any]] = []
    for version, start, cause in (
        ("v1", 100.0, alice),
        ("v2", 200.0, alice),  # names v1: not this rollout's
        ("v1", 300.0, alice),  # names v1, but the rollout at 100 already carries it
        ("v2", 400.0, alice),
        (
            "v1",
            500.0,
            change_cause_value("v1", "rollback by alice@laptop at 2026-12-04T11:00:00.000Z"),
        ),
    ):
        state = RolloutState(version, None, BATCHES, started_at=start)
        history = record(history, _plan(state, "RolloutStarted"), start + 1, cause)
        history = record(history, _plan(state), start + 2, cause)  # later passes: kept
    assert [(e["version"], e["triggeredBy"]) for e in reversed(history)] == [
        ("v1", "rollback by alice@laptop at 2026-12-04T10:00:00.000Z"),
        ("v2", SPEC_EDIT),
        ("v1", SPEC_EDIT),
        ("v2", SPEC_EDIT),
        ("v1", "rollback by alice@laptop at 2026-12-04T11:00:00.000Z"),
    ]


def test_causes_of_other_writers_and_long_ones_of_ci_jobs_stay_attributed() -> None:
    """Found by a review of the rule above: an untimed cause (an older CLI's, a GitOps
    manifest's) may repeat for each rollout and is taken each time, as before; and a CI
    job's long URL must not push the time out of the 300 characters kept, or every build
    of that job would read as one cause."""
    for first, second in (
        ("rollback by alice@laptop", "rollback by alice@laptop"),  # an older CLI's
        (
            change_cause("release", "v1", {"BUILD_URL": "https://ci/" + "x" * 290 + "/41/"}, 10.0)[
                4:
            ],
            change_cause("release", "v1", {"BUILD_URL": "https://ci/" + "x" * 290 + "/42/"}, 90.0)[
                4:
            ],
        ),
    ):
        history: list[dict[str, Any]] = []
        for version, start, why in (
            ("v1", 100.0, first),
            ("v2", 200.0, first),
            ("v1", 300.0, second),
        ):
            state = RolloutState(version, None, BATCHES, started_at=start)
            cause = change_cause_value("v1", why)
            history = record(history, _plan(state, "RolloutStarted"), start + 1, cause)
        assert [e["triggeredBy"] for e in history] == [
            second[:299] + "…" if len(second) > 300 else second,
            SPEC_EDIT,
            first[:299] + "…" if len(first) > 300 else first,
        ]
        assert len(history[0]["triggeredBy"]) <= 300


def test_a_retry_set_by_hand_is_recorded_as_one() -> None:
    """The retry annotation set by hand restarts a failed rollout with the release's
    change-cause still in place, which that rollout's entry already carries."""
    release = change_cause_value("v2", "release by ci at 2026-12-04T10:00:00.000Z")
    failed = RolloutState("v2", "v1", FAILED, started_at=100.0, failure="refused")
    history = record([], _plan(failed, "RolloutStarted"), 101.0, release)
    again = RolloutState("v2", "v1", BATCHES, started_at=200.0)
    history = record(history, _plan(again, "RolloutRetried", "RolloutStarted"), 201.0, release)
    assert [e["triggeredBy"] for e in history] == [
        RETRY_ANNOTATION,
        "release by ci at 2026-12-04T10:00:00.000Z",
    ]
    retry = change_cause_value("v2", "retry by bob@laptop at 2026-12-04T10:05:00.000Z")
    third = RolloutState("v2", "v1", BATCHES, started_at=300.0)
    history = record(history, _plan(third, "RolloutRetried", "RolloutStarted"), 301.0, retry)
    assert history[0]["triggeredBy"] == "retry by bob@laptop at 2026-12-04T10:05:00.000Z"


def test_every_history_the_operator_writes_is_valid_under_the_crd() -> None:
    """First deployment, a held canary, an abort, a retry, a refused version, a
    superseded one and a rollback: each status as the API server would validate it."""
    schema = ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")
    [example] = [
        d for d in yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text()) if d
    ]
    history: list[dict[str, Any]] = []
    results: set[str] = set()

    def step(cluster: SimCluster, sp: Any, **kw: Any) -> None:
        nonlocal history
        plan = cluster.step(sp, **kw)
        history = record(history, plan, cluster.now, change_cause_value(sp.version, "y" * 400))
        status = build_status(
            plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [], signing_key="k"
        )
        status["history"] = history
        results.update(e["result"] for e in history)
        assert schema.problems({**example, "status": status}) == []

    cluster = SimCluster(4, version=None)
    for _ in range(20):
        step(cluster, spec(version="v1"))
    held = spec(version="v2", canary={"percent": 25, "manualPromote": True})
    for _ in range(10):
        step(cluster, held)
    step(cluster, held, aborted="v2")
    step(cluster, held, retried="v2")
    cluster = SimCluster(4, refuse=frozenset({"v7"}))
    history = []
    for version, steps in (("v7", 40), ("v8", 4), ("v1", 40)):
        for _ in range(steps):
            step(cluster, spec(version=version))
    assert {"Succeeded", "Aborted", "Failed", "Superseded", "Progressing"} <= results


def test_two_rollouts_of_a_version_in_one_second_are_two_entries() -> None:
    """A version refused at once and retried within the second: the retry is a rollout
    of its own (the tools follow it by its entry); an entry written to the second by an
    older operator is still found and finished."""
    refused = RolloutState("v2", "v1", FAILED, started_at=100.1, failure="refused")
    history = record([], _plan(refused, "RolloutStarted"), 100.2, None)
    retried = RolloutState("v2", "v1", CANARY, started_at=100.6)
    history = record(history, _plan(retried, "RolloutRetried", "RolloutStarted"), 100.6, None)
    assert [(e["startedAt"], e["result"]) for e in history] == [
        ("1970-01-01T00:01:40.600Z", "Progressing"),
        ("1970-01-01T00:01:40.100Z", "Failed"),
    ]
    legacy = [{"version": "v2", "startedAt": iso(100.6), "result": "Progressing"}]
    done = record(legacy, _plan(replace(retried, stage=COMPLETE)), 130.0, None)
    assert len(done) == 1 and done[0]["result"] == "Succeeded"


# ------------------------------------------------------------ on a real API server

REPLICAS = 2
WAIT = "240"  # a hang guard: each rollout here takes seconds
SIDECARS = SidecarBehaviour(fetch_s=0.1, load_s=0.2, refuse={"v3": "bad_signature"})


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The chart installed (CRD, the operator's RBAC, the user roles, the sidecar
    admission policy)."""
    install_tools(control_plane)
    install_sidecar_policy(control_plane)
    return control_plane


@pytest.fixture
def namespace(cluster: ControlPlane) -> Iterator[str]:
    with namespace_of_its_own(cluster, "day2") as name:
        yield name


@pytest.fixture
async def admin(cluster: ControlPlane, namespace: str) -> AsyncIterator[Admin]:
    async with Admin.connect(cluster, namespace) as cluster_admin:
        yield cluster_admin


@pytest.fixture
def operator(cluster: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """``python -m model_operator`` as the chart's ServiceAccount, for this namespace."""
    identity = install_chart(cluster)
    started = Operator(identity.kubeconfig, namespace, tmp_path / "operator.log", 0.5).start()
    yield started
    started.stop()


class Day2:
    """The tools as the rollout editor runs them; the deployment as the admin and the
    simulated pods see it."""

    def __init__(
        self, admin: Admin, user: Identity, pods: SimulatedModelContainers, operator: Operator,
        work: Path,
    ) -> None:  # fmt: skip
        self.admin, self.user, self.pods, self.operator, self.work = (
            admin,
            user,
            pods,
            operator,
            work,
        )
        self.keys = make_keys(work / "keys")

    async def release(self, version: str, *extra: str) -> tuple[int, str, str]:
        model = self.work / "release" / version / "model.onnx"
        write_mlp(model, seed=1)
        return await run_tool(
            "model-rollout", "release", "--model", "mlp", "--version", version,
            "--file", str(model), "--key", str(self.keys.private), "--deployment", "mlp",
            "--store", f"file://{self.work / 'store'}", "--kubeconfig",
            str(self.user.kubeconfig), *extra,
        )  # fmt: skip

    async def plugin(self, *args: str) -> tuple[int, str, str]:
        return await run_tool("kubectl-model", *args, "--kubeconfig", str(self.user.kubeconfig))

    def serving(self) -> set[str | None]:
        """What the pods' (simulated) servers serve."""
        prefix = f"{self.admin.namespace}/"
        return {v for name, v in self.pods.serving().items() if name.startswith(prefix)}

    async def status(self) -> dict[str, Any]:
        return dict((await self.admin.read()).get("status") or {})

    async def wait(self, what: str, ready: Any) -> dict[str, Any]:
        """The status once ``ready(status)`` holds; a hang guard with the operator's log."""

        async def poll() -> dict[str, Any]:
            while not ready(status := await self.status()):
                await asyncio.sleep(0.2)
            return status

        try:
            return await asyncio.wait_for(poll(), float(WAIT))
        except asyncio.TimeoutError:
            raise AssertionError(
                f"{what}: {await self.status()}\noperator log:\n{self.operator.log_tail(40)}"
            ) from None


def available(version: str) -> Any:
    return lambda s: (
        s.get("phase") == "Available"
        and s.get("currentVersion") == version
        and s.get("versions") == {version: REPLICAS}
    )


def awaiting_promotion(version: str) -> Any:
    def held(s: dict[str, Any]) -> bool:
        progressing = next((c for c in s.get("conditions", []) if c["type"] == "Progressing"), {})
        return (
            s.get("phase") == "Canary"
            and (s.get("rollout") or {}).get("toVersion") == version
            and progressing.get("reason") == "AwaitingPromotion"
        )

    return held


async def test_release_refusal_retry_promote_rollback_abort_and_history_on_a_real_api(
    cluster: ControlPlane,
    namespace: str,
    admin: Admin,
    operator: Operator,
    node_agents: Any,
    tmp_path: Path,
) -> None:
    """Each step checked in what the simulated servers serve, in the status and in the
    exit code and words of the tool; the history lists all seven rollouts, the events
    one retry and one abort, and the operator cleared every annotation it acted on."""
    pods = node_agents(sidecars=SIDECARS).runtime
    assert isinstance(pods, SimulatedModelContainers)
    user = bound_user(cluster, namespace, "release-bot", EDITOR)
    day2 = Day2(admin, user, pods, operator, tmp_path)
    cluster.kubectl.apply(*model_store_claim(namespace))
    canary = {"percent": 50, "pauseSeconds": 1}
    cluster.kubectl.apply(
        model_deployment(
            namespace, model="mlp", replicas=REPLICAS, canary=canary,
            rollout={"batchSize": 1, "jitterSeconds": 0},
        )
    )  # fmt: skip
    await day2.wait("v1 available", available("v1"))
    assert day2.serving() == {"v1"}

    # a good version: released, rolled out through the canary, exit 0 with a report
    code, out, err = await day2.release("v2", "--wait", "--timeout", WAIT, "-o", "json")
    assert code == 0, (out, err)
    report = json.loads(out)
    assert report["result"] == "Succeeded" and report["currentVersion"] == "v2", report
    assert report["versions"] == {"v2": REPLICAS} and "published mlp:v2" in report["published"]
    assert "Canary" in err  # the progress lines went to stderr, the JSON alone to stdout
    assert day2.serving() == {"v2"}

    # a version the sidecars refuse (its signature): exit 1 with their reason
    code, out, err = await day2.release("v3", "--wait", "--timeout", WAIT, "-o", "json")
    assert code == 1, (out, err)
    report = json.loads(out)
    assert report["result"] == "Failed" and "bad_signature" in report["reason"], report
    await day2.wait("back on v2", lambda s: s.get("versions") == {"v2": REPLICAS})
    assert day2.serving() == {"v2"}

    # retry: the rollout runs again and the sidecar refuses it again
    code, out, err = await day2.plugin("retry", "mlp", "--wait", "--timeout", WAIT)
    assert code == 1 and "Failed" in out and "bad_signature" in out, (out, err)
    assert day2.serving() == {"v2"}

    # promote: a canary held for the annotation, promoted by the plugin
    await admin.patch("mlp", {"spec": {"canary": {"manualPromote": True}}})
    code, out, err = await day2.release("v4", "-o", "json")  # no --wait: started
    assert code == 0 and json.loads(out)["result"] == "Started", (out, err)
    await day2.wait("v4 held at its canary", awaiting_promotion("v4"))
    assert day2.serving() == {"v2", "v4"}
    code, out, err = await day2.plugin("status", "mlp")
    assert code == 0 and "AwaitingPromotion" in out and "kubectl model promote mlp" in out
    code, out, err = await day2.plugin("promote", "mlp", "--wait", "--timeout", WAIT)
    assert code == 0 and "result: Succeeded" in out, (out, err)
    assert day2.serving() == {"v4"}

    # rollback: to the previous Succeeded version, v2
    code, out, err = await day2.plugin("rollback", "mlp", "--wait", "--timeout", WAIT)
    assert code == 0 and "to v2" in out and "result: Succeeded" in out, (out, err)
    assert day2.serving() == {"v2"}

    # the CI job of v2 run again: nothing published or rolled out, exit 0
    code, out, err = await day2.release("v2", "--wait", "--timeout", WAIT, "-o", "json")
    assert code == 0, (out, err)
    report = json.loads(out)
    assert (report["result"], report["reason"]) == ("Succeeded", "already serving v2")
    assert report["published"] is None and "not published again" in err

    # abort: the canary of v5 goes back to the stable version at once
    code, out, err = await day2.release("v5")
    assert code == 0, (out, err)
    await day2.wait("v5 held at its canary", awaiting_promotion("v5"))
    assert day2.serving() == {"v2", "v5"}
    code, out, err = await day2.plugin("abort", "mlp", "--wait", "--timeout", WAIT)
    assert code == 0 and "result: Aborted" in out, (out, err)
    assert day2.serving() == {"v2"}
    status = await day2.status()
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (status["phase"], degraded["reason"]) == ("Degraded", "Aborted")
    code, out, err = await day2.plugin("abort", "mlp")
    assert code == 6 and "nothing to abort" in err, (out, err)

    # the history, most recent first, as the operator kept it
    code, out, err = await day2.plugin("history", "mlp", "-o", "json")
    assert code == 0, err
    history = json.loads(out)
    assert [(e["version"], e["result"]) for e in history] == [
        ("v5", "Aborted"),
        ("v2", "Succeeded"),
        ("v4", "Succeeded"),
        ("v3", "Failed"),
        ("v3", "Failed"),
        ("v2", "Succeeded"),
        ("v1", "Succeeded"),
    ], json.dumps(history, indent=1)
    causes = [e["triggeredBy"] for e in history]
    assert causes[0].startswith("release by") and causes[1].startswith("rollback by")
    assert causes[3].startswith("retry by") and causes[-1] == "spec.version edit"
    assert all(e.get("finishedAt") for e in history)
    code, out, err = await day2.plugin("history", "mlp")
    assert code == 0 and "Aborted" in out and "rollback by" in out

    events = await admin.events()
    reasons = [e.get("reason") for e in events]
    assert reasons.count("RolloutRetried") == 1 and reasons.count("RolloutAborted") == 1
    assert "AbortIgnored" not in reasons and "RetryIgnored" not in reasons
    acted = {PROMOTE, ABORT, RETRY}
    annotations = (await admin.read())["metadata"].get("annotations") or {}
    assert not acted & set(annotations), annotations  # each cleared once acted on
    log = operator.log_path.read_text()
    assert "Traceback" not in log and "forbidden" not in log.lower(), log[-3000:]
