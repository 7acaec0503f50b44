"""Entry point of the mopt-image plugin (group `mopt`): registers the `image` kind.

Importing this module imports no builder and runs no tool; that happens when a target is
keyed (fingerprint: `buildah --version`) or built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import hookimpl


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """The `image` target kind."""
    from mopt_image.kind import ImageKind

    register(ImageKind)
