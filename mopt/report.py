"""`mopt report`: one self-contained HTML page over a recipe's sections.

For every built artifact: its size, and what the artifacts that tested it found (any
dependent whose result has accuracy numbers like `min_cosine`, or latency numbers like
`p50_ms`), with a link to its folder and its provenance. No plugin-specific code: kinds
report through the JSON their `run` returns.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from mopt.errors import human

ACCURACY = ("min_cosine", "mean_cosine", "top1_agreement", "max_abs_diff")
SPEED = ("speedup_largest", "peak_rss_mb")


def collect(engine: Any, ids: list[str]) -> list[dict[str, Any]]:
    """One row per built artifact of `ids`, joined with its testers' results."""
    entries = built(engine, ids)
    testers: dict[str, list[str]] = {}
    for i in ids:
        node = engine.graph.nodes[i]
        for d in node.inputs.get("model", []):
            testers.setdefault(d, []).append(i)
    rows = []
    for i, entry in entries.items():
        if _is_tester(entry):
            continue
        node = engine.graph.nodes[i]
        files = engine.store.tree_entries(entry.outputs_tree)
        row: dict[str, Any] = {
            "id": i,
            "section": node.section.id,
            "target": node.label,
            "kind": node.kind,
            "bytes": sum(f.size for f in files),
            "path": str(engine.address_path(i)),
            "key": entry.key,
            "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created)),
            "seconds": round(entry.duration_s, 2),
            "fingerprint": entry.fingerprint,
        }
        own = entry.meta.get("result") or {}
        by_path = {f.path: f for f in files}
        # a kind's own figures (SVG files it names under `figures`) are inlined, its own
        # reports (`reports`) linked; e.g. select's Pareto plot and table
        row["figures"] = [
            engine.store.read_bytes(by_path[f].digest).decode("utf-8", "replace")
            for f in own.get("figures") or []
            if f in by_path and f.endswith(".svg")
        ]
        for f in own.get("reports") or []:
            if f in by_path:
                row.setdefault("reports", []).append(str(engine.address_path(i) / f))
        if own.get("winner"):
            row["winner"] = own["winner"]
            for k in ("min_cosine", "p50_ms"):
                if own.get(f"winner_{k}") is not None:
                    row[k] = own[f"winner_{k}"]
        for t in testers.get(i, []):
            te = entries.get(t)
            if te is None:
                continue
            res = te.meta.get("result") or {}
            for k in ACCURACY + SPEED:
                if res.get(k) is not None:
                    row[k] = res[k]
            if isinstance(res.get("p50_ms"), dict) and res["p50_ms"]:
                last = list(res["p50_ms"].items())[-1]
                row["p50_ms"] = last[1]
                row["shape"] = last[0]
            if res.get("passed") is not None:
                row["passed"] = res["passed"]
            reports = sorted(engine.address_path(t).glob("*.html"))
            if reports:
                row.setdefault("reports", []).append(str(reports[0]))
        rows.append(row)
    return rows


def built(engine: Any, ids: list[str]) -> dict[str, Any]:
    """Node id → action entry of each of `ids` that is built for its current key."""
    status = engine.plan(ids)
    found = {i: engine.store.ac_entry(status[i]["key"]) for i in ids if status[i]["state"] == "up-to-date"}
    return {i: e for i, e in found.items() if e is not None}


def _is_tester(entry: Any) -> bool:
    res = entry.meta.get("result") or {}
    return any(k in res for k in ("min_cosine", "p50_ms"))


def _fmt(v: Any, nd: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return html.escape(str(v))


def _scatter(rows: list[dict[str, Any]]) -> str:
    pts = [r for r in rows if r.get("speedup_largest") is not None and r.get("min_cosine") is not None]
    if not pts:
        return ""
    w, h, pad = 560, 300, 50
    xs = [float(r["speedup_largest"]) for r in pts]
    ys = [float(r["min_cosine"]) for r in pts]
    x0, x1 = min(xs + [1.0]) * 0.9, max(xs) * 1.1
    y0, y1 = min(ys) - 0.01, min(1.0, max(ys) + 0.005)

    def sx(x: float) -> float:
        return pad + (x - x0) / max(x1 - x0, 1e-9) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / max(y1 - y0, 1e-9) * (h - 2 * pad)

    dots = "".join(
        f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="#1f77b4"><title>{html.escape(r["id"])}: '
        f'{x:.2f}× at min cosine {y:.4f}</title></circle>'
        f'<text x="{sx(x) + 7:.1f}" y="{sy(y) + 4:.1f}" font-size="10">{html.escape(r["target"])}</text>'
        for r, x, y in zip(pts, xs, ys)
    )
    return (
        f'<svg width="{w}" height="{h}" role="img" aria-label="speedup vs accuracy">'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#333"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#333"/>'
        f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle" font-size="12">speedup vs baseline (largest shape)</text>'
        f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">min cosine</text>'
        f'<text x="{pad}" y="{h - pad + 14}" font-size="10">{x0:.2f}×</text>'
        f'<text x="{w - pad}" y="{h - pad + 14}" font-size="10" text-anchor="end">{x1:.2f}×</text>'
        f'<text x="{pad - 4}" y="{h - pad}" font-size="10" text-anchor="end">{y0:.3f}</text>'
        f'<text x="{pad - 4}" y="{pad + 4}" font-size="10" text-anchor="end">{y1:.3f}</text>'
        f"{dots}</svg>"
    )


def render(recipe: Path, rows: list[dict[str, Any]]) -> str:
    """The HTML page."""
    by_section: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    parts = [
        "<!doctype html><meta charset='utf-8'><title>mopt report</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:1200px}"
        "table{border-collapse:collapse;margin:1em 0}td,th{padding:4px 10px;border-bottom:1px solid #ddd;"
        "text-align:right}td:first-child,th:first-child{text-align:left}.fail{color:#b00}"
        "details{font-size:12px;color:#444}code{font-size:12px}</style>",
        f"<h1>mopt report: {html.escape(recipe.name)}</h1>",
        f"<p>{len(rows)} built artifacts in {len(by_section)} sections · generated "
        f"{time.strftime('%Y-%m-%d %H:%M')}</p>",
    ]
    for sec, rs in by_section.items():
        parts.append(f"<h2>{html.escape(sec)}</h2>")
        parts.append(_scatter(rs))
        parts.append(
            "<table><tr><th>target</th><th>kind</th><th>size</th><th>min cos</th><th>mean cos</th>"
            "<th>top-1</th><th>p50 ms</th><th>shape</th><th>speedup</th><th>peak RSS MB</th>"
            "<th>built</th><th>provenance</th></tr>"
        )
        for r in rs:
            cls = " class='fail'" if r.get("passed") is False else ""
            won = f" → <b>{html.escape(r['winner'])}</b>" if r.get("winner") else ""
            links = "".join(f" <a href='{html.escape(p)}'>report</a>" for p in r.get("reports", []))
            prov = html.escape(json.dumps({"key": r["key"], "tools": r["fingerprint"]}, sort_keys=True))
            parts.append(
                f"<tr{cls}><td><a href='{html.escape(r['path'])}'>{html.escape(r['target'])}</a>{won}{links}</td>"
                f"<td>{html.escape(r['kind'])}</td><td>{human(r['bytes'])}</td>"
                f"<td>{_fmt(r.get('min_cosine'))}</td><td>{_fmt(r.get('mean_cosine'))}</td>"
                f"<td>{_fmt(r.get('top1_agreement'), 3)}</td><td>{_fmt(r.get('p50_ms'), 2)}</td>"
                f"<td>{_fmt(r.get('shape'))}</td><td>{_fmt(r.get('speedup_largest'), 2)}</td>"
                f"<td>{_fmt(r.get('peak_rss_mb'), 0)}</td><td>{r['built']} ({r['seconds']} s)</td>"
                f"<td><details><summary>key {r['key'][:12]}</summary><code>{prov}</code></details></td></tr>"
            )
        parts.append("</table>")
        for r in rs:
            for svg in r.get("figures", []):
                data = base64.b64encode(svg.encode()).decode()
                parts.append(
                    f"<h3>{html.escape(r['target'])}</h3>"
                    f"<img alt='{html.escape(r['target'])} figure' src='data:image/svg+xml;base64,{data}'>"
                )
    return "\n".join(parts) + "\n"
