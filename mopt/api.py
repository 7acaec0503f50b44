"""The plugin-facing API: what a target kind, model family, source, hardware profile and
executor look like. Plugins import from here (and `mopt.hookspecs`), nothing else.

Nothing in this module imports a heavy library; kinds import theirs inside `run`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pluggy
from pydantic import BaseModel, ConfigDict

hookimpl = pluggy.HookimplMarker("mopt")

#: keys every target table may hold besides its kind's params
RESERVED_TARGET_KEYS = frozenset({"kind", "input"})


class Params(BaseModel):
    """Base for a kind's params: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """Params of a kind that takes none."""


@dataclass(frozen=True)
class Input:
    """One input slot of a target kind.

    `kinds` are the target kinds that can feed it, most preferred first. When a section
    has several candidates of the preferred kind, the recipe must say which with
    `input = "<target>"`. With `fanout`, the node is repeated once per candidate instead
    (e.g. `validate` runs once for every artifact under test). With `gather`, one node
    gets all candidates' nodes in the slot (e.g. `select` over every variant of a sweep).
    """

    name: str
    kinds: tuple[str, ...]
    required: bool = True
    fanout: bool = False
    #: one node takes every candidate's nodes at once (e.g. `select` over a whole sweep)
    gather: bool = False
    #: (with `gather`) run even when some of them failed or cannot build here; they are
    #: listed in `BuildContext.missing` and their status is part of the action key
    partial: bool = False


@dataclass(frozen=True)
class Artifact:
    """A built input as a kind's `run` sees it: a read-only folder and its metadata."""

    path: Path
    kind: str
    target: str
    digest: str
    meta: dict[str, Any] = field(default_factory=dict)
    #: the producing node's label in its section (`int8@smooth_alpha=0.5`)
    label: str = ""
    #: the producing node's own inputs: slot → labels of the nodes it consumed
    input_labels: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Missing:
    """An input of a `partial` slot that is not there: failed, unbuildable here or blocked."""

    label: str
    kind: str
    status: str
    reason: str = ""
    #: its own inputs: slot → labels (which artifact a missing `validate` was about)
    input_labels: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class BuildContext:
    """What `TargetKind.run` gets. It writes only into `out`; `tmp` is scratch space."""

    out: Path
    tmp: Path
    params: Any
    inputs: dict[str, list[Artifact]]
    model_name: str
    family: Family | None
    task: str
    source: Path | None
    hardware: HardwareProfile
    section: str
    target: str
    project_dir: Path
    logger: logging.Logger
    offline: bool = False
    #: a persistent folder for caches that speed builds up without changing outputs
    #: (e.g. TensorRT timing caches): shared by all actions of this kind, never keyed
    cache_dir: Path | None = None
    #: per `partial` slot, the inputs that are not there (see `Input.partial`)
    missing: dict[str, list[Missing]] = field(default_factory=dict)

    def input(self, slot: str | None = None) -> Artifact:
        """The single artifact of `slot` (the first slot when omitted)."""
        if slot is None:
            if not self.inputs:
                raise KeyError("this target has no inputs")
            slot = next(iter(self.inputs))
        arts = self.inputs.get(slot) or []
        if len(arts) != 1:
            raise KeyError(f"input {slot!r} has {len(arts)} artifacts, expected 1")
        return arts[0]

    def log(self, msg: str) -> None:
        """Write a line to this action's log (shown live and kept in the store)."""
        self.logger.info(msg)


class TargetKind:
    """A kind of artifact: subclass, set the class attributes, implement `run`.

    Bump `version` whenever the bytes `run` writes for the same inputs change.
    """

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    consumes: ClassVar[tuple[Input, ...]] = ()
    #: the kind reads the model's source checkpoint (e.g. `weights`)
    uses_source: ClassVar[bool] = False
    #: the output depends on the hardware profile (engines, serving configs)
    per_hardware: ClassVar[bool] = False
    #: requirements on the machine that runs it: "gpu", "cuda>=12", "python:tensorrt",
    #: "tool:buildah", "hardware" (must run on a GPU matching the section's profile)
    requires: ClassVar[tuple[str, ...]] = ()
    #: what to install for an unmet requirement, e.g. {"python:tensorrt": "pip install tensorrt-cu12"}
    install_hints: ClassVar[dict[str, str]] = {}
    #: resource slots one action holds while running ("cpu", "gpu")
    resources: ClassVar[dict[str, int]] = {"cpu": 1}
    #: runs alone: the local scheduler starts it when nothing else runs and starts nothing
    #: beside it (benchmarks: a timing shared with other work is not a timing)
    exclusive: ClassVar[bool] = False
    #: `fingerprint()` depends only on installed packages and env variables (not on the
    #: GPU, driver or other machine state), so a no-op build may skip calling it
    static_fingerprint: ClassVar[bool] = False
    #: byte-for-byte reproducible output (engines built by timing tactics are not)
    reproducible: ClassVar[bool] = True
    #: the action needs the network; with False, a bubblewrap sandbox runs it without any
    network: ClassVar[bool] = True

    def requirements(self, params: Any, hardware: HardwareProfile) -> list[str]:
        """Requirements for these params on this profile (default: `requires`)."""
        return list(self.requires)

    def bind(self, params: Any, *, model: str, hardware: str, section: str) -> Any:
        """Params specialised to a section (e.g. filling `{model}` in paths); default as is."""
        return params

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        """Files outside the store this target reads (data sets, scripts): their content
        digests go into the action key."""
        return []

    def fingerprint(self) -> dict[str, str]:
        """Versions of the tools that shape the output (library versions, GPU, driver)."""
        return {}

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        """Output-relevant properties of the platform (goes into the action key)."""
        return {}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        """Findings for these params on `ctx.hardware` (`mopt check`); no heavy imports."""
        return []

    def run(self, ctx: BuildContext) -> dict[str, Any] | None:
        """Build the artifact into `ctx.out`; return metadata (JSON-serialisable)."""
        raise NotImplementedError(f"target kind {self.name!r} does not implement run()")


@dataclass(frozen=True)
class Finding:
    """One result of `mopt check`: what is wrong, where, with the numbers, and the fix."""

    severity: str  # "error" | "warning" | "info"
    code: str  # stable id, e.g. "precision-unsupported"
    message: str
    fix: str = ""
    section: str = ""
    target: str = ""
    key: str | None = None


@dataclass
class CheckContext:
    """What `TargetKind.check` may look at: the profile and the model's config.json."""

    hardware: HardwareProfile
    model_config: dict[str, Any] | None
    family: Family | None
    section: str
    target: str


class Family:
    """A model family (qwen3, bert, ...): what the graph needs to know about a model.

    Heavy work (loading, pooling, exporting) is done by the plugin's methods, which import
    their libraries lazily. `pooling` is one of "last-token", "mean", "cls".
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    architectures: ClassVar[tuple[str, ...]] = ()
    pooling: ClassVar[str] = "mean"
    tasks: ClassVar[tuple[str, ...]] = ("embedding",)


class Source:
    """A way to get a model checkpoint as a local folder.

    In a recipe, a source is a table whose key named after the source holds its main
    argument: `{ hf = "Qwen/Qwen3-Embedding-0.6B", revision = "..." }`. `Params` validates
    that table (so it must have a field called `name`).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]]

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        """Return a local folder holding the checkpoint, or raise `SourceError`."""
        raise NotImplementedError

    def describe(self, params: Any) -> str:
        """A short human description (`hf:Qwen/Qwen3-Embedding-0.6B@abc123`)."""
        return f"{self.name}:{getattr(params, self.name, '')}"

    def lock_info(self, params: Any, path: Path) -> dict[str, Any]:
        """What the lock file records besides the folder's digest (e.g. a resolved revision)."""
        return {}


@dataclass(frozen=True)
class SourceContext:
    """What a source resolver may use."""

    project_dir: Path
    cache_dir: Path
    offline: bool
    family: Family | None
    model_name: str


class SourceError(Exception):
    """A source could not be resolved; the message says which and what to do."""


class HardwareProfile(BaseModel):
    """A deployment target: one machine type. `cpu` profiles have no GPU fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    device: str = "gpu"  # "gpu" or "cpu"
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_gb: float | None = None
    bandwidth_gbps: float | None = None
    sm_count: int | None = None
    gpu_count: int = 1
    fp16_tflops: float | None = None
    source: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"

    @property
    def precisions(self) -> tuple[str, ...]:
        """Precisions with hardware support on this profile."""
        if not self.is_gpu or self.compute_capability is None:
            return ("fp32", "int8")
        cc = self.compute_capability
        out = ["fp32", "fp16", "int8"]
        if cc >= (8, 0):
            out.append("bf16")
        if cc >= (8, 9):
            out.append("fp8")
        if cc >= (10, 0):
            out.append("nvfp4")
        if cc >= (7, 5):
            out.append("int4")
        return tuple(out)


class Executor:
    """Runs cache misses of a build. `Settings` validates `[executor]` in mopt.toml.

    An executor other than `local` implements
    `build(engine, ids, *, settings, remote, jobs, keep_going, reporter, materialize)`
    returning `{node id: mopt.build.NodeState}`: the engine has keyed nothing yet; the
    executor uses `engine.parts/hit/kind/source/record`, `mopt.keys.action_key`, and
    the remote cache to exchange inputs and outputs with its workers.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Settings: ClassVar[type[BaseModel]] = NoParams
