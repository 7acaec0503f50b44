"""Built-in executors: `local` (this machine, parallel with resource slots)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from mopt import api
from mopt.api import Executor, hookimpl


class LocalExecutor(Executor):
    """Runs actions on this machine: `-j` CPU jobs in parallel, one slot per GPU."""

    name = "local"
    description = "this machine; parallel actions with CPU/GPU slots"

    class Settings(api.Params):
        kind: str = "local"
        jobs: int | None = Field(default=None, ge=1, description="parallel actions (CPU count)")
        sandbox: str = Field(
            default="auto",
            description='"auto" (bubblewrap where usable), "bwrap" (required) or "none": '
            "actions run in worker processes either way",
        )


@hookimpl
def mopt_register_executors(register: Callable[[Any], None]) -> None:
    """The `local` executor."""
    register(LocalExecutor)
