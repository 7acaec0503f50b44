"""`python -m mopt` and the `mopt` command.

A no-op `mopt build` is answered here from its stamp (`mopt.noop.fast_main`) before click,
pydantic or any plugin is imported; everything else goes to the CLI (`mopt.cli.main`)."""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point."""
    from mopt import noop

    if noop.fast_main(sys.argv[1:]):
        return
    from mopt.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
