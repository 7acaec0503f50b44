"""The hook implementations mopt loads through the `mopt` entry point `ml`.

Only light modules are imported here (pydantic models and class definitions); torch,
transformers, onnx and onnxruntime are imported by the targets when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl

from mopt_ml.bench import BenchBaselineKind, BenchKind
from mopt_ml.export import OnnxKind, OnnxSlimKind
from mopt_ml.families import BertFamily, Qwen3Family
from mopt_ml.pretrain import PretrainKind
from mopt_ml.quantize import OrtQuantizeKind
from mopt_ml.rtn import RtnKind
from mopt_ml.select import SelectKind
from mopt_ml.synthetic import SyntheticSource
from mopt_ml.validate import ValidateKind
from mopt_ml.weights import WeightsKind

TARGETS = (
    WeightsKind, OnnxKind, OnnxSlimKind, OrtQuantizeKind, ValidateKind, BenchKind, BenchBaselineKind, SelectKind,
    PretrainKind, RtnKind,
)  # fmt: skip
FAMILIES = (Qwen3Family, BertFamily)
SOURCES = (SyntheticSource,)


@hookimpl
def mopt_register_families(register: Callable[[Any], None]) -> None:
    """qwen3 (last-token pooling) and bert (mean pooling)."""
    for family in FAMILIES:
        register(family)


@hookimpl
def mopt_register_sources(register: Callable[[Any], None]) -> None:
    """synthetic: a family's real architecture, small, random from a seed."""
    for source in SOURCES:
        register(source)


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """weights, onnx, onnx-slim, ort-quantize, validate, bench, bench-baseline, select, pretrain, rtn."""
    for kind in TARGETS:
        register(kind)
