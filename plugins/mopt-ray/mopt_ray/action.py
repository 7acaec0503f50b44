"""One action, described so that any machine can run it: `ActionSpec` and `run_action`.

The driver turns a graph node whose key is known into an `ActionSpec` (plain JSON: the
kind's name and params, the input trees by digest, the hardware profile, the key's parts).
`run_action` re-creates the kind from the registry, materializes the inputs from the
local store (after `fetch_tree` brought them in from the remote cache), runs the kind
in a scratch folder through `mopt.runner.execute_spawn` (the function the local
executor's worker processes run: one `BuildContext`, one way to run a kind) and stores
the result (blobs, then the entry). Nothing in this module imports Ray.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mopt.api import Artifact, HardwareProfile, Missing
from mopt.runner import InputWatch, Spawn, execute_spawn
from mopt.store import ActionEntry, Store

LOG_TAIL_BYTES = 64 * 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Model):
    """One input artifact: its tree digest, and what produced it."""

    tree: str
    kind: str
    target: str
    meta: dict[str, Any] = Field(default_factory=dict)
    label: str = ""
    input_labels: dict[str, list[str]] = Field(default_factory=dict)


class FileSpec(_Model):
    """A declared input file (`TargetKind.input_files`), relative to the project folder."""

    rel: str
    digest: str
    tree: bool = False  # a folder (tree digest) rather than a file (blob digest)


class ActionSpec(_Model):
    """Everything a worker needs to run one action (JSON; travels to Ray workers)."""

    key: str
    node_id: str
    kind: str
    params: dict[str, Any]
    parts: dict[str, Any]
    inputs: dict[str, list[InputSpec]] = Field(default_factory=dict)
    model_name: str
    family: str | None = None
    task: str
    hardware: dict[str, Any]
    section: str
    label: str
    #: partial slots' inputs that are not there (mopt.api.Missing as dicts)
    missing: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    source_tree: str | None = None
    files: list[FileSpec] = Field(default_factory=list)
    recipe: str = ""
    offline: bool = False


@dataclass
class ActionResult:
    """What happened: built (or found already built), failed, or unbuildable here."""

    status: str  # built | cached | failed | unbuildable
    entry: ActionEntry | None = None
    reason: str = ""
    duration: float = 0.0
    log_tail: str = ""
    host: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "entry": None if self.entry is None else self.entry.model_dump(mode="json"),
            "reason": self.reason,
            "duration": self.duration,
            "log_tail": self.log_tail,
            "host": self.host,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ActionResult:
        entry = d.get("entry")
        return cls(
            status=str(d["status"]),
            entry=None if entry is None else ActionEntry.model_validate(entry),
            reason=str(d.get("reason") or ""),
            duration=float(d.get("duration") or 0.0),
            log_tail=str(d.get("log_tail") or ""),
            host=str(d.get("host") or ""),
        )


FetchTree = Callable[[str], Any]
FetchBlob = Callable[[str], Any]

def fingerprint_diff(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """`name a → b` for each tool whose version differs between the key and this machine."""
    names = sorted(set(want) | set(have))
    return [f"{n} {want.get(n)!r} → {have.get(n)!r}" for n in names if want.get(n) != have.get(n)]


def run_action(
    spec: ActionSpec,
    store: Store,
    registry: Any,
    *,
    fetch_tree: FetchTree | None = None,
    fetch_blob: FetchBlob | None = None,
    on_line: Callable[[str], None] | None = None,
    check_requirements: bool = True,
    executor: str = "ray",
) -> ActionResult:
    """Run `spec` into `store` (under the action's lock); never raises for a failing kind.

    `fetch_tree(digest)` / `fetch_blob(digest)` bring inputs into `store` first (a remote
    cache's methods); without them the inputs must already be in `store`.
    """
    host = socket.gethostname()
    kind_cls = registry.targets.get(spec.kind)
    if kind_cls is None:
        return ActionResult(
            "unbuildable",
            reason=f"target kind {spec.kind!r} is not installed on {host} (install its plugin on the workers)",
            host=host,
        )
    kind = kind_cls()
    hardware = HardwareProfile.model_validate(spec.hardware)
    want_fp = dict(spec.parts.get("fingerprint") or {})
    have_fp = dict(kind.fingerprint())
    if have_fp != want_fp:
        return ActionResult(
            "failed",
            reason=(
                f"tools on {host} differ from the ones the action key was made with: "
                + "; ".join(fingerprint_diff(want_fp, have_fp))
                + " (install the same versions on the driver and the workers)"
            ),
            host=host,
        )
    params = kind.Params.model_validate(spec.params)
    if check_requirements:
        from mopt.procs import unmet

        why = unmet(kind.requirements(params, hardware), hardware)
        if why:
            return ActionResult("unbuildable", reason=f"unbuildable on {host}: {why}", host=host)

    with store.lock(spec.key), ExitStack() as stack:
        entry = store.ac_entry(spec.key)
        if entry is not None:
            return ActionResult("cached", entry=entry, host=host)
        # the store keeps a scratch folder from `cleanup_tmp` while in use; removed at the end
        scratch = stack.enter_context(store.scratch_dir(prefix="action-"))
        out_dir, tmp_dir, in_dir = scratch / "out", scratch / "tmp", scratch / "in"
        for d in (out_dir, tmp_dir, in_dir):
            d.mkdir()
        log_path = scratch / "log.txt"
        log_path.touch()
        t0 = time.time()
        try:
            inputs: dict[str, list[Artifact]] = {}
            for slot, arts in spec.inputs.items():
                got = []
                for k, a in enumerate(arts):
                    dest = in_dir / f"{slot}-{k}"
                    _tree_into(store, a.tree, dest, fetch_tree)
                    got.append(
                        Artifact(
                            dest,
                            a.kind,
                            a.target,
                            a.tree,
                            dict(a.meta),
                            label=a.label,
                            input_labels={k: list(v) for k, v in a.input_labels.items()},
                        )
                    )
                inputs[slot] = got
            source = None
            if spec.source_tree is not None:
                source = scratch / "source"
                _tree_into(store, spec.source_tree, source, fetch_tree)
            project_dir = scratch / "project"
            project_dir.mkdir()
            for f in spec.files:
                dest = project_dir / f.rel
                if f.tree:
                    _tree_into(store, f.digest, dest, fetch_tree)
                else:
                    if fetch_blob is not None:
                        fetch_blob(f.digest)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(store.blob_path(f.digest), dest)
                    os.chmod(dest, 0o444)
            # its inputs must come out of the action as they went in (blobs are hard-linked)
            digests = {
                os.path.join(str(in_dir / f"{slot}-{k}"), e.path): e.digest
                for slot, arts in spec.inputs.items()
                for k, a in enumerate(arts)
                for e in store.tree_entries(a.tree)
            }
            watched = [in_dir, project_dir, *([source] if source is not None else [])]
            watch = InputWatch.take(watched, digests)
            # the one action-running function of mopt (the local executor's workers call it
            # too); a Ray task is a process of its own, so it runs here
            res = execute_spawn(
                Spawn(
                    key=spec.key,
                    node_id=spec.node_id,
                    kind=spec.kind,
                    plugin=kind_cls.__module__,
                    params=spec.params,
                    inputs=inputs,
                    model_name=spec.model_name,
                    family=spec.family,
                    task=spec.task,
                    source=str(source) if source is not None and kind.uses_source else None,
                    hardware=spec.hardware,
                    section=spec.section,
                    target=spec.label,
                    project_dir=str(project_dir),
                    missing={s: [Missing(**m) for m in ms] for s, ms in spec.missing.items()},
                    env=dict(spec.parts.get("env") or {}),
                    offline=spec.offline,
                    out=str(out_dir),
                    tmp=str(tmp_dir),
                    log=str(log_path),
                    logger_prefix="mopt.ray.action",
                    host=host,
                ),
                registry,
                on_line,
            )
            changed = watch.changes(watched, store.state.file_digest)
            if changed:
                removed = sum(
                    store.discard_blob(d) for _p, d in changed if d is not None and not store.verify(d)
                )
                why = f"kind {spec.kind!r} changed its input {os.path.relpath(changed[0][0], scratch)}"
                if removed:
                    why += f"; {removed} damaged blob(s) removed from {host}'s store"
                with open(log_path, "a") as fh:
                    fh.write(f"mopt: FAILED: {why}\n")
                res = replace(res, status="failed", error=why)
            if not res.ok:
                store.keep_failed_log(spec.key, log_path)
                return ActionResult(
                    "failed", reason=res.error, duration=res.duration, log_tail=_tail(log_path), host=host
                )
            meta, duration = res.meta, res.duration
            with store.in_use():
                tree, _entries = store.put_tree(out_dir)
                log_digest = store.put_log(log_path)
                entry = store.ac_put(
                    spec.key,
                    ActionEntry(
                        key=spec.key,
                        kind=spec.kind,
                        target=spec.node_id,
                        outputs_tree=tree,
                        log=log_digest,
                        duration_s=duration,
                        fingerprint=want_fp,
                        host=host,
                        meta={
                            "result": meta,
                            "parts": spec.parts,
                            "reproducible": kind.reproducible,
                            "recipe": spec.recipe,
                            "executor": executor,
                        },
                    ),
                )
            return ActionResult("built", entry=entry, duration=duration, host=host)
        except BaseException as exc:  # fetching or storing failed: the action fails, not the worker
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            with open(log_path, "a") as fh:
                fh.write("mopt: FAILED: " + "".join(traceback.format_exception_only(exc)).strip() + "\n")
                fh.write(traceback.format_exc())
            store.keep_failed_log(spec.key, log_path)
            return ActionResult(
                "failed",
                reason=f"{type(exc).__name__}: {exc}",
                duration=time.time() - t0,
                log_tail=_tail(log_path),
                host=host,
            )


def _tree_into(store: Store, tree: str, dest: Path, fetch_tree: FetchTree | None) -> None:
    if fetch_tree is not None:
        fetch_tree(tree)
    with store.in_use():
        store.materialize(tree, dest)


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
