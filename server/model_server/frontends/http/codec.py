"""The HTTP transport's request codec (``data_plane.RequestCodec``): a KServe v2 body
that is JSON, or JSON followed by binary tensor data (:mod:`.binary_codec`), and the
answer in the form the request asked for.

The JSON is decoded by :class:`~.codec_workers.JsonCodec` (in a worker process when it
is large); binary inputs are then read from the rest of the body as views. An answer is
plain JSON unless some output was asked for as binary data (per output with
``parameters.binary_data``, or for all with the request's ``binary_data_output``): then
it is the JSON followed by those outputs' bytes, ``Inference-Header-Content-Length``
giving the JSON's length."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_server.frontends.http.codec_workers import JsonCodec
from model_server.protocol.binary_codec import binary_outputs, read_binary_inputs, split_body
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import BinaryOutput, v2_datatype
from model_server.protocol.v2_codec import InferenceRequest, binary_output_names

JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"  # what Triton answers a binary response with


@dataclass(frozen=True)
class HttpAnswer:
    body: bytes
    header_length: int | None = None  # the JSON's length, when binary data follows it

    @property
    def content_type(self) -> str:
        return JSON_TYPE if self.header_length is None else BINARY_TYPE


@dataclass(frozen=True)
class HttpInferBody:
    """A v2 inference body as it came over HTTP."""

    codec: JsonCodec
    body: memoryview
    charset: str = "utf-8"
    header_length: int | None = None  # Inference-Header-Content-Length, checked

    async def decode(self, specs: tuple[TensorSpec, ...]) -> InferenceRequest:
        header, binary = split_body(self.body, self.header_length)
        decoded = await self.codec.decode(header, self.charset, specs)
        if not decoded.binary:
            if len(binary):
                read_binary_inputs((), binary)  # raises: bytes no input claims
            return decoded.request
        feeds = {**decoded.request.feeds, **read_binary_inputs(decoded.binary, binary)}
        request = decoded.request
        return InferenceRequest(feeds, request.id, request.outputs, request.binary_output)

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: dict[str, np.ndarray],
        request: InferenceRequest,
    ) -> HttpAnswer:
        raw = binary_outputs(outputs, binary_output_names(request, list(outputs)))
        described: dict[str, np.ndarray | BinaryOutput] = {
            n: BinaryOutput(v2_datatype(a.dtype), a.shape, len(raw[n])) if n in raw else a
            for n, a in outputs.items()
        }
        header = await self.codec.encode(name, version, request_id, described)
        if not raw:
            return HttpAnswer(header)
        return HttpAnswer(b"".join([header, *raw.values()]), len(header))
