"""Canary analysis as pure functions: when a check is due, what a check concludes from
the figures, and the analysis' state, kept in ``.status.analysis`` so that a restarted
operator continues where the last one stopped (the last scrape included).

A check judges the figures of one interval: fewer than ``minRequests`` of the
candidate's requests (live and shadowed) is *inconclusive*, which is not a failure and
keeps the interval's start, so the next check sees a longer interval; otherwise it
*fails* when any threshold is crossed and *passes* when none is. The I/O (scraping the
pods, asking Prometheus) is :mod:`.analysis_sources`; the decisions the results lead
to (promote, hold, roll back) are the planner's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from .canary_metrics import Figures, Snapshot, figures, increase
from .spec import AnalysisSpec

# the two sides of a template canary's figures (one version on two pod templates' pods),
# in place of a version canary's two versions
STABLE_GROUP = "stable"
CANDIDATE_GROUP = "candidate"


class Result(str, Enum):
    """``status.analysis.lastResult`` (the printer column ANALYSIS)."""

    PASSED = "Passed"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


@dataclass(frozen=True)
class Check:
    result: Result
    message: str


@dataclass(frozen=True)
class Sample:
    """What the operator read at ``at``: a scrape of the pods, figures from Prometheus
    over the interval, or why nothing could be read."""

    at: float
    snapshot: Snapshot | None = None
    figures: Figures | None = None
    problem: str | None = None


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}ms"


def describe(f: Figures) -> str:
    """Every figure of a check, for the condition message and the Event."""
    parts = [
        f"{f.requests} requests ({f.live_requests} live, {f.shadow_requests} shadowed)",
        "error rate n/a"
        if f.error_rate is None
        else f"error rate {f.error_rate:.2%} ({f.errors} 5xx)",
        f"p99 {_ms(f.candidate_p99)} vs stable {_ms(f.stable_p99)} ("
        + ("" if f.latency_ratio is None else f"x{f.latency_ratio:.2f}, ")
        + f"{f.latency_basis})",
        f"non-finite outputs {f.non_finite}",
    ]
    if f.drift_p99 is not None:
        parts.append(f"drift p99 {f.drift_p99:.3g}")
    if f.argmax_agreement is not None:
        parts.append(f"argmax agreement {f.argmax_agreement:.2%}")
    return ", ".join(parts)


def judge(f: Figures, spec: AnalysisSpec, seconds: float) -> Check:
    """One check of the figures of the last ``seconds``."""
    shown = describe(f)
    if f.requests < spec.min_requests:
        return Check(
            Result.INCONCLUSIVE,
            f"{f.requests} requests of the candidate in {seconds:.0f}s, fewer than minRequests"
            f" {spec.min_requests}: {shown}",
        )
    crossed = []
    if f.error_rate is not None and f.error_rate > spec.max_error_rate:
        crossed.append(f"error rate {f.error_rate:.2%} > {spec.max_error_rate:.2%}")
    if f.latency_ratio is not None and f.latency_ratio > spec.max_latency_ratio:
        crossed.append(
            f"p99 latency x{f.latency_ratio:.2f} > x{spec.max_latency_ratio:g} ({f.latency_basis})"
        )
    if f.non_finite > spec.max_non_finite:
        crossed.append(f"non-finite outputs {f.non_finite} > {spec.max_non_finite}")
    drift, agreement = spec.max_output_drift, spec.min_argmax_agreement
    if drift is not None and f.drift_p99 is not None and f.drift_p99 > drift:
        crossed.append(f"drift p99 {f.drift_p99:.3g} > {drift:g}")
    if agreement is not None and f.argmax_agreement is not None and f.argmax_agreement < agreement:
        crossed.append(f"argmax agreement {f.argmax_agreement:.2%} < {agreement:.2%}")
    if crossed:
        return Check(Result.FAILED, f"{'; '.join(crossed)} ({shown})")
    if f.engine_time and f.candidate_p99 is not None and f.stable_p99 is None:
        # the stable version ran only in batches (their engine time is not a request's):
        # a slow candidate would pass unjudged, so this interval proves nothing
        return Check(
            Result.INCONCLUSIVE,
            "no run of the stable version alone to compare the shadow runs' engine time "
            f"with (dynamic batching ran every request in a batch): {shown}",
        )
    return Check(Result.PASSED, shown)


@dataclass(frozen=True)
class AnalysisState:
    """One canary's analysis. ``rollout``: the rollout's promotion token, so that an
    analysis never carries over to another rollout."""

    rollout: str
    window_start: float  # the interval being measured began here
    next_check_at: float
    checks: int = 0
    failures: int = 0
    last_result: Result | None = None
    message: str = ""
    at: float | None = None  # when the last check was made
    baseline: Snapshot | None = None  # the last scrape (scraping only; None: none yet)
    inconclusive: int = 0  # inconclusive checks in a row
    # since when no check concluded: the analysis' start, or its last passed or failed check
    undecided_since: float | None = None

    @classmethod
    def start(cls, rollout: str, now: float, spec: AnalysisSpec) -> AnalysisState:
        """Scraping begins with a baseline at once; Prometheus has the history and is
        first asked one interval later."""
        first = now + spec.interval_seconds if spec.prometheus is not None else now
        return cls(rollout, now, first, message="waiting for the first check", undecided_since=now)

    def restart_window(self, now: float, spec: AnalysisSpec) -> AnalysisState:
        """The canary's pods changed: measure afresh (the counts so far stand). The last
        verdict does not: it judged other pods, and must not promote these. Nor does the
        clock of inconclusive checks restart: a canary whose pods keep changing must still
        conclude."""
        fresh = AnalysisState.start(self.rollout, now, spec)
        return replace(fresh, checks=self.checks, failures=self.failures,
                       last_result=None, message=self.message, at=self.at,
                       inconclusive=self.inconclusive,
                       undecided_since=self.undecided_since)  # fmt: skip

    def due(self, now: float) -> bool:
        return now >= self.next_check_at

    def advance(
        self, sample: Sample, spec: AnalysisSpec, stable: str, candidate: str
    ) -> tuple[AnalysisState, Check | None]:
        """The state after ``sample``, and the check it made (``None``: it was the
        baseline every later scrape is compared with)."""
        next_at = sample.at + spec.interval_seconds
        if sample.problem is None and sample.snapshot is not None and self.baseline is None:
            return replace(self, baseline=sample.snapshot, window_start=sample.at,
                           next_check_at=next_at), None  # fmt: skip
        seconds = sample.at - self.window_start
        if sample.problem is not None:
            check = Check(Result.INCONCLUSIVE, f"could not read the figures: {sample.problem}")
        else:
            measured = sample.figures
            if measured is None:
                assert sample.snapshot is not None and self.baseline is not None
                measured = figures(increase(self.baseline, sample.snapshot), stable, candidate)
            check = judge(measured, spec, seconds)
        state = replace(
            self,
            next_check_at=next_at,
            checks=self.checks + 1,
            failures=self.failures + (check.result is Result.FAILED),
            last_result=check.result,
            message=check.message,
            at=sample.at,
            inconclusive=self.inconclusive + 1,
        )
        if check.result is not Result.INCONCLUSIVE:  # a judged interval: the next one starts
            state = replace(state, window_start=sample.at, baseline=sample.snapshot,
                            inconclusive=0, undecided_since=sample.at)  # fmt: skip
        return state, check

    def undecided(self, spec: AnalysisSpec, deadline_seconds: float) -> str | None:
        """Why the analysis has gone on too long without concluding, or ``None``: the
        last check was inconclusive, and the ``inconclusiveLimit``-th in a row, or no check
        concluded for ``deadline_seconds`` (no traffic, the figures unreadable)."""
        if self.inconclusive == 0 or self.at is None:
            return None
        limit = spec.inconclusive_limit
        if limit is not None and self.inconclusive >= limit:
            return f"{self.inconclusive} inconclusive checks in a row (inconclusiveLimit {limit})"
        since = self.window_start if self.undecided_since is None else self.undecided_since
        if self.at - since >= deadline_seconds:
            return (
                f"no check concluded in {self.at - since:.0f}s ({self.inconclusive} "
                f"inconclusive in a row; deadline {deadline_seconds:.0f}s)"
            )
        return None

    def to_status(self) -> dict[str, Any]:
        """``status.analysis`` but for ``at`` (:mod:`.status` writes the time for people):
        the verdict, then the bookkeeping a restarted operator continues from."""
        out: dict[str, Any] = {
            "message": self.message,
            "checks": self.checks,
            "failures": self.failures,
            "rollout": self.rollout,
            "windowStart": self.window_start,
            "nextCheckAt": self.next_check_at,
            "inconclusiveChecks": self.inconclusive,
        }
        if self.undecided_since is not None:
            out["undecidedSince"] = self.undecided_since
        if self.last_result is not None:
            out["lastResult"] = str(self.last_result)
        if self.at is not None:
            out["checkedAt"] = self.at
        if self.baseline is not None:
            out["baseline"] = self.baseline
        return out

    @classmethod
    def from_status(cls, raw: Any) -> AnalysisState | None:
        """What :meth:`to_status` wrote, or ``None`` for a missing or foreign one."""
        if not isinstance(raw, dict) or not isinstance(raw.get("rollout"), str):
            return None
        try:
            result = raw.get("lastResult")
            at = raw.get("checkedAt")
            since = raw.get("undecidedSince")
            return cls(
                rollout=raw["rollout"],
                window_start=float(raw["windowStart"]),
                next_check_at=float(raw["nextCheckAt"]),
                checks=int(raw.get("checks", 0)),
                failures=int(raw.get("failures", 0)),
                last_result=None if result is None else Result(result),
                message=str(raw.get("message", "")),
                at=None if at is None else float(at),
                baseline=_snapshot(raw.get("baseline")),
                inconclusive=int(raw.get("inconclusiveChecks", 0)),
                undecided_since=None if since is None else float(since),
            )
        except (KeyError, TypeError, ValueError):
            return None


def last_check_passed(analysis: AnalysisState | None) -> bool:
    """Whether a canary's last check passed: what its end (or a promotion) waits for."""
    return analysis is not None and analysis.last_result is Result.PASSED


def verdict_of(analysis: AnalysisState | None) -> str:
    """A canary's analysis so far, for a status message."""
    if analysis is None or analysis.last_result is None:
        return "waiting for the first check"
    a = analysis
    return f"{a.last_result} ({a.checks} checks, {a.failures} failed): {a.message}"


def _snapshot(raw: Any) -> Snapshot | None:
    """A baseline read back from the status; one of the wrong shape is no baseline (the
    next scrape becomes one)."""
    if not isinstance(raw, dict):
        return None
    out: Snapshot = {}
    for pod, versions in raw.items():
        if not isinstance(versions, dict):
            return None
        out[pod] = {}
        for version, series in versions.items():
            if not isinstance(series, dict):
                return None
            out[pod][version] = {str(k): float(v) for k, v in series.items()}
    return out
