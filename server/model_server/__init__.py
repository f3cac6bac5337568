"""Inference server with atomic, double-buffered engine hot-swap."""

__version__ = "0.1.0"
