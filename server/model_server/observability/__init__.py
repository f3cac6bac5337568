"""Metrics, per-version series and the audit log."""
