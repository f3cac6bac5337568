"""Names of the custom resource the operator serves (the annotations and labels it shares
with the other programs are in :mod:`model_rollout_contract.annotations`)."""

from model_rollout_contract.annotations import DOMAIN

GROUP = DOMAIN
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
