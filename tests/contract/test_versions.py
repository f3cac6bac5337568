"""The one version order (model_rollout_contract/versions.py): PEP 440 where every
version compared is one, SemVer where every one is that, else only a history orders."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from packaging.version import Version

from model_rollout_contract.versions import (
    is_ordered,
    newest,
    predecessor,
    rule,
    semver,
    sorted_versions,
)

# semver.org's own example of precedence, oldest first (spec item 11)
SEMVER_SPEC = [
    "1.0.0-alpha",
    "1.0.0-alpha.1",
    "1.0.0-alpha.beta",
    "1.0.0-beta",
    "1.0.0-beta.2",
    "1.0.0-beta.11",
    "1.0.0-rc.1",
    "1.0.0",
]
SHAS = ["9f2c1e7", "03b1d4a", "e5a0c2f", "77aa01b"]


@pytest.mark.parametrize(
    "ordered",
    [
        ["1.9.0", "1.10.0-rc1", "1.10.0", "1.10.1"],  # the case: rc before release
        ["v1.2.3-alpha.1", "v1.2.3-beta", "v1.2.3"],
        ["v1", "v2", "v9", "v10"],
        ["1.0.dev1", "1.0a1", "1.0b2", "1.0rc1", "1.0", "1.0.post1"],
        ["2026.1.2", "2026.11.30"],
        SEMVER_SPEC,
        ["v1.0.0-alpha.beta", "v1.0.0"],  # SemVer only (not PEP 440), with a v
    ],
)
def test_versions_as_people_write_them(ordered: list[str]) -> None:
    shuffled = random.Random(0).sample(ordered, len(ordered))
    assert sorted_versions(shuffled) == ordered
    assert newest(shuffled) == ordered[-1]
    assert predecessor(shuffled, ordered[-1]) == ordered[-2]


def test_the_rc_is_not_the_predecessor_of_its_release_but_the_one_before() -> None:
    """What the init container pre-pulls as previous for 1.10.0."""
    assert predecessor(["1.9.0", "1.10.0-rc1"], "1.10.0") == "1.10.0-rc1"
    assert predecessor(["1.9.0", "1.10.0"], "1.10.0-rc1") == "1.9.0"


def test_git_shas_have_no_order_but_the_history() -> None:
    assert not is_ordered(SHAS)
    assert newest(SHAS) is None  # no SHA is newer than another
    assert predecessor(SHAS, SHAS[2]) is None
    history = ["e5a0c2f", "03b1d4a", "77aa01b", "9f2c1e7"]  # publish order, oldest first
    assert is_ordered(SHAS, history)
    assert sorted_versions(SHAS, history) == history
    assert newest(SHAS, history) == "9f2c1e7"
    assert predecessor(SHAS, "77aa01b", history) == "03b1d4a"
    assert predecessor(SHAS, "e5a0c2f", history) is None


def test_one_version_without_a_rule_orders_the_whole_set_by_history() -> None:
    """1.0 and 2.0 are PEP 440, but ``hotfix`` is not: the comparison has no rule."""
    versions = ["2.0", "hotfix", "1.0"]
    history = ["1.0", "hotfix", "2.0"]
    assert sorted_versions(versions, history) == history
    assert predecessor(versions, "2.0", history) == "hotfix"
    assert newest(versions) is None
    assert newest(["2.0", "1.0"]) == "2.0"


def test_versions_the_history_does_not_name_are_never_the_newest() -> None:
    assert sorted_versions(["aaa", "zzz", "mmm"], ["zzz"]) == ["aaa", "mmm", "zzz"]
    assert newest(["aaa", "zzz", "mmm"], ["zzz"]) is None  # aaa and mmm are not ordered
    assert predecessor(["aaa", "zzz"], "mmm", ["zzz"]) is None


def test_a_version_rolled_out_again_keeps_its_first_place_in_the_history() -> None:
    assert sorted_versions(["b", "a"], ["a", "b", "a"]) == ["a", "b"]


pep440_versions = st.builds(
    lambda release, pre, post, dev, v: (
        ("v" if v else "")
        + ".".join(map(str, release))
        + (f"{pre[0]}{pre[1]}" if pre else "")
        + (f".post{post}" if post is not None else "")
        + (f".dev{dev}" if dev is not None else "")
    ),
    st.lists(st.integers(0, 30), min_size=1, max_size=4),
    st.none() | st.tuples(st.sampled_from(["a", "b", "rc", "-rc", "-alpha."]), st.integers(0, 20)),
    st.none() | st.integers(0, 5),
    st.none() | st.integers(0, 5),
    st.booleans(),
)
semver_ids = st.from_regex(r"\A(0|[1-9][0-9]{0,2}|[a-z][a-z0-9-]{0,5})\Z")
semver_versions = st.builds(
    lambda core, pre: ".".join(map(str, core)) + ("-" + ".".join(pre) if pre else ""),
    st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
    st.lists(semver_ids, max_size=3),
)
free_text = st.from_regex(r"\A[0-9a-f]{7}\Z") | st.from_regex(r"\A[a-z][a-z0-9_.-]{0,10}\Z")


@given(st.lists(pep440_versions, min_size=1, max_size=8))
def test_pep440_versions_sort_as_packaging_reads_them(versions: list[str]) -> None:
    ordered = sorted_versions(versions)
    assert sorted(set(versions)) == sorted(ordered)
    assert [Version(v) for v in ordered] == sorted(Version(v) for v in ordered)
    assert sorted_versions(reversed(versions)) == ordered  # input order plays no part


@given(st.lists(semver_versions, min_size=1, max_size=8))
def test_a_semver_release_is_newer_than_its_pre_releases(versions: list[str]) -> None:
    # where every one is PEP 440 too, PEP 440 decides (1.2.3-1 is its post-release)
    assume(rule(versions) is semver)
    ordered = sorted_versions(versions)
    assert sorted_versions(reversed(versions)) == ordered
    for v in ordered:
        core = v.split("-", 1)[0]
        if core in ordered and core != v:  # a pre-release and its release
            assert ordered.index(v) < ordered.index(core)
        assert predecessor(ordered, v) == (
            ordered[ordered.index(v) - 1] if ordered.index(v) else None
        )


@given(st.lists(free_text | pep440_versions, min_size=2, max_size=8, unique=True), st.randoms())
def test_without_a_rule_the_history_is_the_order(versions: list[str], rng: random.Random) -> None:
    assume(not is_ordered(versions))  # not every one happened to follow a rule
    history = rng.sample(versions, len(versions))
    assert sorted_versions(versions, history) == history
    assert newest(versions, history) == history[-1]
    assert newest(versions) is None
    for i, v in enumerate(history):
        assert predecessor(versions, v, history) == (history[i - 1] if i else None)


def test_the_predecessor_is_judged_by_the_rule_of_all_the_versions() -> None:
    """Found by the property test: 0.0.0 and 0.0.0-0 alone are PEP 440 (0.0.0-0 its
    post-release, the newer), but beside 0.0.1-0.0 (SemVer only) the rule is SemVer's,
    where 0.0.0-0 is 0.0.0's pre-release: the older of the two."""
    ordered = ["0.0.0-0", "0.0.0", "0.0.1-0.0"]
    assert sorted_versions(reversed(ordered)) == ordered
    assert predecessor(ordered, "0.0.1-0.0") == "0.0.0"
