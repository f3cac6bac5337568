"""KServe v2 over gRPC: the servicer, its codec and the generated protocol code."""
