"""Registration of this plugin's target kinds (entry point `mopt-torch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl
from mopt_torch.kinds import AotiKind, TorchCompileKind


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """`torch-compile`, `aoti`."""
    register(TorchCompileKind)
    register(AotiKind)
