"""`mopt build`, `explain`, `show`, `ls`, `gc`: the commands that use the store."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click

from mopt.cli import CONTEXT, PluginCore, Session, _print_json, err, json_opt, out, recipe_arg, selectors_arg
from mopt.errors import BuildFailed, MoptError, human
from mopt.gcpause import paused_gc


def _target(ctx: click.Context, _param: Any, value: str | None) -> str:
    """TARGET, else the first argument when it was no recipe (`mopt show TARGET` beside one recipe)."""
    if got := value or next(iter(ctx.meta.pop("sel", ())), None):
        return got
    raise MoptError("no TARGET given", hint="name one: model.hardware:target, as `mopt plan` lists them")


target_arg = click.argument("target", required=False, callback=_target)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DUR = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """`200G`, `512M`, `1.5T` → bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if not m:
        raise MoptError(f"bad size {text!r}", key="--max-size", hint="e.g. 200G, 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m` → seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smhdw])\s*", text)
    if not m:
        raise MoptError(f"bad duration {text!r}", key="--older-than", hint="e.g. 30d, 12h, 90m")
    return float(m.group(1)) * _DUR[m.group(2)]


def _outcome(st: Any) -> str:
    """How long a built action took, else why it ended as it did (if it says)."""
    return f" in {st.duration:.1f}s" if st.status == "built" else f": {st.reason}" if st.reason else ""


class LineReporter:
    """One line per finished action (logs, CI, pipes)."""

    def __init__(self, stream: Any, quiet: bool = False, progress: bool | None = None) -> None:
        self.stream = stream
        self.quiet = quiet
        self.show_progress = not quiet if progress is None else progress
        self.total = 0
        self.n = 0

    def start(self, states: dict[str, Any]) -> None:
        self.total = len(states)

    def started(self, st: Any) -> None:
        if not self.quiet:
            self.stream.write(f"[{self.n}/{self.total}] running {st.node.id} ({st.node.kind})\n")
            self.stream.flush()

    def waiting(self, st: Any) -> None:
        self.stream.write(f"waiting for another mopt process building {st.node.id}\n")
        self.stream.flush()

    def done(self, st: Any) -> None:
        self.n += 1
        if not (self.quiet and st.status == "cached"):
            self.stream.write(f"[{self.n}/{self.total}] {st.status} {st.node.id}{_outcome(st)}\n")
            self.stream.flush()

    def progress(self, st: Any, msg: str) -> None:
        if self.show_progress:
            self.stream.write(f"      {st.node.id}: {msg}\n")
            self.stream.flush()

    def tick(self) -> None: ...

    def stop(self) -> None: ...


class LiveReporter(LineReporter):
    """A live view of running actions (elapsed, last log line) on a terminal."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True, highlight=False, markup=False, emoji=False)  # names print as they are
        self.console = console
        self.running: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self.live = Live(console=console, refresh_per_second=4, transient=True)

    def start(self, states: dict[str, Any]) -> None:
        super().start(states)
        self.live.start()

    def started(self, st: Any) -> None:
        self.running[st.node.id] = st
        self._refresh()

    def done(self, st: Any) -> None:
        self.n += 1
        self.running.pop(st.node.id, None)
        self.counts[st.status] = self.counts.get(st.status, 0) + 1
        if st.status != "cached":
            self.live.console.print(f"{st.status:>11} {st.node.id}{_outcome(st)}")
        self._refresh()

    def progress(self, st: Any, msg: str) -> None: ...  # the live view shows it as the last line

    def tick(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        from rich.table import Table
        from rich.text import Text

        t = Table.grid(padding=(0, 1))
        now = time.time()
        for st in self.running.values():
            t.add_row(
                Text(f"{now - st.started:6.1f}s", style="cyan"),
                Text(st.node.id),
                Text(st.last_line, style="dim", no_wrap=True, overflow="ellipsis"),  # cut to the terminal
            )
        summary = ", ".join(f"{v} {k}" for k, v in sorted(self.counts.items()))
        t.add_row(Text(""), Text(f"[{self.n}/{self.total}] {summary}", style="bold"), Text(""))
        self.live.update(t)

    def stop(self) -> None:
        self.live.stop()


def register(app: click.Group) -> None:
    """Add the store commands to the CLI."""
    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @selectors_arg
    @click.option("--jobs", "-j", type=click.IntRange(min=1), help="parallel actions (default: the CPUs this process may use)")
    @click.option("--keep-going", "-k", is_flag=True, help="build what can be built after a failure")
    @click.option("--offline", is_flag=True, help="never touch the network")
    @click.option("--frozen", is_flag=True, help="fail if sources or tools differ from mopt.lock")
    @click.option("--no-check", is_flag=True, help="skip `mopt check` before building")
    @click.option("--quiet", "-q", is_flag=True, help="do not list cached actions")
    @click.option("--no-lock", is_flag=True, help="do not write mopt.lock (e.g. a read-only recipe folder)")
    @click.option("--no-log", is_flag=True, help="do not trust the build log: check every hit in the store")
    @click.option("--rebuild", metavar="SEL", multiple=True, help="run the targets SEL selects again, up to date or not")
    @json_opt
    # keying 10,000 cached nodes makes ~1M objects that live until the end (the graph, the
    # entries, their manifests); each full collection walks them all again (~1.7 s of 7.5 s
    # there). The engine turns the collector back on at the first action it runs.
    @paused_gc()
    def build(
        recipe: Path,
        selectors: tuple[str, ...],
        jobs: int | None,
        keep_going: bool,
        offline: bool,
        frozen: bool,
        no_check: bool,
        quiet: bool,
        no_lock: bool,
        no_log: bool,
        rebuild: tuple[str, ...],
        as_json: bool,
    ) -> None:
        """Build the selected targets of RECIPE: cache hits are reused, misses run.

        SELECTORS are model.hardware:target, globs allowed ('*.h200', '*:onnx')."""
        from mopt import buildlog

        t0 = time.time()
        use_log = not no_log and not os.environ.get("MOPT_NO_LOG")
        miss = "--no-log"
        if use_log and not rebuild:  # (`python -m mopt` asked already, before click was imported)
            log, miss = buildlog.noop(str(recipe), selectors, offline) if recipe.exists() else (None, "")
            if log is not None:  # nothing it depends on changed: no plugins, no keys
                buildlog.report(log, time.time() - t0, as_json, quiet)
                return
        from mopt.build import Engine

        s = Session(recipe, buildlog.plugins_of_last_build() if use_log else None)
        wanted = s.graph.match(list(selectors))
        ids = s.graph.closure(wanted)
        if not no_check:
            from mopt.cli_check import run_check_for_build

            run_check_for_build(s, ids)
        engine = Engine(s, offline=offline, selectors=selectors, use_log=use_log)
        engine.rebuild = set(s.graph.match(list(rebuild))) if rebuild else set()
        if as_json or not sys.stderr.isatty() or os.environ.get("CI"):
            # --json: the report is stdout's; stderr still carries long actions' progress
            reporter: Any = LineReporter(sys.stderr, quiet=quiet or as_json, progress=not quiet)
        else:
            reporter = LiveReporter()
        # a service manager's stop (SIGTERM) or a closed terminal (SIGHUP) stops the actions
        # like Ctrl-C does, instead of leaving them running
        from mopt import procs

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, procs.raise_terminated)
        try:
            states = engine.run(ids, wanted=wanted, jobs=jobs, keep_going=keep_going, reporter=reporter,
                                frozen=frozen, lock=not no_lock)
        except KeyboardInterrupt as exc:
            _interrupted(exc)
        for w in engine.warnings:
            err.print(f"warning: {w}")
        _report_build(engine, states, time.time() - t0, as_json, miss)

    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @target_arg
    @json_opt
    def explain(recipe: Path, target: str, as_json: bool) -> None:
        """Print the parts of TARGET's action key (what its cache entry depends on)."""
        from mopt.build import Engine

        s = Session(recipe)
        node_id = _one(s, target)
        engine = Engine(s, read_only=True)
        info = engine.explain(node_id)
        if as_json:
            _print_json(info)
            return
        out.print(f"{info['id']}")
        out.print(f"  key: {info['key'] or '(not known until its inputs are built)'}")
        for k, v in info["parts"].items():
            out.print(f"  {k}: {json.dumps(v, sort_keys=True)}")
        for p in info["inputs_not_built"]:
            out.print(f"  input not built yet: {p}")

    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @target_arg
    @json_opt
    def show(recipe: Path, target: str, as_json: bool) -> None:
        """Print a built TARGET's manifest (files, sizes, digests) and provenance."""
        from mopt.build import Engine

        s = Session(recipe)
        node_id = _one(s, target)
        engine = Engine(s, read_only=True)
        info = engine.explain(node_id)
        entry = engine.hit(info["key"], fetch=False) if info["key"] else None
        if entry is None:
            raise MoptError(f"{node_id} is not built", hint=f"run: mopt build {recipe} '{node_id}'")
        files = engine.store.tree_entries(entry.outputs_tree)
        path = engine.address_path(node_id)
        data: dict[str, Any] = {
            "id": node_id,
            "path": str(path),
            # whether build/ holds these bytes (another recipe's target of the same name may
            # have been laid out there since)
            "laid_out": engine.store.holds(entry.outputs_tree, path),
            "key": entry.key,
            "outputs_tree": entry.outputs_tree,
            "files": [
                {"path": f.path, "size": f.size, "mode": oct(f.mode), "digest": f.digest} for f in files
            ],
            "provenance": {
                "kind": entry.kind,
                "duration_s": entry.duration_s,
                "host": entry.host,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.created)),
                "fingerprint": entry.fingerprint,
                "log": entry.log,
                "reproducible": entry.meta.get("reproducible", True),
                "result": entry.meta.get("result", {}),
                "key_parts": entry.meta.get("parts", {}),
            },
        }
        if as_json:
            _print_json(data)
            return
        out.print(f"{node_id}  ({data['path']})")
        if not data["laid_out"]:
            out.print(f"  note: {data['path']} does not hold these bytes (run: mopt build {recipe} '{node_id}')")
        out.print(f"  key {entry.key}\n  tree {entry.outputs_tree}")
        for f in data["files"]:
            name = f["path"] if f["path"].isprintable() else repr(f["path"])[1:-1]  # a newline, ESC: escaped
            out.print(f"  {human(f['size']):>10}  {f['digest'][:16]}  {name}")
        prov = data["provenance"]
        out.print(
            f"  built by {prov['kind']} on {prov['host']} at {prov['created']} in {prov['duration_s']:.2f}s"
        )
        if not prov["reproducible"]:
            out.print("  note: this kind's output is not bit-reproducible (rebuilds differ byte-wise)")
        for k, v in prov["fingerprint"].items():
            out.print(f"  tool {k} {v}")
        if prov["result"]:
            out.print(f"  result {json.dumps(prov['result'], sort_keys=True)[:400]}")

    @app.command("ls", context_settings=CONTEXT)
    @recipe_arg
    @selectors_arg
    @json_opt
    def ls_(recipe: Path, selectors: tuple[str, ...], as_json: bool) -> None:
        """List built artifacts of RECIPE with their sizes."""
        nodes = PluginCore().nodes(recipe, selectors)
        rows: list[dict[str, Any]] = [
            {
                "id": n.id,
                "kind": n.kind,
                "files": len(n.built.files),
                "bytes": sum(size for size, _blob in n.built.files.values()),
                "path": str(n.path),
                "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(n.built.created)),
            }
            for n in nodes
            if n.built is not None
        ]
        if as_json:
            _print_json({"artifacts": rows})
            return
        for r in rows:
            out.print(
                f"{human(r['bytes']):>10}  {r['files']:>4} files  {r['built']}  {r['id']}  ({r['kind']})"
            )
        out.print(f"{len(rows)} built of {len(nodes)}; {human(sum(r['bytes'] for r in rows))} in all")

    @app.command(context_settings=CONTEXT)
    @click.option("--max-size", help="shrink the store below this (e.g. 200G)")
    @click.option("--older-than", help="drop entries unused for this long (e.g. 30d)")
    @click.option("--dry-run", is_flag=True, help="say what would go, remove nothing")
    @click.option("--force", is_flag=True, help="collect even if a lock file cannot be read (it pins nothing)")
    @json_opt
    def gc(max_size: str | None, older_than: str | None, dry_run: bool, force: bool, as_json: bool) -> None:
        """Remove least recently used cache entries; never what lock files reference.

        Roots are the project's mopt.lock files and every lock file registered in the
        store's roots/ folder by a build of any project sharing the store. Entries a running
        build uses are kept too."""
        from mopt.config import load_project
        from mopt.store import Store

        project = load_project(Path.cwd())
        if not project.store_dir.exists():
            raise MoptError(f"no store at {project.store_dir}", hint="run mopt build first")
        with Store(project.store_dir) as store:
            keep = _lock_roots(
                project.root, store, force=force, skip=[project.store_dir, project.build_dir], prune=not dry_run
            )
            rep = store.gc(
                max_size_bytes=parse_size(max_size) if max_size else None,
                older_than_s=parse_duration(older_than) if older_than else None,
                keep_keys=keep,
                dry_run=dry_run,
            )
        data = {**rep.__dict__, "kept_by_lock_files": len(keep)}
        if as_json:
            _print_json(data)
            return
        verb = "would remove" if dry_run else "removed"
        out.print(
            f"{verb} {rep.removed_entries} entries, {rep.removed_blobs} blobs, {human(rep.removed_bytes)}; "
            f"kept {rep.kept_entries} entries ({human(rep.kept_bytes)}), {len(keep)} pinned by lock files"
        )


def _interrupted(exc: KeyboardInterrupt) -> None:
    """Stop every action and exit 128 + the signal: outputs are in the store's tmp/ only."""
    from mopt import procs, runner

    signum = exc.signum if isinstance(exc, procs.Terminated) else int(signal.SIGINT)
    runner.kill_all()
    what = {int(signal.SIGTERM): "terminated (SIGTERM)", int(signal.SIGHUP): "hung up (SIGHUP)"}
    err.print(f"{what.get(signum, 'interrupted')}: running actions stopped; nothing partial was stored")
    sys.stderr.flush()
    os._exit(128 + signum)  # worker threads may be inside a library call


def _report_build(engine: Any, states: dict[str, Any], seconds: float, as_json: bool, miss: str) -> None:
    """What `mopt build` prints after a build that was not a no-op; BuildFailed if one failed."""
    counts = dict(Counter(st.status for st in states.values()))
    failed = [st for st in states.values() if st.status in ("failed", "unbuildable", "blocked")]
    if as_json:
        state = engine.store.state
        _print_json(
            {
                "recipe": str(engine.recipe.path),
                "seconds": round(seconds, 3),
                "counts": counts,
                "io": {
                    "hashed_files": state.hashed_files,
                    "hashed_bytes": state.hashed_bytes,
                    "stat_hits": state.hits,
                    # hits the build log vouched for (entry and blobs not read again)
                    "logged": len(engine._from_log),
                    # why this build was not a no-op, and why the log was not used
                    "noop_miss": miss,
                    "log_miss": engine.log_miss,
                    # the plugins loaded besides the built-ins (after an edit, only those the
                    # last build used, while the log shows them unchanged)
                    "plugins": sorted(p for p in engine.registry.plugins if not p.startswith("mopt.builtin")),
                },
                "build_dir": str(engine.build_dir),
                "nodes": [st.as_json() for st in states.values()],
            }
        )
    else:
        off = engine.fast_path_off(states)
        if off and not failed:
            err.print(f"note: no-op fast path off: {off}")
        for st in failed:
            if st.status == "failed":
                err.print(f"FAILED {st.node.id}: {st.reason}")
                if st.log_path:
                    # the action's own last lines: mopt's FAILED line and traceback close the log
                    lines = Path(st.log_path).read_text(errors="replace").splitlines()
                    end = max((k for k, line in enumerate(lines) if line.startswith("mopt: FAILED: ")), default=len(lines))
                    for line in lines[:end][-15:]:
                        err.print(f"  | {line}")
                    err.print(f"  full log: {st.log_path}")
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        err.print(f"{len(states)} action(s): {summary} in {seconds:.2f}s")
        done = [engine.address_path(i) for i, st in states.items() if st.status in ("built", "cached")]
        reports = sorted(p for d in done for p in (d / "report.html", d / "selection.html") if p.is_file())
        for line in engine.selected(states):
            err.print(line)
        if reports:
            err.print("reports:")
            for r in reports[:20]:
                err.print(f"  {r}")
        err.print(f"artifacts under {engine.build_dir}")
    if failed:
        raise BuildFailed("")


#: folders under a project never holding its lock files (skipped by name below the root only)
_NOT_LOCK_DIRS = frozenset({".mopt", ".venv", "venv", "build", ".nox", ".git", ".tox", "node_modules", "__pycache__"})


def project_lock_files(root: Path, skip: list[Path] | None = None) -> list[Path]:
    """mopt.lock files under `root`, not descending into virtualenvs, stores, build/ or VCS
    folders. Only names below `root` count: a project under /home/x/build/ keeps its roots."""
    skipped = {os.path.realpath(p) for p in skip or []}
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in _NOT_LOCK_DIRS and os.path.realpath(os.path.join(dirpath, d)) not in skipped
        )
        if "mopt.lock" in filenames:
            found.append(Path(dirpath) / "mopt.lock")
    return found


def _lock_roots(
    root: Path, store: Any, *, force: bool = False, skip: list[Path] | None = None, prune: bool = True
) -> set[str]:
    """Action keys pinned by the project's lock files and those registered in the store.

    A lock file that exists but cannot be read stops gc (exit 2 naming it): dropping what
    it pinned is the one thing gc promises not to do. `force` skips it with a warning."""
    from mopt.build import LockFileError, lock_keys

    keys: set[str] = set()
    files = {os.path.abspath(p) for p in project_lock_files(root, skip)}
    files |= {os.path.abspath(p) for p in store.roots(prune=prune)}
    for p in sorted(files):
        try:
            keys |= lock_keys(Path(p))
        except LockFileError as exc:
            if not force:
                raise MoptError(
                    f"{exc.message}; gc would drop what it pins",
                    file=p,
                    hint="fix or delete the file, or run `mopt gc --force` to collect anyway",
                ) from None
            err.print(f"warning: {exc} (--force: ignoring it)")
    return keys


def _one(s: Any, target: str) -> str:
    named = set(s.graph.match([target]))  # exact names first, then globs
    ids = [i for i in s.graph.select([target]) if i in named and _matches(s.graph.nodes[i], target)]
    if len(ids) != 1:
        raise MoptError(
            f"{target!r} names {len(ids)} targets" + (f": {', '.join(ids[:5])}" if ids else ""),
            hint="give one model.hardware:target (a variant's full label if swept)",
        )
    return ids[0]


def _matches(node: Any, sel: str) -> bool:
    import fnmatch

    def part(name: str, pattern: str) -> bool:  # a printed id (`bench[int8]`) is itself
        return name == pattern or fnmatch.fnmatchcase(name, pattern or "*")

    sec, _, tgt = sel.partition(":")
    return any(
        part(a.partition(":")[0], sec)
        and (
            part(a.partition(":")[2], tgt)
            or (tgt == node.target.name and a.partition(":")[2] == node.label)
        )
        for a in node.addresses
    )
