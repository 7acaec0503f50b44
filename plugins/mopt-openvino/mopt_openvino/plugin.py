"""Registration of this plugin's target kinds (entry point `mopt-openvino`); light imports only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl

from mopt_openvino.convert import OpenVinoKind
from mopt_openvino.nncf_quantize import NncfQuantizeKind

TARGETS = (OpenVinoKind, NncfQuantizeKind)


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """openvino, nncf-quantize."""
    for kind in TARGETS:
        register(kind)


@hookimpl
def mopt_register_doctor_checks(register: Callable[[Any], None]) -> None:
    """`mopt doctor`'s lines about what this plugin needs here."""
    from mopt_openvino.doctor import openvino

    register(openvino)
