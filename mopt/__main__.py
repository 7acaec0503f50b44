"""`python -m mopt` and the `mopt` command.

A no-op `mopt build` is answered here from its stamp (`mopt.noop.fast_main`) before click,
pydantic or any plugin is imported; everything else goes to the CLI (`mopt.cli.main`)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Console entry point."""
    from mopt import noop

    if noop.fast_main(sys.argv[1:]):
        _leave()
        return
    from mopt.cli import main as cli_main

    cli_main()


def _leave() -> None:
    """Exit 0 now that the no-op build's output is out, without tearing the interpreter down
    (freeing every module and object: 15-60 ms after a touched input's rehash, which loads
    sqlite3 and the stat cache). Nothing is left to do: the stamp and the stat cache are
    written and closed, every thread that ran is joined, and the atexit handlers this path
    can register (logging's, loaded with the stat cache) have nothing to flush: no handler
    is configured. If the output cannot be flushed (a closed pipe), the usual exit reports it."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        return
    os._exit(0)


if __name__ == "__main__":
    main()
