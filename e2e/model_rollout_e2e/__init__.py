"""End-to-end harness, load generator and demo for model-rollout."""
