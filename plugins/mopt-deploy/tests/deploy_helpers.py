"""Helpers of mopt-deploy's tests (a uniquely named module: every test folder has a conftest):
the `deploy` kind run directly on input folders written by the test or recorded on the H200."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from mopt_deploy.kind import DeployKind

from mopt.api import Artifact, BuildContext, HardwareProfile
from mopt.builtin.hardware import PROFILES
from mopt.digest import hash_tree

ROOT = Path(__file__).resolve().parents[3]
HW = {p.name: p for p in PROFILES}
DIGEST = "sha256:" + "5e" * 32
#: mopt-image's embed server's buckets (mopt_image/servers/embed_server.py)
EMBED_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
#: a tiny BERT's config.json (what `weights` writes for cpu-serve.toml's tiny-bert, in miniature)
TINY_BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 1000, "max_position_embeddings": 512,
             "type_vocab_size": 2}  # fmt: skip


def artifact(
    path: Path, kind: str, target: str | None = None, meta: dict[str, Any] | None = None
) -> Artifact:
    return Artifact(path, kind, target or kind, hash_tree(path)[0], meta or {}, label=target or kind)


def step(
    c: int, rps: float, p99: float, completed: int = 400, tokens_per_request: float = 64.0
) -> dict[str, Any]:
    """One load-test step as serve-check writes it."""
    return {"concurrency": c, "requests": completed, "completed": completed, "errors": 0,
            "duration_s": completed / rps, "requests_per_s": rps, "tokens_per_s": rps * tokens_per_request,
            "p50_ms": p99 / 2, "p90_ms": p99 * 0.8, "p99_ms": p99, "mean_ms": p99 / 2, "tool": "mopt-loop",
            "error_sample": ""}  # fmt: skip


def container_check_inputs(tmp: Path, steps: list[dict[str, Any]], slo_ms: float = 100.0,
                           startup_s: float = 1.5) -> dict[str, list[Artifact]]:  # fmt: skip
    """`measured` (container-check's serve.json), `image` (image.json) and `model` (config.json)."""
    ok = [s for s in steps if s["errors"] == 0 and s["p99_ms"] <= slo_ms]
    kn = max(ok, key=lambda s: s["concurrency"]) if ok else None
    check, image, weights = tmp / "check", tmp / "image", tmp / "weights"
    for d in (check, image, weights):
        d.mkdir(parents=True)
    (check / "serve.json").write_text(json.dumps({
        "format": "mopt-container-check/1", "models": ["tiny-bert"], "min_cosine": 0.99, "loadtest": steps,
        "loadtest_spec": {"input_len": 64, "texts_per_request": 1}, "slo_p99_ms": slo_ms, "knee": kn,
        "startup_s": startup_s, "recovery": [{"healthy_after_s": 0.9, "recovered": True}], "image_digest": DIGEST,
        "image_builder": {"name": "buildah"}, "container": {"daemon": "20.10.24"}, "passed": True,
    }))  # fmt: skip
    (image / "image.json").write_text(json.dumps({
        "tag": "mopt/tiny-bert:cpu", "image_digest": DIGEST, "ports": [8000], "backend": "embed",
        "entrypoint": ["python3", "/opt/mopt/server/embed_server.py", "--port", "8000"],
        "labels": {"dev.mopt.input.int8": "ort-quantize blake3:00"},
    }))  # fmt: skip
    (weights / "config.json").write_text(json.dumps(TINY_BERT))
    return {"measured": [artifact(check, "container-check", "check")], "image": [artifact(image, "image")],
            "model": [artifact(weights, "weights")]}  # fmt: skip


def recorded_h200_search(tmp: Path) -> dict[str, list[Artifact]]:
    """serve-search's output as `best` left it on the H200 on 2026-12-05: search.json and
    selection.json as recorded (tests/data/h200-2026-12-05), and the winner's config files
    (vllm-fp8: args.json, vllm.yaml) as recorded on 2026-12-01 for the same recipe target
    (tests/data/h200-2026-12-01/vllm-fp8; the 2026-12-05 run did not keep them). RECORDED
    RESULTS USED AS A FIXTURE: no GPU runs here."""
    best, weights = tmp / "best", tmp / "weights"
    best.mkdir(parents=True)
    weights.mkdir(parents=True)
    for f in ("search.json", "selection.json"):
        shutil.copy(ROOT / "tests/data/h200-2026-12-05" / f, best / f)
    for f in ("args.json", "vllm.yaml"):
        shutil.copy(ROOT / "tests/data/h200-2026-12-01/vllm-fp8" / f, best / f)
    # the recipe's synthetic source config (recipes/h200-serve.toml), as weights writes it
    text = (ROOT / "recipes/h200-serve.toml").read_text()
    m = re.search(r"config = \{([^}]*)\}", text)
    assert m, "recipes/h200-serve.toml: no synthetic config"
    cfg = {k.strip(): int(v) for k, v in (kv.split("=") for kv in m[1].split(","))}
    (weights / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                     "tie_word_embeddings": True, **cfg}))  # fmt: skip
    return {"measured": [artifact(best, "serve-search", "best")], "model": [artifact(weights, "weights")]}


def family(name: str) -> Any:
    from mopt_ml import families

    return {"bert": families.BertFamily, "qwen3": families.Qwen3Family}[name]()


def run_deploy(tmp: Path, inputs: dict[str, list[Artifact]], *, hardware: str = "cpu", model: str = "tiny-bert",
               fam: str = "bert", name: str = "run", **params: Any) -> tuple[dict[str, Any], Path]:  # fmt: skip
    """DeployKind.run on `inputs` with `params`; its result and output folder."""
    out, scratch = tmp / name / "out", tmp / name / "tmp"
    out.mkdir(parents=True)
    scratch.mkdir(parents=True)
    logger = logging.getLogger(f"test-deploy.{tmp.name}.{name}")
    logger.setLevel(logging.INFO)
    hw: HardwareProfile = HW[hardware]
    ctx = BuildContext(
        out=out, tmp=scratch, params=DeployKind.Params(**params), inputs=inputs, model_name=model,
        family=family(fam), task="embedding", source=None, hardware=hw, section=f"{model}.{hardware}",
        target="deploy", project_dir=tmp, logger=logger,
    )  # fmt: skip
    return DeployKind().run(ctx), out


def load(out: Path, rel: str) -> Any:
    text = (out / rel).read_text()
    return json.loads(text) if rel.endswith(".json") else yaml.safe_load(text)


def ceil(x: float) -> int:
    return math.ceil(x - 1e-9)
