"""``kubectl model status`` shows the canary's step (issue 31): shadow, where the candidate
answers only mirrored requests, then live; with the analysis' checks beside it, in the
text view and in ``-o json``."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone
from typing import Any

import pytest

from model_rollout_cli.commands import Follow, promote, status_json
from model_rollout_cli.overview import list_row
from model_rollout_cli.view import render

NOW = datetime(2026, 12, 3, 9, 0, 0, tzinfo=timezone.utc)
SHADOW_RESULT = "passed at check 2 (0 failed): 120 requests (0 live, 120 shadowed)"


def resource(rollout: dict[str, Any], phase: str = "Canary", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "mlp", "namespace": "ml", "generation": 4},
        "spec": {"model": "mlp", "version": "v3", "replicas": 4},
        "status": {
            "phase": phase,
            "observedGeneration": 4,
            "currentVersion": "v2",
            "targetVersion": "v3",
            "rollout": {"toVersion": "v3", "fromVersion": "v2", "startedAt": 1e9, **rollout},
            **status,
        },
    }


def lines(md: dict[str, Any]) -> list[str]:
    return render(md, [], [], NOW).splitlines()


def test_the_shadow_step_and_its_checks_are_shown() -> None:
    md = resource(
        {"stage": "canary", "canaryStep": "shadow"},
        message="canary step shadow: v3 answers only mirrored requests",
        analysis={"lastResult": "Inconclusive", "checks": 1, "failures": 0, "message": "few"},
    )
    shown = lines(md)
    at = shown.index(
        "Canary step: shadow (the candidate answers only mirrored requests; live after a"
        " passed check)"
    )
    assert shown[at + 1] == "Analysis:    Inconclusive (1 checks, 0 failed): few"
    assert "Message:     canary step shadow: v3 answers only mirrored requests" in shown
    raw = json.loads(status_json(md, [], []))
    assert raw["status"]["rollout"]["canaryStep"] == "shadow"


def test_the_live_step_says_how_the_shadow_step_went() -> None:
    md = resource(
        {"stage": "canary", "canaryStep": "live", "shadowResult": SHADOW_RESULT},
        analysis={"lastResult": "Passed", "checks": 3, "failures": 0, "message": "ok"},
    )
    assert f"Canary step: live (shadow step {SHADOW_RESULT})" in lines(md)
    raw = json.loads(status_json(md, [], []))
    assert raw["status"]["rollout"]["shadowResult"] == SHADOW_RESULT


def test_a_canary_rolled_back_in_its_shadow_step_says_no_user_saw_the_candidate() -> None:
    md = resource({"stage": "failed", "canaryStep": "shadow", "rolledBack": True}, phase="Degraded")
    assert (
        "Canary step: shadow (rolled back in this step; no user got an answer of the candidate)"
        in lines(md)
    )
    live = resource(
        {"stage": "failed", "canaryStep": "live", "shadowResult": SHADOW_RESULT,
         "rolledBack": True},
        phase="Degraded",
    )  # fmt: skip
    assert "Canary step: live (rolled back in this step)" in lines(live)


def test_no_step_is_shown_without_a_shadow_step_or_once_the_canary_is_over() -> None:
    for rollout in (
        {"stage": "canary", "canaryStep": "live"},  # live from the start
        {"stage": "canary"},  # written by an operator before steps
        {"stage": "batches", "canaryStep": "live", "shadowResult": SHADOW_RESULT},
        {"stage": "failed", "canaryStep": "shadow"},  # a load refused: not a rollback
        # aborted in the batches (a batch ran): no canary step was rolled back
        {
            "stage": "failed",
            "canaryStep": "live",
            "shadowResult": SHADOW_RESULT,
            "rolledBack": True,
            "aborted": True,
            "batch": 2,
        },
    ):
        assert not any(line.startswith("Canary step:") for line in lines(resource(rollout)))


class OneResource:
    """The cluster as ``promote`` sees it: one resource, and the patches written to it."""

    def __init__(self, md: dict[str, Any]) -> None:
        self.md = md
        self.patches: list[dict[str, Any]] = []

    def get(self, name: str) -> dict[str, Any]:
        return self.md

    def patch(self, name: str, body: dict[str, Any]) -> None:
        self.patches.append(body)


@pytest.mark.parametrize("full", [False, True])
def test_a_promote_in_the_shadow_step_says_what_it_does(full: bool) -> None:
    """A promote read in the shadow step approves (the checks still decide), and
    ``--full`` skips the shadow step unchecked: the command says so, not 'promoted'."""
    md = resource({"stage": "canary", "canaryStep": "shadow"})
    md["spec"]["canary"] = {"percent": 25, "manualPromote": True}
    out = io.StringIO()
    code = promote(OneResource(md), "mlp", Follow(out=out), full=full)  # type: ignore[arg-type]
    said = out.getvalue()
    assert code == 0 and len(said.splitlines()) == 1, said
    if full:
        assert "fully promoted" in said and "shadow step skipped with no check passed" in said
    else:
        assert "canary of v3 approved" in said and "promoted" not in said.split("(")[0], said


@pytest.mark.parametrize("full", [False, True])
def test_promote_during_an_image_change_promotes_the_pod_template_rollout(full: bool) -> None:
    """An image change is a rollout of the pod template: ``promote`` writes that rollout's
    id (its canary, or ``--full`` every pod), not a version's."""
    md = resource({"stage": "complete"})
    md["spec"]["canary"] = {"percent": 25, "manualPromote": True}
    md["status"]["templateRollout"] = {
        "kind": "template", "stage": "canary", "to": {"deployment": "mlp-0123456789"},
        "promoteWith": "mlp-0123456789@1700000000",
    }  # fmt: skip
    cluster = OneResource(md)
    out = io.StringIO()
    code = promote(cluster, "mlp", Follow(out=out), full=full)  # type: ignore[arg-type]
    value = "mlp-0123456789@1700000000" + ("+full" if full else "")
    assert code == 0 and cluster.patches == [
        {"metadata": {"annotations": {"serving.model-rollout.io/promote": value}}}
    ]
    assert "pod template rollout to mlp-0123456789" in out.getvalue()


def test_status_shows_the_template_rollout_and_its_own_promote_value() -> None:
    """A template canary awaiting its promotion: the command to run names the template
    rollout's id, not a version's (which the operator would ignore); a malformed
    templateRollout is shown as unknown, never a crash."""
    md = resource({"stage": "complete"})
    md["status"]["conditions"] = [
        {"type": "Progressing", "status": "True", "reason": "AwaitingPromotion"}
    ]
    md["status"]["templateRollout"] = {
        "kind": "template", "stage": "canary", "wanted": 1,
        "from": {"deployment": "mlp"}, "to": {"deployment": "mlp-0123456789"},
        "promoteWith": "mlp-0123456789@1700000000",
    }  # fmt: skip
    shown = lines(md)
    assert "Template:    mlp -> mlp-0123456789   (canary, 1 pods wanted; an image change)" in shown
    [promote_line] = [line for line in shown if line.startswith("Promote:")]
    assert promote_line.endswith("(serving.model-rollout.io/promote=mlp-0123456789@1700000000)")
    md["status"]["templateRollout"] = {"from": "x", "to": ["y"]}
    assert any(line.startswith("Template:    - -> -") for line in lines(md))


def test_a_template_canarys_analysis_is_shown_as_the_template_canarys() -> None:
    """A template canary's analysis (``status.analysis``, kind template) is the ANALYSIS
    column of ``kubectl model list`` and the Analysis line, which says whose it is."""
    md = resource({"stage": "complete"})
    md["status"]["templateRollout"] = {
        "kind": "template", "stage": "canary", "wanted": 1,
        "from": {"deployment": "mlp"}, "to": {"deployment": "mlp-0123456789"},
    }  # fmt: skip
    md["status"]["analysis"] = {
        "kind": "template", "lastResult": "Failed", "checks": 2, "failures": 1, "message": "slow",
    }  # fmt: skip
    assert "Analysis:    pod template canary: Failed (2 checks, 1 failed): slow" in lines(md)
    assert "Failed" in list_row(md, NOW, namespaces=False)
