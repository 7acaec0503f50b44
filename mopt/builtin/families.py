"""Built-in families: `generic` (a model the graph knows nothing about, for `command` steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mopt.api import Family, hookimpl


class GenericFamily(Family):
    """Any model: no loading or pooling knowledge; for recipes of `command` steps."""

    name = "generic"
    description = "any model; only `command` and family-agnostic kinds apply"
    pooling = "mean"
    tasks = ("any",)


@hookimpl
def mopt_register_families(register: Callable[[Any], None]) -> None:
    """The `generic` family."""
    register(GenericFamily)
