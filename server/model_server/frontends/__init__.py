"""The ways in: HTTP, gRPC and the sidecar's control socket. They reach the server through the
data plane."""
