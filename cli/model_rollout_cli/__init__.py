"""Day-2 tools for ModelDeployments: the ``kubectl-model`` plugin and ``model-rollout
release``. They speak to the Kubernetes API with the user's kubeconfig and share only the
contract package with the other programs."""
