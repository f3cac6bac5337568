"""What the server says about itself and its models in KServe v2 / Triton terms: server
metadata (name, version, the extensions it really implements) and a version's model
configuration as Triton's ``/v2/models/{m}/config`` (model_config.proto's JSON form),
which is what ``tritonclient``'s ``get_model_config`` reads."""

from __future__ import annotations

from typing import Any

from model_server import __version__
from model_server.backends.base import Engine
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import config_datatype

SERVER_NAME = "model-rollout"
# every extension listed is implemented over HTTP and gRPC (and tested with tritonclient)
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "statistics")


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def _tensor(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    # with batching, dims leave out the batch axis (Triton's convention)
    dims = list(spec.shape[1:] if batched else spec.shape)
    return {"name": spec.name, "data_type": config_datatype(spec.dtype), "dims": dims}


def model_config(
    name: str,
    engine: Engine,
    backend: str,
    retain: int,
    max_batch_size: int = 0,
    max_queue_delay_us: int = 0,
) -> dict[str, Any]:
    """Triton's model configuration of one loaded version. ``max_batch_size``: the rows
    of a dynamic batch when this version's requests are batched (:mod:`.batching`), else
    0; then the first axis is the batch axis, left out of the dims."""
    batched = max_batch_size > 0
    config: dict[str, Any] = {
        "name": name,
        "platform": engine.platform,
        "backend": backend,
        # versions are names here, not numbers: the policy says how many are kept loaded
        "version_policy": {"latest": {"num_versions": retain}},
        "max_batch_size": max_batch_size,
        "input": [_tensor(s, batched) for s in engine.inputs],
        "output": [_tensor(s, batched) for s in engine.outputs],
    }
    if batched:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": max_queue_delay_us}
    return config
