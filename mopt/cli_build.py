"""`mopt build`, `explain`, `show`, `ls`, `gc`: the commands that use the store."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from mopt.errors import BuildFailed, MoptError

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


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class LineReporter:
    """One line per finished action (logs, CI, pipes)."""

    def __init__(self, stream: Any, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
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
        if self.quiet and st.status == "cached":
            return
        extra = ""
        if st.status == "built":
            extra = f" in {st.duration:.1f}s"
        elif st.reason:
            extra = f": {st.reason}"
        self.stream.write(f"[{self.n}/{self.total}] {st.status} {st.node.id}{extra}\n")
        self.stream.flush()

    def tick(self) -> None: ...

    def stop(self) -> None: ...


class LiveReporter(LineReporter):
    """A live view of running actions (elapsed, last log line) on a terminal."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True, highlight=False)
        self.console = console
        self.running: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self.live = Live(console=console, refresh_per_second=4, transient=True)

    def start(self, states: dict[str, Any]) -> None:
        self.total = len(states)
        self.live.start()

    def started(self, st: Any) -> None:
        self.running[st.node.id] = st
        self._refresh()

    def done(self, st: Any) -> None:
        self.n += 1
        self.running.pop(st.node.id, None)
        self.counts[st.status] = self.counts.get(st.status, 0) + 1
        if st.status != "cached":
            extra = (
                f" in {st.duration:.1f}s" if st.status == "built" else (f": {st.reason}" if st.reason else "")
            )
            self.live.console.print(f"{st.status:>11} {st.node.id}{extra}", markup=False, highlight=False)
        self._refresh()

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
                Text(st.last_line[-80:], style="dim"),
            )
        summary = ", ".join(f"{v} {k}" for k, v in sorted(self.counts.items()))
        t.add_row(Text(""), Text(f"[{self.n}/{self.total}] {summary}", style="bold"), Text(""))
        self.live.update(t)

    def stop(self) -> None:
        self.live.stop()


def _collector_paused(command: Any) -> Any:
    """Run `command` with Python's cyclic collector off. Keying 10,000 cached nodes makes ~1M
    objects that live until the end (the graph, the entries, their manifests); each full
    collection walks them all again, ~1.7 s of ~7.5 s there. The engine turns the collector
    back on at the first action it runs (a build that runs something takes long anyway), and
    it is on again at the end."""
    import functools

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from mopt.gcpause import paused_gc

        try:
            with paused_gc():
                return command(*args, **kwargs)
        finally:
            if "mopt.build" in sys.modules:
                setattr(sys.modules["mopt.build"], "gc_paused", False)  # noqa: B010

    return run


def register(app: click.Group) -> None:
    """Add the store commands to the CLI."""
    from mopt.cli import CONTEXT, Session, _print_json, err, json_opt, out, recipe_arg, selectors_arg

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
    @json_opt
    @_collector_paused
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
        as_json: bool,
    ) -> None:
        """Build the selected targets of RECIPE: cache hits are reused, misses run.

        SELECTORS are model.hardware:target, globs allowed ('*.h200', '*:onnx')."""
        import gc

        from mopt import noop

        t0 = time.time()
        store_dir = noop.find_store_dir(str(recipe)) if recipe.exists() else None
        stamp = noop.stamp_path(store_dir, str(recipe), list(selectors), offline) if store_dir else None
        ident = noop.ident_of(str(recipe), list(selectors), offline)
        prehashing = None
        if stamp is not None:
            # (`python -m mopt` asked already, before click was imported: `noop.fast_main`)
            done = noop.consult(stamp, ident)
            if done is not None:  # nothing it depends on changed: no plugins, no keys
                noop.report(done, time.time() - t0, as_json, quiet)
                return
            prehashing = noop.prehashing  # the changed input files, being digested
        from mopt import build as build_mod
        from mopt import procs
        from mopt.build import (
            Engine,
            LockFileError,
            current_lock,
            frozen_diff,
            noop_stamp_inputs,
            vouched_expect,
            vouched_nodes_now,
            vouched_stamp_updates,
            write_lock,
        )

        build_mod.gc_paused = not gc.isenabled()

        s = Session(recipe, writes_store=True)
        if prehashing is not None:
            prehashing.join()
        wanted = s.graph.match(list(selectors))
        ids = s.graph.closure(wanted)
        if not no_check:
            _run_check(s, ids)
        engine = Engine(s, offline=offline)
        if prehashing is not None:
            engine.prehashed = dict(prehashing.results)
        vouched = None
        if stamp is not None:
            # the stale stamp's word for the nodes whose key is the one it recorded: their
            # blobs and build/ folders are unchanged since that build found them intact
            vouched = noop.vouch(stamp, ident, store_dir=str(engine.store.root), build_dir=str(engine.build_dir))
            if vouched is not None:
                engine.vouched = vouched["nodes"]
                engine.vouched_digests = build_mod.vouched_input_digests(vouched)
        # the action runner's zygotes import torch & co. while the sources are resolved
        engine.prestart(ids, jobs)
        try:
            lock_now = current_lock(engine, ids)
            if frozen:
                diffs = frozen_diff(s.recipe.path, lock_now)
                if diffs:
                    raise MoptError(
                        "--frozen: " + "; ".join(diffs),
                        file=str(s.recipe.path.parent / "mopt.lock"),
                        hint="rebuild without --frozen to update the lock file",
                    )
        except BaseException:
            engine.stop_prestarted()
            raise
        reporter: Any
        if as_json or not sys.stderr.isatty() or os.environ.get("CI"):
            reporter = LineReporter(sys.stderr, quiet=quiet or as_json)
        else:
            reporter = LiveReporter()
        # a service manager's stop (SIGTERM) or a closed terminal (SIGHUP) stops the actions
        # like Ctrl-C does, instead of leaving them running
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, procs.raise_terminated)
        try:
            states = engine.build(
                ids, jobs=jobs, keep_going=keep_going, reporter=reporter, materialize=set(wanted)
            )
        except KeyboardInterrupt as exc:
            from mopt import runner

            signum = exc.signum if isinstance(exc, procs.Terminated) else int(signal.SIGINT)
            runner.kill_all()
            procs.kill_all()
            what = {int(signal.SIGTERM): "terminated (SIGTERM)", int(signal.SIGHUP): "hung up (SIGHUP)"}
            err.print(f"{what.get(signum, 'interrupted')}: running actions stopped; nothing partial was stored")
            sys.stderr.flush()
            os._exit(128 + signum)  # worker threads may be inside a library call; outputs are in tmp only
        finally:
            engine.store.close()
        # off again (the first action run turned it on): the lock, stamp and plan files are
        # made of ~100,000 objects at 10,000 nodes that all stay alive; on at the end
        gc.disable()
        artifacts = {
            st.node.id: st.key for st in states.values() if st.status in ("built", "cached") and st.key
        }
        if not frozen and not no_lock:
            try:
                # taken again: it now holds the digests of the declared sources the build read
                write_lock(s.recipe.path, current_lock(engine, ids), artifacts, store=engine.store)
            except LockFileError as exc:
                err.print(f"warning: {exc}")
        elif (s.recipe.path.parent / "mopt.lock").exists():
            engine.store.add_root(s.recipe.path.parent / "mopt.lock")
        counts: dict[str, int] = {}
        for st in states.values():
            counts[st.status] = counts.get(st.status, 0) + 1
        failed = [st for st in states.values() if st.status in ("failed", "unbuildable", "blocked")]
        selected = _selected(states, engine.build_dir, s.recipe)
        no_fast_path = _fast_path_off(engine, states)
        if no_fast_path and not failed and not as_json:
            err.print(f"note: {no_fast_path}")
        if stamp is not None:
            from mopt import planstamp

            planstamp.forget(stamp)  # removed first: a crash below leaves no plan file behind
            nodes = [dict(st.as_json(), status="cached") for st in states.values()]
            token = planstamp.new_token()
            result = {
                "recipe": str(s.recipe.path),
                "n": len(states),
                "build_dir": str(engine.build_dir),
                "nodes": nodes,
                "selected": selected,
                "plan_token": token,
            }
            # every node vouched for, only the recipe/settings/lock changed: the stamp is the
            # old one with their new stats (what the full write below would record)
            updates = None if failed or vouched is None else vouched_stamp_updates(engine, states, vouched)
            watch = None
            patched = updates is not None and noop.patch(
                stamp, vouched["stamp"], updates, result, nodes=vouched_nodes_now(engine, vouched)  # type: ignore[arg-type,index]
            )
            if not patched:  # else the patched stamp stands
                if failed:
                    noop.invalidate(stamp)
                elif (watch := noop_stamp_inputs(engine, states)) is None and no_fast_path:
                    noop.skip(stamp, no_fast_path)
                elif watch is None:
                    noop.invalidate(stamp)
                else:
                    expect = None
                    if vouched is not None and engine.vouched_n:
                        # the files of vouched nodes, filed under the stat the stamp showed them at
                        expect = vouched_expect(engine, vouched)
                    noop.write(stamp, **watch, ident=ident, result=result, expect=expect)
            if os.path.exists(stamp):  # `mopt plan` of these selectors, answered from it
                keys = {i: st.key for i, st in states.items() if st.key}
                planstamp.write(stamp, token, s, engine, ids, keys)
        if as_json:
            _print_json(
                {
                    "recipe": str(s.recipe.path),
                    "seconds": round(time.time() - t0, 3),
                    "counts": counts,
                    "io": {
                        "hashed_files": engine.store.state.hashed_files + engine.prehashed_files,
                        "hashed_bytes": engine.store.state.hashed_bytes + engine.prehashed_bytes,
                        # of those, hashed while the build loaded (after a no-op miss)
                        "prehashed_files": engine.prehashed_files,
                        # hits the stale no-op stamp vouched for (blobs, build/ not checked again)
                        "vouched": engine.vouched_n,
                        "stat_hits": engine.store.state.hits,
                        # why the no-op fast path was not taken
                        "noop_miss": noop.last_miss if stamp is not None else "no store folder",
                    },
                    "build_dir": str(engine.build_dir),
                    "nodes": [st.as_json() for st in states.values()],
                }
            )
        else:
            for st in failed:
                if st.status == "failed":
                    err.print(f"FAILED {st.node.id}: {st.reason}")
                    if st.log_path:
                        tail = Path(st.log_path).read_text(errors="replace").splitlines()[-15:]
                        for line in tail:
                            err.print(f"  | {line}")
                        err.print(f"  full log: {st.log_path}")
            summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            err.print(f"{len(states)} action(s): {summary} in {time.time() - t0:.2f}s")
            built_dirs = {engine.build_dir / s.graph.nodes[i].model.name for i in ids}
            reports = sorted(
                p
                for d in built_dirs
                if d.exists()
                for pat in ("**/report.html", "**/selection.html")
                for p in d.glob(pat)
            )
            for line in selected:
                err.print(line)
            if reports:
                err.print("reports:")
                for r in reports[:20]:
                    err.print(f"  {r}")
            err.print(f"artifacts under {engine.build_dir}")
        if failed:
            raise BuildFailed("")

    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @click.argument("target")
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
    @click.argument("target")
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
        data: dict[str, Any] = {
            "id": node_id,
            "path": str(engine.address_path(node_id)),
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
        out.print(f"  key {entry.key}\n  tree {entry.outputs_tree}")
        for f in data["files"]:
            out.print(f"  {human(f['size']):>10}  {f['digest'][:16]}  {f['path']}")
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
        from mopt.build import Engine

        s = Session(recipe)
        ids = s.graph.select(list(selectors))
        engine = Engine(s, read_only=True)
        status = engine.plan(ids)
        rows: list[dict[str, Any]] = []
        for i in ids:
            st = status[i]
            key = st.get("key")
            entry = engine.store.ac_entry(key) if key and st["state"] == "up-to-date" else None
            if entry is None:
                continue
            files = engine.store.tree_entries(entry.outputs_tree)
            rows.append(
                {
                    "id": i,
                    "kind": s.graph.nodes[i].kind,
                    "files": len(files),
                    "bytes": sum(f.size for f in files),
                    "path": str(engine.address_path(i)),
                    "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created)),
                }
            )
        if as_json:
            _print_json({"artifacts": rows})
            return
        for r in rows:
            out.print(
                f"{human(r['bytes']):>10}  {r['files']:>4} files  {r['built']}  {r['id']}  ({r['kind']})"
            )
        out.print(f"{len(rows)} built of {len(ids)}; {human(sum(r['bytes'] for r in rows))} in all")

    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @selectors_arg
    @click.option(
        "--output", "-o", type=click.Path(path_type=Path),
        help="HTML file (default: report-<recipe name>.html in the build folder, [store] build_dir)",
    )
    @json_opt
    def report(recipe: Path, selectors: tuple[str, ...], output: Path | None, as_json: bool) -> None:
        """One HTML page over RECIPE's built artifacts: accuracy, latency, size, provenance."""
        from mopt.build import Engine
        from mopt.report import collect, render

        s = Session(recipe)
        ids = s.graph.select(list(selectors))
        engine = Engine(s, read_only=True)
        rows = collect(engine, ids)
        if as_json:
            _print_json({"artifacts": rows})
            return
        if not rows:
            raise MoptError("nothing of this recipe is built yet", hint=f"run: mopt build {recipe}")
        dest = output or engine.build_dir / f"report-{s.recipe.path.stem}.html"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(render(s.recipe.path, rows))
        out.print(f"report: {dest} ({len(rows)} artifacts)")

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


def _selected(states: dict[str, Any], build_dir: Path, recipe: Any = None) -> list[str]:
    """One line per built node whose result names a `winner` (a select-like kind)."""
    from mopt.build import address_path

    lines = []
    for st in states.values():
        res = (st.entry.meta.get("result") or {}) if st.entry is not None else {}
        if st.status in ("built", "cached") and res.get("winner"):
            lines.append(
                f"selected {st.node.section.id}: {res['winner']} ({res.get('objective', 'objective')}; "
                f"{res.get('eligible', '?')} of {res.get('variants', '?')} variants passed) → "
                f"{address_path(build_dir, st.node.id, recipe)}"
            )
    return lines


def _fast_path_off(engine: Any, states: dict[str, Any]) -> str:
    """Which kinds of this build turn the no-op fast path off (their fingerprint may read
    machine state), as one line; "" when none does."""
    off: dict[str, str] = {}
    for st in states.values():
        kind = engine.kind(st.node.kind)
        if not kind.static_fingerprint:
            off.setdefault(st.node.kind, engine.registry.plugin_of("targets", st.node.kind).name)
    if not off:
        return ""
    names = ", ".join(f"{k!r} (plugin {p!r})" for k, p in sorted(off.items()))
    return (
        f"no-op fast path off: {'kind' if len(off) == 1 else 'kinds'} {names} may read machine state in "
        "fingerprint() "
        "(static_fingerprint = False); a kind whose fingerprint is package versions says "
        "fingerprint_packages = (...)"
    )


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
    from mopt.cli import err

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
    ids = [i for i in s.graph.select([target]) if _matches(s.graph.nodes[i], target)]
    if len(ids) != 1:
        raise MoptError(
            f"{target!r} names {len(ids)} targets" + (f": {', '.join(ids[:5])}" if ids else ""),
            hint="give one model.hardware:target (a variant's full label if swept)",
        )
    return ids[0]


def _matches(node: Any, sel: str) -> bool:
    import fnmatch

    sec, _, tgt = sel.partition(":")
    return any(
        fnmatch.fnmatchcase(a.partition(":")[0], sec or "*")
        and (
            fnmatch.fnmatchcase(a.partition(":")[2], tgt or "*")
            or (tgt == node.target.name and a.partition(":")[2] == node.label)
        )
        for a in node.addresses
    )


def _run_check(s: Any, ids: list[str]) -> None:
    try:
        from mopt.cli_check import run_check_for_build
    except ImportError:
        return
    run_check_for_build(s, ids)
