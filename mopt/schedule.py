"""What every scheduler of a build shares (the local one in `mopt.build`, the session an
executor plugin drives in `mopt.executor`): a node's state, when it may start, what it
reads, and the reporter they tell. One rule for all of them, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopt.api import Missing
from mopt.graph import Node
from mopt.store import ActionEntry

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


class Reporter:
    """Progress callbacks (silent by default)."""

    def start(self, states: dict[str, NodeState]) -> None: ...
    def started(self, st: NodeState) -> None: ...
    def waiting(self, st: NodeState) -> None: ...
    def done(self, st: NodeState) -> None: ...
    def tick(self) -> None: ...
    def stop(self) -> None: ...
