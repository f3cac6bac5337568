"""How runs reach an engine: dynamic batching, the traffic split and shadow runs."""
