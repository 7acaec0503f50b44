"""Registration of this plugin's target kinds (entry point `mopt-tensorrt`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl
from mopt_tensorrt.modelopt_onnx import AutoCastKind, ModelOptQuantizeKind
from mopt_tensorrt.trt_engine import TrtEngineKind


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """`trt-engine`, `autocast`, `modelopt-quantize`."""
    for kind in (TrtEngineKind, AutoCastKind, ModelOptQuantizeKind):
        register(kind)
