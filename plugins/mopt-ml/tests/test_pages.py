"""select's selection.html and pareto.svg from a Selection: the decision and the median's
interval when the selection has them, a page without them when it does not, excluded rows
marked with their reason, everything escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from mopt_ml.select import Row, Selection, pareto_svg, render_html


def selection() -> Selection:
    rows = [
        Row("onnx-slim", "onnx-slim", bytes=89 << 20, min_cosine=0.99990, mean_cosine=0.99995, p50_ms=257.0,
            p99_ms=270.0, value=257.0, status="winner", why="lowest min_latency_p50"),
        Row("onnx", "onnx", bytes=90 << 20, min_cosine=0.99991, mean_cosine=0.99995, p50_ms=256.5, p99_ms=280.0,
            value=258.0, status="lost", why="258.0 vs 257.0 ms"),
        Row("int8<b>", "ort-quantize", bytes=23 << 20, min_cosine=0.981, mean_cosine=0.99, p50_ms=120.0,
            p99_ms=130.0, value=120.0, status="excluded", why="min cosine 0.9810 < 0.99"),
        Row("trt", "trt-engine", status="unbuilt", why="unbuildable here: needs tensorrt"),
    ]  # fmt: skip
    return Selection("min_latency_p50", {"min_cosine": 0.99}, rows, "onnx-slim", gate_min_cosine=0.99)


def test_page_without_intervals_or_decision_marks_excluded_rows_with_their_reason():
    page = render_html(selection(), "<svg></svg>", "minilm.cpu")
    assert page.startswith("<!doctype html>") and "<table>" in page
    assert "<h1>minilm.cpu: onnx-slim</h1>" in page
    assert '<tr class="excluded"><td class=text>int8&lt;b&gt;</td>' in page  # escaped
    assert '<td class="text why">min cosine 0.9810 &lt; 0.99</td>' in page
    assert '<tr class="unbuilt"><td class=text>trt</td>' in page
    assert "grey rows are out of the running" in page and "<th>reason</th>" in page
    assert "<th>interval</th>" not in page and "<th>n</th>" not in page and 'class="decision' not in page
    assert "<svg></svg>" in page  # the figure inline, as it is


def test_page_shows_the_median_interval_and_the_decision_when_there():
    sel = selection()
    for r, (lo, hi) in zip(sel.rows[:2], [(250.0, 262.0), (251.0, 266.0)], strict=True):
        r.ci_low, r.ci_high, r.n = lo, hi, 41  # type: ignore[attr-defined]
    sel.decision = {  # type: ignore[attr-defined]
        "winner": "onnx-slim", "runner_up": "onnx", "ratio": 0.9961, "ratio_ci": [0.97, 1.02], "tie": True,
        "why": "the interval of the ratio holds 1: a tie, broken by mean cosine", "method": "finals",
        "tie_tolerance": 0.03, "confidence": 0.95,
    }  # fmt: skip
    page = render_html(sel, "<svg></svg>", "minilm.cpu")
    assert "<th>interval</th>" in page and "<th>n</th>" in page
    assert "<td>250.0 ms – 262.0 ms</td><td>41</td>" in page
    assert 'class="decision tie"' in page and "0.996× better than onnx (95 % interval 0.970–1.020)" in page
    assert "beyond 1 + 0.03, measured side by side in the finals" in page
    assert "broken by mean cosine" in page


def test_pareto_of_a_selection_names_the_winner_and_the_excluded():
    root = ET.fromstring(pareto_svg(selection()))
    legend = next(e for e in root.iter() if e.get("id") == "legend_1")
    entries = ["".join(t.itertext()) for t in legend.iter("{http://www.w3.org/2000/svg}text")]
    assert "winner: onnx-slim" in entries and "onnx" in entries
    assert "int8<b> (excluded: min cosine 0.9810 < 0.99)" in entries and "not measured: trt" in entries
    assert any(t.startswith("latency p50 (ms") for t in root.itertext())
