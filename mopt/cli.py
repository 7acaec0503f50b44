"""The `mopt` command line. Exit codes: 0 ok, 1 build failed, 2 bad input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from mopt import __version__
from mopt.errors import BuildFailed, MoptError


class _Console:
    """Plain output to sys.stdout or sys.stderr (whichever they are when it prints)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    @property
    def stream(self) -> Any:
        return sys.stderr if self._stream == "stderr" else sys.stdout

    def print(self, text: object = "") -> None:
        self.stream.write(f"{text}\n")
        self.stream.flush()

    def table(
        self, columns: list[str], rows: list[list[str]], indent: str = "", right: tuple[int, ...] = ()
    ) -> None:
        """Aligned columns (those numbered in `right` to the right); never wrapped or cut when
        piped (one write: a 10,000-row plan)."""
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        fmt = (indent + "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))).format
        self.stream.write("".join([fmt(*columns).rstrip() + "\n", *[fmt(*r).rstrip() + "\n" for r in rows]]))
        self.stream.flush()


out = _Console("stdout")
err = _Console("stderr")

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _Group(click.Group):
    """The core's commands in other modules are added when a command runs (or for --help);
    plugins' commands are asked for only when the name is none of the core's."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        _register_extra_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        _register_extra_commands(plugins=False)
        if name not in self.commands:
            _register_extra_commands()
        return super().get_command(ctx, name)


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="mopt", message="%(prog)s %(version)s")
def app() -> None:
    """make for model optimization: build model artifacts (weights, ONNX, quantized graphs,
    engines, serving configs, images) from a recipe, reproducibly and incrementally.

    Exit codes: 0 ok, 1 a build failed, 2 bad input."""


def recipe_arg(f: Any) -> Any:
    return click.argument("recipe", required=False, type=click.Path(path_type=Path), callback=_recipe)(f)


def selectors_arg(f: Any) -> Any:  # (a first argument that is no recipe is the first selector)
    return click.argument("selectors", nargs=-1, callback=lambda c, _p, v: c.meta.pop("sel", ()) + v)(f)


def _recipe(ctx: click.Context, _param: Any, value: Path | None) -> Path:
    """RECIPE, else the one recipe (a *.toml with `schema =`) in the current folder."""
    import re

    if value is not None and (value.suffix == ".toml" or value.exists()):
        return value
    found = [p for p in sorted(Path().glob("*.toml")) if p.is_file() and re.search(r"(?m)^schema\s*=", p.read_text(errors="replace"))]  # fmt: skip
    if len(found) != 1:
        what = f"{len(found)} recipes in {Path.cwd()}: {', '.join(map(str, found))}" if found else f"no recipe (a *.toml with `schema = 1`) in {Path.cwd()}"  # fmt: skip
        raise MoptError(f"no RECIPE given, and {what}", hint="name one" if found else "give the recipe's path")
    ctx.meta["sel"] = () if value is None else (str(value),)
    return found[0]


def json_opt(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="machine-readable output on stdout")(f)


def _print_json(obj: Any) -> None:
    """Indented on a terminal; compact into a pipe or a file (the C encoder: a 10,000-node
    listing takes a third of the time the indenting one does)."""
    indent = 2 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(obj, indent=indent, separators=None if indent else (",", ":"), default=str) + "\n")


class Session:
    """A loaded recipe with its project, plugins and graph."""

    def __init__(self, recipe_path: Path, plugins: list[str] | None = None) -> None:
        """`plugins`: load just the built-ins and these (what the last build of this recipe
        used, while its build log shows them unchanged); a recipe that names anything else
        is loaded again with every plugin, so its errors and hints are the full registry's."""
        from mopt.config import load_project
        from mopt.gcpause import paused_gc
        from mopt.graph import build_graph
        from mopt.plugins import get_registry
        from mopt.recipe import load_recipe

        if not recipe_path.exists():
            raise MoptError("recipe not found", file=str(recipe_path), hint="give the path to a .toml recipe")
        with paused_gc(freeze=True):  # all of it lives as long as the session
            self.project = load_project(recipe_path.resolve().parent)
            disable = self.project.config.plugins.disable
            try:
                self.registry = get_registry(disable, plugins)
                self.recipe = load_recipe(recipe_path, self.registry)
                self.graph = build_graph(self.recipe, self.registry)
            except MoptError:
                if plugins is None:
                    raise
                self.registry = get_registry(disable)
                self.recipe = load_recipe(recipe_path, self.registry)
                self.graph = build_graph(self.recipe, self.registry)


def _disabled(project_dir: Path | None = None) -> list[str]:
    """The plugins the project at `project_dir` (default: the current folder) disables."""
    from mopt.config import load_project

    return list(load_project(project_dir or Path.cwd()).config.plugins.disable)


def _registry(project_dir: Path | None = None) -> Any:
    from mopt.plugins import get_registry

    return get_registry(_disabled(project_dir))


class PluginCore:
    """`mopt.api.Core`: what the core does for plugins' commands (`mopt_register_commands`)."""

    registry = staticmethod(_registry)

    def probe_gpus(self) -> Any:
        from mopt import machine

        return machine.probe_gpus()

    def gpu_matches(self, gpu: Any, profile: Any) -> str | None:
        from mopt import machine

        return machine.gpu_matches(gpu, profile)

    def built_target(self, recipe: Path, selector: str, *, kind: str | None = None) -> Any:
        from mopt.api import BuiltTarget
        from mopt.build import Engine

        s = Session(recipe)
        ids = [i for i in s.graph.select([selector]) if kind is None or s.graph.nodes[i].kind == kind]
        if selector.partition(":")[2]:
            named = set(s.graph.match([selector]))
            ids = [i for i in ids if i in named]
        if len(ids) != 1:
            what = f"{kind} targets" if kind else "targets"
            raise MoptError(
                f"{selector!r} names {len(ids)} {what}" + (f": {', '.join(ids[:5])}" if ids else ""),
                hint="give one model.hardware:target" + (f" of kind {kind}" if kind else ""),
            )
        node_id = ids[0]
        engine = Engine(s)
        try:
            info = engine.explain(node_id)
            entry = engine.store.ac_entry(info["key"]) if info["key"] else None
            if entry is None:
                raise MoptError(f"{node_id} is not built", hint=f"run: mopt build {recipe} '{node_id}'")
            files = {e.path: engine.store.blob_path(e.digest) for e in engine.store.tree_entries(entry.outputs_tree)}
            meta = dict(entry.meta.get("result") or {})
        finally:
            engine.store.close()
        return BuiltTarget(node_id, s.graph.nodes[node_id].kind, info["key"], files, meta)

    def nodes(self, recipe: Path, selectors: tuple[str, ...] = ()) -> list[Any]:
        from mopt.api import RecipeNode
        from mopt.build import Engine

        s = Session(recipe)
        ids = s.graph.select(list(selectors))
        engine = Engine(s, read_only=True)
        try:
            status = engine.plan(ids)
            found = []
            for i in ids:
                n, st = s.graph.nodes[i], status[i]
                entry = engine.store.ac_entry(st["key"]) if st["state"] == "up-to-date" else None
                inputs = {slot: list(deps) for slot, deps in n.inputs.items()}
                found.append(RecipeNode(i, n.section.id, n.model.name, n.hardware.name, n.label, n.kind, inputs,
                                        st["state"], st["summary"], engine.address_path(i),
                                        None if entry is None else _record(engine.store, entry, files=True)))  # fmt: skip
            return found
        finally:
            engine.store.close()

    def entry(self, recipe: Path, key: str) -> Any:
        from mopt.store import Store

        with Store(self._project(recipe).store_dir, read_only=True) as store:
            try:
                entry = store.ac_entry(key, check_blobs=False)
            except ValueError:  # not a key (a hand-edited lock file)
                return None
            return None if entry is None else _record(store, entry, files=False)

    def locked_keys(self, recipe: Path, text: str, where: str) -> dict[str, str]:
        from mopt.build import parse_lock

        recipes = parse_lock(text, where).get("recipes", {})
        entry = recipes.get(recipe.resolve().name)
        if not isinstance(entry, dict):
            raise MoptError(
                f"the lock file records no build of recipe {recipe.resolve().name}",
                file=where,
                hint=f"it records: {', '.join(sorted(recipes))}" if recipes else "it records no recipe at all",
            )
        return {i: k for i, k in entry.get("artifacts", {}).items() if isinstance(k, str)}

    def key_changes(self, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
        from mopt.keys import diff_parts

        return diff_parts(old, new)

    def build_dir(self, recipe: Path) -> Path:
        return self._project(recipe).build_dir

    @staticmethod
    def _project(recipe: Path) -> Any:
        from mopt.config import load_project

        return load_project(recipe.resolve().parent)


def _record(store: Any, entry: Any, files: bool) -> Any:
    """`mopt.api.ActionRecord` of a store's action entry (`files`: list its output tree)."""
    from mopt.api import ActionRecord

    tree = store.tree_entries(entry.outputs_tree) if files else []
    parts = entry.meta.get("parts")
    return ActionRecord(entry.key, entry.created, entry.duration_s, dict(entry.fingerprint),
                        dict(entry.meta.get("result") or {}), parts if isinstance(parts, dict) else {},
                        {f.path: (f.size, store.blob_path(f.digest)) for f in tree})  # fmt: skip


# --------------------------------------------------------------------------- plan / graph


@app.command(context_settings=CONTEXT)
@recipe_arg
@selectors_arg
@click.option("--no-log", is_flag=True, help="do not trust the build log: check every hit in the store")
@json_opt
def plan(recipe: Path, selectors: tuple[str, ...], no_log: bool, as_json: bool) -> None:
    """Show every node of RECIPE: kind, inputs, and whether it is up to date and why.

    SELECTORS are model.hardware:target, globs allowed ('*.h200', '*:onnx')."""
    from mopt import buildlog

    use_log = not no_log and not os.environ.get("MOPT_NO_LOG")
    if use_log and recipe.exists():
        log, _why = buildlog.noop(str(recipe), selectors, False, learn=False)
        if log is not None and not as_json:  # the last build of these selectors, nothing changed since
            import marshal

            for w in log.doc["result"]["warnings"]:
                err.print(f"warning: {w}")
            plan_table((i, n, kind, deps, "up to date", sec) for i, n, kind, deps, sec in marshal.loads(log.doc["result"]["plan"]))
            return
    s = Session(recipe, buildlog.plugins_of_last_build() if use_log else None)
    ids = s.graph.select(list(selectors))
    statuses = _statuses(s, ids, selectors, use_log)
    if as_json:
        _print_json({"recipe": str(s.recipe.path), "nodes": [node_json(s, i, statuses.get(i)) for i in ids]})
        return
    rows = ((i, len(n.addresses), n.kind, n.input_ids(), st["summary"] if (st := statuses.get(i)) else "-", n.section.id)
            for i in ids for n in (s.graph.nodes[i],))  # fmt: skip
    plan_table(rows)


def plan_table(rows: Any) -> None:
    """`mopt plan`'s table from (id, addresses, kind, input ids, status, section) per node."""
    table = []
    sections = set()
    for node_id, addresses, kind, deps, summary, section in rows:
        shared = f" (+{addresses - 1} shared)" if addresses > 1 else ""
        shown = ", ".join(deps) if len(deps) <= 3 else f"{len(deps)} nodes ({', '.join(deps[:2])}, …)"
        table.append([node_id + shared, kind, shown or "-", summary])
        sections.add(section)
    out.table(["target", "kind", "inputs", "status"], table)
    out.print(f"{len(table)} node(s) in {len(sections)} section(s)")


def _statuses(s: Session, ids: list[str], selectors: tuple[str, ...], use_log: bool) -> dict[str, dict[str, Any]]:
    from mopt.build import plan_status
    from mopt.gcpause import paused_gc

    with paused_gc():  # keying every node: a bounded burst, nothing of it is a cycle to free early
        return plan_status(s, ids, wanted=s.graph.match(list(selectors)), selectors=selectors, use_log=use_log)


def node_json(s: Session, i: str, status: dict[str, Any] | None) -> dict[str, Any]:
    """One node of `mopt plan --json`."""
    n = s.graph.nodes[i]
    d: dict[str, Any] = {"id": n.id, "addresses": n.addresses, "section": n.section.id, "model": n.model.name,
                         "hardware": n.hardware.name, "target": n.target.name, "label": n.label, "kind": n.kind,
                         "kind_version": n.kind_version, "plugin": n.plugin, "variant": dict(n.target.variant),
                         "params": n.params_json(), "inputs": n.inputs, "identity": n.identity}  # fmt: skip
    return d if status is None else {**d, "status": status}


@app.command(context_settings=CONTEXT)
@recipe_arg
@selectors_arg
@click.option("--format", "-f", "fmt", default="dot", show_default=True, help="dot or mermaid")
@json_opt
def graph(recipe: Path, selectors: tuple[str, ...], fmt: str, as_json: bool) -> None:
    """Print the build graph of RECIPE as Graphviz dot or a Mermaid flowchart (--json: its
    nodes, each with its kind, section and inputs per slot)."""
    from mopt.graph import to_dot, to_mermaid

    if fmt not in ("dot", "mermaid"):
        raise MoptError(f"unknown format {fmt!r}", key="--format", hint="use dot or mermaid")
    s = Session(recipe)
    ids = s.graph.select(list(selectors))
    if as_json:
        nodes = map(s.graph.nodes.__getitem__, ids)
        _print_json({"recipe": str(s.recipe.path), "nodes": [{"id": n.id, "kind": n.kind, "section": n.section.id, "inputs": n.inputs} for n in nodes]})  # fmt: skip
    else:
        sys.stdout.write(to_dot(s.graph, ids) if fmt == "dot" else to_mermaid(s.graph, ids))


# --------------------------------------------------------------------------- listings


@app.command(context_settings=CONTEXT)
@json_opt
def plugins(as_json: bool) -> None:
    """List loaded plugins, their versions and what each registered."""
    reg = _registry()
    rows = [{"name": p.name, "version": p.version, "distribution": p.dist, "builtin": p.builtin,
             "registered": {k: v for k, v in p.registered.items() if v}} for p in reg.plugins.values()]  # fmt: skip
    if as_json:
        _print_json({"plugins": rows, "disabled": reg.disabled})
        return
    out.table(["plugin", "version", "registers"],
              [[r["name"], f"{r['distribution'] or ''} {r['version']}".strip(),
                "; ".join(f"{k}: {', '.join(v)}" for k, v in r["registered"].items()) or "-"] for r in rows])  # fmt: skip
    if reg.disabled:
        out.print(f"disabled: {', '.join(reg.disabled)}")


@app.command(context_settings=CONTEXT)
@json_opt
def hardware(as_json: bool) -> None:
    """List hardware profiles (compute capability, memory, bandwidth, SMs, precisions)."""
    reg = _registry()
    profiles = list(reg.hardware.values())
    if as_json:
        _print_json({"profiles": [{**p.model_dump(mode="json"), "precisions": list(p.precisions),
                                   "plugin": reg.origin[("hardware", p.name)]} for p in profiles]})  # fmt: skip
        return
    rows = [[p.name, p.gpu_name or p.kind_label, ".".join(map(str, p.compute_capability or ())) or "-",
             f"{p.memory_gb:g} GB" if p.memory_gb else "-", f"{p.bandwidth_gbps:g} GB/s" if p.bandwidth_gbps else "-",
             str(p.sm_count or "-"), str(p.gpu_count), ",".join(p.precisions)] for p in profiles]  # fmt: skip
    out.table(["profile", "device", "CC", "memory", "bandwidth", "SMs", "GPUs", "precisions"], rows)


@app.command(context_settings=CONTEXT)
@click.option("--output", "-o", type=click.Path(path_type=Path), help="write to a file")
def schema(output: Path | None) -> None:
    """Print the JSON Schema of the recipe format (for editor completion)."""
    from mopt.recipe import json_schema

    text = json.dumps(json_schema(_registry()), indent=2) + "\n"
    if output:
        output.write_text(text)
        err.print(f"wrote {output}")
    else:
        sys.stdout.write(text)


# --------------------------------------------------------------------------- entry point

_registered: set[str] = set()


def _register_extra_commands(plugins: bool = True) -> None:
    """The core's commands of other modules (build engine, checks, doctor, cache), then, with
    `plugins`, the plugins' (`mopt_register_commands`)."""
    import importlib

    for modname in ("mopt.cli_build", "mopt.cli_check", "mopt.cli_cache"):
        if modname not in _registered:
            _registered.add(modname)
            importlib.import_module(modname).register(app)
    if plugins and "plugins" not in _registered:
        from mopt.plugins import register_commands

        disabled = _disabled()
        _registered.add("plugins")
        register_commands(app, PluginCore(), disabled)


def main() -> None:
    """Console entry point: map errors to exit codes, never a traceback for bad input."""
    try:
        rv = app.main(standalone_mode=False, prog_name="mopt")
    except (MoptError, click.ClickException) as exc:
        if exc.__cause__ is not None and os.environ.get("MOPT_TRACEBACK"):  # a plugin's bug: where
            __import__("traceback").print_exception(exc.__cause__)
        if "--json" in sys.argv[1:]:  # the error as data on stdout, where the answer would be
            where = {k: getattr(exc, k) for k in ("file", "line", "table", "key")} if isinstance(exc, MoptError) else None
            _print_json({"error": exc.message, "where": where, "hint": getattr(exc, "hint", None)})
        elif isinstance(exc, MoptError):
            err.print(f"error: {exc}")
        else:
            exc.show()
        sys.exit(exc.exit_code)
    except BuildFailed as exc:
        if str(exc):
            err.print(f"error: {exc}")
        sys.exit(1)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("interrupted")
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
