"""Errors meant for the user: what was wrong, where (file, table, key), what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


class MoptError(Exception):
    """Bad input (recipe, config, command line): printed as one line, exit code 2."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        table: str | None = None,
        key: str | None = None,
        line: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.file = str(file) if file is not None else None
        self.table = table
        self.key = key
        self.line = line
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        """The one-line form: `file:line: [table] key: message; hint`."""
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "") + ": "
        loc = f"[{self.table}] " if self.table else ""
        if self.key:
            loc += f"{self.key}: "
        out = f"{where}{loc}{self.message}"
        if self.hint:
            out += f" ({self.hint})"
        return out


class PluginError(MoptError):
    """A plugin registered something invalid; the message names the plugin."""


class BuildFailed(Exception):
    """One or more actions failed or could not be built (exit code 1)."""

    exit_code = 1


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The closest valid name, for 'did you mean' hints."""
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: str, choices: Iterable[str], what: str = "") -> str:
    """A hint naming the closest choice, or listing the valid ones when none is close."""
    choices = sorted(set(choices))
    best = closest(name, choices)
    if best:
        return f"did you mean {best!r}?"
    if not choices:
        return f"no {what or 'names'} are registered"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"valid {what or 'names'}: {shown}"


def human(n: float) -> str:
    """`512 B`, `1.5 KiB`, ... `2.0 TiB`: sizes as mopt prints them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
