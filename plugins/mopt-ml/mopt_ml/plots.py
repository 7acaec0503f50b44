"""The figures of mopt-ml's reports (select's pareto.svg and serving.svg, bench's report.html),
drawn with matplotlib and returned as self-contained SVG text.

Every figure follows the same rules, so that a reader can trust what they see: matplotlib's
tick locators (at least four ticks an axis), axis labels with units, a legend that names every
variant once (no text on points: two close points would print their names over each other),
one colour and marker per variant from a colour-blind-safe palette (tab10), excluded variants
hollow grey, the winner ringed and named in the legend, gates and SLOs dashed. Text stays text
(`svg.fonttype: none`) and the same data gives the same bytes (fixed hash salt, no date).

matplotlib is imported inside the functions: importing mopt_ml stays cheap.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: tab10 without its red (kept for gates and SLOs) and grey (kept for excluded variants)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
#: cycled at a different period than PALETTE, so colour and marker together tell apart 40 variants
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p")
GREY = "#999999"
GATE = "#d62728"
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
#: 1 px of the `width` / `height` arguments, in inches (CSS px)
PX = 1 / 96


def style(i: int) -> tuple[str, str]:
    """The colour and marker of the i-th variant."""
    return PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]


def short(why: str, limit: int = 40) -> str:
    """The first clause of a reason, at most `limit` characters (the legend's)."""
    first = why.split(";")[0].strip()
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


@contextmanager
def _figure(width: int, height: int) -> Iterator[tuple[Any, Any]]:
    """A figure with one axes, under this module's rc settings (matplotlib's global rcParams
    are restored on exit); no pyplot, so no figure manager or GUI state."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(width * PX, height * PX))
        FigureCanvasSVG(fig)
        ax = fig.add_subplot()
        for axis in (ax.xaxis, ax.yaxis):
            # matplotlib's default locator, asked for at least four ticks
            axis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], min_n_ticks=4))
        ax.ticklabel_format(useOffset=False, style="plain")
        yield fig, ax


def _svg(fig: Any) -> str:
    """The figure as SVG text, from `<svg` on (no XML prolog or DOCTYPE: it inlines into HTML)."""
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


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="#555")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def _legend(ax: Any, handles: list[Any], labels: list[str]) -> None:
    """The legend right of the axes (savefig's tight box makes room for it)."""
    from matplotlib.legend_handler import HandlerTuple

    ax.legend(
        handles,
        labels,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        handler_map={tuple: HandlerTuple(ndivide=None)},
    )


def _translucent(color: str) -> tuple[float, ...]:
    from matplotlib.colors import to_rgba

    return to_rgba(color, 0.55)


def _blank() -> Any:
    """A legend handle that draws nothing (for notes in the legend)."""
    from matplotlib.patches import Rectangle

    return Rectangle((0, 0), 0, 0, fill=False, edgecolor="none", visible=False)


# --------------------------------------------------------------------------- select: Pareto


def front(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Pareto front of `points` (dicts with `x`, `y`): lower x (latency) and higher y
    (cosine) are better; sorted by x."""
    out: list[dict[str, Any]] = []
    best = -math.inf
    for p in sorted(points, key=lambda p: (float(p["x"]), -float(p["y"]))):
        if float(p["y"]) > best:
            out.append(p)
            best = float(p["y"])
    return out


def pareto_svg(
    points: list[dict[str, Any]],
    *,
    gate_min_cosine: float | None,
    x_label: str = "latency p50 (ms)",
    title: str = "",
    width: int = 560,
    height: int = 340,
) -> str:
    """Latency (x) against min cosine (y), one marker per variant (`label`, `x`, `y`, optional
    `x_lo` / `x_hi` drawn as error bars, `size_bytes` as the marker's area, `status` winner /
    lost / tie / excluded / unbuilt, `why`); the Pareto front of the variants still in the
    running as a step line, the cosine gate dashed."""
    from matplotlib.lines import Line2D

    shown = [p for p in points if p.get("x") is not None and p.get("y") is not None]
    unmeasured = [str(p["label"]) for p in points if p not in shown]
    with _figure(width, height) as (fig, ax):
        if title:
            ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel("min cosine vs reference")
        if not shown:
            _empty(ax, "no measured variants")
            return _svg(fig)
        ax.margins(x=0.08, y=0.12)
        sizes = [float(p["size_bytes"]) for p in shown if p.get("size_bytes")]
        biggest = max(sizes) if sizes else None
        handles: list[Any] = []
        labels: list[str] = []
        running = [p for p in shown if p.get("status") in ("winner", "lost", "tie")]
        line = front(running)
        if len(line) > 1:
            (step,) = ax.step(
                [float(p["x"]) for p in line],
                [float(p["y"]) for p in line],
                where="post",
                color="#555555",
                linewidth=1.0,
                zorder=1,
            )
            step.set_gid("pareto-front")
            handles.append(step)
            labels.append("Pareto front (faster or more accurate)")
        if gate_min_cosine is not None:
            gate = ax.axhline(gate_min_cosine, color=GATE, linestyle="--", linewidth=1.2, zorder=1)
            gate.set_gid("gate")
            handles.append(gate)
            labels.append(f"gate: min cosine ≥ {gate_min_cosine:g}")
        for i, p in enumerate(shown):
            color, marker = style(i)
            x, y = float(p["x"]), float(p["y"])
            status = str(p.get("status", "lost"))
            out = status not in ("winner", "lost", "tie")
            area = 90.0 if biggest is None else 30.0 + 270.0 * float(p.get("size_bytes") or 0) / biggest
            face, edge = ("none", GREY) if out else (_translucent(color), color)
            # the smaller on top, and the fill see-through: two variants at one spot both show
            dot = ax.scatter(
                [x],
                [y],
                s=area,
                marker=marker,
                facecolors=face,
                edgecolors=edge,
                linewidths=1.3,
                zorder=3 + 1 / area,
            )
            dot.set_gid(f"{'excluded' if out else 'variant'}-{i}")
            if p.get("x_lo") is not None and p.get("x_hi") is not None:
                bars = ax.errorbar(
                    [x],
                    [y],
                    xerr=[[max(0.0, x - float(p["x_lo"]))], [max(0.0, float(p["x_hi"]) - x)]],
                    fmt="none",
                    ecolor=edge,
                    elinewidth=1.0,
                    capsize=3,
                    zorder=2,
                )
                bars.lines[2][0].set_gid(f"interval-{i}")
            handle: Any = Line2D(
                [],
                [],
                linestyle="",
                marker=marker,
                markersize=7,
                markerfacecolor="none" if out else _translucent(color),
                markeredgecolor=edge,
            )
            name = str(p["label"])
            if status == "winner":
                ring = ax.scatter(
                    [x],
                    [y],
                    s=(math.sqrt(area) + 9) ** 2,
                    marker="o",
                    facecolors="none",
                    edgecolors="#000000",
                    linewidths=1.8,
                    zorder=4,
                )
                ring.set_gid("winner-ring")
                ring_handle = Line2D(
                    [],
                    [],
                    linestyle="",
                    marker="o",
                    markersize=12,
                    markerfacecolor="none",
                    markeredgecolor="#000000",
                    markeredgewidth=1.8,
                )
                handle = (ring_handle, handle)
                name = f"winner: {name}"
            elif status == "tie":
                name = f"{name} (tie)"
            elif out:
                reason = short(str(p.get("why") or ""))
                name = f"{name} ({status}: {reason})" if reason else f"{name} ({status})"
            handles.append(handle)
            labels.append(name)
        if biggest is not None:
            handles.append(_blank())
            labels.append(f"marker area ∝ size (largest {biggest / 2**20:,.1f} MiB)")
        if unmeasured:
            handles.append(_blank())
            labels.append("not measured: " + ", ".join(unmeasured))
        _legend(ax, handles, labels)
        return _svg(fig)


# --------------------------------------------------------------------------- load tests


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
    style "" (plain), "winner" (ringed knee, thick, named so in the legend) or "dim" (out of
    the running: grey, hollow, dashed); each knee ringed, the SLO dashed. `legend_px` is
    accepted for the old callers (the legend now sizes itself)."""
    from matplotlib.lines import Line2D

    del legend_px
    with _figure(width, height) as (fig, ax):
        ax.set_title(title)
        ax.set_xlabel("throughput (tokens/s)")
        ax.set_ylabel("p99 latency (ms)")
        if not any(_usable(one[1]) for one in series):
            _empty(ax, "no load steps")
            return _svg(fig)
        handles: list[Any] = []
        labels: list[str] = []
        if slo_p99_ms:
            slo = ax.axhline(slo_p99_ms, color=GATE, linestyle="--", linewidth=1.2, zorder=1)
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
            color, marker = style(i)
            dim = kind == "dim"
            (line,) = ax.plot(
                [float(s["tokens_per_s"]) for s in good],
                [float(s["p99_ms"]) for s in good],
                color=GREY if dim else color,
                linestyle="--" if dim else "-",
                linewidth=2.6 if kind == "winner" else 1.4,
                marker=marker,
                markersize=5,
                markerfacecolor="none" if dim else color,
                zorder=2,
            )
            line.set_gid(f"{'excluded' if dim else 'series'}-{i}")
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
            elif dim:
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
        _legend(ax, handles, labels)
        return _svg(fig)


# --------------------------------------------------------------------------- bench


def bench_lines_svg(
    series: Sequence[tuple[str, Sequence[Sequence[float | None]]]],
    title: str,
    x_label: str,
    y_label: str,
    *,
    log_x: bool = True,
    width: int = 460,
    height: int = 280,
) -> str:
    """A line per series `(name, points)`, each point `(x, y)` or `(x, y, lo, hi)`: `lo`..`hi`
    (the interval of the median, when the bench had one) drawn as an error bar. With `log_x`
    (batch sizes, concurrencies) x is on a log2 axis ticked with plain numbers where the
    points span four octaves or more, linear below that."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    with _figure(width, height) as (fig, ax):
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        drawn = [(name, sorted(pts, key=lambda p: float(p[0]))) for name, pts in series if pts]
        if not drawn:
            _empty(ax, "no points")
            return _svg(fig)
        intervals = False
        for i, (name, pts) in enumerate(drawn):
            color, marker = style(i)
            xs = [float(p[0]) for p in pts]
            ys = [float(p[1] or 0.0) for p in pts]
            (line,) = ax.plot(xs, ys, color=color, marker=marker, markersize=4, linewidth=1.6, label=name)
            line.set_gid(f"series-{i}")
            have = [
                (x, y, p)
                for x, y, p in zip(xs, ys, pts, strict=True)
                if len(p) >= 4 and p[2] is not None and p[3] is not None
            ]
            if have:
                intervals = True
                ax.errorbar(
                    [x for x, _, _ in have],
                    [y for _, y, _ in have],
                    yerr=[
                        [max(0.0, y - float(p[2] or 0.0)) for _, y, p in have],
                        [max(0.0, float(p[3] or 0.0) - y) for _, y, p in have],
                    ],
                    fmt="none",
                    ecolor=color,
                    elinewidth=1.0,
                    capsize=3,
                )
        xs_all = [float(p[0]) for _, pts in drawn for p in pts]
        # log2 only over four octaves or more: a narrower span would get fewer than four ticks
        if log_x and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 16:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(bottom=0)
        handles, labels = ax.get_legend_handles_labels()
        if intervals:
            handles.append(_blank())
            labels.append("bars: interval of the median")
        _legend(ax, handles, labels)
        return _svg(fig)
