"""The control socket between the sidecar and the server of one pod: one JSON object per
line each way, a reply for every request. Both ends build and read these classes.

Requests::

    {"op": "load", "model": "m", "version": "v2", "path": "/models/m/v2/model.onnx",
     "sha256": "<hex>"}
    {"op": "load", ..., "stable": "v1", "candidate": "v2", "traffic_percent": 10,
     "shadow_percent": 20}          (a canary's load: the policy is set with the swap)
    {"op": "rollback", "model": "m", "version": "v1"}     (version optional)
    {"op": "status", "model": "m"}
    {"op": "traffic", "model": "m", "stable": "v1", "candidate": "v2",
     "traffic_percent": 10, "shadow_percent": 20}    (candidate null: no policy)

Replies::

    {"ok": true, "model": "m", "from": "v1", "to": "v2", "duration_ms": 812.5,
     "instant": false, "stages_ms": {"read": 6.1, ...}}        (load, rollback; stages
                                                     only when a version was loaded)
    {"ok": true, "model": "m", "version": "v2", "sha256": "<hex>", "loaded": ["v1", "v2"],
     "policy": {"stable": "v1", "candidate": "v2", "trafficPercent": 10,
                "shadowPercent": 20}}    (status, traffic; "policy" null: none held)
    {"ok": false, "error": "why", "code": "load_refused"}

:func:`exchange` is the one client exchange (a request, its reply line) both the sidecar
and the server's pool relay use; how it failed is one of its typed errors (as httpx's
``_exceptions.py``), which each caller maps to its own codes::

    ControlExchangeError
    ├── ControlUnreachable    nobody listens: no socket file, or the connection refused
    ├── ControlDenied         no permission on the socket, not a socket, a path too long
    ├── ControlClosed         the connection dropped, or closed without a reply
    └── ControlLineTooLong    a reply line over MAX_LINE bytes
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .canary import InvalidPolicy, TrafficPolicy
from .names import InvalidName, check_model_key, check_name

MAX_LINE = 64 * 1024  # bytes in one message, newline included
_MAX_SHOWN = 200  # characters of a bad value quoted in an error: replies stay short


class ProtocolError(ValueError):
    """A line that is not a valid message of this protocol."""


def _shown(text: str) -> str:
    """``text`` cut in the middle to at most about ``_MAX_SHOWN`` characters."""
    half = _MAX_SHOWN // 2
    return text if len(text) <= _MAX_SHOWN else f"{text[:half]} ... {text[-half:]}"


def _policy_fields(policy: TrafficPolicy | None) -> dict[str, Any]:
    """A traffic policy as the flat fields of a request (``candidate`` None: none)."""
    p = policy
    return {
        "stable": p.stable if p else None,
        "candidate": p.candidate if p else None,
        "traffic_percent": p.traffic_percent if p else 0,
        "shadow_percent": p.shadow_percent if p else 0,
    }


@dataclass(frozen=True)
class LoadRequest:
    """Load ``version`` and swap it in. With ``policy`` (a canary pod's, whose candidate
    is ``version``) the server sets the policy in the same step as the swap, so the
    candidate never answers a request outside the policy's share."""

    model: str
    version: str
    path: str | None  # None: the version's directory in the server's repository
    sha256: str  # the server re-hashes the file and refuses a mismatch
    policy: TrafficPolicy | None = None
    op = "load"

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy.candidate != self.version:
            raise InvalidPolicy(
                f"a load's traffic policy has the loaded version {self.version!r} as its "
                f"candidate, not {self.policy.candidate!r}"
            )

    def to_json(self) -> dict[str, Any]:
        body = {"op": self.op, "model": self.model, "version": self.version,
                "path": self.path, "sha256": self.sha256}  # fmt: skip
        if self.policy is not None:  # without one the message is as it always was
            body |= _policy_fields(self.policy)
        return body


@dataclass(frozen=True)
class RollbackRequest:
    model: str
    version: str | None = None  # None: the most recently served retained version
    op = "rollback"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"op": self.op, "model": self.model}
        if self.version is not None:
            body["version"] = self.version
        return body


@dataclass(frozen=True)
class StatusRequest:
    model: str
    op = "status"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "model": self.model}


@dataclass(frozen=True)
class TrafficRequest:
    """Set the model's traffic policy (``canary.TrafficPolicy``); ``policy`` None clears
    it. Answered with a StatusReply."""

    model: str
    policy: TrafficPolicy | None
    op = "traffic"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "model": self.model, **_policy_fields(self.policy)}


Request = LoadRequest | RollbackRequest | StatusRequest | TrafficRequest


@dataclass(frozen=True)
class SwapReply:
    model: str
    from_version: str | None
    to_version: str
    duration_ms: float
    instant: bool  # a pointer swap to a retained version, no load
    # where a load's time went (milliseconds per stage, the server's own timing, adding
    # up to duration_ms); () for a pointer swap. Diagnostics only: a malformed value in
    # a reply is dropped, never the reply
    stages_ms: tuple[tuple[str, float], ...] = ()

    def fields(self) -> dict[str, Any]:
        """The swap itself; the HTTP admin API answers with the same fields."""
        swap: dict[str, Any] = {
            "model": self.model, "from": self.from_version, "to": self.to_version,
            "duration_ms": self.duration_ms, "instant": self.instant,
        }  # fmt: skip
        if self.stages_ms:
            swap["stages_ms"] = dict(self.stages_ms)
        return swap

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **self.fields()}


@dataclass(frozen=True)
class StatusReply:
    model: str
    version: str | None  # serving, or None before the first load
    sha256: str | None
    loaded: tuple[str, ...]  # every version held, the serving one included
    # the traffic policy the server holds; only said when ``policy_reported``: a server
    # older than this field ignores the policy a load carries, so a sidecar that does not
    # see it confirmed sends it with the ``traffic`` op
    policy: TrafficPolicy | None = None
    policy_reported: bool = False

    def to_json(self) -> dict[str, Any]:
        body = {"ok": True, "model": self.model, "version": self.version,
                "sha256": self.sha256, "loaded": list(self.loaded)}  # fmt: skip
        if self.policy_reported:
            body["policy"] = self.policy.to_json() if self.policy is not None else None
        return body


# the ErrorReply code of a connection over the server's bound: nothing was done, try again
BUSY = "busy"


@dataclass(frozen=True)
class ErrorReply:
    error: str  # for people
    code: str  # stable, for programs (the server's error codes)

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error, "code": self.code}


Reply = SwapReply | StatusReply | ErrorReply


def encode(message: Request | Reply) -> bytes:
    return json.dumps(message.to_json()).encode() + b"\n"


def _object(line: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, UTF-8, huge numbers
        raise ProtocolError(f"not a JSON line: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError("a message must be a JSON object")
    return raw


def _text(raw: dict[str, Any], key: str, what: str, optional: bool = False) -> Any:
    value = raw.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{what} needs {key!r} (a string)")
    return value


def parse_request(line: bytes) -> Request:
    raw = _object(line)
    nested = [key for key, value in raw.items() if isinstance(value, dict | list)]
    if nested:  # requests are flat; deeper nesting than JSON's limit fails in _object
        raise ProtocolError(f"a request holds no nested values: {_shown(repr(nested))}")
    op = raw.get("op")
    try:
        model = check_model_key(_text(raw, "model", _shown(repr(op))))
        if op == "status":
            return StatusRequest(model)
        if op == "load":
            if raw.get("candidate") is None and raw.get("stable") is not None:
                raise ProtocolError("a load's traffic policy needs 'candidate' (the version)")
            return LoadRequest(
                model,
                check_name("version", _text(raw, "version", "'load'")),
                _text(raw, "path", "'load'", optional=True),
                _text(raw, "sha256", "'load'"),
                _policy(raw),
            )
        if op == "rollback":
            version = _text(raw, "version", "'rollback'", optional=True)
            return RollbackRequest(
                model, None if version is None else check_name("version", version)
            )
        if op == "traffic":
            return TrafficRequest(model, _policy(raw))
    except (InvalidName, InvalidPolicy) as exc:
        raise ProtocolError(_shown(str(exc))) from exc
    raise ProtocolError(
        f"unknown op {_shown(repr(op))}; expected load, rollback, status or traffic"
    )


def _policy(raw: dict[str, Any]) -> TrafficPolicy | None:
    if raw.get("candidate") is None:
        return None
    return TrafficPolicy.from_json(
        {
            "stable": raw.get("stable"),
            "candidate": raw.get("candidate"),
            "trafficPercent": raw.get("traffic_percent", 0),
            "shadowPercent": raw.get("shadow_percent", 0),
        }
    )


def _typed(raw: dict[str, Any], key: str, kinds: tuple[type, ...]) -> Any:
    value = raw.get(key)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"malformed reply: {key!r} is {value!r}")
    return value


def _held_policy(raw: dict[str, Any]) -> TrafficPolicy | None:
    """The ``policy`` of a status reply (absent or null: none)."""
    held = raw.get("policy")
    if held is None:
        return None
    try:
        return TrafficPolicy.from_json(held)
    except InvalidPolicy as exc:
        raise ProtocolError(f"malformed reply: 'policy': {_shown(str(exc))}") from exc


def parse_reply(line: bytes) -> Reply:
    raw = _object(line)
    if raw.get("ok") is not True:
        return ErrorReply(str(raw.get("error", "no reason given")), str(raw.get("code", "")))
    optional_text = (str, type(None))
    model = _typed(raw, "model", (str,))
    if "loaded" in raw:
        loaded = _typed(raw, "loaded", (list,))
        if not all(isinstance(v, str) for v in loaded):
            raise ProtocolError(f"malformed reply: 'loaded' is {loaded!r}")
        return StatusReply(
            model,
            _typed(raw, "version", optional_text),
            _typed(raw, "sha256", optional_text),
            tuple(loaded),
            _held_policy(raw),
            "policy" in raw,
        )
    try:
        duration = float(_typed(raw, "duration_ms", (int, float)))
    except OverflowError as exc:
        raise ProtocolError("malformed reply: 'duration_ms' is out of range") from exc
    if not math.isfinite(duration):
        raise ProtocolError(f"malformed reply: 'duration_ms' is {duration!r}")
    return SwapReply(
        model,
        _typed(raw, "from", optional_text),
        _typed(raw, "to", (str,)),
        duration,
        _typed(raw, "instant", (bool,)),
        _stages(raw.get("stages_ms")),
    )


def _stages(raw: Any) -> tuple[tuple[str, float], ...]:
    """A swap reply's ``stages_ms`` if well formed (names to finite numbers), else ()."""
    if not isinstance(raw, dict):
        return ()
    stages = []
    for name, value in raw.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return ()
        if not math.isfinite(value):
            return ()
        stages.append((str(name), float(value)))
    return tuple(stages)


class ControlExchangeError(Exception):
    """One exchange on a control socket failed; ``path`` is the socket's. The message
    names the socket, so a caller prefixes only who it is (``server``, ``worker 1``)."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


class ControlUnreachable(ControlExchangeError):
    """Nobody listens on the socket (not created yet, or its server is gone): transient."""


class ControlDenied(ControlExchangeError):
    """The socket cannot be used by this process (no permission, not a socket, a path too
    long): waiting does not help."""


class ControlClosed(ControlExchangeError):
    """The connection dropped, or the peer closed it without a reply (it died meanwhile)."""


class ControlLineTooLong(ControlExchangeError):
    """The reply line is longer than :data:`MAX_LINE`: outside the protocol."""


async def exchange(path: Path, request: Request) -> bytes:
    """Send ``request`` on the control socket at ``path`` and return the reply line (its
    newline included; not parsed: see :func:`parse_reply`). No timeout of its own: the
    caller knows how long a load may take."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_LINE)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise ControlUnreachable(path, f"control socket {path} not answering: {exc}") from exc
    except PermissionError as exc:
        raise ControlDenied(path, f"no permission to use the control socket {path}: {exc}") from exc
    except OSError as exc:  # not a socket, a path too long, ...
        raise ControlDenied(path, f"cannot connect to the control socket {path}: {exc}") from exc
    try:
        writer.write(encode(request))
        await writer.drain()
        line = await reader.readline()
    except OSError as exc:  # a ConnectionError (reset, broken pipe): the peer went away
        raise ControlClosed(path, f"control socket {path} closed the connection: {exc}") from exc
    except ValueError as exc:  # asyncio's LimitOverrunError, as readline raises it
        raise ControlLineTooLong(
            path, f"control socket {path} answered {request.op} with a line over {MAX_LINE} bytes"
        ) from exc
    finally:
        writer.close()
    if not line:
        raise ControlClosed(path, f"control socket {path} closed the connection without answering")
    return line
