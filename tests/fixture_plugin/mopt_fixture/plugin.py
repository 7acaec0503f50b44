"""Toy target kinds shaped like the real ones (weights → export → engine → check), a toy
family and a toy GPU profile. Outputs are real files derived from the inputs, so caching,
sharing and invalidation can be tested without torch."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import Field

from mopt.api import (
    BuildContext,
    Family,
    HardwareProfile,
    Input,
    Params,
    Source,
    SourceContext,
    TargetKind,
    hookimpl,
)


def _digest_dir(path: Any) -> str:
    h = hashlib.sha256()
    for root, _dirs, files in sorted(os.walk(path)):
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


class ToyWeights(TargetKind):
    """Copy the model source folder and write a manifest."""

    name = "toy-weights"
    version = "1"
    description = "copy the source checkpoint (fixture)"
    uses_source = True

    class Params(Params):
        dtype: str = Field(default="fp32", description="fp32 or fp16")

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        assert ctx.source is not None
        for f in sorted(os.listdir(ctx.source)):
            shutil.copy(ctx.source / f, ctx.out / f)
        (ctx.out / "manifest.json").write_text(json.dumps({"dtype": ctx.params.dtype}))
        ctx.log(f"copied {ctx.source}")
        return {"files": len(os.listdir(ctx.out))}


class ToyExport(TargetKind):
    """'Export' the weights: a file holding a digest of the input and the opset."""

    name = "toy-export"
    version = "1"
    consumes = (Input("model", kinds=("toy-weights",)),)

    class Params(Params):
        opset: int = 17
        sleep: float = Field(default=0.0, description="seconds to sleep (tests of concurrency)")
        fail: bool = Field(default=False, description="fail after writing a partial output")

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        src = ctx.input("model").path
        (ctx.out / "model.txt").write_text(f"opset={ctx.params.opset}\nfrom={_digest_dir(src)}\n")
        counter = os.environ.get("MOPT_FIXTURE_COUNTER")
        if counter:  # lets tests count how often an action really ran, across processes
            with open(counter, "a") as fh:
                fh.write(f"{ctx.target}\n")
        if ctx.params.sleep:
            ctx.log("sleeping")
            with _timed(ctx.target):
                time.sleep(ctx.params.sleep)
        if ctx.params.fail:
            (ctx.out / "partial.bin").write_bytes(b"x" * 10)
            raise RuntimeError("toy export failed on purpose")
        return {"opset": ctx.params.opset}


class ToyEngine(TargetKind):
    """A per-hardware 'engine' with the params of a TensorRT build."""

    name = "toy-engine"
    version = "2"
    per_hardware = True
    reproducible = False
    consumes = (Input("model", kinds=("toy-export",)),)

    class Params(Params):
        precision: str = "fp16"
        max_batch_size: int = Field(default=32, ge=1)
        opt_level: int = Field(default=3, ge=0, le=5)

    def fingerprint(self) -> dict[str, str]:
        return {"toy-compiler": os.environ.get("MOPT_FIXTURE_TOOL_VERSION", "1.0")}

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        src = ctx.input().path / "model.txt"
        p = ctx.params
        body = src.read_text() + f"hw={ctx.hardware.name} {p.precision} b{p.max_batch_size} O{p.opt_level}\n"
        (ctx.out / "engine.plan").write_text(body)
        return {}


class ToyGpuOnly(TargetKind):
    """Needs a GPU: unbuildable on CI machines."""

    name = "toy-gpu-only"
    per_hardware = True
    requires = ("gpu",)
    consumes = (Input("model", kinds=("toy-export",)),)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        raise RuntimeError("should never run without a GPU")


class ToyCheck(TargetKind):
    """Validate every artifact of the section (fan-out), against the weights."""

    name = "toy-check"
    consumes = (
        Input("model", kinds=("toy-engine", "toy-export"), fanout=True),
        Input("reference", kinds=("toy-weights",)),
    )

    class Params(Params):
        min_score: float = Field(default=0.5, ge=0, le=1)
        data: str | None = Field(default=None, description="a data file, relative to the recipe")

    def input_files(self, params: Any, project_dir: Any) -> list[Any]:
        return [project_dir / params.data] if params.data else []

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        art = ctx.input("model")
        score = 0.9
        if score < ctx.params.min_score:
            raise RuntimeError(f"score {score} below min_score {ctx.params.min_score}")
        data = ""
        if ctx.params.data:
            data = (ctx.project_dir / ctx.params.data).read_text()
        (ctx.out / "report.json").write_text(
            json.dumps({"artifact": art.target, "score": score, "data_lines": len(data.splitlines())})
        )
        return {"score": score}


@contextlib.contextmanager
def _timed(label: str) -> Iterator[None]:
    """Append `start end label` to $MOPT_FIXTURE_TIMES (tests of scheduling)."""
    t0 = time.time()
    yield
    path = os.environ.get("MOPT_FIXTURE_TIMES")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{t0} {time.time()} {label}\n")


class ToyTimed(TargetKind):
    """An `exclusive` kind (like a benchmark): nothing else may run beside it."""

    name = "toy-timed"
    exclusive = True
    consumes = (Input("model", kinds=("toy-export",), fanout=True),)

    class Params(Params):
        sleep: float = 0.3

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        with _timed(ctx.target):
            time.sleep(ctx.params.sleep)
        (ctx.out / "t.txt").write_text("timed\n")
        return {}


class ToyGather(TargetKind):
    """Takes every engine / export of the section and every check at once, whatever got
    built (`gather` + `partial`): writes what it got and what was missing."""

    name = "toy-gather"
    consumes = (
        Input("models", kinds=("toy-engine", "toy-export", "toy-gpu-only"), gather=True, partial=True),
        Input("checks", kinds=("toy-check",), gather=True, partial=True),
    )

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        got = {
            slot: [{"label": a.label, "kind": a.kind, "from": a.input_labels} for a in arts]
            for slot, arts in ctx.inputs.items()
        }
        missing = {
            slot: [{"label": m.label, "status": m.status, "reason": m.reason} for m in ms]
            for slot, ms in ctx.missing.items()
        }
        (ctx.out / "gathered.json").write_text(json.dumps({"got": got, "missing": missing}, sort_keys=True))
        return {"got": sum(len(v) for v in got.values()), "missing": sum(len(v) for v in missing.values())}


class ToyFamily(Family):
    """A toy family."""

    name = "toyfam"
    description = "toy family for tests"
    pooling = "mean"


class ToyGen(Source):
    """A generated checkpoint whose bytes follow from its declaration (as `synthetic`'s do);
    MOPT_FIXTURE_TOYGEN_NOISE makes the generator not deterministic."""

    name = "toygen"
    description = "a toy checkpoint generated from a seed (fixture)"

    class Params(Params):
        toygen: str = Field(description="a label")
        seed: int = 0

    def identity(self, params: Any, ctx: SourceContext) -> Any:
        generator = os.environ.get("MOPT_FIXTURE_TOYGEN_VERSION", "1")
        return {"label": params.toygen, "seed": params.seed, "generator": generator}

    def resolve(self, params: Any, ctx: SourceContext) -> Any:
        out = ctx.cache_dir / f"toygen-{params.toygen}-{params.seed}"
        if not out.is_dir():
            out.mkdir(parents=True)
            noise = os.urandom(8).hex() if os.environ.get("MOPT_FIXTURE_TOYGEN_NOISE") else ""
            (out / "config.json").write_text(json.dumps({"label": params.toygen}))
            (out / "weights.bin").write_text(f"seed={params.seed}{noise}\n" * 100)
        return out


TOY_GPU = HardwareProfile(
    name="toy-gpu",
    description="A toy GPU profile from the fixture plugin",
    gpu_name="Toy GPU",
    compute_capability=(8, 9),
    memory_gb=16,
    bandwidth_gbps=500,
    sm_count=40,
    source="tests/fixture_plugin",
)


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """Toy kinds."""
    for k in (ToyWeights, ToyExport, ToyEngine, ToyGpuOnly, ToyCheck, ToyTimed, ToyGather):
        register(k)


@hookimpl
def mopt_register_families(register: Callable[[Any], None]) -> None:
    """The toy family."""
    register(ToyFamily)


@hookimpl
def mopt_register_sources(register: Callable[[Any], None]) -> None:
    """The toy generated source."""
    register(ToyGen)


@hookimpl
def mopt_register_hardware(register: Callable[[Any], None]) -> None:
    """The toy GPU profile."""
    register(TOY_GPU)
