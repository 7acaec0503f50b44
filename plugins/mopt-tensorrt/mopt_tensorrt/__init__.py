"""mopt plugin: TensorRT engines and the ModelOpt ONNX passes that feed them.

Target kinds: `trt-engine`, `autocast`, `modelopt-quantize`. Importing this package imports
neither tensorrt nor modelopt (they are imported inside `run`, on the machine that builds).
"""

__version__ = "0.1.0"
