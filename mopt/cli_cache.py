"""`mopt cache status|push|pull`: the shared remote cache (`[remote] url` in mopt.toml)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mopt.cli import CONTEXT, json_opt
from mopt.errors import MoptError, human


def _open(recipe: Path | None) -> tuple[Any, Any]:
    """(local store, remote cache) of the project of the recipe's folder, or the current one."""
    from mopt.config import load_project
    from mopt.remote import RemoteCache, RemoteError
    from mopt.store import Store

    if recipe is not None and not recipe.exists():
        raise MoptError("recipe not found", file=str(recipe), hint="give the path to a .toml recipe")
    start = recipe.resolve().parent if recipe is not None else Path.cwd()
    project = load_project(start)
    settings = project.config.remote
    if not getattr(settings, "url", None):
        raise MoptError(
            "no remote cache configured",
            file=str(project.config_file or start / "mopt.toml"),
            table="remote",
            key="url",
            hint='add [remote] url = "s3://bucket/prefix" (or gs://, file://...) to mopt.toml',
        )
    store = Store(project.store_dir)
    try:
        remote = RemoteCache.from_settings(settings, store)
    except ImportError as exc:
        raise MoptError(
            f"the remote cache needs fsspec and the URL's filesystem package ({exc.name or exc})",
            hint="pip install 'mopt[remote]' (and s3fs / gcsfs / adlfs for s3:// gs:// az://)",
        ) from None
    except RemoteError as exc:
        raise MoptError(str(exc), table="remote", key="url") from None
    assert remote is not None
    return store, remote


def _lock_keys(recipe: Path) -> dict[str, str]:
    """node id → action key, as the recipe's mopt.lock recorded them."""
    from mopt.build import lock_path, read_lock

    arts = read_lock(recipe).get("artifacts") or {}
    if not arts:
        raise MoptError(
            f"{lock_path(recipe)} records no artifacts for {recipe.name}",
            hint="build the recipe once (mopt build), or use --all",
        )
    return {str(k): str(v) for k, v in arts.items()}


def _local_keys(store: Any) -> list[str]:
    return sorted(p.name[: -len(".json")] for p in store.ac_dir.glob("*.json"))


def _emit(as_json: bool, obj: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    else:
        for line in lines:
            sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _each(keys: dict[str, str], fn: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"target": name, "key": key, **fn(key)} for name, key in keys.items()]


def register(app: click.Group) -> None:
    """Add `mopt cache status|push|pull` to the CLI."""
    recipe_opt = click.argument("recipe", required=False, type=click.Path(path_type=Path))

    @app.group("cache", context_settings=CONTEXT)
    def cache() -> None:
        """The shared remote cache ([remote] url in mopt.toml): status, push, pull.

        RECIPE, where given, selects the artifacts its mopt.lock records and the
        mopt.toml next to it (else the one in or above the current folder)."""

    @cache.command("status", context_settings=CONTEXT)
    @recipe_opt
    @json_opt
    def status(recipe: Path | None, as_json: bool) -> None:
        """The remote cache (reachable? entries, blobs, bytes) next to the local store."""
        store, remote = _open(recipe)
        st = remote.status()
        usage = store.usage()
        local = set(_local_keys(store))
        remote_keys: set[str] = set(remote.list_keys()) if st.reachable else set()
        obj: dict[str, Any] = {
            "remote": st.to_json(),
            "local": {
                "path": str(store.root),
                "ac_entries": usage.ac_entries,
                "blobs": usage.blobs,
                "blob_bytes": usage.blob_bytes,
            },
            "only_local": len(local - remote_keys) if st.reachable else None,
            "only_remote": len(remote_keys - local) if st.reachable else None,
        }
        if recipe is not None:
            with_lock = _lock_keys(recipe)
            obj["recipe"] = {
                "artifacts": len(with_lock),
                "on_remote": sum(1 for k in with_lock.values() if k in remote_keys),
                "local": sum(1 for k in with_lock.values() if k in local),
            }
        lines = [f"remote {st.url} ({st.protocol}, push {'on' if st.push else 'off'})"]
        if not st.reachable:
            lines.append(f"  unreachable: {st.error}")
        else:
            lines.append(
                f"  {st.ac_entries} action(s), {st.blobs} blob(s), {human(st.blob_bytes or 0)}"
                + (f", {st.tmp_files} unfinished upload(s)" if st.tmp_files else "")
            )
            if st.error:
                lines.append(f"  {st.error}")
        lines.append(
            f"local  {store.root}\n  {usage.ac_entries} action(s), {usage.blobs} blob(s), "
            f"{human(usage.blob_bytes)}"
        )
        if st.reachable:
            lines.append(
                f"only local: {obj['only_local']} action(s); only remote: {obj['only_remote']} action(s)"
            )
        if "recipe" in obj:
            r = obj["recipe"]
            lines.append(
                f"{recipe}: {r['artifacts']} artifact(s), {r['on_remote']} on the remote, {r['local']} local"
            )
        _emit(as_json, obj, lines)
        store.close()
        if not st.reachable:
            raise click.exceptions.Exit(1)

    @cache.command("push", context_settings=CONTEXT)
    @recipe_opt
    @json_opt
    def push(recipe: Path | None, as_json: bool) -> None:
        """Upload local actions (the recipe's, or all) that the remote lacks: blobs, then entries."""
        from mopt.remote import RemoteError
        from mopt.store import StoreError

        t0 = time.time()
        store, remote = _open(recipe)
        keys = _lock_keys(recipe) if recipe is not None else {k: k for k in _local_keys(store)}
        totals = {"uploaded_blobs": 0, "uploaded_bytes": 0, "present_blobs": 0}

        def one(key: str) -> dict[str, Any]:
            entry = store.ac_entry(key)
            if entry is None:
                return {"status": "not-local"}
            try:
                rep = remote.push(key, entry)
            except (RemoteError, StoreError) as exc:
                return {"status": "failed", "error": str(exc)}
            for k in totals:
                totals[k] += getattr(rep, k)
            return {
                "status": "pushed" if rep.entry_written else "present",
                "uploaded_blobs": rep.uploaded_blobs,
                "uploaded_bytes": rep.uploaded_bytes,
            }

        rows = _each(keys, one)
        store.close()
        counts = _counts(rows)
        lines = [
            f"{r['status']:>9} {r['target']}" + (f": {r['error']}" if "error" in r else "") for r in rows
        ]
        lines.append(
            f"{len(rows)} action(s): {_summary(counts)}; {totals['uploaded_blobs']} blob(s) "
            f"({human(totals['uploaded_bytes'])}) uploaded, {totals['present_blobs']} already there, "
            f"to {remote.url} in {time.time() - t0:.2f}s"
        )
        _emit(as_json, {"remote": remote.url, "counts": counts, **totals, "actions": rows}, lines)
        if counts.get("failed"):
            raise click.exceptions.Exit(1)

    @cache.command("pull", context_settings=CONTEXT)
    @recipe_opt
    @click.option("--key", "keys_opt", multiple=True, help="an action key to pull (repeatable)")
    @click.option("--all", "all_", is_flag=True, help="every action on the remote")
    @json_opt
    def pull(recipe: Path | None, keys_opt: tuple[str, ...], all_: bool, as_json: bool) -> None:
        """Download actions (the recipe's, --key, or --all) into the local store, verified."""
        t0 = time.time()
        store, remote = _open(recipe)
        keys: dict[str, str] = {}
        if recipe is not None:
            keys.update(_lock_keys(recipe))
        keys.update({k: k for k in keys_opt or []})
        if all_:
            keys.update({k: k for k in remote.list_keys()})
        if not keys:
            raise MoptError(
                "nothing to pull", hint="give a recipe (its mopt.lock artifacts), --key KEY or --all"
            )
        before = remote.stats.downloaded_bytes

        def one(key: str) -> dict[str, Any]:
            if store.ac_entry(key) is not None:
                return {"status": "local"}
            entry = remote.fetch_entry(key)
            if entry is None:
                return {"status": "not-on-remote"}
            got = remote.pull(key, entry)
            return (
                {"status": "pulled"}
                if got is not None
                else {"status": "failed", "error": "rejected (see log)"}
            )

        rows = _each(keys, one)
        store.close()
        counts = _counts(rows)
        lines = [f"{r['status']:>13} {r['target']}" for r in rows]
        lines.append(
            f"{len(rows)} action(s): {_summary(counts)}; {remote.stats.downloaded_blobs} blob(s) "
            f"({human(remote.stats.downloaded_bytes - before)}) downloaded and verified, "
            f"{remote.stats.rejected_blobs} rejected, from {remote.url} in {time.time() - t0:.2f}s"
        )
        _emit(
            as_json,
            {
                "remote": remote.url,
                "counts": counts,
                "downloaded_blobs": remote.stats.downloaded_blobs,
                "downloaded_bytes": remote.stats.downloaded_bytes - before,
                "rejected_blobs": remote.stats.rejected_blobs,
                "actions": rows,
            },
            lines,
        )
        if counts.get("failed"):
            raise click.exceptions.Exit(1)


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(r["status"] for r in rows))


def _summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"
