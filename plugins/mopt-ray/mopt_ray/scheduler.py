"""The driver side of the Ray executor: submit the session's misses as Ray tasks.

For each action of the build (`mopt.api.ExecutorSession`, in dependency order), once its
inputs are in:

1. the session keys it and takes it as a hit of the local store or the remote cache
   (`session.cached`: the remote's entry verified, its bytes downloaded only when the node
   is to be materialized under build/; workers fetch their inputs themselves);
2. otherwise its placement (`mopt_ray.placement`) is checked against the cluster's alive
   nodes: if no node can hold it, it is reported unbuildable with the reason;
3. otherwise `session.spawn` makes its inputs available on the remote cache and describes
   it as a spawn, which is submitted as a Ray task (`session.run_spawn`, the core's remote
   runner, in a Ray worker) with `num_cpus`, `num_gpus`, the profile's custom resource and
   `max_retries` (retries on worker or node loss only: a failing kind is not retried).

While tasks run, the cluster is re-checked every few seconds: a task whose only capable
nodes left the cluster is cancelled and reported unbuildable, not left pending.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import suppress
from typing import Any

from mopt.api import ExecutorSession, MoptError
from mopt_ray.placement import Placement, infeasible, node_resources, placement

log = logging.getLogger("mopt.ray")

RECHECK_S = 3.0


class RayBuild:
    """One build of the session's actions on the Ray cluster. Use `run()`."""

    def __init__(self, session: ExecutorSession, settings: Any) -> None:
        self.session = session
        self.settings = settings
        self.placements: dict[str, Placement] = {}
        self.cfg = {"store": settings.worker_store, "remote": session.remote_connection()}

    def run(self) -> dict[str, Any]:
        import ray

        s = self.session
        task = ray.remote(_execute_entry)
        pending = deque(s.ids)
        running: dict[Any, str] = {}
        stop = False
        nodes = node_resources()
        last_check = time.time()
        s.start()
        try:
            while pending or running:
                for _ in range(len(pending)):
                    i = pending.popleft()
                    state, why_not = s.readiness(i)
                    if state == "blocked":
                        s.done(i, "blocked", why_not)
                        continue
                    if stop:
                        s.done(i, "blocked", "not started after an earlier failure (use --keep-going)")
                        continue
                    if state == "wait":
                        pending.append(i)
                        continue
                    ref = self._schedule(i, task, nodes)
                    if ref is not None:
                        running[ref] = i
                if not running:
                    if pending and not any(s.readiness(i)[0] != "wait" for i in pending):
                        # every pending node waits on something that will never come
                        for i in list(pending):
                            s.done(i, "blocked", "an input was not built")
                        pending.clear()
                    continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=0.2)
                for ref in ready:
                    i = running.pop(ref)
                    ok = self._collect(i, ref)
                    if not ok and not s.keep_going:
                        stop = True
                if time.time() - last_check > RECHECK_S and running:
                    last_check = time.time()
                    nodes = node_resources()
                    for ref, i in list(running.items()):
                        why = infeasible(self.placements[i], nodes)
                        if why:
                            ray.cancel(ref, force=True)
                            running.pop(ref)
                            s.done(i, "unbuildable", f"unbuildable on the Ray cluster: {why}")
                s.tick()
            return s.states()
        finally:
            for ref in running:
                with suppress(Exception):  # best effort on the way out
                    ray.cancel(ref, force=True)
            s.stop()

    def _schedule(self, node_id: str, task: Any, nodes: list[dict[str, float]]) -> Any:
        """Key the node; finish it as a hit, or as unbuildable, or submit it (return its ref)."""
        s = self.session
        s.key(node_id)
        if s.cached(node_id):
            return None
        node = s.node(node_id)
        p = placement(node.kind_class(), node.params, node.hardware, portable_kinds=self.settings.portable_kinds)
        self.placements[node_id] = p
        why = infeasible(p, nodes)
        if why:
            s.done(node_id, "unbuildable", f"unbuildable on the Ray cluster: {why}")
            return None
        try:
            spec = s.spawn(node_id)
        except (MoptError, OSError, ValueError) as exc:
            s.done(node_id, "failed", f"preparing inputs for the workers: {exc}")
            return None
        except Exception as exc:  # the remote cache refused an upload
            s.done(node_id, "failed", f"uploading inputs to the remote cache: {exc}")
            return None
        s.started(node_id)
        opts: dict[str, Any] = {
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "max_retries": self.settings.max_retries,
            "retry_exceptions": False,
            "name": f"mopt {node_id}",
        }
        if p.resources:
            opts["resources"] = dict(p.resources)
        if self.settings.runtime_env:
            opts["runtime_env"] = dict(self.settings.runtime_env)
        return task.options(**opts).remote(self.session.run_spawn, spec, self.cfg)

    def _collect(self, node_id: str, ref: Any) -> bool:
        """Take a finished task's result; True when the node is built or cached."""
        import ray
        from ray.exceptions import RayError, TaskCancelledError

        s = self.session
        try:
            result = ray.get(ref)
        except TaskCancelledError:
            s.done(node_id, "failed", "cancelled")
            return False
        except RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            retries = self.settings.max_retries
            s.done(
                node_id,
                "failed",
                f"lost on the Ray cluster after {retries} retr{'y' if retries == 1 else 'ies'}: "
                f"{type(exc).__name__}: {first}",
            )
            return False
        return s.finished(node_id, result)


def _execute_entry(run_spawn: Any, spec_json: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Ray task (a module-level function, so workers import it by name); `run_spawn` is
    the session's remote runner, pickled by reference (mopt is installed on the workers)."""
    return dict(run_spawn(spec_json, cfg, executor="ray"))
