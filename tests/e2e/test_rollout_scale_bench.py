"""The scale benchmark (``bench/rollout_scale.py``) in small: 20 simulated pods of 2
ModelDeployments on the session's real control plane, rolled v1→v2 and back by the
operator as the chart runs it. Its figures are the API server's counts, so they are
checked for what the structure allows, never for time: no write while idle; in a
rollout, a pod is written at most 5 times (the operator's target, the sidecar's reports:
fetching, loading, ok) and each ModelDeployment's status at most once per pod and step."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.scale_run import ScaleSettings, run_scale

pytestmark = pytest.mark.slow  # a whole operator and node: not in make test-fast


def test_a_small_scale_run_is_counted_and_within_the_targets(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    # idle windows longer than the resync: a pass at the resync writes nothing either
    settings = ScaleSettings(
        pods=20, deployments=2, idle_s=25.0, settle_s=3.0, timeout_s=240, interval_s=10.0
    )
    report = run_scale(tmp_path, settings, control_plane)
    idle, forward, back, idle_after = report["windows"]
    for rollout in (forward, back):
        # every pod's target is set, and its sidecar reports at least once
        assert rollout["pod_writes"] >= 2 * settings.pods, rollout["by_writer"]
        assert rollout["pod_writes"] <= 5 * settings.pods, rollout["by_writer"]
        assert settings.deployments <= rollout["md_status_writes"] <= 2 * settings.pods + 10
        assert rollout["operator_cpu_s"] > 0
    for window in (idle, idle_after):
        assert window["writes"] == 0, window["by_writer"]
