"""Built-in hardware profiles: the table is data, `hardware.toml` beside this file (each
profile's facts and their sources are there)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mopt.api import HardwareProfile, hookimpl
from mopt.tomlfile import tomllib

PROFILES = [
    HardwareProfile(**p) for p in tomllib.loads(Path(__file__).with_name("hardware.toml").read_text())["profile"]
]


@hookimpl
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    """The built-in profiles."""
    for profile in PROFILES:
        register(profile)
