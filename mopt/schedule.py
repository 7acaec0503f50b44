"""What every scheduler of a build shares (the local one in `mopt.build`, the session an
executor plugin drives in `mopt.executor`): a node's state, when it may start, what it
reads, the action it runs, how its result is stored, and the reporter they tell. One rule
for all of them, so they agree.
"""

from __future__ import annotations

import functools
import socket
import sys
import traceback
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopt.api import Artifact, Missing
from mopt.digest import hash_bytes
from mopt.graph import Node
from mopt.spawn import Spawn, SpawnResult
from mopt.store import ActionEntry, Store

#: statuses after which a node's output will not come in this build
NOT_BUILT = ("failed", "unbuildable", "blocked")


def readiness(
    node: Node, states: dict[str, NodeState], outputs: dict[str, str], graph: Any
) -> tuple[str, str, dict[str, list[Missing]]]:
    """Whether `node` can start: ("ready", "", missing), ("wait", "", {}) or
    ("blocked", reason, {}). Inputs of `partial` slots that will not come are `missing`
    instead of blocking it (every scheduler uses this, so they agree)."""
    deps = node.input_ids()
    if all(d in outputs for d in deps):  # the common case: nothing gone, nothing to wait for
        return "ready", "", {}
    gone = [d for d in deps if d not in outputs and states[d].status in NOT_BUILT]
    hard = [d for d in gone if node.needs(d)]
    if hard:
        return "blocked", f"input {hard[0]} {states[hard[0]].status}", {}
    if any(d not in outputs and d not in gone for d in deps):
        return "wait", "", {}
    return "ready", "", missing_inputs(node, {d: (states[d].status, states[d].reason) for d in gone}, graph)


def missing_inputs(node: Node, gone: dict[str, tuple[str, str]], graph: Any) -> dict[str, list[Missing]]:
    """Slot → the inputs of `node` that will not come (`gone`: id → (status, reason))."""
    missing: dict[str, list[Missing]] = {}
    for slot, ids in node.inputs.items():
        for d in ids:
            if d in gone:
                dep = graph.nodes[d]
                status, reason = gone[d]
                missing.setdefault(slot, []).append(
                    Missing(dep.label, dep.kind, status, reason, graph.input_labels(dep))
                )
    return missing


def built_inputs(node: Node, outputs: dict[str, str]) -> dict[str, list[str]]:
    """Slot → output trees of the inputs that got built (all of them, unless partial)."""
    return {s: [outputs[d] for d in ds if d in outputs] for s, ds in node.inputs.items()}


@dataclass
class NodeState:
    """What happened (or will happen) to one node."""

    node: Node
    status: str = "pending"  # pending|running|cached|built|failed|unbuildable|blocked
    key: str | None = None
    parts: dict[str, Any] | None = None
    entry: ActionEntry | None = None
    reason: str = ""
    log_path: Path | None = None
    #: inputs of `partial` slots that are not there, per slot (see `Input.partial`)
    missing: dict[str, list[Missing]] = field(default_factory=dict)
    started: float = 0.0
    duration: float = 0.0
    last_line: str = ""

    def as_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.node.id,
            "kind": self.node.kind,
            "status": self.status,
            "key": self.key,
        }
        if self.reason:
            d["reason"] = self.reason
        if self.entry is not None:
            d["outputs"] = self.entry.outputs_tree
            d["duration_s"] = round(self.entry.duration_s, 3)
        if self.log_path is not None:
            d["log"] = str(self.log_path)
        return d


def node_spawn(st: NodeState, inputs: dict[str, list[Artifact]], registry: Any, **where: Any) -> Spawn:
    """The keyed node's action as a `Spawn`; `where`: what depends on the machine that runs it
    (`source`, `project_dir`, ...)."""
    node = st.node
    assert st.key is not None and st.parts is not None
    return Spawn(
        key=st.key,
        node_id=node.id,
        kind=node.kind,
        plugin=node.plugin,
        params=node.target.params.model_dump(mode="json"),
        inputs=inputs,
        model_name=node.model.name,
        family=node.model.spec.family,
        task=node.model.spec.task,
        hardware=node.hardware.model_dump(mode="json"),
        section=node.section.id,
        target=node.label,
        missing=st.missing,
        env=dict(st.parts.get("env") or {}),
        disabled_plugins=tuple(getattr(registry, "disabled", ()) or ()),
        **where,
    )


def store_built(
    store: Store, spawn: Spawn, res: SpawnResult, parts: dict[str, Any], kind: Any, **meta: Any
) -> ActionEntry:
    """Put what a successful spawn of `kind` wrote (`res.out`, `res.log`) into `store`, the
    action entry last; `meta`: more to record in the entry's meta."""
    with store.in_use():
        tree, _entries = store.put_tree(res.out)
        log_digest = store.put_log(res.log)
        return store.ac_put(
            spawn.key,
            ActionEntry(
                key=spawn.key,
                kind=spawn.kind,
                target=spawn.node_id,
                outputs_tree=tree,
                log=log_digest,
                duration_s=res.duration,
                fingerprint=dict(parts.get("fingerprint") or {}),
                host=socket.gethostname(),
                meta={
                    "result": res.meta,
                    "parts": parts,
                    "reproducible": bool(kind.reproducible and res.meta.get("reproducible", True)),
                    "code": code_digest(type(kind).__module__),
                    **meta,
                },
            ),
        )


@functools.cache
def code_digest(module: str) -> str:
    """BLAKE3 of the module defining a target kind ("" if it has no file): an action entry
    records it, so that code changed under the same `version` is noticed (`Engine.code_changed`)."""
    try:
        return hash_bytes(Path(sys.modules[module].__file__ or "").read_bytes())
    except (AttributeError, KeyError, OSError):
        return ""


def log_failure(log_path: Path, why: BaseException | str) -> None:
    """Append why the action failed to its log: a message as it is, an exception with its
    traceback. A log that cannot take it (a full disk) is skipped: the reason is reported all
    the same."""
    with suppress(OSError), open(log_path, "a") as fh:
        if isinstance(why, str):
            fh.write(f"mopt: FAILED: {why}\n")
        else:
            fh.write("mopt: FAILED: " + "".join(traceback.format_exception_only(why)).strip() + "\n")
            fh.write(traceback.format_exc())


class Reporter:
    """Progress callbacks (silent by default)."""

    def start(self, states: dict[str, NodeState]) -> None: ...
    def started(self, st: NodeState) -> None: ...
    def waiting(self, st: NodeState) -> None: ...
    def done(self, st: NodeState) -> None: ...
    def progress(self, st: NodeState, msg: str) -> None: ...
    def tick(self) -> None: ...
    def stop(self) -> None: ...
