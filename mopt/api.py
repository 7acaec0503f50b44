"""The plugin-facing API: what a target kind, model family, source, hardware profile and
executor look like. Plugins import from here (and `mopt.hookspecs`), nothing else.

Contracts and values only: nothing here imports the engine or the CLI (tests/test_layers.py
holds it to that). What a plugin needs of the engine arrives as hook arguments: an
executor's `ExecutorSession`, a command's `Core`. Nothing in this module imports a heavy
library; kinds import theirs inside `run`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pluggy
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from mopt import plugin_env
from mopt.digest import MODE_EXEC, MODE_FILE, TreeEntry, hash_tree, iter_files, mode_of
from mopt.errors import BuildFailed, MoptError, PluginError, human
from mopt.estimate import ConfigError, ModelDims, activation_bytes
from mopt.family import (
    DTYPES,
    EMBEDDING,
    TEXT_GENERATION,
    ExportSpec,
    Family,
    TransformersFamily,
    generation_export_spec,
    generation_graph_names,
    quiet_transformers,
    tokenize,
    torch_dtype,
)

hookimpl = pluggy.HookimplMarker("mopt")

#: how a log line marks itself as progress (`BuildContext.progress`)
PROGRESS = "progress: "
#: the lock file a build writes beside its recipe (`Core.locked_keys` reads one)
LOCK_NAME = "mopt.lock"

__all__ = [
    "DTYPES",
    "EMBEDDING",
    "FORMATS",
    "LOCK_NAME",
    "MODE_EXEC",
    "MODE_FILE",
    "PROGRESS",
    "TEXT_GENERATION",
    "ActionNode",
    "ActionRecord",
    "Artifact",
    "BuildContext",
    "BuildFailed",
    "BuiltTarget",
    "CheckContext",
    "ConfigError",
    "Core",
    "Executor",
    "ExecutorSession",
    "ExportSpec",
    "Family",
    "Finding",
    "HardwareProfile",
    "Input",
    "KvPool",
    "Missing",
    "ModelDims",
    "MoptError",
    "NoParams",
    "Params",
    "PluginError",
    "RecipeNode",
    "Role",
    "Source",
    "SourceContext",
    "SourceError",
    "TargetKind",
    "TransformersFamily",
    "TreeEntry",
    "activation_bytes",
    "generation_export_spec",
    "generation_graph_names",
    "hash_tree",
    "hookimpl",
    "human",
    "iter_files",
    "mode_of",
    "package_versions",
    "param_roles",
    "plugin_env",
    "quiet_transformers",
    "run_process",
    "tokenize",
    "torch_dtype",
]


class Params(BaseModel):
    """Base for a kind's params: unknown keys are errors, values immutable, and strict in a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """Params of a kind that takes none."""


class Role(str, enum.Enum):
    """What a param means to `mopt check`'s generic rules: mark a field with
    `Annotated[str, Role.precision]`. Only marked fields are checked; the name of a field
    means nothing to `check`. What each role is: docs/plugins.md, *Parameter roles*."""

    precision = "precision"
    kv_cache_precision = "kv_cache_precision"
    quantization = "quantization"
    batch_size = "batch_size"
    seq_len = "seq_len"
    num_tokens = "num_tokens"
    shapes = "shapes"
    memory_fraction = "memory_fraction"
    kv_cache_fraction = "kv_cache_fraction"
    tensor_parallel = "tensor_parallel"
    pipeline_parallel = "pipeline_parallel"
    kv_block_tokens = "kv_block_tokens"
    workspace_gb = "workspace_gb"


def param_roles(params_model: type[BaseModel]) -> dict[str, Role]:
    """Field name → its `Role`, for the fields of `params_model` that carry one (through
    `Annotated[..., Role.x]` or `Field(json_schema_extra={"mopt_role": "x"})`)."""
    out: dict[str, Role] = {}
    for name, info in params_model.model_fields.items():
        for meta in info.metadata:
            if isinstance(meta, Role):
                out[name] = meta
        extra = info.json_schema_extra
        if isinstance(extra, dict) and isinstance(extra.get("mopt_role"), str):
            out[name] = Role(extra["mopt_role"])
    return out


#: artifact formats: what a kind's output folder holds, so that any kind producing a format
#: can feed any slot that accepts it (docs/plugins.md describes each layout)
FORMATS: dict[str, str] = {
    "hf-checkpoint": "a Hugging Face model folder: config.json, *.safetensors, tokenizer files",
    "modelopt-checkpoint": "an HF folder quantized by NVIDIA ModelOpt (hf_quant_config.json)",
    "onnx": "model.onnx (+ model.onnx.data), mopt_ml.json, tokenizer and config files",
    "openvino-ir": "OpenVINO IR (model.xml + model.bin) with tokenizer files",
    "tensorrt-plan": "a serialized TensorRT engine (model.plan) and its metadata",
    "torch-compile-cache": "a torch.compile cache (megacache) for the family's model",
    "aoti-package": "an AOTInductor package (model.pt2)",
    "vllm-config": "a vLLM serving config: args.json, serve.sh",
    "trtllm-config": "a TensorRT-LLM serving config: extra_llm_api_options.yaml, args.json",
    "triton-repo": "a Triton model repository",
    "oci-image": "an OCI image archive (image.tar) and image.json",
    "report": "a JSON report (report.json / bench.json), maybe with report.html",
    "selection": "the winner's files (its own format), selection.json, selection.html, pareto.svg",
    "files": "any files (the `command` kind's output)",
}


@dataclass(frozen=True)
class Input:
    """One input slot of a target kind (docs/plugins.md, *Inputs*).

    `formats` (`TargetKind.produces` values) and `kinds` (`("*",)`: any kind the recipe names
    with `input = "<target>"`) say what may fill it, most preferred first. Several candidates
    of the preferred one: the recipe names one, unless `fanout` (a node per candidate, e.g.
    `validate`) or `gather` (one node gets them all, e.g. `select`).
    """

    name: str
    kinds: tuple[str, ...] = ()
    required: bool = True
    fanout: bool = False
    gather: bool = False
    #: (with `gather`) run even when some of them failed or cannot build here; they are
    #: listed in `BuildContext.missing` and their status is part of the action key
    partial: bool = False
    formats: tuple[str, ...] = ()
    #: kinds tried first, in this order, before the other producers of `formats` (a
    #: preference, where `kinds` is a restriction): `vllm` takes `weights` when the section has
    #: it, and a third party's `hf-checkpoint` too
    prefer: tuple[str, ...] = ()

    def accepts(self, kind: str, produces: str) -> bool:
        """Whether an artifact of `kind` in format `produces` may fill this slot."""
        if self.formats and produces not in self.formats:
            return False
        return not self.kinds or kind in self.kinds or "*" in self.kinds

    def describe(self) -> str:
        """What it takes, for messages: `format onnx or openvino-ir`, `kind weights`."""
        parts = []
        if self.formats:
            parts.append("format " + " or ".join(self.formats))
        if self.kinds and "*" not in self.kinds:
            parts.append("kind " + " or ".join(self.kinds))
        return ", ".join(parts) or "any kind"


@dataclass(frozen=True)
class Artifact:
    """A built input as a kind's `run` sees it: a read-only folder and its metadata. `meta` is
    what the producing kind's `run()` returned (as its action entry recorded it; `{}` for None)."""

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

    def progress(self, msg: str) -> None:
        """A line of the action's log that `mopt build` also prints without a terminal (a
        bench's finished point): long actions are not silent in CI logs."""
        self.logger.info(PROGRESS + msg)


class TargetKind:
    """A kind of artifact: subclass, set the class attributes, implement `run`. Bump `version`
    whenever the bytes `run` writes for the same inputs change."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    consumes: ClassVar[tuple[Input, ...]] = ()
    #: the artifact format its output folder holds (a FORMATS name; "" says nothing, and
    #: then only slots that name this kind in `Input.kinds` take it)
    produces: ClassVar[str] = ""
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
    #: runs alone: nothing else starts beside it (benchmarks)
    exclusive: ClassVar[bool] = False
    #: distributions whose versions shape the output: what the default `fingerprint()` returns
    fingerprint_packages: ClassVar[tuple[str, ...]] = ()
    #: `fingerprint()` reads only installed packages and env variables (no GPU, driver or
    #: other machine state), so a no-op build may skip it; unset, it is True unless the class
    #: overrides `fingerprint()`
    static_fingerprint: ClassVar[bool] = True
    #: byte-for-byte reproducible output (engines built by timing tactics are not)
    reproducible: ClassVar[bool] = True
    #: the action needs the network; with False, a bubblewrap sandbox runs it without any
    network: ClassVar[bool] = True
    #: the action may run in the bubblewrap sandbox; False for kinds that drive system tools
    #: keeping state outside the project (buildah, docker), run in a plain worker process
    sandbox: ClassVar[bool] = True
    #: heavy modules `run()` imports (e.g. ("torch", "transformers")): the build's fork
    #: server imports them once, before it forks the workers that run this kind
    preload: ClassVar[tuple[str, ...]] = ()
    #: how `mopt check` sizes its GPU memory: "engine" (batch × sequence through one pass),
    #: "none", or None: as its `kv_pool()`, else "engine" when such roles are marked
    memory_model: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a class that says static_fingerprint decides for its subclasses; otherwise an own
        # fingerprint() (which may read anything: nvidia-smi, a driver) makes it not static
        own = cls.__mro__[: cls.__mro__.index(TargetKind)]
        if any("static_fingerprint" in c.__dict__ for c in own):
            return
        if any("fingerprint" in c.__dict__ for c in own):
            cls.static_fingerprint = False

    def requirements(self, params: Any, hardware: HardwareProfile) -> list[str]:
        """Requirements for these params on this profile (default: `requires`)."""
        return list(self.requires)

    def bind(self, params: Any, *, model: str, hardware: str, section: str) -> Any:
        """Params specialised to a section (e.g. filling `{model}` in paths); default as is."""
        return params

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        """Files outside the store it reads (data sets, scripts): their digests go into the key."""
        return []

    def fingerprint(self) -> dict[str, str]:
        """Versions of the tools that shape the output (library versions, GPU, driver);
        default: the versions of `fingerprint_packages`."""
        return package_versions(*self.fingerprint_packages)

    def platform(self, hardware: HardwareProfile) -> dict[str, Any]:
        """Output-relevant properties of the platform (goes into the action key)."""
        return {}

    def kv_pool(self, hardware: HardwareProfile, task: str) -> KvPool | None:
        """How the serving runtime this kind configures keeps its KV cache on `hardware` for a
        model of `task`, with the runtime's defaults (for `mopt check`); None: no KV cache."""
        return None

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        """Findings for these params on `ctx.hardware` (`mopt check`); no heavy imports."""
        return []

    def run(self, ctx: BuildContext) -> dict[str, Any] | None:
        """Build the artifact into `ctx.out`; return metadata (JSON-serialisable): it is
        recorded in the action entry and is what consumers see as `Artifact.meta`."""
        raise NotImplementedError(f"target kind {self.name!r} does not implement run()")


def run_process(
    argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
    on_line: Any = None,
) -> int:  # fmt: skip
    """Run a tool from a kind's `run()`: in its own process group (killed with the build on
    Ctrl-C), its output lines streamed to `on_line` (e.g. `ctx.log`); the exit status."""
    from mopt import procs

    return procs.run(argv, cwd=cwd, env=env, on_line=on_line)


def package_versions(*dists: str) -> dict[str, str]:
    """Installed versions of distributions, read from package metadata without importing
    them ("missing" for one that is not installed): the usual `fingerprint()`."""
    return {dist: plugin_env.dist_version(dist) or "missing" for dist in dists}


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


@dataclass(frozen=True)
class KvPool:
    """A serving runtime's KV-cache pool as `mopt check` sizes it (`TargetKind.kv_pool`):
    the share of memory it takes, and the runtime's defaults for what the params leave out."""

    #: "gpu": `fraction` of the GPU's memory holds the weights, activations and the cache
    #: (vLLM's gpu_memory_utilization); "free": `fraction` of the memory the model leaves
    #: free holds the cache (TensorRT-LLM's kv_cache_free_gpu_memory_fraction)
    share_of: str
    #: the share when no `Role.memory_fraction` ("gpu") / `Role.kv_cache_fraction` ("free") sets it
    fraction: float
    #: sequences at once when no `Role.batch_size` param sets it
    max_seqs: int
    #: tokens of one forward pass when no `Role.num_tokens` param sets it
    max_tokens: int
    #: one pass takes at least a whole sequence (no chunked prefill)
    whole_sequence: bool = False
    #: the runtime's names of those settings, for messages
    seqs_key: str = "max_batch_size"
    seq_key: str = "max_seq_len"
    fraction_key: str = "kv_cache_fraction"
    tokens_key: str = "max_num_tokens"
    #: a text-generation section none of whose targets sets serving limits is sized as
    #: this runtime would serve it with every default (the first such kind by name)
    baseline: bool = False


@dataclass
class CheckContext:
    """What `TargetKind.check` may look at: the profile and the model's config.json."""

    hardware: HardwareProfile
    model_config: dict[str, Any] | None
    family: Family | None
    section: str
    target: str
    #: the model's `task` ("embedding", "text-generation")
    task: str = EMBEDDING


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

    def identity(self, params: Any, ctx: SourceContext) -> Any:
        """None (the default): the folder's bytes are the source's identity. A source whose
        bytes follow from its declaration returns a JSON value naming everything they depend
        on, cheaply (no heavy import, no download): keys then use it, and nothing resolves
        the folder before an action reads it (docs/plugins.md, *Sources*)."""
        return None

    def lock_info(self, params: Any, path: Path) -> dict[str, Any]:
        """What the lock file records besides the folder's digest (e.g. a resolved revision);
        not asked of a source with an `identity` (the lock file records that instead)."""
        return {}


@dataclass(frozen=True)
class SourceContext:
    """What a source resolver may use."""

    project_dir: Path
    cache_dir: Path
    offline: bool
    family: Family | None
    model_name: str
    #: every registered family by name (e.g. for a source that builds a named architecture)
    families: dict[str, type[Family]] = field(default_factory=dict)
    #: the model's `task` (a synthetic source builds a model for it)
    task: str = EMBEDDING


class SourceError(Exception):
    """A source could not be resolved; the message says which and what to do."""


#: what `HardwareProfile.device` may be
DEVICES = ("gpu", "cpu", "accelerator")


class HardwareProfile(BaseModel):
    """A deployment target: one machine type. `device` is "gpu" (NVIDIA: the CUDA rules of
    `mopt check` apply), "cpu" or "accelerator" (an NPU, a TPU, another vendor's GPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    device: str = "gpu"
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_gb: float | None = None
    bandwidth_gbps: float | None = None
    sm_count: int | None = None
    gpu_count: int = 1
    fp16_tflops: float | None = None
    #: the GPU's `memory_gb` is the machine's one pool, shared with the CPU (Jetson-class)
    shared_memory: bool = False
    #: device="accelerator": its kind ("npu", "tpu", "intel-gpu", ...)
    accelerator: str | None = None
    #: precisions with native support, when the compute capability cannot tell (accelerators)
    supported_precisions: tuple[str, ...] | None = None
    source: str = ""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in DEVICES:
            hint = ' (an NPU, TPU, ...: device = "accelerator", accelerator = "npu")' if v != "" else ""
            raise ValueError(f"device {v!r} is not one of {', '.join(DEVICES)}{hint}")
        return v

    @model_validator(mode="after")
    def _fields(self) -> HardwareProfile:
        if self.device == "accelerator" and not self.accelerator:
            raise ValueError('device "accelerator" needs accelerator = "<its kind, e.g. npu>"')
        if self.device != "accelerator" and self.accelerator:
            raise ValueError(f'accelerator is only for device "accelerator" (this one is {self.device!r})')
        if self.device != "gpu" and self.compute_capability is not None:
            raise ValueError(f"compute_capability is a CUDA GPU property; device is {self.device!r}")
        return self

    @property
    def is_gpu(self) -> bool:
        """An NVIDIA (CUDA) GPU profile."""
        return self.device == "gpu"

    @property
    def kind_label(self) -> str:
        """What it is, for listings: "gpu", "cpu", or the accelerator's kind."""
        return self.accelerator or self.device

    @property
    def precisions(self) -> tuple[str, ...]:
        """Precisions with hardware support on this profile."""
        if self.supported_precisions is not None:
            return tuple(self.supported_precisions)
        if not self.is_gpu or self.compute_capability is None:
            return ("fp32", "int8")
        cc = self.compute_capability
        since = {"bf16": (8, 0), "fp8": (8, 9), "nvfp4": (10, 0), "int4": (7, 5)}
        return ("fp32", "fp16", "int8", *(p for p, first in since.items() if cc >= first))


class Executor:
    """Runs the cache misses of a build somewhere else than this machine's worker pool;
    `Settings` validates `[executor]` in mopt.toml.

    `local` is mopt's own. Any other executor implements
    `build(session: ExecutorSession, *, settings) -> session.states()`, Bazel's remote
    execution in mopt's terms: the session keys, takes hits, records and reports; the
    executor places each miss, runs its `session.spawn(id)` with `session.run_spawn(spawn,
    worker)` in a process on the machine it picked (`worker`: `{"store": <a store folder
    there>, "remote": session.remote_connection()}`), and hands the result back
    (`session.finished`, or `session.done`). docs/plugins.md, *Executors*, walks through it.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Settings: ClassVar[type[BaseModel]] = NoParams


@dataclass(frozen=True)
class ActionNode:
    """One action of a build, as an executor sees it (`ExecutorSession.node`)."""

    id: str
    label: str
    kind: str
    #: the `TargetKind` subclass (resources, requirements, exclusive: for placement)
    kind_class: Any
    #: the kind's validated `Params`
    params: Any
    hardware: HardwareProfile
    model_name: str
    #: slot → ids of the actions whose outputs it reads
    inputs: dict[str, list[str]]


class ExecutorSession(Protocol):
    """What `Executor.build` gets: one build's actions, and where their results go.

    Call order per action: `readiness` until "ready" (or "blocked": `done`), `key`,
    `cached` (True: done, a hit), else `spawn` → run it → `started` before, `finished`
    after (or `done` with a reason). `ids` are in dependency order."""

    ids: list[str]
    keep_going: bool
    #: the build's registry of plugins (`.targets`, `.hardware`, ...)
    registry: Any
    #: the remote runner, `run_spawn(spawn_json, worker, executor=name)` (see `Executor`): a
    #: module-level function, so it pickles by reference to a worker that has mopt installed
    run_spawn: Callable[..., dict[str, Any]]

    def node(self, node_id: str) -> ActionNode: ...
    def status(self, node_id: str) -> str: ...
    def readiness(self, node_id: str) -> tuple[str, str]: ...
    def key(self, node_id: str) -> str: ...
    def cached(self, node_id: str) -> bool: ...
    def spawn(self, node_id: str) -> str: ...
    def started(self, node_id: str) -> None: ...
    def finished(self, node_id: str, result: dict[str, Any], *, duration: float | None = None) -> bool: ...
    def done(self, node_id: str, status: str, reason: str = "") -> None: ...
    def remote_connection(self) -> dict[str, Any] | None: ...
    def remote_writable(self) -> bool: ...
    def probe_gpus(self) -> Any: ...
    def gpu_matches(self, gpu: Any, profile: HardwareProfile) -> str | None: ...
    def start(self) -> None: ...
    def tick(self) -> None: ...
    def stop(self) -> None: ...
    def states(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class BuiltTarget:
    """A built target as the store holds it for its current action key (`Core.built_target`)."""

    node_id: str
    kind: str
    key: str
    #: relative path in the output folder → the read-only blob holding its bytes
    files: dict[str, Path]
    #: what the kind's run() returned (`Artifact.meta`)
    meta: dict[str, Any]


@dataclass(frozen=True)
class ActionRecord:
    """What the store recorded for one action key (`Core.nodes`, `Core.entry`)."""

    key: str
    created: float
    duration_s: float
    #: the tools' versions the action ran with (`TargetKind.fingerprint`)
    fingerprint: dict[str, Any]
    #: what the kind's run() returned (`Artifact.meta`)
    result: dict[str, Any]
    #: what the key was computed from (`mopt explain`); `Core.key_changes` compares two
    parts: dict[str, Any]
    #: relative path in the output folder → its size and the read-only blob holding its bytes
    files: dict[str, tuple[int, Path]]


@dataclass(frozen=True)
class RecipeNode:
    """One node of a recipe's graph and its state in the store (`Core.nodes`)."""

    id: str
    section: str
    model: str
    hardware: str
    label: str
    kind: str
    #: slot → the ids of the nodes it reads
    inputs: dict[str, list[str]]
    #: `mopt plan`'s state (`up-to-date`, `new`, `changed`, ...) and its one-line summary
    state: str
    summary: str
    #: its folder, build/<model>/<section>/<target>
    path: Path
    #: the store's record of its current key if it is built (`up-to-date`), else None
    built: ActionRecord | None


class Core(Protocol):
    """What mopt's core does for a plugin's commands: handed to `mopt_register_commands` as
    `core`, so that a command never imports the engine."""

    def registry(self, project_dir: Path | None = None) -> Any:
        """The registry of installed plugins, less those the project at `project_dir`
        (default: the current folder) disables: `.targets`, `.families`, `.hardware`, ..."""

    def probe_gpus(self) -> Any:
        """The NVIDIA GPUs visible here: `.visible` (each with `.index`, `.name`, `.cc`) and
        `.error` (why none, if none)."""

    def gpu_matches(self, gpu: Any, profile: HardwareProfile) -> str | None:
        """None when `gpu` (from `probe_gpus`) is what `profile` describes, else why not."""

    def built_target(self, recipe: Path, selector: str, *, kind: str | None = None) -> BuiltTarget:
        """The one built target of `recipe` that `selector` (model.hardware:target) names, of
        `kind` when given; `MoptError` when it names none or several, or the target is not
        built for its current key (a stale build is never returned)."""

    def nodes(self, recipe: Path, selectors: tuple[str, ...] = ()) -> list[RecipeNode]:
        """The nodes of `recipe` that `selectors` select (all without), in build order, each
        with its plan state and, when built for its current key, what the store holds."""

    def entry(self, recipe: Path, key: str) -> ActionRecord | None:
        """The store's record of any action `key` (one a lock file names), None if it has none
        or `key` is no key; `files` is left empty (its blobs may be gone)."""

    def locked_keys(self, recipe: Path, text: str, where: str) -> dict[str, str]:
        """The artifacts (node id → action key) that a lock file's `text` records for
        `recipe`; `MoptError` naming `where` if it is no mopt lock file or has no such build."""

    def key_changes(self, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
        """Why a key changed, as `mopt plan` says it (`param opset: 17 → 13`), from two `parts`."""

    def build_dir(self, recipe: Path) -> Path:
        """The build folder of `recipe`'s project (`[store] build_dir`)."""
