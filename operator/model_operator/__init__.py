"""Rollout operator for ModelDeployment resources (import name ``model_operator``; the
folder is called ``operator/`` but never shadows the standard library's ``operator``)."""
