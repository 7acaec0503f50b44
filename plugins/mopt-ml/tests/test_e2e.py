"""End to end through the real `mopt` CLI: changed validation texts rerun only validate and
bench; a variant below the gate fails the build with the numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "mopt_ml" / "data" / "sentences.txt"

RECIPE = """\
schema = 1

[models.tiny]
family = "qwen3"
source = { synthetic = "qwen3", seed = 1 }

[tiny.cpu]
hardware = "cpu"
targets = ["weights", "onnx", "int8", "validate", "bench"]

[tiny.cpu.int8]
kind = "ort-quantize"

[tiny.cpu.validate]
data = "texts.txt"
min_cosine = MIN

[tiny.cpu.bench]
data = "texts.txt"
batch_sizes = [2]
seq_lens = [16]
max_seconds = 3
"""


def mopt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_changed_texts_rerun_only_validate_and_bench_and_the_gate_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(RECIPE.replace("MIN", "0.9"))
    (tmp_path / "texts.txt").write_text("\n".join(DATA.read_text().splitlines()[40:70]) + "\n")
    first = mopt(tmp_path, "build", "r.toml", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["counts"] == {"built": 7}

    with open(tmp_path / "texts.txt", "a") as fh:
        fh.write("One more sentence about the weather today.\n")
    second = json.loads(mopt(tmp_path, "build", "r.toml", "--json").stdout)
    ran = {n["id"] for n in second["nodes"] if n["status"] == "built"}
    assert ran == {"tiny.cpu:validate[int8]", "tiny.cpu:validate[onnx]", "tiny.cpu:bench[int8]",
                   "tiny.cpu:bench[onnx]"}
    report = json.loads((tmp_path / "build/tiny/cpu/validate[int8]/report.json").read_text())
    assert report["passed"] is True and report["metrics"]["min_cosine"] >= 0.9

    (tmp_path / "r.toml").write_text(RECIPE.replace("MIN", "0.99999999"))
    failed = mopt(tmp_path, "build", "r.toml")
    assert failed.returncode == 1
    line = next(x for x in failed.stderr.splitlines() if x.startswith("FAILED tiny.cpu:validate[int8]"))
    assert "min_cosine" in line and "< 0.99999999" in line and "min cosine 0." in line
    # the failed gate is not cached: the folder still holds the last passing result
    kept = json.loads((tmp_path / "build/tiny/cpu/validate[int8]/report.json").read_text())
    assert kept["passed"] is True
