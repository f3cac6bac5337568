"""What the three programs share about canary analysis: the traffic policy the operator
puts on canary pods (the sidecar relays it to its server), the request header that pins
a version, the per-version metric names the server exports and the operator reads, and
the golden set's file format.

Traffic policy, as the operator writes it on a canary pod (``TRAFFIC_POLICY``)::

    {"stable": "v1", "candidate": "v2", "trafficPercent": 10, "shadowPercent": 20}

The pod's target version is the candidate (the sidecar fetches and loads it as usual);
its server keeps the stable version loaded beside it and, under this policy, answers
``trafficPercent`` % of requests (chosen per request) from the candidate and the rest
from the stable one; of the requests answered by the stable version, ``shadowPercent`` %
are also run on the candidate after the answer is sent, and the two outputs compared.
Without a policy the server answers from its serving version, as always.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .annotations import DOMAIN
from .names import check_name

TRAFFIC_POLICY = f"{DOMAIN}/traffic"  # pod annotation, operator -> sidecar -> server
PIN_HEADER = "X-Model-Version"  # a request header naming a loaded version answers from it


class InvalidPolicy(ValueError):
    """A traffic policy that is not valid JSON of the documented shape."""


def _percent(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
        raise InvalidPolicy(f"{key} must be a whole number from 0 to 100, not {value!r}")
    return value


@dataclass(frozen=True)
class TrafficPolicy:
    stable: str
    candidate: str
    traffic_percent: int = 0  # share of requests answered by the candidate
    shadow_percent: int = 0  # share of the stable answers also run on the candidate

    def __post_init__(self) -> None:
        check_name("version", self.stable)
        check_name("version", self.candidate)
        for name in ("traffic_percent", "shadow_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise InvalidPolicy(f"{name} must be from 0 to 100")

    def to_json(self) -> dict[str, Any]:
        return {
            "stable": self.stable,
            "candidate": self.candidate,
            "trafficPercent": self.traffic_percent,
            "shadowPercent": self.shadow_percent,
        }

    def to_annotation(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: object) -> TrafficPolicy:
        if not isinstance(raw, dict):
            raise InvalidPolicy(f"a traffic policy is a JSON object, not {type(raw).__name__}")
        stable, candidate = raw.get("stable"), raw.get("candidate")
        if not isinstance(stable, str) or not isinstance(candidate, str):
            raise InvalidPolicy("a traffic policy names its stable and candidate versions")
        try:
            return cls(
                stable, candidate, _percent(raw, "trafficPercent"), _percent(raw, "shadowPercent")
            )
        except ValueError as exc:
            raise InvalidPolicy(str(exc)) from exc

    @classmethod
    def from_annotation(cls, text: str) -> TrafficPolicy:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise InvalidPolicy(f"traffic policy is not JSON: {exc}") from exc
        return cls.from_json(raw)


# --- per-version metrics: the server exports them, the operator reads /metrics ----------
# named as Prometheus asks (the server's prefix model_server_, units, _total on counters
# only: tests/contract/test_metric_names.py); docs/metrics.md lists the names they replaced
# every series is labelled {model, version}; counters are cumulative since the version
# was loaded, so analysis works on the difference between two scrapes
# + label code: "200", "400", "500", ...; a shadow run counts too (200, 500 when the
# candidate failed, or the 4xx a live request would have had: over the candidate's own
# bounds, inputs its kernels' shape checks refuse), as one of SHADOW_REQUESTS: live
# answers are the difference (both are counted when the run ends, so a run in flight
# counts in neither). Analysis counts only 5xx as the version's failures: a 4xx is the
# client's (the server maps the runtime's shape and argument errors to 400)
REQUESTS = "model_server_version_requests_total"
LATENCY = "model_server_version_request_duration_seconds"  # histogram
# histogram: the engine's own time per run of one request, live or shadow (no queueing,
# no JSON): what a shadowed candidate's SHADOW_LATENCY is compared with, since a shadow
# run has no request. A run of several requests batched together (dynamic batching) is
# not observed: its time is that of all their rows, not like one shadow run; with every
# request batched the stable version has no engine time and latency is not judged
# (a batch of one request, or a request run alone after its batch failed, counts)
ENGINE_LATENCY = "model_server_version_engine_duration_seconds"
OUTPUT_VALUES = "model_server_version_output_values_total"  # output values seen
OUTPUT_NONFINITE = "model_server_version_output_nonfinite_total"  # of which NaN or ±Inf
OUTPUT_SUM = "model_server_version_output_sum_of_values"  # sum of the finite values
OUTPUT_SQUARES = "model_server_version_output_squares_total"  # sum of their squares
SHADOW_REQUESTS = "model_server_shadow_requests_total"  # requests mirrored to the candidate
# histogram: per request, max |stable - candidate|, in the model's own output units
SHADOW_DRIFT = "model_server_shadow_drift_output_units"
SHADOW_ARGMAX_COMPARED = "model_server_shadow_argmax_compared_total"  # class-score outputs
SHADOW_ARGMAX_AGREED = "model_server_shadow_argmax_agreed_total"  # of which the argmax agreed
SHADOW_LATENCY = "model_server_shadow_duration_seconds"  # histogram: the candidate's time
DRIFT_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a drift beyond the last bucket (NaN, a shape mismatch, anything huge) reads as that
# bucket's bound, as histogram_quantile does: a threshold must lie below it to ever fail
MAX_DRIFT_THRESHOLD = DRIFT_BUCKETS[-2]

# --- golden set ------------------------------------------------------------------------
# ``golden.npz`` beside the model, named (with its sha256 and size) by the signed
# manifest: arrays "input/<name>" (a batch of inputs), "output/<name>" (what the
# version must answer) and optional scalars "atol" and "rtol" (numpy.allclose's; default
# 1e-5 and 1e-4). A version whose answers fall outside is refused: 422 golden_mismatch.
GOLDEN_FILE = "golden.npz"
MAX_GOLDEN_BYTES = 256 << 20  # larger golden sets are refused (publish and fetch)
GOLDEN_INPUT_PREFIX = "input/"
GOLDEN_OUTPUT_PREFIX = "output/"
GOLDEN_DEFAULT_ATOL = 1e-5
GOLDEN_DEFAULT_RTOL = 1e-4
