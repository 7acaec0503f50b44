"""Entry point of the mopt-deploy plugin (group `mopt`): registers the `deploy` kind.

Importing this module imports no validator, no plotting and runs no tool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """The `deploy` target kind."""
    from mopt_deploy.kind import DeployKind

    register(DeployKind)
