"""`python -m mopt` and the `mopt` command.

A no-op `mopt build` is answered here from its build log (`mopt.buildlog`) before click,
pydantic or any plugin is imported; everything else goes to the CLI (`mopt.cli.main`)."""

from __future__ import annotations

import os
import sys

#: `mopt build` options this entry understands (name → what it sets); any other argument (a
#: typo, --help, a combined short flag, --no-log) leaves the command to click
_FLAGS = {"--json": "json", "--quiet": "quiet", "-q": "quiet", "--offline": "offline", "--no-check": "",
          "--keep-going": "", "-k": "", "--frozen": "", "--no-lock": ""}  # fmt: skip


def _parse_build(argv: list[str]) -> tuple[str, list[str], dict[str, bool]] | None:
    """(recipe, selectors, flags) of a plain `mopt build ...` command line, else None."""
    if not argv or argv[0] != "build":
        return None
    flags = {"json": False, "quiet": False, "offline": False}
    positional: list[str] = []
    args = iter(argv[1:])
    for a in args:
        if a.startswith("-") and a != "-":
            if a in _FLAGS:
                if _FLAGS[a]:
                    flags[_FLAGS[a]] = True
                continue
            value = next(args, None) if a in ("--jobs", "-j") else a[len("--jobs=") :] if a.startswith("--jobs=") else None
            if value is None or not (value.isascii() and value.isdigit() and int(value) >= 1):
                return None
            continue
        positional.append(a)
    return (positional[0], positional[1:], flags) if positional else None


def fast_main(argv: list[str]) -> bool:
    """A no-op `mopt build` answered from its build log: True if it printed what the full
    path would. Anything else (another command, an option it does not know, a miss) returns
    False, and the CLI runs as usual."""
    import time

    t0 = time.time()
    parsed = _parse_build(argv)
    if parsed is None or os.environ.get("MOPT_NO_LOG") or not os.path.exists(parsed[0]):
        return False
    recipe, selectors, flags = parsed
    from mopt import buildlog

    try:
        log, _why = buildlog.noop(recipe, selectors, flags["offline"])
    except Exception:  # the full path runs and reports whatever this was
        return False
    if log is None:
        return False
    buildlog.report(log, time.time() - t0, flags["json"], flags["quiet"])
    return True


def main() -> None:
    """Console entry point. After a no-op build's output it exits 0 at once, without tearing
    the interpreter down (freeing every module and object: 15-60 ms): the log is written and
    every thread that ran is joined. If the output cannot be flushed (a closed pipe), the
    usual exit reports it."""
    if not fast_main(sys.argv[1:]):
        from mopt.cli import main as cli_main

        cli_main()
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        return
    os._exit(0)


if __name__ == "__main__":
    main()
