"""mopt_serve.plots (serve-check's loadtest.svg), on load tests recorded on the H200
(tests/data/h200-2026-12-01): valid SVG, enough ticks, every config named once in the legend,
the winner marked, configs out of the running grey, the SLO dashed, no text over text, and
the same steps giving the same bytes."""

from __future__ import annotations

import itertools
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from mopt_serve.plots import latency_throughput_svg

SVG = "{http://www.w3.org/2000/svg}"
DATA = Path(__file__).resolve().parents[3] / "tests/data/h200-2026-12-01"
CHECKS = ["serve-check", "serve-check-fp8", "serve-check-tuned-s32-t4096", "serve-check-tuned-s256-t4096"]


def series() -> list[tuple[str, list[dict], dict | None, str]]:
    docs = {name: json.loads((DATA / name / "serve.json").read_text()) for name in CHECKS}
    style = {"serve-check-tuned-s256-t4096": "winner", "serve-check-fp8": "dim"}
    return [(name, d["loadtest"], d.get("knee"), style.get(name, "")) for name, d in docs.items()]


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


def styles(el: ET.Element) -> list[str]:
    return [e.get("style", "") for e in el.iter() if e.tag in (f"{SVG}path", f"{SVG}use")]


def overlapping(root: ET.Element) -> list[tuple[str, str]]:
    """Pairs of text elements whose extents (0.5 em a character) intersect."""
    boxes = []
    for t in root.iter(f"{SVG}text"):
        s, style = "".join(t.itertext()), t.get("style", "")
        fs = float(re.search(r"font-size: ([\d.]+)px", style).group(1))
        x, y, w, h = float(t.get("x")), float(t.get("y")), 0.5 * fs * len(s), 0.7 * fs
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[re.search(r"text-anchor: (\w+)", style).group(1)]
        if "rotate(-90" in t.get("transform", ""):
            boxes.append((s, x - h, y - w / 2, x, y + w / 2))
        else:
            boxes.append((s, x0, y - h, x0 + w, y))
    return [
        (a[0], b[0])
        for a, b in itertools.combinations(boxes, 2)
        if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]
    ]


def test_loadtest_plot_is_readable_svg():
    svg = latency_throughput_svg(series(), 2000.0, "p99 latency vs throughput per config")
    root = parse(svg)
    assert len(tick_labels(root, "x")) >= 4 and len(tick_labels(root, "y")) >= 4
    assert {"throughput (tokens/s)", "p99 latency (ms)"} <= set(texts(root))
    entries = texts(by_id(root, "legend_1"))
    named = [e.removeprefix("winner: ").split(" (")[0] for e in entries]
    assert all(named.count(name) == 1 for name in CHECKS), entries
    assert any(e.startswith("winner: serve-check-tuned-s256-t4096 (knee: ") for e in entries)
    assert any(e.startswith("serve-check-fp8 (") and e.endswith("out of the running") for e in entries)
    assert "SLO: p99 ≤ 2000 ms" in entries
    assert any("stroke-dasharray" in s for s in styles(by_id(root, "slo")))
    # the config out of the running is grey and hollow; the others are in colour
    assert all("#999999" in s for s in styles(by_id(root, "excluded-1")) if "stroke:" in s)
    assert not any("#999999" in s for s in styles(by_id(root, "series-0")))
    # knees ringed; no text on the points, so none over another
    by_id(root, "knee-0")
    assert overlapping(root) == []


def test_same_steps_same_bytes_and_an_empty_load_test_is_still_a_figure():
    assert latency_throughput_svg(series(), 2000.0, "t") == latency_throughput_svg(
        series(), 2000.0, "t", legend_px=190
    )
    empty = parse(latency_throughput_svg([("x", [], None)], None, "t"))
    assert "no load steps" in texts(empty)
