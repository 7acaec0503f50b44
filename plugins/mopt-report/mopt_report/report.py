"""`mopt report`: one self-contained HTML page over a recipe's sections, and `--compare`:
the same nodes side by side with an earlier build recorded in a mopt.lock.

For every built artifact: its size, and what the artifacts that tested it found (any
dependent whose result has accuracy numbers like `min_cosine`, or latency numbers like
`p50_ms`), with a link to its folder and its provenance. No plugin-specific code: kinds
report through the JSON their `run` returns; the keys read here are listed in
docs/plugins.md ("What a kind's result may contain"). The store is read through
`mopt.api.Core` only (`core.nodes`, `core.entry`, `core.locked_keys`, `core.key_changes`).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from mopt.api import LOCK_NAME, ActionRecord, Core, MoptError, RecipeNode, human

ACCURACY = ("min_cosine", "mean_cosine", "top1_agreement", "max_abs_diff")
SPEED = ("speedup_largest", "peak_rss_mb")

#: the marks of a row, most telling first, and what the legend says of each
MARKS = {
    "fail": ("✗", "failed a gate: the reason column says which"),
    "excluded": ("⊘", "excluded by a select: the reason column says why"),
    "winner": ("★", "picked by a select"),
    "pass": ("✓", "passed its gates"),
}


# --------------------------------------------------------------------------- the page


def collect(selected: list[RecipeNode]) -> list[dict[str, Any]]:
    """One row per built artifact of the `selected` nodes, joined with its testers' results."""
    entries = built(selected)
    nodes = {n.id: n for n in selected}
    testers: dict[str, list[str]] = {}
    for i, entry in entries.items():
        if _is_tester(entry):
            slots = nodes[i].inputs
            # what it tested: its `model` input; a tester without one (a baseline timing of
            # the reference weights) its only input
            tested = slots.get("model") or (next(iter(slots.values())) if len(slots) == 1 else [])
            for d in tested:
                testers.setdefault(d, []).append(i)
    rows: list[dict[str, Any]] = []
    for i, entry in entries.items():
        if _is_tester(entry):
            continue
        node = nodes[i]
        row: dict[str, Any] = {
            "id": i,
            "section": node.section,
            "target": node.label,
            "kind": node.kind,
            "bytes": sum(size for size, _blob in entry.files.values()),
            "path": str(node.path),
            "key": entry.key,
            "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created)),
            "seconds": round(entry.duration_s, 2),
            "fingerprint": entry.fingerprint,
            "shapes": {},
            "reasons": [],
            "verdicts": [],
        }
        own = entry.result
        # a kind's own figures (SVG files it names under `figures`) are inlined, its own
        # reports (`reports`) linked; e.g. select's Pareto plot and table
        row["figures"] = [
            entry.files[f][1].read_bytes().decode("utf-8", "replace")
            for f in own.get("figures") or []
            if f in entry.files and f.endswith(".svg")
        ]
        # the lines a kind explains its result with (a deploy's capacity plan, a select's
        # ranking) go beside its figures
        row["notes"] = [str(x) for x in own.get("explain") or []] if row["figures"] else []
        for f in own.get("reports") or []:
            if f in entry.files:
                row.setdefault("reports", []).append(str(node.path / f))
        if own.get("winner"):
            row["winner"] = own["winner"]
            if own.get("winner_min_cosine") is not None:
                row["min_cosine"] = own["winner_min_cosine"]
        if isinstance(own.get("verdicts"), dict):
            row["judges"] = own["verdicts"]
        _own_outcome(row, own, node.label)
        for t in testers.get(i, []):
            res = entries[t].result
            for k in ACCURACY + SPEED:
                if res.get(k) is not None:
                    row[k] = res[k]
            row["shapes"].update(shapes_of(res))
            _own_outcome(row, res, nodes[t].label)
            reports = sorted(nodes[t].path.glob("*.html"))
            if reports:
                row.setdefault("reports", []).append(str(reports[0]))
        rows.append(row)
    _apply_verdicts(rows)
    return rows


def _own_outcome(row: dict[str, Any], res: dict[str, Any], who: str) -> None:
    """`passed`, `failed_gates` and `why` of a result, onto `row` (a failure wins)."""
    if res.get("passed") is not None:
        row["passed"] = bool(res["passed"]) and row.get("passed", True)
    for g in res.get("failed_gates") or []:
        row["reasons"].append(f"{who}: {g}")
    if res.get("passed") is False and isinstance(res.get("why"), str) and res["why"]:
        row["reasons"].append(f"{who}: {res['why']}")


def _apply_verdicts(rows: list[dict[str, Any]]) -> None:
    """A judging artifact's `verdicts` (input label → status and why) onto the rows of its
    section it judged; its own row shows its winner's latencies."""
    by_section: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    for judge in rows:
        verdicts = judge.pop("judges", None) or {}
        if not verdicts and not judge.get("winner"):
            continue
        for r in by_section[judge["section"]]:
            if r is judge:
                continue
            v = verdicts.get(r["target"])
            if isinstance(v, dict) and v.get("status"):
                r["verdicts"].append(
                    {"by": judge["target"], "status": str(v["status"]), "why": str(v.get("why") or "")}
                )
            if judge.get("winner") == r["target"] and not judge["shapes"]:
                judge["shapes"] = dict(r["shapes"])
                judge["winner_shapes"] = True
    for r in rows:
        statuses = {v["status"] for v in r["verdicts"]}
        r["mark"] = (
            "fail" if r.get("passed") is False
            else "excluded" if "excluded" in statuses
            else "winner" if "winner" in statuses
            else "pass" if r.get("passed") is True
            else ""
        )  # fmt: skip


def shapes_of(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per shape (`"8x128"`): p50 ms, its interval, samples and speedup, from a result's
    `p50_ms`, `p50_ci_ms`, `samples` and `speedup` (each `{shape: value}`; older results
    have `p50_ms` only)."""
    p50 = res.get("p50_ms")
    if not isinstance(p50, dict):
        return {}

    def of(key: str, shape: str) -> Any:
        d = res.get(key)
        return d.get(shape) if isinstance(d, dict) else None

    cells = {}
    for shape, ms in p50.items():
        if not _is_number(ms):
            continue
        ci = of("p50_ci_ms", shape)
        cells[str(shape)] = {
            "ms": ms,
            "ci": ci if _is_interval(ci) else None,
            "n": of("samples", shape),
            "speedup": of("speedup", shape),
        }
    return cells


def shape_order(shape: str) -> tuple[int, int, int, str]:
    """`1x128` < `8x128` < `32x128` < `32x512`: by batch, then sequence length (names not
    of that form last, by name)."""
    m = re.fullmatch(r"(\d+)x(\d+)", shape)
    return (0, int(m[1]), int(m[2]), "") if m else (1, 0, 0, shape)


def built(nodes: list[RecipeNode]) -> dict[str, ActionRecord]:
    """Node id → the store's record of each of `nodes` that is built for its current key."""
    return {n.id: n.built for n in nodes if n.built is not None}


def _is_tester(entry: ActionRecord) -> bool:
    return any(k in entry.result for k in ("min_cosine", "p50_ms"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_interval(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v)


def fmt(v: Any, nd: int = 4) -> str:
    """A number as the page shows it (`–` for none)."""
    if v is None:
        return "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.{nd}f}"
    return str(v)


def sections(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows by section, each with its bench shapes in order and its figures."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)
    out = []
    for sec, rs in by.items():
        marks = {r["mark"] for r in rs}
        out.append(
            {
                "id": sec,
                "rows": rs,
                "shapes": sorted({s for r in rs for s in r["shapes"]}, key=shape_order),
                "marks": [(m, *MARKS[m]) for m in MARKS if m in marks],
                "figures": [
                    (r["target"], base64.b64encode(svg.encode()).decode(), r["notes"] if i == 0 else [])
                    for r in rs
                    for i, svg in enumerate(r["figures"])
                ],
            }
        )
    return out


def render(recipe: Path, rows: list[dict[str, Any]], comparison: dict[str, Any] | None = None) -> str:
    """The HTML page (jinja2, imported here: no other command pays for it)."""
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(
        loader=PackageLoader("mopt_report"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.filters["human"] = human
    env.filters["g"] = _g
    env.filters["provenance"] = lambda r: json.dumps(
        {"key": r["key"], "tools": r["fingerprint"]}, sort_keys=True
    )
    secs = sections(rows)
    return env.get_template("report.html.j2").render(
        recipe=recipe.name,
        rows=rows,
        sections=secs,
        marks=MARKS,
        comparison=comparison,
        generated=time.strftime("%Y-%m-%d %H:%M"),
    )


# --------------------------------------------------------------------------- --compare


def locked_artifacts(core: Core, recipe_path: Path, ref: str) -> tuple[dict[str, str], str]:
    """The artifacts (node id → action key) that the mopt.lock at `ref` recorded for this
    recipe, and how to name where they came from. `ref`: a mopt.lock file (or a folder
    holding one), else a git revision of the repository the recipe is in."""
    p = Path(ref)
    if p.is_dir():
        p = p / LOCK_NAME
    if p.is_file():
        try:
            text, where = p.read_text(encoding="utf-8"), str(p)
        except (OSError, UnicodeDecodeError) as exc:
            raise MoptError(f"cannot read the lock file: {exc}", file=str(p)) from None
    else:
        text, where = _git_lock(ref, recipe_path.parent / LOCK_NAME)
    return core.locked_keys(recipe_path, text, where), where


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise MoptError("git is not installed", hint="give --compare a path to a mopt.lock instead") from None


def _git_lock(ref: str, lock: Path) -> tuple[str, str]:
    """The text of `lock` as revision `ref` has it, and `REV:path` to name it."""
    folder = lock.resolve().parent
    top = _git(["rev-parse", "--show-toplevel"], folder)
    if top.returncode != 0:
        raise MoptError(
            f"--compare {ref}: no such file, and {folder} is not in a git repository (so it is no revision either)",
            hint="give a path to a mopt.lock, or a revision of the recipe's git repository",
        )
    rev = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], folder)
    if rev.returncode != 0:
        raise MoptError(
            f"--compare {ref}: unknown git revision (and no such file)",
            hint="a commit, branch or tag (git log --oneline), or a path to a mopt.lock",
        )
    rel = Path(os.path.relpath(os.path.realpath(lock), os.path.realpath(top.stdout.strip()))).as_posix()
    shown = _git(["show", f"{rev.stdout.strip()}:{rel}"], folder)
    if shown.returncode != 0:
        raise MoptError(
            f"--compare {ref}: that revision has no {rel}",
            hint=f"it recorded no build of this folder; `git log -- {rel}` lists the ones that did",
        )
    return shown.stdout, f"{ref}:{rel}"


def compare(
    core: Core,
    recipe_path: Path,
    selected: list[RecipeNode],
    old: dict[str, str],
    ref: str,
    everything: bool = True,
) -> dict[str, Any]:
    """Each of the `selected` nodes built now or in the earlier build `old` (node id → action
    key), side by side: what changed in its key, and its result's numbers old → new with
    their intervals. `everything`: the recipe's every node is selected, and the nodes of
    `old` no longer in it are shown too (no selectors)."""
    now = built(selected)
    status = {n.id: n for n in selected}
    order = [n.id for n in selected] + sorted(i for i in old if i not in status and everything)
    nodes = []
    for i in order:
        if i not in old and i not in now:
            continue
        old_key, entry = old.get(i), now.get(i)
        was = core.entry(recipe_path, old_key) if old_key else None
        n: dict[str, Any] = {
            "id": i,
            "old_key": old_key,
            "new_key": entry.key if entry is not None else None,
            "changes": [],
            "metrics": [],
        }
        if old_key is None:
            n["state"], n["note"] = "only-new", f"not in {ref}'s build"
        elif entry is None:
            st = status.get(i)
            n["state"] = "only-old"
            n["note"] = f"not built now ({st.summary})" if st else "no longer in the recipe"
        elif old_key == entry.key:
            n["state"], n["note"] = "same", "same action key"
        elif was is None:
            n["state"], n["note"] = "gone", "not in the store any more (gc'd)"
        else:
            n["state"], n["note"] = "changed", ""
            if was.parts and entry.parts:
                n["changes"] = core.key_changes(was.parts, entry.parts)
            n["params"] = {p: [a, b] for p, a, b in _leaves_diff(_params(was.parts), _params(entry.parts))}
            n["metrics"] = metric_diff(was.result, entry.result)
        nodes.append(n)
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["state"]] = counts.get(n["state"], 0) + 1
    return {"ref": ref, "recipe": recipe_path.name, "counts": counts, "nodes": nodes}


def _params(parts: Any) -> dict[str, Any]:
    p = parts.get("params") if isinstance(parts, dict) else None
    return p if isinstance(p, dict) else {}


_UNSET = object()


def _leaves_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(set(a) | set(b))
            for d in _leaves_diff(a.get(k, _UNSET), b.get(k, _UNSET), f"{prefix}{k}.")
        ]
    if a != b:
        return [(prefix.rstrip("."), None if a is _UNSET else a, None if b is _UNSET else b)]
    return []


def _ci_key(key: str) -> list[str]:
    """Where a result keeps the interval of `key`: `p50_ms` → `p50_ci_ms`, `score` → `score_ci`."""
    stem, _, unit = key.rpartition("_")
    return [f"{key}_ci"] + ([f"{stem}_ci_{unit}"] if stem else [])


def measurements(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A result's values as `name` or `name[shape]` → value, interval (or None), samples."""
    out: dict[str, dict[str, Any]] = {}
    samples = res.get("samples")
    n: dict[str, Any] = samples if isinstance(samples, dict) else {}
    for k, v in res.items():
        if "ci" in k.split("_") or k in ("samples", "figures", "reports", "verdicts"):
            continue
        ci = next((res[c] for c in _ci_key(k) if c in res), None)
        if isinstance(v, dict):
            for s, x in v.items():
                if _is_number(x) or isinstance(x, (str, bool)):
                    c = ci.get(s) if isinstance(ci, dict) else None
                    out[f"{k}[{s}]"] = {"value": x, "ci": c if _is_interval(c) else None, "n": n.get(s)}
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            out[k] = {"value": "; ".join(v) or "(none)", "ci": None, "n": None}
        elif _is_number(v) or isinstance(v, (str, bool)) or v is None:
            out[k] = {"value": v, "ci": ci if _is_interval(ci) else None, "n": None}
    return out


def metric_diff(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The values of two results that differ, old → new; numbers with an interval on both
    sides are `significant` when the intervals do not overlap, else `within noise`."""
    a, b = measurements(old), measurements(new)
    out = []
    for name in [*b, *(k for k in a if k not in b)]:
        x, y = a.get(name), b.get(name)
        if x is not None and y is not None and x["value"] == y["value"]:
            continue
        d: dict[str, Any] = {
            "metric": name,
            "old": x["value"] if x else None,
            "new": y["value"] if y else None,
            "old_ci": x["ci"] if x else None,
            "new_ci": y["ci"] if y else None,
            "old_n": x["n"] if x else None,
            "new_n": y["n"] if y else None,
            "change_pct": None,
            "verdict": "",
        }
        if x and y and _is_number(x["value"]) and _is_number(y["value"]):
            if x["value"]:
                d["change_pct"] = round((y["value"] - x["value"]) / abs(x["value"]) * 100, 2)
            if x["ci"] and y["ci"]:
                apart = x["ci"][1] < y["ci"][0] or y["ci"][1] < x["ci"][0]
                d["verdict"] = "significant" if apart else "within noise"
            else:
                d["verdict"] = "no interval"
        out.append(d)
    return out


def _g(v: Any) -> str:
    """A number in a few significant digits; other values as they are."""
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def side(value: Any, ci: Any) -> str:
    """`0.412 [0.39–0.44]`: a value and its interval, as the comparison shows them."""
    return _g(value) + (f" [{_g(ci[0])}–{_g(ci[1])}]" if ci else "")


def compare_table(c: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """The comparison for a terminal: a summary line, then columns and rows: each node that
    differs, what changed in its key, and its numbers old → new (nodes that are the same are
    counted in the summary only)."""
    counts = c["counts"]
    say = {"changed": "changed", "same": "same", "only-old": f"only in {c['ref']}", "only-new": "only now",
           "gone": "gc'd"}  # fmt: skip
    head = f"{c['recipe']}: {c['ref']} → now: " + (
        ", ".join(f"{counts[s]} {w}" for s, w in say.items() if counts.get(s)) or "nothing built in either"
    )
    rows: list[list[str]] = []
    for n in c["nodes"]:
        if n["state"] == "same":
            continue
        rows.append([n["id"], n["state"], n["note"], "", "", "", ""])
        rows.extend(["", "", x, "", "", "", ""] for x in n["changes"])
        for m in n["metrics"]:
            pct = f"{m['change_pct']:+.1f} %" if m["change_pct"] is not None else ""
            rows.append(
                [
                    "",
                    "",
                    m["metric"],
                    side(m["old"], m["old_ci"]),
                    side(m["new"], m["new_ci"]),
                    pct,
                    m["verdict"],
                ]
            )
    return head, ["node", "state", "what changed", "old", "new", "change", "verdict"], rows
