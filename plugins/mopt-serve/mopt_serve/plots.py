"""serve-check's loadtest.svg: p99 latency against tokens/s, drawn with matplotlib, returned
as self-contained SVG text (text stays text; the same steps give the same bytes).

mopt-serve draws its own (it does not depend on mopt-ml); the rules are mopt-ml's
`mopt_ml.plots`: matplotlib's tick locators, units on the axes, a legend instead of text on
points, a colour-blind-safe palette (tab10), out-of-the-running series hollow grey and dashed,
the SLO dashed. matplotlib is imported inside the function: importing mopt_serve stays cheap.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

#: tab10 without its red (the SLO's) and grey (series out of the running)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p")
GREY = "#999999"
SLO = "#d62728"
RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "mopt",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.color": "#e5e5e5",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "legend.fontsize": 8,
    "legend.frameon": False,
}
PX = 1 / 96  # inches per CSS px


def _usable(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    good = [s for s in steps if s.get("completed") and not math.isnan(float(s["p99_ms"]))]
    return sorted(good, key=lambda s: s["concurrency"])


def latency_throughput_svg(
    series: Sequence[tuple[Any, ...]],
    slo_p99_ms: float | None,
    title: str,
    width: int = 620,
    height: int = 360,
    legend_px: int = 150,
    **_: Any,
) -> str:
    """p99 latency (y) against tokens/s (x) of load-test steps (`tokens_per_s`, `p99_ms`,
    `concurrency`, `completed`): one line per series `(name, steps, knee or None[, style])`,
    style "" (plain), "winner" (thick, named so in the legend) or "dim" (out of the running:
    grey, hollow, dashed); each knee ringed, the SLO dashed. `legend_px` is accepted for old
    callers (the legend sizes itself)."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    del legend_px
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(width * PX, height * PX))
        FigureCanvasSVG(fig)
        ax = fig.add_subplot()
        ax.set_title(title)
        ax.set_xlabel("throughput (tokens/s)")
        ax.set_ylabel("p99 latency (ms)")
        if not any(_usable(one[1]) for one in series):
            ax.text(0.5, 0.5, "no load steps", transform=ax.transAxes, ha="center", va="center")
            ax.set_xticks([])
            ax.set_yticks([])
            return _svg(fig)
        for axis in (ax.xaxis, ax.yaxis):
            # matplotlib's default locator, asked for at least four ticks
            axis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], min_n_ticks=4))
        ax.ticklabel_format(useOffset=False, style="plain")
        handles: list[Any] = []
        labels: list[str] = []
        if slo_p99_ms:
            slo = ax.axhline(slo_p99_ms, color=SLO, linestyle="--", linewidth=1.2, zorder=1)
            slo.set_gid("slo")
            handles.append(slo)
            labels.append(f"SLO: p99 ≤ {slo_p99_ms:g} ms")
        knees = False
        for i, one in enumerate(series):
            name, steps, knee = str(one[0]), one[1], one[2]
            kind = one[3] if len(one) > 3 else ""
            good = _usable(steps)
            if not good:
                continue
            color = GREY if kind == "dim" else PALETTE[i % len(PALETTE)]
            (line,) = ax.plot(
                [float(s["tokens_per_s"]) for s in good],
                [float(s["p99_ms"]) for s in good],
                color=color,
                linestyle="--" if kind == "dim" else "-",
                linewidth=2.6 if kind == "winner" else 1.4,
                marker=MARKERS[i % len(MARKERS)],
                markersize=5,
                markerfacecolor="none" if kind == "dim" else color,
                zorder=2,
            )
            line.set_gid(f"{'excluded' if kind == 'dim' else 'series'}-{i}")
            if knee:
                knees = True
                ring = ax.scatter(
                    [float(knee["tokens_per_s"])],
                    [float(knee["p99_ms"])],
                    s=160,
                    marker="o",
                    facecolors="none",
                    edgecolors="#000000",
                    linewidths=1.5,
                    zorder=3,
                )
                ring.set_gid(f"knee-{i}")
            label = (
                f"{name} (knee: {knee['concurrency']} clients)" if knee else f"{name} (no step within SLO)"
            )
            if kind == "winner":
                label = f"winner: {label}"
            elif kind == "dim":
                label = f"{label}, out of the running"
            handles.append(line)
            labels.append(label)
        if knees:
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="",
                    marker="o",
                    markersize=10,
                    markerfacecolor="none",
                    markeredgecolor="#000000",
                )
            )
            labels.append("knee: most clients with p99 within the SLO")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        return _svg(fig)


def _svg(fig: Any) -> str:
    """The figure as SVG text from `<svg` on (no prolog: it inlines into HTML), no metadata."""
    buf = io.StringIO()
    fig.savefig(
        buf,
        format="svg",
        bbox_inches="tight",
        pad_inches=0.05,
        metadata={"Date": None, "Creator": None, "Format": None, "Type": None},
    )
    text = buf.getvalue()
    return text[text.index("<svg") :]
