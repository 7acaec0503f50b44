"""capacity.svg: the measured load curve (p99 against requests/s of one replica), the SLO,
the knee with its interval, and the capacity plan it gives. Drawn with matplotlib (imported
inside the function), deterministic SVG text (the same numbers give the same bytes)."""

from __future__ import annotations

import io
from typing import Any

from mopt_deploy.plan import CapacityPlan
from mopt_deploy.served import Served

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


def capacity_svg(served: Served, plan: CapacityPlan, title: str) -> str:
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    xkey = "requests_per_s" if plan.unit == "requests/s" else "tokens_per_s"
    steps: list[dict[str, Any]] = sorted(
        (s for s in served.steps if s.get("completed") and s.get(xkey) is not None),
        key=lambda s: s["concurrency"],
    )
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(6.6, 3.8))
        FigureCanvasSVG(fig)
        ax = fig.add_subplot(1, 1, 1)
        if steps:
            ax.plot([s[xkey] for s in steps], [s["p99_ms"] for s in steps], marker="o", color="#1f77b4",
                    label=f"p99 per load ({served.measured_target})")  # fmt: skip
            for s in steps:
                ax.annotate(f"c={s['concurrency']}", (s[xkey], s["p99_ms"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color="#555555")  # fmt: skip
        ax.axhline(plan.slo_p99_ms, color="#d62728", linestyle="--", linewidth=1,
                   label=f"SLO p99 {plan.slo_p99_ms:g} ms")  # fmt: skip
        lo, hi = plan.knee_ci
        ax.axvspan(lo, hi, color="#2ca02c", alpha=0.12, label=f"knee interval [{lo:,.0f}, {hi:,.0f}]")
        ax.axvline(plan.knee, color="#2ca02c", linewidth=1.2, label=f"knee {plan.knee:,.1f} {plan.unit}")
        ax.set_xlabel(f"{plan.unit} (one replica)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title}\n{plan.target:,.6g} {plan.unit}: {plan.sentence()}", loc="left")
        ax.legend(loc="upper left")
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    return buf.getvalue()
