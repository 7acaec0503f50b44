"""The `mopt` command line. Exit codes: 0 ok, 1 build failed, 2 bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import click
import typer
from rich.console import Console
from rich.table import Table

from mopt import __version__
from mopt.errors import BuildFailed, MoptError

app = typer.Typer(
    name="mopt",
    help="make for model optimization: build model artifacts (weights, ONNX, quantized "
    "graphs, engines, serving configs, images) from a recipe, reproducibly and incrementally.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# listings are read by people and by grep: never wrap or cut a line when piped
out = Console(highlight=False, markup=False, soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)

RecipeArg = typer.Argument(..., help="recipe file, e.g. recipes/demo.toml", show_default=False)
SelectorsArg = typer.Argument(
    None,
    help="targets to select: model.hardware:target, globs allowed ('*.h200', '*:onnx')",
    show_default=False,
)
JsonOpt = typer.Option(False, "--json", help="machine-readable output on stdout")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


class Session:
    """A loaded recipe with its project, plugins and graph."""

    def __init__(self, recipe_path: Path) -> None:
        from mopt.config import load_project
        from mopt.graph import build_graph
        from mopt.plugins import get_registry
        from mopt.recipe import load_recipe

        if not recipe_path.exists():
            raise MoptError("recipe not found", file=str(recipe_path), hint="give the path to a .toml recipe")
        self.project = load_project(recipe_path.resolve().parent)
        self.registry = get_registry(self.project.config.plugins.disable)
        self.recipe = load_recipe(recipe_path, self.registry)
        self.graph = build_graph(self.recipe, self.registry)


def _registry() -> Any:
    from mopt.config import load_project
    from mopt.plugins import get_registry

    project = load_project(Path.cwd())
    return get_registry(project.config.plugins.disable)


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"mopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="print the version"
    ),
) -> None:
    """make for model optimization."""


# --------------------------------------------------------------------------- plan / graph


@app.command()
def plan(
    recipe: Path = RecipeArg,
    selectors: Optional[list[str]] = SelectorsArg,
    as_json: bool = JsonOpt,
) -> None:
    """Show every node of the graph: its kind, inputs, and whether it is up to date and why."""
    s = Session(recipe)
    ids = s.graph.select(selectors or [])
    statuses = _statuses(s, ids)
    if as_json:
        _print_json(
            {
                "recipe": str(s.recipe.path),
                "nodes": [_node_json(s, i, statuses.get(i)) for i in ids],
            }
        )
        return
    table = Table(box=None, pad_edge=False)
    for col in ("target", "kind", "inputs", "status"):
        table.add_column(col)
    for i in ids:
        n = s.graph.nodes[i]
        shared = f" (+{len(n.addresses) - 1} shared)" if len(n.addresses) > 1 else ""
        st = statuses.get(i)
        table.add_row(
            n.id + shared,
            n.kind,
            ", ".join(n.input_ids()) or "-",
            st["summary"] if st else "-",
        )
    out.print(table)
    out.print(f"{len(ids)} node(s) in {len({s.graph.nodes[i].section.id for i in ids})} section(s)")


def _statuses(s: Session, ids: list[str]) -> dict[str, dict[str, Any]]:
    from mopt.build import plan_status

    return plan_status(s, ids)


def _node_json(s: Session, i: str, status: dict[str, Any] | None) -> dict[str, Any]:
    n = s.graph.nodes[i]
    d: dict[str, Any] = {
        "id": n.id,
        "addresses": n.addresses,
        "section": n.section.id,
        "model": n.model.name,
        "hardware": n.hardware.name,
        "target": n.target.name,
        "label": n.label,
        "kind": n.kind,
        "kind_version": n.kind_version,
        "plugin": n.plugin,
        "variant": dict(n.target.variant),
        "params": n.params_json(),
        "inputs": n.inputs,
        "identity": n.identity,
    }
    if status is not None:
        d["status"] = status
    return d


@app.command()
def graph(
    recipe: Path = RecipeArg,
    selectors: Optional[list[str]] = SelectorsArg,
    fmt: str = typer.Option("dot", "--format", "-f", help="dot or mermaid"),
) -> None:
    """Print the build graph as Graphviz dot or a Mermaid flowchart."""
    from mopt.graph import to_dot, to_mermaid

    if fmt not in ("dot", "mermaid"):
        raise MoptError(f"unknown format {fmt!r}", key="--format", hint="use dot or mermaid")
    s = Session(recipe)
    ids = s.graph.select(selectors or [])
    sys.stdout.write(to_dot(s.graph, ids) if fmt == "dot" else to_mermaid(s.graph, ids))


# --------------------------------------------------------------------------- listings


@app.command()
def plugins(as_json: bool = JsonOpt) -> None:
    """List loaded plugins, their versions and what each registered."""
    reg = _registry()
    rows = [
        {
            "name": p.name,
            "version": p.version,
            "distribution": p.dist,
            "builtin": p.builtin,
            "registered": {k: v for k, v in p.registered.items() if v},
        }
        for p in reg.plugins.values()
    ]
    if as_json:
        _print_json({"plugins": rows, "disabled": reg.disabled})
        return
    table = Table(box=None, pad_edge=False)
    for col in ("plugin", "version", "registers"):
        table.add_column(col)
    for r in rows:
        regs = "; ".join(f"{k}: {', '.join(v)}" for k, v in r["registered"].items())
        table.add_row(r["name"], f"{r['distribution'] or ''} {r['version']}".strip(), regs or "-")
    out.print(table)
    if reg.disabled:
        out.print(f"disabled: {', '.join(reg.disabled)}")


@app.command()
def hardware(as_json: bool = JsonOpt) -> None:
    """List hardware profiles (compute capability, memory, bandwidth, SMs, precisions)."""
    reg = _registry()
    profiles = list(reg.hardware.values())
    if as_json:
        _print_json(
            {
                "profiles": [
                    {
                        **p.model_dump(mode="json"),
                        "precisions": list(p.precisions),
                        "plugin": reg.origin[("hardware", p.name)],
                    }
                    for p in profiles
                ]
            }
        )
        return
    table = Table(box=None, pad_edge=False)
    for col in ("profile", "device", "CC", "memory", "bandwidth", "SMs", "GPUs", "precisions"):
        table.add_column(col)
    for p in profiles:
        cc = ".".join(map(str, p.compute_capability)) if p.compute_capability else "-"
        table.add_row(
            p.name,
            p.gpu_name or p.device,
            cc,
            f"{p.memory_gb:g} GB" if p.memory_gb else "-",
            f"{p.bandwidth_gbps:g} GB/s" if p.bandwidth_gbps else "-",
            str(p.sm_count or "-"),
            str(p.gpu_count),
            ",".join(p.precisions),
        )
    out.print(table)


@app.command()
def schema(output: Optional[Path] = typer.Option(None, "--output", "-o", help="write to a file")) -> None:
    """Print the JSON Schema of the recipe format (for editor completion)."""
    from mopt.recipe import json_schema

    text = json.dumps(json_schema(_registry()), indent=2) + "\n"
    if output:
        output.write_text(text)
        err.print(f"wrote {output}")
    else:
        sys.stdout.write(text)


# --------------------------------------------------------------------------- entry point


def _register_extra_commands() -> None:
    """Commands that live in their own modules (build engine, checks, doctor)."""
    import importlib

    for modname in ("mopt.cli_build", "mopt.cli_check"):
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise
            continue
        mod.register(app)


def main() -> None:
    """Console entry point: map errors to exit codes, never a traceback for bad input."""
    _register_extra_commands()
    try:
        rv = app(standalone_mode=False)
    except MoptError as exc:
        err.print(f"error: {exc}", markup=False)
        sys.exit(exc.exit_code)
    except BuildFailed as exc:
        if str(exc):
            err.print(f"error: {exc}", markup=False)
        sys.exit(1)
    except click.exceptions.Abort:
        err.print("interrupted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
