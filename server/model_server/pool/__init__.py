"""A pool of worker processes behind one port: supervisor, workers, relayed loads and merged
metrics."""
