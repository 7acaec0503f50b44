"""One action as any runner runs it, and what came of it (Bazel's Spawn and SpawnResult).

The same value goes to a warm worker process on this machine, to one inside bubblewrap, and
(as JSON) to a remote worker of an executor plugin, which fetches the inputs, the source and
the declared input files by digest, then runs it like the others.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mopt.api import Artifact, Missing


@dataclass(frozen=True)
class Spawn:
    """One action, as any process can run it (picklable; paths are strings)."""

    key: str
    node_id: str
    kind: str
    #: the plugin that registered the kind (for messages; the worker loads the same registry)
    plugin: str
    params: dict[str, Any]
    inputs: dict[str, list[Artifact]]
    model_name: str
    family: str | None
    task: str
    source: str | None
    hardware: dict[str, Any]
    section: str
    target: str
    project_dir: str
    missing: dict[str, list[Missing]] = field(default_factory=dict)
    #: env values set for the action (None: unset), e.g. the `command` kind's keyed `env`
    env: dict[str, str | None] = field(default_factory=dict)
    offline: bool = False
    cache_dir: str | None = None
    #: the kind needs the network (`TargetKind.network`); without it a sandbox unshares it
    network: bool = True
    #: the kind may run in the sandbox (`TargetKind.sandbox`); False: a plain worker process
    sandboxed: bool = True
    disabled_plugins: tuple[str, ...] = ()
    #: modules the kind's run() imports (`TargetKind.preload`): a zygote imports them
    #: before it forks the worker that runs this spawn
    preload: tuple[str, ...] = ()
    #: for a runner on another machine: the source's tree digest, the kind's declared input
    #: files as (path relative to the project, digest, whether a tree), the recipe's path,
    #: and the action key's members (the tool versions to check, recorded in the entry)
    source_tree: str | None = None
    files: tuple[tuple[str, str, bool], ...] = ()
    recipe: str = ""
    parts: dict[str, Any] = field(default_factory=dict)
    #: written by the runner: where the action writes its output, scratch and log
    out: str = ""
    tmp: str = ""
    log: str = ""
    #: the machine, named in the log when the action runs on another one
    host: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Spawn:
        d = json.loads(text)
        d["inputs"] = {
            slot: [Artifact(**{**a, "path": Path(a["path"])}) for a in arts] for slot, arts in d["inputs"].items()
        }
        d["missing"] = {slot: [Missing(**m) for m in ms] for slot, ms in d["missing"].items()}
        d["files"] = tuple((rel, digest, bool(tree)) for rel, digest, tree in d["files"])
        d["disabled_plugins"] = tuple(d["disabled_plugins"])
        d["preload"] = tuple(d["preload"])
        return cls(**d)


@dataclass
class SpawnResult:
    """What came of a spawn. `status`: ok | failed (the kind raised) | crashed (its process died)."""

    status: str
    meta: dict[str, Any] = field(default_factory=dict)
    duration: float = 0.0
    #: one line: the exception, or how the process ended
    error: str = ""
    out: Path = Path()
    log: Path = Path()

    @property
    def ok(self) -> bool:
        return self.status == "ok"
