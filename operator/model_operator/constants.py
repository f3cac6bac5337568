"""Names of the custom resource and of the labels and keys the operator owns."""

from model_sidecar.annotations import DOMAIN

GROUP = DOMAIN
VERSION = "v1alpha1"
PLURAL = "modeldeployments"

DEPLOYMENT_LABEL = f"{DOMAIN}/deployment"  # on pods, to find a ModelDeployment's pods
MODEL_LABEL = f"{DOMAIN}/model"
PROMOTE_ANNOTATION = f"{DOMAIN}/promote"  # `kubectl annotate md x ...=v2` promotes a canary
CONFIGMAP_VERSION_KEY = "target-version"
