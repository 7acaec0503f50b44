"""Entry point of the mopt-report plugin (group `mopt`): the `mopt report` and `mopt kinds`
commands.

Importing this module imports neither jinja2 nor the report; the command does when it runs."""

from __future__ import annotations

from typing import Any

from mopt.api import Core, hookimpl


@hookimpl
def mopt_register_commands(cli: Any, core: Core) -> None:
    """`mopt report RECIPE [SELECTORS] [--compare REF] [-o FILE] [--json]`, `mopt kinds [KIND]`."""
    from mopt_report.cli import register

    register(cli, core)
