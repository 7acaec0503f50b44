"""`mopt kinds [KIND]` and docs/kinds.md, generated from the registry and kept up to date."""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

import pytest

from mopt.plugins import FIRST_PARTY_DISTRIBUTIONS
from tests.conftest import run_mopt

ROOT = Path(__file__).resolve().parents[3]


def test_docs_kinds_md_is_what_mopt_kinds_generates() -> None:
    missing = []
    for dist in sorted(FIRST_PARTY_DISTRIBUTIONS):
        try:
            md.distribution(dist)
        except md.PackageNotFoundError:
            missing.append(dist)
    if missing:
        pytest.skip(f"not every first-party plugin is installed (missing: {', '.join(missing)})")
    proc = run_mopt("kinds", "--markdown", "--first-party", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "docs/kinds.md").read_text(), (
        "docs/kinds.md is out of date: run `mopt kinds --markdown --first-party > docs/kinds.md`"
    )
    assert "| [toy-check](#toy-check)" not in proc.stdout  # the test plugins' kinds are not mopt's


def test_mopt_kinds_lists_kinds_and_prints_a_kinds_params(tmp_path: Path) -> None:
    listing = run_mopt("kinds", cwd=tmp_path).stdout.splitlines()
    assert listing[0].split() == ["kind", "plugin", "takes", "produces"]
    row = next(line for line in listing if line.startswith("ort-quantize "))
    assert row.split()[1] == "mopt-ml" and row.endswith(" onnx") and "model: format onnx" in row
    assert any(
        line.split()[:2] == ["toy-check", "mopt-fixture-plugin"] for line in listing
    )  # third parties too

    proc = run_mopt("kinds", "ort-quantize", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("ort-quantize (mopt-ml): ONNX Runtime INT8")
    assert "  takes: model: format onnx, kind onnx-slim or onnx\n  produces: onnx\n" in out
    params = {line.split()[0]: line for line in out.split("  params:\n")[1].splitlines()[1:]}
    from mopt_ml.quantize import OrtQuantizeKind

    assert set(params) == set(OrtQuantizeKind.Params.model_fields)
    assert params["calibration_batch_size"].split()[1:4] == ["int", "8", "texts"]
    assert params["op_types"].split()[1:3] == ["list[str]", '["MatMul"]']

    data = json.loads(run_mopt("kinds", "ort-quantize", "--json", cwd=tmp_path).stdout)["kinds"][0]
    assert all(p["description"] for p in data["params"])  # every param says what it is
    assert data["takes"] == [
        {
            "slot": "model",
            "what": "format onnx, kind onnx-slim or onnx",
            "required": True,
            "fanout": False,
            "gather": False,
        }
    ]
    proc = run_mopt("kinds", "ort-quantise", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (
        2,
        "error: unknown target kind 'ort-quantise' (did you mean 'ort-quantize'?)\n",
    )


@pytest.mark.parametrize(
    "kind",
    [
        "weights",
        "onnx",
        "onnx-slim",
        "ort-quantize",
        "openvino",
        "nncf-quantize",
        "validate",
        "bench",
        "bench-baseline",
        "select",
    ],
)
def test_the_first_recipes_kinds_describe_every_param(tmp_path: Path, kind: str) -> None:
    data = json.loads(run_mopt("kinds", kind, "--json", cwd=tmp_path).stdout)["kinds"][0]
    assert [p["name"] for p in data["params"] if not p["description"]] == []
