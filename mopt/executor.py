"""What an executor other than `local` gets (Bazel's remote execution; the contract is
`mopt.api.Executor`): a `BuildSession` on the driver, which keys the actions, takes the hits
and hands out the misses as `Spawn`s, and `run_remote_spawn`, the remote runner, on the
machine that runs one: it fetches the inputs from the remote cache into a local store, runs
the kind through `mopt.runner.execute_spawn` (as the local workers do), checks that the
inputs did not change, and pushes the outputs (blobs first, the action entry last).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mopt import machine
from mopt.api import ActionNode, Artifact, HardwareProfile
from mopt.errors import MoptError
from mopt.remote import RemoteCache, RemoteError
from mopt.runner import InputWatch, execute_spawn
from mopt.schedule import NodeState, Reporter, built_inputs, log_failure, node_spawn, readiness, store_built
from mopt.spawn import Spawn, SpawnResult
from mopt.store import ActionEntry, Store, StoreError

LOG_TAIL_BYTES = 64 * 1024


@dataclass
class RemoteResult:
    """What came of a remote spawn: built (or found already built), failed, or unbuildable there."""

    status: str  # built | cached | failed | unbuildable
    entry: ActionEntry | None = None
    reason: str = ""
    duration: float = 0.0
    log_tail: str = ""
    host: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "entry": None if self.entry is None else self.entry.model_dump(mode="json")}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RemoteResult:
        entry = d["entry"]
        return cls(**{**d, "entry": None if entry is None else ActionEntry.model_validate(entry)})


# ---------------------------------------------------------------------- the driver side


class BuildSession:
    """The driver's side of a build on another executor (`mopt.api.ExecutorSession`)."""

    probe_gpus = staticmethod(machine.probe_gpus)
    gpu_matches = staticmethod(machine.gpu_matches)

    def __init__(
        self,
        engine: Any,
        ids: list[str],
        *,
        remote: Any,
        keep_going: bool = False,
        reporter: Reporter | None = None,
        materialize: set[str] | None = None,
    ) -> None:
        self._engine = engine
        self._graph = engine.graph
        self.ids = list(ids)
        self.remote = remote
        self.keep_going = keep_going
        self.reporter = reporter or Reporter()
        self._want = set(ids) if materialize is None else set(materialize)
        self._states = {i: NodeState(self._graph.nodes[i]) for i in ids}
        self._outputs: dict[str, str] = {}
        self._on_remote: set[str] = set()  # node ids whose entry is known to be on the remote
        self._sources: dict[str, str] = {}  # model name → source tree digest, uploaded
        self.registry = engine.registry
        #: the remote runner, for the executor to call on its workers (picklable by name)
        self.run_spawn = run_remote_spawn

    # -- what the executor reads

    def node(self, node_id: str) -> ActionNode:
        n = self._graph.nodes[node_id]
        return ActionNode(
            id=n.id,
            label=n.label,
            kind=n.kind,
            kind_class=type(self._engine.kind(n.kind)),
            params=n.target.params,
            hardware=n.hardware,
            model_name=n.model.name,
            inputs={s: list(ds) for s, ds in n.inputs.items()},
        )

    def status(self, node_id: str) -> str:
        return self._states[node_id].status

    def remote_connection(self) -> dict[str, Any] | None:
        """How a worker reaches the remote cache (URL and options: pass to `run_remote_spawn`);
        None without `[remote] url`."""
        return None if self.remote is None else dict(self.remote.connection())

    def remote_writable(self) -> bool:
        """Whether outputs may be pushed to the remote cache (`[remote] push`)."""
        return self.remote is not None and bool(self.remote.push_enabled)

    # -- the steps of one action

    def readiness(self, node_id: str) -> tuple[str, str]:
        """("ready" | "wait" | "blocked", why blocked): as the local scheduler decides it."""
        st = self._states[node_id]
        state, why, missing = readiness(st.node, self._states, self._outputs, self._graph)
        if state == "ready":
            st.missing = missing
        return state, why

    def key(self, node_id: str) -> str:
        """The action key of a ready node (its inputs' outputs are known)."""
        st = self._states[node_id]
        st.parts, st.key = self._engine.keyed(st.node, built_inputs(st.node, self._outputs), st.missing)
        return st.key

    def cached(self, node_id: str) -> bool:
        """Finish the node as a hit of the local store or the remote cache, if it is one.

        The remote's entry is verified (its manifest fetched, its blobs' presence checked),
        so an entry whose blobs went is a miss; its bytes are downloaded only when the node
        is to be materialized under build/."""
        st = self._states[node_id]
        assert st.key is not None, "key() first"
        if node_id in self._engine.rebuild:  # mopt build --rebuild
            return False
        entry = self._engine.hit(st.key, remote=False)  # the remote's own way is next: no bytes yet
        if entry is not None:
            self._engine.code_changed(st.node, entry.meta)
            return self._finish(st, entry, "cached", local=True)
        entry = self.remote.fetch_entry(st.key, verify=True)
        return entry is not None and self._finish(st, entry, "cached", local=False)

    def spawn(self, node_id: str) -> str:
        """The node as a `Spawn` (JSON), its inputs made available on the remote cache first
        (local-only hits pushed; the model source and declared input files uploaded).

        Raises `MoptError` / `OSError` / `ValueError` for inputs that cannot be shared, and
        the remote cache's own errors when it refuses an upload."""
        st = self._states[node_id]
        node = st.node
        engine = self._engine
        assert st.key is not None and st.parts is not None
        kind = engine.kind(node.kind)
        inputs: dict[str, list[Artifact]] = {}
        for slot, dep_ids in node.inputs.items():
            arts = []
            for d in dep_ids:
                if d not in self._outputs:  # a partial slot's missing input
                    continue
                entry = self._ensure_on_remote(d)
                dep, meta = self._graph.nodes[d], dict(entry.meta.get("result") or {})
                # no path: the remote runner puts the tree where its action reads it
                arts.append(
                    Artifact(Path(), dep.kind, dep.target.name, entry.outputs_tree, meta,
                             label=dep.label, input_labels=self._graph.input_labels(dep))
                )  # fmt: skip
            inputs[slot] = arts
        source_tree = self._upload_source(node.model.name) if kind.uses_source else None
        files = []
        project_dir = Path(engine.recipe.project_dir).resolve()
        for f in kind.input_files(node.target.params, engine.recipe.project_dir):
            path = Path(f).resolve()
            try:
                rel = path.relative_to(project_dir).as_posix()
            except ValueError:
                raise MoptError(
                    f"input file {path} is outside the project folder {project_dir}; remote workers "
                    "get only files inside it",
                    hint="move the file into the project",
                ) from None
            is_tree = path.is_dir()
            digest = engine.store.put_tree(path)[0] if is_tree else engine.store.put_file(path)
            (self.remote.push_tree if is_tree else self.remote.push_blob)(digest)
            files.append((rel, digest, is_tree))
        return node_spawn(
            st,
            inputs,
            engine.registry,
            source=None,
            project_dir="",
            offline=engine.offline,
            source_tree=source_tree,
            files=tuple(files),
            recipe=str(engine.recipe.path),
            parts=st.parts,
        ).to_json()

    def started(self, node_id: str) -> None:
        st = self._states[node_id]
        st.status = "running"
        st.started = time.time()
        self.reporter.started(st)

    def finished(self, node_id: str, result: dict[str, Any], *, duration: float | None = None) -> bool:
        """Record what `run_remote_spawn` returned for the node; True when it is built or cached."""
        st = self._states[node_id]
        res = RemoteResult.from_json(result)
        st.duration = duration if duration is not None else time.time() - st.started
        if res.status in ("built", "cached") and res.entry is not None:
            if res.entry.key != st.key:
                self.done(node_id, "failed", f"worker returned an entry for another key ({res.entry.key[:16]})")
                return False
            if res.duration:
                st.duration = res.duration
            if not self._finish(st, res.entry, res.status, local=False):
                why = f"built on {res.host}, but its outputs could not be downloaded (see the log)"
                self.done(node_id, "failed", why)
                return False
            return True
        if res.log_tail:
            with tempfile.NamedTemporaryFile("w", dir=self._engine.store.tmp_dir, suffix=".log") as fh:
                fh.write(res.log_tail)
                fh.flush()
                st.log_path = self._engine.store.keep_failed_log(st.key or "", fh.name)
        self.done(node_id, res.status if res.status == "unbuildable" else "failed", res.reason)
        return False

    def done(self, node_id: str, status: str, reason: str = "") -> None:
        """Finish the node without a result: "blocked", "unbuildable" or "failed", and why."""
        st = self._states[node_id]
        st.status = status
        st.reason = reason
        self.reporter.done(st)

    # -- the build as a whole

    def start(self) -> None:
        self.reporter.start(self._states)

    def tick(self) -> None:
        self.reporter.tick()

    def stop(self) -> None:
        self._engine.store.state.flush()
        self.reporter.stop()

    def states(self) -> dict[str, NodeState]:
        """Every node's final state (what `Executor.build` returns)."""
        return self._states

    # -- inside

    def _ensure_on_remote(self, node_id: str) -> ActionEntry:
        """An input's entry, pushed first if only the local store has it (a local hit)."""
        st = self._states.get(node_id)
        if st is None or st.entry is None or st.key is None:
            raise ValueError(f"input {node_id} has no action entry")
        if node_id not in self._on_remote:
            self.remote.push(st.key, st.entry)
            self._on_remote.add(node_id)
        return st.entry

    def _upload_source(self, model_name: str) -> str:
        """Put the model's source checkpoint into the remote CAS (once); return its tree digest."""
        if model_name not in self._sources:
            path, digest, _info = self._engine.source(model_name)
            with self._engine.store.in_use():
                tree, _ = self._engine.store.put_tree(path)
            if tree != digest:
                raise MoptError(f"the source of model {model_name!r} ({path}) changed while building; rebuild")
            self.remote.push_tree(tree)
            self._sources[model_name] = tree
        return self._sources[model_name]

    def _finish(self, st: NodeState, entry: ActionEntry, status: str, *, local: bool) -> bool:
        """Record a hit or a built entry; download and materialize it if wanted. False when
        its bytes had to be downloaded and could not be: the node is then a miss."""
        node = st.node
        assert st.key is not None and st.parts is not None
        if not local:
            self._on_remote.add(node.id)
        if node.id in self._want:
            if not local:
                got = self.remote.pull(st.key, entry)
                if got is None:
                    return False
                entry = got
            with self._engine.store.in_use():
                for address in node.addresses:
                    self._engine.store.materialize(entry.outputs_tree, self._engine.address_path(address))
        st.entry = entry
        self._outputs[node.id] = entry.outputs_tree
        self.done(node.id, status, st.reason)
        return True


# ---------------------------------------------------------------------- the worker side


def run_remote_spawn(spawn_json: str, worker: dict[str, Any], *, executor: str = "remote") -> dict[str, Any]:
    """The remote runner: run one `ExecutorSession.spawn` result (a `Spawn` as JSON) on this
    machine, through the remote cache, and return the result as JSON for
    `ExecutorSession.finished`; never raises for a failing action. `worker`: `store` (this
    machine's local store, `~` expanded here) and `remote` (`ExecutorSession.remote_connection()`).
    A process killed midway leaves a scratch folder in the local store (swept later) and at
    most some content-addressed blobs on the remote, never an entry."""
    from mopt.plugins import get_registry

    spec = Spawn.from_json(spawn_json)
    host = socket.gethostname()
    store = Store(Path(os.path.expanduser(worker["store"])))
    try:
        conn = worker["remote"]
        remote = RemoteCache(conn["url"], store, push=True, options=conn.get("options") or {})
        # built meanwhile by someone else (another driver, an earlier attempt)?
        entry = remote.fetch_entry(spec.key, verify=True)
        if entry is not None:
            return RemoteResult("cached", entry=entry, host=host).to_json()
        registry = get_registry(spec.disabled_plugins)
        try:
            result = _run(spec, store, registry, remote, executor=executor, host=host)
        except (RemoteError, StoreError) as exc:
            result = RemoteResult("failed", reason=f"fetching inputs on {host}: {exc}")
        if result.entry is not None and result.status in ("built", "cached"):
            try:
                remote.push(spec.key, result.entry)
            except (RemoteError, StoreError) as exc:
                why = f"built on {host}, but pushing the outputs failed: {exc}"
                result = RemoteResult("failed", reason=why)
        return replace(result, host=host).to_json()
    finally:
        store.close()


def _run(spec: Spawn, store: Store, registry: Any, remote: Any, *, executor: str, host: str) -> RemoteResult:
    """Run `spec` into `store` (under the action's lock), its inputs fetched from `remote`."""
    kind_cls = registry.targets.get(spec.kind)
    if kind_cls is None:
        return RemoteResult(
            "unbuildable",
            reason=f"target kind {spec.kind!r} is not installed on {host} (install its plugin on the workers)",
        )
    kind = kind_cls()
    hardware = HardwareProfile.model_validate(spec.hardware)
    want_fp = dict(spec.parts.get("fingerprint") or {})
    have_fp = dict(kind.fingerprint())
    if have_fp != want_fp:
        names = sorted(n for n in set(want_fp) | set(have_fp) if want_fp.get(n) != have_fp.get(n))
        diff = "; ".join(f"{n} {want_fp.get(n)!r} → {have_fp.get(n)!r}" for n in names)
        return RemoteResult(
            "failed",
            reason=f"tools on {host} differ from the ones the action key was made with: {diff} "
            "(install the same versions on the driver and the workers)",
        )
    params = kind.Params.model_validate(spec.params)
    why = machine.unmet(kind.requirements(params, hardware), hardware)
    if why:
        return RemoteResult("unbuildable", reason=f"unbuildable on {host}: {why}")

    def tree_into(tree: str, dest: Path) -> None:
        remote.fetch_tree(tree)
        with store.in_use():
            store.materialize(tree, dest)

    with store.lock(spec.key), ExitStack() as stack:
        entry = store.ac_entry(spec.key)
        if entry is not None:
            return RemoteResult("cached", entry=entry)
        # the store keeps a scratch folder from `cleanup_tmp` while in use; removed at the end
        scratch = stack.enter_context(store.scratch_dir(prefix="action-"))
        out_dir, tmp_dir, in_dir = scratch / "out", scratch / "tmp", scratch / "in"
        for d in (out_dir, tmp_dir, in_dir):
            d.mkdir()
        log_path = scratch / "log.txt"
        log_path.touch()
        t0 = time.time()
        try:
            inputs = {
                slot: [replace(a, path=in_dir / f"{slot}-{k}") for k, a in enumerate(arts)]
                for slot, arts in spec.inputs.items()
            }
            for arts in inputs.values():
                for a in arts:
                    tree_into(a.digest, a.path)
            source = None
            if spec.source_tree is not None:
                source = scratch / "source"
                tree_into(spec.source_tree, source)
            project_dir = scratch / "project"
            project_dir.mkdir()
            for rel, digest, is_tree in spec.files:
                dest = project_dir / rel
                if is_tree:
                    tree_into(digest, dest)
                else:
                    remote.fetch_blob(digest)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(store.blob_path(digest), dest)
                    os.chmod(dest, 0o444)
            # its inputs must come out of the action as they went in (blobs are hard-linked)
            digests = {
                os.path.join(a.path, e.path): e.digest
                for arts in inputs.values()
                for a in arts
                for e in store.tree_entries(a.digest)
            }
            watched = [in_dir, project_dir, *([source] if source is not None else [])]
            watch = InputWatch.take(watched, digests)
            # the one action-running function of mopt (the local executor's workers call it
            # too); the executor's task is a process of its own, so it runs here
            res = execute_spawn(
                replace(
                    spec,
                    inputs=inputs,
                    source=str(source) if source is not None else None,
                    project_dir=str(project_dir),
                    out=str(out_dir),
                    tmp=str(tmp_dir),
                    log=str(log_path),
                    host=host,
                ),
                registry,
            )
            changed = watch.changes(watched)
            if changed:
                removed = sum(
                    store.discard_blob(d) for _p, d in changed if d is not None and not store.verify(d)
                )
                why = f"kind {spec.kind!r} changed its input {os.path.relpath(changed[0][0], scratch)}"
                if removed:
                    why += f"; {removed} damaged blob(s) removed from {host}'s store"
                log_failure(log_path, why)
                res = replace(res, status="failed", error=why)
            if res.ok:
                entry = store_built(store, spec, res, spec.parts, kind, recipe=spec.recipe, executor=executor)
                return RemoteResult("built", entry=entry, duration=res.duration)
        except BaseException as exc:  # fetching or storing failed: the action fails, not the worker
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            log_failure(log_path, exc)
            res = SpawnResult("failed", duration=time.time() - t0, error=f"{type(exc).__name__}: {exc}")
        store.keep_failed_log(spec.key, log_path)
        return RemoteResult("failed", reason=res.error, duration=res.duration, log_tail=_tail(log_path))


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
