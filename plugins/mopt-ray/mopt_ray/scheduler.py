"""The driver side of the Ray executor: key the graph, take hits, submit only the misses.

The driver keys nodes in topological order, exactly like `Engine.build` (a key needs its
inputs' output digests). For each node whose key is known:

1. a hit in the local store (`engine.hit`) or the remote cache (`remote.fetch_entry(key,
   verify=True)`: the entry, its tree manifest and a presence check of its blobs, no output
   bytes) is done; its bytes are downloaded only when the node is to be materialized under
   build/ (workers fetch their inputs themselves);
2. otherwise its placement (`mopt_ray.placement`) is checked against the cluster's alive
   nodes: if no node can hold it, it is reported unbuildable with the reason;
3. otherwise its inputs are made available on the remote cache (local-only hits are
   pushed; a model source or declared input files are uploaded by digest) and it is
   submitted as a Ray task (`mopt_ray.worker.execute`) with `num_cpus`, `num_gpus`, the
   profile's custom resource and `max_retries` (retries on worker or node loss only: a
   failing kind is not retried).

While tasks run, the cluster is re-checked every few seconds: a task whose only capable
nodes left the cluster is cancelled and reported unbuildable, not left pending.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import deque
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mopt.build import NodeState, Reporter, built_inputs, readiness
from mopt.errors import MoptError
from mopt.keys import action_key
from mopt.store import ActionEntry
from mopt_ray.action import ActionResult, ActionSpec, FileSpec, InputSpec
from mopt_ray.placement import Placement, infeasible, node_resources, placement

log = logging.getLogger("mopt.ray")

RECHECK_S = 3.0


class RayBuild:
    """One build of `ids` on the Ray cluster. Use `run()`."""

    def __init__(
        self,
        engine: Any,
        ids: list[str],
        *,
        remote: Any,
        settings: Any,
        keep_going: bool = False,
        reporter: Reporter | None = None,
        materialize: set[str] | None = None,
    ) -> None:
        self.engine = engine
        self.graph = engine.graph
        self.ids = ids
        self.remote = remote
        self.settings = settings
        self.keep_going = keep_going
        self.reporter = reporter or Reporter()
        self.want = set(ids) if materialize is None else set(materialize)
        self.states = {i: NodeState(self.graph.nodes[i]) for i in ids}
        self.outputs: dict[str, str] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.on_remote: set[str] = set()  # node ids whose entry is known to be on the remote
        self.sources: dict[str, str] = {}  # model name → source tree digest, uploaded
        self.placements: dict[str, Placement] = {}
        self.cfg = {
            "worker_store": settings.worker_store,
            "remote": remote.connection(),
            "disable_plugins": list(engine.project.config.plugins.disable),
        }

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict[str, NodeState]:
        import ray

        task = ray.remote(_execute_entry)
        pending = deque(self.ids)
        running: dict[Any, str] = {}
        stop = False
        nodes = node_resources()
        last_check = time.time()
        self.reporter.start(self.states)
        try:
            while pending or running:
                for _ in range(len(pending)):
                    i = pending.popleft()
                    st = self.states[i]
                    state, why_not, missing = readiness(st.node, self.states, self.outputs, self.graph)
                    if state == "blocked":
                        self._done(st, "blocked", why_not)
                        continue
                    if stop:
                        self._done(st, "blocked", "not started after an earlier failure (use --keep-going)")
                        continue
                    if state == "wait":
                        pending.append(i)
                        continue
                    st.missing = missing
                    ref = self._schedule(st, task, nodes)
                    if ref is not None:
                        running[ref] = i
                if not running:
                    if pending and not any(
                        readiness(self.states[i].node, self.states, self.outputs, self.graph)[0] != "wait"
                        for i in pending
                    ):
                        # every pending node waits on something that will never come
                        for i in list(pending):
                            self._done(self.states[i], "blocked", "an input was not built")
                        pending.clear()
                    continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=0.2)
                for ref in ready:
                    i = running.pop(ref)
                    ok = self._collect(self.states[i], ref)
                    if not ok and not self.keep_going:
                        stop = True
                if time.time() - last_check > RECHECK_S and running:
                    last_check = time.time()
                    nodes = node_resources()
                    for ref, i in list(running.items()):
                        why = infeasible(self.placements[i], nodes)
                        if why:
                            ray.cancel(ref, force=True)
                            running.pop(ref)
                            self._done(
                                self.states[i], "unbuildable", f"unbuildable on the Ray cluster: {why}"
                            )
                self.reporter.tick()
            return self.states
        finally:
            for ref in running:
                with suppress(Exception):  # best effort on the way out
                    ray.cancel(ref, force=True)
            self.engine.store.state.flush()
            self.reporter.stop()

    def _done(self, st: NodeState, status: str, reason: str = "") -> None:
        st.status = status
        st.reason = reason
        self.reporter.done(st)

    # ------------------------------------------------------------------ one node

    def _schedule(self, st: NodeState, task: Any, nodes: list[dict[str, float]]) -> Any:
        """Key `st`; finish it as a hit, or as unbuildable, or submit it (return its ref)."""
        node = st.node
        engine = self.engine
        st.parts = engine.parts(node, built_inputs(node, self.outputs), st.missing)
        st.key = action_key(st.parts)
        entry = engine.hit(st.key)
        if entry is not None:
            self._finish(st, entry, "cached", local=True)
            return None
        # verify: the manifest is fetched and every blob's presence checked, so an entry
        # whose blobs were removed (found corrupt, or collected) is a miss, not a failure
        # of every dependent's worker
        entry = self.remote.fetch_entry(st.key, verify=True)
        if entry is not None and self._finish(st, entry, "cached", local=False):
            return None
        kind = engine.kind(node.kind)
        p = placement(kind, node.target.params, node.hardware, portable_kinds=self.settings.portable_kinds)
        self.placements[node.id] = p
        why = infeasible(p, nodes)
        if why:
            self._done(st, "unbuildable", f"unbuildable on the Ray cluster: {why}")
            return None
        try:
            spec = self._spec(st, kind)
        except (MoptError, OSError, ValueError) as exc:
            self._done(st, "failed", f"preparing inputs for the workers: {exc}")
            return None
        except Exception as exc:  # RemoteError / StoreError: the remote cache refused
            self._done(st, "failed", f"uploading inputs to the remote cache: {exc}")
            return None
        st.status = "running"
        st.started = time.time()
        self.reporter.started(st)
        opts: dict[str, Any] = {
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "max_retries": self.settings.max_retries,
            "retry_exceptions": False,
            "name": f"mopt {node.id}",
        }
        if p.resources:
            opts["resources"] = dict(p.resources)
        if self.settings.runtime_env:
            opts["runtime_env"] = dict(self.settings.runtime_env)
        return task.options(**opts).remote(spec.model_dump_json(), self.cfg)

    def _spec(self, st: NodeState, kind: Any) -> ActionSpec:
        node = st.node
        engine = self.engine
        assert st.key is not None and st.parts is not None
        inputs: dict[str, list[InputSpec]] = {}
        for slot, dep_ids in node.inputs.items():
            arts = []
            for d in dep_ids:
                if d not in self.outputs:  # a partial slot's missing input
                    continue
                self._ensure_on_remote(d)
                dep = self.graph.nodes[d]
                arts.append(
                    InputSpec(
                        tree=self.outputs[d],
                        kind=dep.kind,
                        target=dep.target.name,
                        meta=self.meta[d],
                        label=dep.label,
                        input_labels=self.graph.input_labels(dep),
                    )
                )
            inputs[slot] = arts
        source_tree = None
        if kind.uses_source:
            source_tree = self._upload_source(node.model.name)
        files = []
        project_dir = Path(engine.recipe.project_dir).resolve()
        for f in kind.input_files(node.target.params, engine.recipe.project_dir):
            path = Path(f).resolve()
            try:
                rel = path.relative_to(project_dir).as_posix()
            except ValueError:
                raise MoptError(
                    f"input file {path} is outside the project folder {project_dir}; Ray workers "
                    "get only files inside it",
                    hint="move the file into the project",
                ) from None
            if path.is_dir():
                tree, _ = engine.store.put_tree(path)
                self.remote.push_tree(tree)
                files.append(FileSpec(rel=rel, digest=tree, tree=True))
            else:
                digest = engine.store.put_file(path)
                self.remote.push_blob(digest)
                files.append(FileSpec(rel=rel, digest=digest))
        return ActionSpec(
            key=st.key,
            node_id=node.id,
            kind=node.kind,
            params=node.target.params.model_dump(mode="json"),
            parts=st.parts,
            inputs=inputs,
            model_name=node.model.name,
            family=node.model.spec.family,
            task=node.model.spec.task,
            hardware=node.hardware.model_dump(mode="json"),
            section=node.section.id,
            label=node.label,
            missing={s: [asdict(m) for m in ms] for s, ms in st.missing.items()},
            source_tree=source_tree,
            files=files,
            recipe=str(engine.recipe.path),
            offline=bool(getattr(engine, "offline", False)),
        )

    def _ensure_on_remote(self, node_id: str) -> None:
        """Push an input that only the local store has (a local hit) before a worker needs it."""
        if node_id in self.on_remote:
            return
        st = self.states.get(node_id)
        if st is None or st.entry is None or st.key is None:
            raise ValueError(f"input {node_id} has no action entry")
        self.remote.push(st.key, st.entry)
        self.on_remote.add(node_id)

    def _upload_source(self, model_name: str) -> str:
        """Put the model's source checkpoint into the remote CAS (once); return its tree digest."""
        if model_name not in self.sources:
            path, digest, _info = self.engine.source(model_name)
            with self.engine.store.in_use():
                tree, _ = self.engine.store.put_tree(path)
            if tree != digest:
                raise MoptError(
                    f"the source of model {model_name!r} ({path}) changed while building; rebuild",
                )
            self.remote.push_tree(tree)
            self.sources[model_name] = tree
        return self.sources[model_name]

    def _finish(self, st: NodeState, entry: ActionEntry, status: str, *, local: bool) -> bool:
        """Record a hit or a built entry; download and materialize it if wanted.

        False when its bytes had to be downloaded and could not be (missing or corrupt on
        the remote): the node is then a miss.
        """
        node = st.node
        assert st.key is not None and st.parts is not None
        if not local:
            self.on_remote.add(node.id)
        if node.id in self.want:
            if not local:
                got = self.remote.pull(st.key, entry)
                if got is None:
                    return False
                entry = got
            with self.engine.store.in_use():
                for address in node.addresses:
                    self.engine.store.materialize(
                        entry.outputs_tree, self.engine.address_path(address)
                    )
        st.entry = entry
        self.outputs[node.id] = entry.outputs_tree
        self.meta[node.id] = dict(entry.meta.get("result") or {})
        self.engine.record(node, st.key, st.parts)
        self._done(st, status, st.reason)
        return True

    def _collect(self, st: NodeState, ref: Any) -> bool:
        """Take a finished task's result; True when the node is built or cached."""
        import ray
        from ray.exceptions import RayError, TaskCancelledError

        st.duration = time.time() - st.started
        try:
            res = ActionResult.from_json(ray.get(ref))
        except TaskCancelledError:
            self._done(st, "failed", "cancelled")
            return False
        except RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._done(
                st,
                "failed",
                f"lost on the Ray cluster after {self.settings.max_retries} retr"
                f"{'y' if self.settings.max_retries == 1 else 'ies'}: {type(exc).__name__}: {first}",
            )
            return False
        if res.status in ("built", "cached") and res.entry is not None:
            if res.entry.key != st.key:
                self._done(st, "failed", f"worker returned an entry for another key ({res.entry.key[:16]})")
                return False
            self.on_remote.add(st.node.id)
            if res.duration:
                st.duration = res.duration
            if not self._finish(st, res.entry, "built" if res.status == "built" else "cached", local=False):
                st.status = "failed"
                st.reason = f"built on {res.host}, but its outputs could not be downloaded (see the log)"
                return False
            return True
        if res.log_tail:
            with tempfile.NamedTemporaryFile(
                "w", delete=False, dir=self.engine.store.tmp_dir, suffix=".log"
            ) as fh:
                fh.write(res.log_tail)
            try:
                st.log_path = self.engine.store.keep_failed_log(st.key or "", fh.name)
            finally:
                Path(fh.name).unlink(missing_ok=True)
        self._done(st, res.status if res.status == "unbuildable" else "failed", res.reason)
        return False


def _execute_entry(spec_json: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Ray task (a module-level function, so workers import it by name)."""
    from mopt_ray.worker import execute

    return execute(spec_json, cfg)
