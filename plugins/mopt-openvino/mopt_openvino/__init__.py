"""mopt plugin: OpenVINO IR targets.

Target kinds: `openvino` (IR from the ONNX graph or the weights; f32 / bf16 inference
precision recorded as a runtime property) and `nncf-quantize` (INT8 with NNCF). Both produce
the "openvino-ir" format, which mopt-ml's `validate`, `bench` and `select` take like an ONNX
artifact. Importing this package imports neither openvino nor nncf.
"""

__version__ = "0.1.0"
