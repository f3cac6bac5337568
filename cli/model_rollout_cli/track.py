"""One track of a ModelDeployment, seen as the resource itself: what lets ``promote``,
``abort`` and ``retry`` (and their ``--wait``) act on a tenant model's rollout with the
very checks and following they use for the deployment's own model.

The operator plans a tenant track with the deployment's settings, the tenant model's
``spec.tenants.models[].version`` as its version, and keeps the track's state in
``status.tenants.<track>`` with the fields the resource's own rollout has at the top level
(model_rollout_contract.tracks). So the track's view is the resource with that version
as ``spec.version`` and that entry as ``status``: nothing else needs to know of tracks."""

from __future__ import annotations

from typing import Any

from model_rollout_contract.tracks import InvalidTrack, TrackKeys, track_keys

from .errors import USAGE, CliError


def tenant_models(md: dict[str, Any]) -> list[dict[str, Any]]:
    models = ((md.get("spec") or {}).get("tenants") or {}).get("models") or []
    if not isinstance(models, list):
        return []
    return [m for m in models if isinstance(m, dict) and m.get("name")]


def checked_keys(md: dict[str, Any], name: str, track: str | None) -> TrackKeys:
    """The annotation keys of ``track`` (``None``: the default track's), or a usage error
    (exit 2) naming the tracks there are, for a track the spec does not list."""
    if track is None:
        return track_keys()
    names = [str(m["name"]) for m in tenant_models(md)]
    if track not in names:
        known = ", ".join(names) if names else "none (no spec.tenants.models)"
        raise CliError(f"unknown track {track!r} for {name}: its tracks are {known}", USAGE)
    try:
        return track_keys(track)
    except InvalidTrack as exc:  # listed, but a name the operator refuses
        raise CliError(f"{exc} (listed in {name}'s spec.tenants.models)", USAGE) from exc


def track_view(md: dict[str, Any], track: str | None) -> dict[str, Any]:
    """``md`` as ``track``'s rollout sees it (itself for the default track). A track gone
    from the spec has no version: following it then ends as the spec having moved on."""
    if track is None:
        return md
    entry = next((m for m in tenant_models(md) if m.get("name") == track), {})
    states = (md.get("status") or {}).get("tenants") or {}
    state = states.get(track) if isinstance(states, dict) else None
    spec = {k: v for k, v in (md.get("spec") or {}).items() if k != "tenants"}
    return {
        "metadata": md.get("metadata") or {},
        "spec": {**spec, "version": entry.get("version")},
        "status": state if isinstance(state, dict) else {},
    }


def described(name: str, track: str | None) -> str:
    """How a message names what it acted on: ``modeldeployment mlp`` or, for a tenant
    track, ``modeldeployment mlp track acme-mlp``."""
    return f"modeldeployment {name}" + (f" track {track}" if track else "")


def subject(name: str, track: str | None) -> str:
    """The same, as a refusal's subject: ``mlp`` or ``mlp's track acme-mlp``."""
    return name if track is None else f"{name}'s track {track}"
