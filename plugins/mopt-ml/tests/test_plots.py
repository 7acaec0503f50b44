"""mopt_ml.plots: the figures are valid SVG that a reader can trust: enough ticks, every
variant named once in the legend, excluded variants grey, the winner marked, no text drawn
over text, and the same data giving the same bytes."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET

from mopt_ml.plots import bench_lines_svg, front, latency_throughput_svg, pareto_svg

SVG = "{http://www.w3.org/2000/svg}"

POINTS = [
    {"label": "onnx", "x": 256.0, "x_lo": 251.0, "x_hi": 262.0, "y": 0.99991, "size_bytes": 90_000_000, "status": "lost"},
    {"label": "onnx-slim", "x": 257.0, "y": 0.99990, "size_bytes": 89_000_000, "status": "winner"},
    {"label": "fp16", "x": 180.0, "y": 0.99950, "size_bytes": 45_000_000, "status": "lost"},
    {"label": "int8", "x": 120.0, "y": 0.9810, "size_bytes": 23_000_000, "status": "excluded",
     "why": "min cosine 0.9810 < gate 0.99; top-1 0.97"},
    {"label": "trt", "x": None, "y": None, "status": "unbuilt", "why": "unbuildable here: needs tensorrt"},
]  # fmt: skip


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def by_id(root: ET.Element, gid: str) -> ET.Element:
    found = [e for e in root.iter() if e.get("id") == gid]
    assert len(found) == 1, f"{gid}: {len(found)} elements"
    return found[0]


def texts(el: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in el.iter(f"{SVG}text")]


def tick_labels(root: ET.Element, axis: str) -> list[str]:
    groups = [g for g in root.iter(f"{SVG}g") if re.fullmatch(rf"{axis}tick_\d+", g.get("id", ""))]
    return [t for g in groups for t in texts(g) if t.strip()]


def legend(root: ET.Element) -> list[str]:
    return texts(by_id(root, "legend_1"))


def styles(el: ET.Element) -> list[str]:
    return [e.get("style", "") for e in el.iter() if e.tag in (f"{SVG}path", f"{SVG}use")]


def boxes(root: ET.Element) -> list[tuple[str, float, float, float, float]]:
    """(text, x0, y0, x1, y1) of every text element, its extent estimated from the font size
    (0.5 em a character: DejaVu Sans averages more, so an overlap found here is real)."""
    out = []
    for t in root.iter(f"{SVG}text"):
        s = "".join(t.itertext())
        style = t.get("style", "")
        fs = float(re.search(r"font-size: ([\d.]+)px", style).group(1))
        x, y = float(t.get("x")), float(t.get("y"))
        w, h = 0.5 * fs * len(s), 0.7 * fs
        anchor = re.search(r"text-anchor: (\w+)", style).group(1)
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
        if "rotate(-90" in t.get("transform", ""):  # the y label reads upwards from (x, y)
            out.append((s, x - h, y - w / 2, x, y + w / 2))
        else:
            out.append((s, x0, y - h, x0 + w, y))
    return out


def overlapping(root: ET.Element) -> list[tuple[str, str]]:
    return [
        (a[0], b[0])
        for a, b in itertools.combinations(boxes(root), 2)
        if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]
    ]


def test_pareto_is_valid_svg_with_ticks_units_and_a_legend_naming_each_variant_once():
    root = parse(pareto_svg(POINTS, gate_min_cosine=0.99, title="latency vs accuracy"))
    assert len(tick_labels(root, "x")) >= 4 and len(tick_labels(root, "y")) >= 4
    assert "latency p50 (ms)" in texts(root) and "min cosine vs reference" in texts(root)
    entries = legend(root)
    named = [e.removeprefix("winner: ").split(" (")[0] for e in entries]
    for p in POINTS[:4]:
        assert named.count(p["label"]) == 1, entries
    assert "winner: onnx-slim" in entries
    assert "not measured: trt" in entries
    assert any(e.startswith("marker area ∝ size") for e in entries)
    # the gate, dashed, in the legend; the front and the winner's ring drawn
    assert "gate: min cosine ≥ 0.99" in entries
    assert any("stroke-dasharray" in s for s in styles(by_id(root, "gate")))
    by_id(root, "pareto-front")
    by_id(root, "winner-ring")
    by_id(root, "interval-0")  # onnx's latency interval as an error bar


def test_pareto_draws_excluded_variants_hollow_grey_and_says_why_in_the_legend():
    root = parse(pareto_svg(POINTS, gate_min_cosine=0.99))
    (style,) = [s for s in styles(by_id(root, "excluded-3")) if "stroke" in s]
    assert "fill: none" in style and "stroke: #999999" in style
    for i in (0, 1, 2):  # the others are filled, in their own colours
        drawn = styles(by_id(root, f"variant-{i}"))
        assert any(re.search(r"fill: #[0-9a-f]{6}", s) for s in drawn)
        assert not any("fill: none" in s or "#999999" in s for s in drawn)
    assert "int8 (excluded: min cosine 0.9810 < gate 0.99)" in legend(root)


def test_close_points_print_no_text_over_each_other():
    svg = pareto_svg(POINTS, gate_min_cosine=0.99)
    root = parse(svg)
    assert overlapping(root) == []
    # no label on the points: the variants' names are in the legend only
    outside = [t for t in texts(root) if t not in legend(root)]
    assert not any(p["label"] in t for t in outside for p in POINTS)


def test_the_overlap_check_sees_text_over_text():
    style = "font-size: 10px; text-anchor: start"
    two = (
        f'<svg xmlns="http://www.w3.org/2000/svg"><text style="{style}" x="100" y="50">onnx</text>'
        f'<text style="{style}" x="103" y="52">onnx-slim</text></svg>'
    )
    assert overlapping(parse(two)) == [("onnx", "onnx-slim")]


def test_same_points_same_bytes():
    assert pareto_svg(POINTS, gate_min_cosine=0.99) == pareto_svg(
        [dict(p) for p in POINTS], gate_min_cosine=0.99
    )
    assert "<svg" in pareto_svg([], gate_min_cosine=None)  # nothing measured: still a figure


def test_front_keeps_the_faster_or_more_accurate():
    pts = [{"x": 1, "y": 0.9}, {"x": 2, "y": 0.95}, {"x": 3, "y": 0.94}, {"x": 4, "y": 0.99}]
    assert [p["x"] for p in front(pts)] == [1, 2, 4]


STEPS = [
    {"concurrency": c, "completed": 50, "tokens_per_s": 900.0 * c**0.8, "p99_ms": 20.0 + 3.0 * c}
    for c in (1, 2, 4, 8, 16, 32)
]


def test_serving_plot_names_the_winner_greys_the_excluded_and_dashes_the_slo():
    series = [
        ("vllm-tuned", STEPS, STEPS[4], "winner"),
        ("vllm", [dict(s, p99_ms=s["p99_ms"] * 1.3) for s in STEPS], STEPS[3], ""),
        ("vllm-fp8", [dict(s, p99_ms=s["p99_ms"] * 1.1) for s in STEPS], None, "dim"),
    ]
    svg = latency_throughput_svg(series, 100.0, "p99 vs throughput", 680, 380, legend_px=190)
    root = parse(svg)
    assert len(tick_labels(root, "x")) >= 4 and len(tick_labels(root, "y")) >= 4
    assert {"throughput (tokens/s)", "p99 latency (ms)"} <= set(texts(root))
    entries = legend(root)
    assert "winner: vllm-tuned (knee: 16 clients)" in entries
    assert "vllm-fp8 (no step within SLO), out of the running" in entries
    assert "SLO: p99 ≤ 100 ms" in entries
    assert all("#999999" in s for s in styles(by_id(root, "excluded-2")) if "stroke" in s)
    assert overlapping(root) == []
    assert svg == latency_throughput_svg(series, 100.0, "p99 vs throughput", 680, 380)


def test_bench_lines_draw_the_median_interval_and_at_least_four_ticks():
    series = [
        ("onnx", [(1, 3.0, 2.9, 3.2), (4, 9.0, 8.7, 9.4), (16, 30.0, 29.0, 31.5), (32, 58.0, 56.0, 60.0)]),
        ("pytorch-fp32", [(1, 5.0), (4, 16.0), (16, 61.0), (32, 120.0)]),
    ]
    svg = bench_lines_svg(series, "Latency p50 vs batch size (seq 128)", "batch size", "p50 latency (ms)")
    root = parse(svg)
    assert tick_labels(root, "x") == ["1", "2", "4", "8", "16", "32"]
    assert len(tick_labels(root, "y")) >= 4
    assert legend(root) == ["onnx", "pytorch-fp32", "bars: interval of the median"]
    assert overlapping(root) == []
    # two batch sizes: a linear axis, still four ticks or more
    narrow = parse(bench_lines_svg([("onnx", [(1, 3.0), (4, 9.0)])], "t", "batch size", "ms"))
    assert len(tick_labels(narrow, "x")) >= 4
    assert "bars: interval of the median" not in legend(narrow)
