"""`mopt report` over a real build of a tiny model: every per-shape cell of the page is the
number bench.json holds for that shape (not the last shape's, as it once was), with its
interval, sample count and speedup; a variant below its gate is marked and says why."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

MODEL = """\
schema = 1

[models.tiny]
family = "qwen3"
source = { synthetic = "qwen3", seed = 0, config = { hidden_size = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 16, intermediate_size = 128 } }

[tiny.cpu]
hardware = "cpu"
"""

BENCH = """
[tiny.cpu.bench]
batch_sizes = [4, 1]
seq_lens = [32, 16]
warmup = 0
min_samples = 6
max_samples = 8
max_seconds = 0.5
"""

RECIPE = (
    MODEL
    + """targets = ["weights", "onnx", "int8", "validate", "bench"]

[tiny.cpu.int8]
kind = "ort-quantize"
input = "onnx"

[tiny.cpu.validate]
min_cosine = 0.9999
on_fail = "record"
"""
    + BENCH
)


def mopt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


class Cells(HTMLParser):
    """The artifact tables: (row id, shape) → the texts of the cell's parts (`ms`, `ci`,
    `n`, `sp`); row id → its class and reason text; the shape columns' order."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], dict[str, str]] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.columns: list[str] = []
        self.legends: list[str] = []
        self._row: str | None = None
        self._cell: tuple[str, str] | None = None
        self._part: str | None = None
        self._reason = False
        self._legend = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        cls = a.get("class") or ""
        if tag == "tr" and a.get("data-id"):
            self._row = a["data-id"]
            self.rows[self._row] = {"class": cls, "reason": ""}
        elif tag == "th" and a.get("data-shape"):
            self.columns.append(a["data-shape"] or "")
        elif tag == "td" and self._row and a.get("data-shape"):
            self._cell = (self._row, a["data-shape"] or "")
            self.cells[self._cell] = {}
        elif tag == "td" and self._row and "reason" in cls.split():
            self._reason = True
        elif tag == "span" and self._cell:
            self._part = cls.split()[0]
        elif tag == "p" and "legend" in cls.split():
            self._legend = True
            self.legends.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell, self._reason = None, False
        elif tag == "span":
            self._part = None
        elif tag == "tr":
            self._row = None
        elif tag == "p":
            self._legend = False

    def handle_data(self, data: str) -> None:
        if self._cell and self._part:
            self.cells[self._cell][self._part] = self.cells[self._cell].get(self._part, "") + data
        elif self._cell and data.strip():
            self.cells[self._cell]["text"] = data.strip()
        elif self._reason:
            self.rows[self._row or ""]["reason"] += data
        elif self._legend:
            self.legends[-1] += data


def test_every_shape_cell_of_the_report_is_bench_json_s_number(tmp_path: Path) -> None:
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(RECIPE)
    built = mopt(tmp_path, "build", "r.toml", "--json")
    assert built.returncode == 0, built.stderr[-3000:]
    rep = mopt(tmp_path, "report", "r.toml", "-o", "report.html")
    assert rep.returncode == 0, rep.stderr
    page = Cells()
    page.feed((tmp_path / "report.html").read_text())

    # one column per shape, by batch then sequence length (the recipe lists them unordered)
    assert page.columns == ["1x16", "1x32", "4x16", "4x32"]
    checked = 0
    for target in ("onnx", "int8"):
        bench = json.loads((tmp_path / f"build/tiny/cpu/bench[{target}]/bench.json").read_text())
        points = {f"{p['batch']}x{p['seq']}": p for p in bench["results"][0]["points"]}
        speedups = {f"{s['batch']}x{s['seq']}": s["speedup_p50"] for s in bench["speedup_vs_pytorch_fp32"]}
        assert set(points) == set(page.columns) == set(speedups)
        for shape, p in points.items():
            cell = page.cells[(f"tiny.cpu:{target}", shape)]
            # the result rounds p50 and the interval to 0.01 ms, the speedup to 0.001; the page
            # shows two decimals of each
            assert cell["ms"] == f"{round(p['p50_ms'], 2):.2f}", (target, shape, cell, p)
            if p["ci_ms"] is not None:
                lo, hi = (f"{round(x, 2):.2f}" for x in p["ci_ms"])
                assert cell["ci"] == f"{lo}–{hi}", (target, shape, cell, p)
            else:
                assert "ci" not in cell
            assert cell["n"] == f"n={p['samples']}" and 6 <= p["samples"] <= 8
            assert cell["sp"] == f"{round(speedups[shape], 3):.2f}×", (target, shape, cell)
            checked += 1
    assert checked == 8
    # the reference weights row: the PyTorch baseline has no row of its own; nothing timed it
    assert all(page.cells[("tiny.cpu:weights", s)] == {"text": "–"} for s in page.columns)

    # a variant below its gate: marked, and its reason is the validate's failed gate
    for target in ("onnx", "int8"):
        report = json.loads((tmp_path / f"build/tiny/cpu/validate[{target}]/report.json").read_text())
        row = page.rows[f"tiny.cpu:{target}"]
        if report["passed"]:
            assert row["class"] == "pass" and row["reason"].strip() == ""
        else:
            failed = [f"{name}" for name, g in report["gates"].items() if not g["passed"]]
            assert row["class"] == "fail" and failed
            assert all(name in row["reason"] for name in failed) and f"validate[{target}]" in row["reason"]
    # the static tiny model's INT8 is below 0.9999, its fp32 ONNX is not: both marks appear
    assert {page.rows["tiny.cpu:onnx"]["class"], page.rows["tiny.cpu:int8"]["class"]} == {"pass", "fail"}
    [legend] = page.legends
    assert "✗ failed a gate" in legend and "✓ passed its gates" in legend and "per shape" in legend


def test_compare_shows_the_changed_param_and_each_latency_old_to_new(tmp_path: Path) -> None:
    """Two builds of one bench, the grid's warm-up changed: the param, and every shape's p50
    old → new with both intervals and a verdict that follows from them."""
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    recipe = MODEL + 'targets = ["weights", "onnx", "bench"]\n' + BENCH
    (tmp_path / "r.toml").write_text(recipe)
    assert mopt(tmp_path, "build", "r.toml").returncode == 0
    (tmp_path / "old.lock").write_text((tmp_path / "mopt.lock").read_text())
    (tmp_path / "r.toml").write_text(recipe.replace("warmup = 0", "warmup = 1"))
    second = mopt(tmp_path, "build", "r.toml", "--json")
    assert second.returncode == 0, second.stderr[-2000:]
    assert {n["id"] for n in json.loads(second.stdout)["nodes"] if n["status"] == "built"} == {
        "tiny.cpu:bench"
    }

    rep = mopt(tmp_path, "report", "r.toml", "--compare", "old.lock", "--json")
    assert rep.returncode == 0, rep.stderr
    cmp = json.loads(rep.stdout)["compare"]
    nodes = {n["id"]: n for n in cmp["nodes"]}
    assert cmp["counts"] == {"same": 2, "changed": 1}
    bench = nodes["tiny.cpu:bench"]
    assert bench["params"] == {"warmup": [0, 1]} and bench["changes"] == ["param warmup: 0 → 1"]
    metrics = {m["metric"]: m for m in bench["metrics"]}
    new = json.loads((tmp_path / "build/tiny/cpu/bench/bench.json").read_text())["results"][0]["points"]
    for p in new:
        m = metrics.get(f"p50_ms[{p['batch']}x{p['seq']}]")
        if m is None:  # the same to 0.01 ms in both builds
            continue
        assert m["new"] == round(p["p50_ms"], 2) and m["new_n"] == p["samples"]
        ci_old, ci_new = m["old_ci"], m["new_ci"]
        if ci_old and ci_new:
            apart = ci_old[1] < ci_new[0] or ci_new[1] < ci_old[0]
            assert m["verdict"] == ("significant" if apart else "within noise")
        else:
            assert m["verdict"] == "no interval"

    text = mopt(tmp_path, "report", "r.toml", "--compare", "old.lock", "-o", "report.html")
    assert text.returncode == 0, text.stderr
    assert "r.toml: old.lock → now: 1 changed, 2 same" in text.stdout
    assert "param warmup: 0 → 1" in text.stdout
    page = (tmp_path / "report.html").read_text()
    assert "compared with old.lock" in page and 'data-node="tiny.cpu:bench"' in page
