"""Every hook mopt calls, one line of doc each. This file is the whole extension surface.

Each registration hook gets a `register` callback; call it once per thing the plugin adds.
The core validates each registration as it arrives and names the plugin when one is invalid.
What a plugin needs of the engine comes as a hook argument, never through an import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("mopt")


@hookspec
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """Register target kinds: `register(KindClass)` for each `mopt.api.TargetKind` subclass."""


@hookspec
def mopt_register_families(register: Callable[[Any], None]) -> None:
    """Register model families: `register(FamilyClass)` for each `mopt.api.Family` subclass."""


@hookspec
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    """Register hardware profiles: `register(profile)` for each `mopt.api.HardwareProfile`."""


@hookspec
def mopt_register_sources(register: Callable[[Any], None]) -> None:
    """Register model sources: `register(SourceClass)` for each `mopt.api.Source` subclass."""


@hookspec
def mopt_register_executors(register: Callable[[Any], None]) -> None:
    """Register executors: `register(ExecutorClass)` per `mopt.api.Executor` subclass; its `build(session, *, settings)` runs each miss `session.spawn(id)` describes with `session.run_spawn` and hands the result to `session.finished` (or ends it with `session.done`)."""


@hookspec
def mopt_register_doctor_checks(register: Callable[[Any], None]) -> None:
    """Register `mopt doctor` checks: `register(fn)`, `fn(machine)` returns a list of dicts (name, status: ok | info | warn | missing | fail, summary, cause, fix) about what the plugin needs here."""


@hookspec
def mopt_register_commands(cli: Any, core: Any) -> None:
    """Add commands to the `mopt` command line: `cli` is its click group (`@cli.command()`), `core` a `mopt.api.Core` (the registry, this machine's GPUs, built targets)."""
