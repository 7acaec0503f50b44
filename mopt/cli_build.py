"""`mopt build`, `explain`, `show`, `ls`, `gc`: the commands that use the store."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

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

    def __init__(self, console: Any) -> None:
        super().__init__(sys.stderr)
        from rich.live import Live

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
            extra = f" in {st.duration:.1f}s" if st.status == "built" else (f": {st.reason}" if st.reason else "")
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


def register(app: typer.Typer) -> None:
    """Add the store commands to the CLI."""
    from mopt.cli import JsonOpt, RecipeArg, SelectorsArg, Session, _print_json, err, out

    @app.command()
    def build(
        recipe: Path = RecipeArg,
        selectors: Optional[list[str]] = SelectorsArg,
        jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="parallel actions (CPU count)"),
        keep_going: bool = typer.Option(False, "--keep-going", "-k", help="build what can be built after a failure"),
        offline: bool = typer.Option(False, "--offline", help="never touch the network"),
        frozen: bool = typer.Option(False, "--frozen", help="fail if sources or tools differ from mopt.lock"),
        no_check: bool = typer.Option(False, "--no-check", help="skip `mopt check` before building"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="do not list cached actions"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Build the selected targets: cache hits are reused, misses run."""
        from mopt import procs
        from mopt.build import Engine, current_lock, frozen_diff, write_lock

        t0 = time.time()
        s = Session(recipe)
        ids = s.graph.select(selectors or [])
        if not no_check:
            _run_check(s, ids)
        engine = Engine(s, offline=offline)
        lock_now = current_lock(engine, ids)
        if frozen:
            diffs = frozen_diff(s.recipe.path, lock_now)
            if diffs:
                raise MoptError(
                    "--frozen: " + "; ".join(diffs),
                    file=str(s.recipe.path.parent / "mopt.lock"),
                    hint="rebuild without --frozen to update the lock file",
                )
        reporter: Any
        if as_json or not sys.stderr.isatty() or os.environ.get("CI"):
            reporter = LineReporter(sys.stderr, quiet=quiet or as_json)
        else:
            reporter = LiveReporter(err)
        try:
            states = engine.build(ids, jobs=jobs, keep_going=keep_going, reporter=reporter)
        except KeyboardInterrupt:
            procs.kill_all()
            err.print("interrupted: running actions stopped; nothing partial was stored")
            sys.stderr.flush()
            os._exit(130)  # worker threads may be inside a library call; outputs are in tmp only
        finally:
            engine.store.close()
        artifacts = {
            st.node.id: st.key for st in states.values() if st.status in ("built", "cached") and st.key
        }
        if not frozen:
            write_lock(s.recipe.path, lock_now, artifacts)
        counts: dict[str, int] = {}
        for st in states.values():
            counts[st.status] = counts.get(st.status, 0) + 1
        failed = [st for st in states.values() if st.status in ("failed", "unbuildable", "blocked")]
        if as_json:
            _print_json(
                {
                    "recipe": str(s.recipe.path),
                    "seconds": round(time.time() - t0, 3),
                    "counts": counts,
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
            reports = sorted(engine.build_dir.glob("**/report.html"))
            if reports:
                err.print(f"reports: {', '.join(str(r) for r in reports[:5])}")
            err.print(f"artifacts under {engine.build_dir}")
        if failed:
            raise BuildFailed("")

    @app.command()
    def explain(
        recipe: Path = RecipeArg,
        target: str = typer.Argument(..., help="model.hardware:target", show_default=False),
        as_json: bool = JsonOpt,
    ) -> None:
        """Print the parts of a target's action key (what its cache entry depends on)."""
        from mopt.build import Engine

        s = Session(recipe)
        node_id = _one(s, target)
        engine = Engine(s)
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

    @app.command()
    def show(
        recipe: Path = RecipeArg,
        target: str = typer.Argument(..., help="model.hardware:target", show_default=False),
        as_json: bool = JsonOpt,
    ) -> None:
        """Print a built target's manifest (files, sizes, digests) and provenance."""
        from mopt.build import Engine, address_path

        s = Session(recipe)
        node_id = _one(s, target)
        engine = Engine(s)
        info = engine.explain(node_id)
        entry = engine.store.ac_entry(info["key"]) if info["key"] else None
        if entry is None:
            raise MoptError(f"{node_id} is not built", hint=f"run: mopt build {recipe} {node_id}")
        files = engine.store.tree_entries(entry.outputs_tree)
        data = {
            "id": node_id,
            "path": str(address_path(engine.build_dir, node_id)),
            "key": entry.key,
            "outputs_tree": entry.outputs_tree,
            "files": [{"path": f.path, "size": f.size, "mode": oct(f.mode), "digest": f.digest} for f in files],
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
        out.print(f"  built by {prov['kind']} on {prov['host']} at {prov['created']} in {prov['duration_s']:.2f}s")
        if not prov["reproducible"]:
            out.print("  note: this kind's output is not bit-reproducible (rebuilds differ byte-wise)")
        for k, v in prov["fingerprint"].items():
            out.print(f"  tool {k} {v}")
        if prov["result"]:
            out.print(f"  result {json.dumps(prov['result'], sort_keys=True)[:400]}")

    @app.command("ls")
    def ls_(
        recipe: Path = RecipeArg,
        selectors: Optional[list[str]] = SelectorsArg,
        as_json: bool = JsonOpt,
    ) -> None:
        """List built artifacts of a recipe with their sizes."""
        from mopt.build import Engine, address_path

        s = Session(recipe)
        ids = s.graph.select(selectors or [])
        engine = Engine(s)
        status = engine.plan(ids)
        rows = []
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
                    "path": str(address_path(engine.build_dir, i)),
                    "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created)),
                }
            )
        if as_json:
            _print_json({"artifacts": rows})
            return
        for r in rows:
            out.print(f"{human(r['bytes']):>10}  {r['files']:>4} files  {r['built']}  {r['id']}  ({r['kind']})")
        out.print(f"{len(rows)} built of {len(ids)}; {human(sum(r['bytes'] for r in rows))} in all")

    @app.command()
    def gc(
        max_size: Optional[str] = typer.Option(None, "--max-size", help="shrink the store below this (e.g. 200G)"),
        older_than: Optional[str] = typer.Option(None, "--older-than", help="drop entries unused this long (e.g. 30d)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="say what would go, remove nothing"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Remove least recently used cache entries; never what lock files reference."""
        from mopt.config import load_project
        from mopt.store import Store

        project = load_project(Path.cwd())
        if not project.store_dir.exists():
            raise MoptError(f"no store at {project.store_dir}", hint="run mopt build first")
        keep = _lock_roots(project.root)
        with Store(project.store_dir) as store:
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


def _lock_roots(root: Path) -> set[str]:
    """Action keys referenced by mopt.lock files under the project."""
    keys: set[str] = set()
    for p in root.rglob("mopt.lock"):
        if any(part in (".mopt", ".venv", "build", ".nox", ".git") for part in p.parts):
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        for entry in data.get("recipes", {}).values():
            keys.update(v for v in entry.get("artifacts", {}).values() if isinstance(v, str))
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
        and (fnmatch.fnmatchcase(a.partition(":")[2], tgt or "*") or (tgt == node.target.name and a.partition(":")[2] == node.label))
        for a in node.addresses
    )


def _run_check(s: Any, ids: list[str]) -> None:
    try:
        from mopt.cli_check import run_check_for_build
    except ImportError:
        return
    run_check_for_build(s, ids)
