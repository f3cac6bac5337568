"""Operator settings (command line / environment), handed to handlers through kopf's memo."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OperatorConfig:
    kube_api: str | None = None  # explicit API URL (tests, kmock); default: in-cluster/kubeconfig
    namespaces: list[str] = field(default_factory=list)
    interval_s: float = 2.0
    check_store: bool = True
    disable_scanning: bool = False  # API servers without full discovery (kmock)
