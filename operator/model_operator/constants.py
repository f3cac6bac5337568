"""Names of the custom resource the operator serves (the annotations and labels it shares
with the other programs are in :mod:`model_rollout_contract.annotations`)."""

from model_rollout_contract.annotations import DOMAIN

GROUP = DOMAIN
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
# the finalizer kopf's daemon put on every ModelDeployment (the operator's earlier
# versions); removed wherever found, as nothing needs one (see handlers)
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
MIN_LEASE_S = 1.0  # a Lease holds whole seconds (rounded up): shorter ones are refused
