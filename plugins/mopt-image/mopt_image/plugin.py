"""Entry point of the mopt-image plugin (group `mopt`): registers the `image` and
`base-image` kinds and the `mopt image load|push|path` commands.

Importing this module imports no builder and runs no tool; that happens when a target is
keyed (fingerprint: `buildah --version`) or built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import Core, hookimpl


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """The `image` and `base-image` target kinds."""
    from mopt_image.debian import BaseImageKind
    from mopt_image.kind import ImageKind

    register(ImageKind)
    register(BaseImageKind)


@hookimpl
def mopt_register_commands(cli: Any, core: Core) -> None:
    """`mopt image load|push|path`: hand a built image to a runtime or a registry."""
    from mopt_image.cli import register

    register(cli, core)


@hookimpl
def mopt_register_doctor_checks(register: Callable[[Any], None]) -> None:
    """`mopt doctor`'s lines about what this plugin needs here."""
    from mopt_image.doctor import containers

    register(containers)
