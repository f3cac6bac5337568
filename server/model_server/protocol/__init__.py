"""KServe v2 / Open Inference Protocol: tensors and their codecs, and what the server says
about itself and its models. No I/O."""
