"""`mopt report RECIPE [SELECTORS]`: the command; the page and the comparison are built in
`mopt_report.report` from what `core` (`mopt.api.Core`) says of the recipe's nodes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from mopt.api import Core, MoptError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _print_json(obj: Any) -> None:
    """Indented on a terminal, compact into a pipe or a file (as the core's commands print)."""
    indent = 2 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(obj, indent=indent, separators=None if indent else (",", ":"), default=str) + "\n")


def _table(columns: list[str], rows: list[list[str]], indent: str = "") -> None:
    """Aligned columns, never wrapped or cut (as `mopt plan` prints its table)."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    fmt = (indent + "  ".join(f"{{:<{w}}}" for w in widths)).format
    sys.stdout.write("".join([fmt(*columns).rstrip() + "\n", *[fmt(*r).rstrip() + "\n" for r in rows]]))


def register(app: click.Group, core: Core) -> None:
    """Add `mopt report` and `mopt kinds` to the `mopt` command line."""

    @app.command(context_settings=CONTEXT)
    @click.argument("kind", required=False)
    @click.option("--markdown", "as_markdown", is_flag=True, help="the reference page (docs/kinds.md) on stdout")
    @click.option("--first-party", is_flag=True, help="only mopt's own kinds (the core's and its plugins')")
    @click.option("--json", "as_json", is_flag=True, help="machine-readable output on stdout")
    def kinds(kind: str | None, as_markdown: bool, first_party: bool, as_json: bool) -> None:
        """List the target kinds: plugin, what each takes and produces; with KIND, its params
        (type, default, description)."""
        import difflib

        from mopt_report.kinds import kind_info, markdown, takes

        reg = core.registry()
        if kind is not None and kind not in reg.targets:
            near = difflib.get_close_matches(kind, reg.targets, 1)
            raise MoptError(f"unknown target kind {kind!r}", hint=f"did you mean {near[0]!r}?" if near else "see `mopt kinds`")
        infos = [kind_info(reg, k) for k in ([kind] if kind else sorted(reg.targets))]
        infos = [i for i in infos if i["first_party"] or not first_party]
        if as_json:
            _print_json({"kinds": infos})
        elif as_markdown:
            sys.stdout.write(markdown(infos))
        elif kind is None:
            _table(["kind", "plugin", "takes", "produces"], [[i["name"], i["distribution"], takes(i) or "-", i["produces"] or "-"] for i in infos])  # fmt: skip
        else:
            i = infos[0]
            click.echo(f"{i['name']} ({i['distribution']}): {i['description']}\n  takes: {takes(i) or 'nothing'}\n  produces: {i['produces'] or 'nothing'}")  # fmt: skip
            if i["params"]:
                click.echo("  params:")
                _table(["name", "type", "default", "description"], [list(p.values()) for p in i["params"]], indent="    ")  # fmt: skip

    @app.command(context_settings=CONTEXT)
    @click.argument("recipe", type=click.Path(path_type=Path))
    @click.argument("selectors", nargs=-1)
    @click.option(
        "--output", "-o", type=click.Path(path_type=Path),
        help="HTML file (default: report-<recipe name>.html in the build folder, [store] build_dir)",
    )  # fmt: skip
    @click.option(
        "--compare",
        "ref",
        metavar="REF",
        help="also compare with an earlier build: a git revision whose mopt.lock recorded it, or a "
        "mopt.lock file (params that differ, numbers old → new with intervals)",
    )
    @click.option("--json", "as_json", is_flag=True, help="machine-readable output on stdout")
    def report(
        recipe: Path, selectors: tuple[str, ...], output: Path | None, ref: str | None, as_json: bool
    ) -> None:
        """One HTML page over RECIPE's built artifacts: accuracy, latency per shape, size,
        provenance; with --compare, the difference from an earlier build too."""
        from mopt_report.report import collect, compare, compare_table, locked_artifacts, render

        nodes = core.nodes(recipe, selectors)  # the recipe's errors first, then the lock's
        path = recipe.resolve()
        old = locked_artifacts(core, path, ref) if ref is not None else None
        rows = collect(nodes)
        comparison = None
        if old is not None:
            comparison = compare(core, path, nodes, old[0], ref or "", everything=not selectors)
            comparison["lock"] = old[1]
        if as_json:
            _print_json({"artifacts": rows, **({"compare": comparison} if comparison else {})})
            return
        if not rows and comparison is None:
            raise MoptError("nothing of this recipe is built yet", hint=f"run: mopt build {recipe}")
        dest = output or core.build_dir(path) / f"report-{path.stem}.html"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(render(path, rows, comparison))
        if comparison is not None:
            head, columns, table = compare_table(comparison)
            click.echo(head)
            if table:
                _table(columns, table)
        click.echo(f"report: {dest} ({len(rows)} artifacts)")
