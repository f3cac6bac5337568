"""Model sidecar: pre-pulls (init mode) and hot-delivers (watch mode) verified engines."""
