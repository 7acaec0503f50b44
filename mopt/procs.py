"""Child processes of actions, so that Ctrl-C can stop them (a leaf: imports nothing of mopt)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: descriptors an action's commands inherit (in a worker: the action's lock, so the lock
#: stays held while any process of the action lives, orphans included)
ACTION_FDS: tuple[int, ...] = ()


def _child_setup() -> None:
    # between fork and exec: die with the worker that started us (PR_SET_PDEATHSIG);
    # the prctl function is looked up before forking
    if prctl is not None:
        prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL


#: libc's prctl (None without one), looked up once: the worker processes call it too
prctl: Any
try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    prctl = None


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C (a KeyboardInterrupt, so every handler of
    one stops the build the same way); `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum: int, _frame: Any) -> None:
    """A signal handler for SIGTERM / SIGHUP."""
    raise Terminated(signum)


def run(
    argv: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> int:
    """Run a command in its own process group, streaming its output lines to `on_line`."""
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        pass_fds=ACTION_FDS,
        preexec_fn=_child_setup if os.environ.get("MOPT_WORKER") else None,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if on_line:
            on_line(line.rstrip("\n"))
    return proc.wait()
