"""mopt plugin: serving configs and their checks.

Target kinds: `vllm`, `trtllm`, `modelopt-ptq`, `triton-repo`, `serve-check`. Importing this
package imports none of vllm, tensorrt_llm, modelopt or torch (they load inside `run`).
"""

__version__ = "0.1.0"
