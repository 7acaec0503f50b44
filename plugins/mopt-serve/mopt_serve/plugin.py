"""Registration of this plugin's target kinds (entry point `mopt-serve`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl
from mopt_serve.container import ContainerCheckKind
from mopt_serve.modelopt_ptq import ModelOptPtqKind
from mopt_serve.serve_check import ServeCheckKind
from mopt_serve.serve_search import ServeSearchKind
from mopt_serve.triton import TritonRepoKind
from mopt_serve.trtllm import TrtllmKind
from mopt_serve.vllm import VllmKind


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """`vllm`, `trtllm`, `modelopt-ptq`, `triton-repo`, `serve-check`, `serve-search`, `container-check`."""
    for kind in (VllmKind, TrtllmKind, ModelOptPtqKind, TritonRepoKind, ServeCheckKind, ServeSearchKind,
                 ContainerCheckKind):  # fmt: skip
        register(kind)
