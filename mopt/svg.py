"""Inline SVG figures that more than one plugin draws (stdlib only: reports stay
self-contained, and importing this imports nothing heavy). Plugins reach it through
`mopt.api`."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")

#: a series: (name, load-test steps, its knee or None[, style]); style "" (plain), "winner"
#: (thick, starred in the legend) or "dim" (dashed: out of the running)
Series = tuple[Any, ...]


def _usable(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    good = [s for s in steps if s.get("completed") and not math.isnan(float(s["p99_ms"]))]
    return sorted(good, key=lambda s: s["concurrency"])


def latency_throughput_svg(
    series: Sequence[Series],
    slo_p99_ms: float | None,
    title: str,
    width: int = 620,
    height: int = 360,
    legend_px: int = 150,
) -> str:
    """p99 latency (y) against tokens/s (x) of load-test steps (`tokens_per_s`, `p99_ms`,
    `concurrency`, `completed`; `requests_per_s`, `p50_ms`, `errors` go into the tooltips
    when there): one polyline per series, points labelled with their concurrency, the SLO
    as a dashed line, each series' knee ringed. serve-check draws one server's, select a
    sweep's served configs on one plot."""
    left, right, top, bottom = 64, legend_px, 36, 44
    pw, ph = width - left - right, height - top - bottom
    pts = [(float(s["tokens_per_s"]), float(s["p99_ms"])) for one in series for s in _usable(one[1])]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<text x="{(left + pw / 2):.0f}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
    ]
    if not pts:
        parts.append(
            f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle">no load steps</text>'
        )
        return "".join(parts) + "</svg>"
    x1 = max(x for x, _ in pts) * 1.08
    y1 = max([y for _, y in pts] + ([slo_p99_ms] if slo_p99_ms else [])) * 1.1

    def sx(x: float) -> float:
        return left + x / max(x1, 1e-9) * pw

    def sy(y: float) -> float:
        return top + ph - y / max(y1, 1e-9) * ph

    parts.append(
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>'
        f'<text x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">throughput (tokens/s)</text>'
        f'<text transform="translate(14,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle">p99 latency (ms)</text>'
    )
    for k in range(5):
        xv, yv = x1 * k / 4, y1 * k / 4
        parts.append(
            f'<text x="{sx(xv):.1f}" y="{top + ph + 14}" text-anchor="middle">{xv:,.0f}</text>'
            f'<text x="{left - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>'
        )
    if slo_p99_ms:
        y = sy(slo_p99_ms)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" stroke-dasharray="6 4"/>'
            f'<text x="{left + 4}" y="{y - 4:.1f}" fill="#d62728">SLO p99 {slo_p99_ms:g} ms</text>'
        )
    chars = max(8, (right - 32) // 5)
    for i, one in enumerate(series):
        name, steps, kn = one[0], one[1], one[2]
        style = one[3] if len(one) > 3 else ""
        c = COLORS[i % len(COLORS)]
        wide = 3.5 if style == "winner" else 1.8
        dash = ' stroke-dasharray="3 3"' if style == "dim" else ""
        good = _usable(steps)
        d = " ".join(f"{sx(float(s['tokens_per_s'])):.1f},{sy(float(s['p99_ms'])):.1f}" for s in good)
        parts.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="{wide}"{dash}/>')
        for s in good:
            x, y = sx(float(s["tokens_per_s"])), sy(float(s["p99_ms"]))
            tip = f"{name} c={s['concurrency']}: "
            if s.get("requests_per_s") is not None:
                tip += f"{float(s['requests_per_s']):.0f} req/s, "
            tip += f"{float(s['tokens_per_s']):,.0f} tok/s, "
            if s.get("p50_ms") is not None:
                tip += f"p50 {float(s['p50_ms']):.1f} ms, "
            tip += f"p99 {float(s['p99_ms']):.1f} ms"
            if s.get("errors") is not None:
                tip += f", errors {s['errors']}"
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{c}"><title>{html.escape(tip)}</title></circle>'
                f'<text x="{x + 4:.1f}" y="{y - 5:.1f}" fill="{c}" font-size="9">{s["concurrency"]}</text>'
            )
        if kn:
            parts.append(
                f'<circle cx="{sx(float(kn["tokens_per_s"])):.1f}" cy="{sy(float(kn["p99_ms"])):.1f}" r="7" '
                f'fill="none" stroke="{c}" stroke-width="2"/>'
            )
        ly = top + 14 + 16 * i
        label = ("★ " if style == "winner" else "") + str(name)
        parts.append(
            f'<line x1="{left + pw + 10}" x2="{left + pw + 28}" y1="{ly - 4}" y2="{ly - 4}" stroke="{c}" '
            f'stroke-width="{min(wide, 3.0)}"{dash}/>'
            f'<text x="{left + pw + 32}" y="{ly}">{html.escape(label[:chars])}</text>'
        )
    parts.append(
        f'<text x="{left + pw + 10}" y="{top + ph}" font-size="9" fill="#555">labels: concurrency; ring: knee</text>'
    )
    return "".join(parts) + "</svg>"
