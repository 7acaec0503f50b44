"""mopt-ml: model families (qwen3, bert), the `synthetic` source, and the targets weights,
onnx, onnx-slim, ort-quantize, validate and bench.

Importing this package (or `mopt_ml.plugin`) imports no torch, transformers or onnx: each
target imports its libraries inside `run`.
"""

__version__ = "0.1.0"
