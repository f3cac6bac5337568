"""The e2e harness's in-process operator: what it died of reaches the test."""

from __future__ import annotations

import sys

import pytest

from model_operator.config import OperatorConfig
from model_rollout_e2e.processes import OperatorThread


def test_an_operator_that_cannot_even_be_imported_fails_the_test_at_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator is imported on its thread (so the server's benches run where its
    dependencies are not installed): an import error there must still reach ``stop``,
    not leave a thread that died quietly and a test that passes."""
    monkeypatch.setitem(sys.modules, "model_operator.cli", None)  # import raises
    thread = OperatorThread(OperatorConfig()).start()
    with pytest.raises(RuntimeError, match="failed") as failure:
        thread.stop(timeout_s=10)
    assert isinstance(failure.value.__cause__, ImportError)
