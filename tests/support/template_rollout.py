"""The pod template rollout tests' two templates: the stable one's Deployment "mlp"
(digest ``OLD``) and the target's (digest ``NEW``), named as the operator names it."""

from __future__ import annotations

from model_operator.template_rollout import TemplateRef

OLD, NEW = "a" * 16, "b" * 16
STABLE = TemplateRef("mlp", OLD)
TARGET = f"mlp-{NEW[:10]}"
