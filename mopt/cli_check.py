"""`mopt check` and `mopt doctor` (registered on the main app by `mopt.cli`), and the check
`mopt build` runs first (`run_check_for_build`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mopt.cli import CONTEXT, Session, _print_json, _registry, err, json_opt, out, recipe_arg, selectors_arg
from mopt.errors import MoptError

if TYPE_CHECKING:
    from mopt.api import Finding
    from mopt.check import CheckReport, NodeEstimate
    from mopt.doctor import DoctorReport

_ORDER = {"error": 0, "warning": 1, "info": 2}


def run_check_for_build(session: Any, ids: list[str]) -> None:
    """The first step of `mopt build`: print errors and warnings to stderr; raise `MoptError`
    (exit 2) when there is any error, before anything is built."""
    from mopt.check import run_checks

    findings = [f for f in run_checks(session.graph, ids).findings if f.severity in ("error", "warning")]
    if not findings:
        return
    for line in finding_lines(findings, with_section=True):
        err.print(line)
    n = sum(1 for f in findings if f.severity == "error")
    if n:
        raise MoptError(
            f"mopt check found {n} error{'s' if n != 1 else ''} in the recipe",
            hint="fix them (the fixes are listed above), or build anyway with --no-check",
        )


def finding_lines(findings: list[Finding], indent: str = "  ", with_section: bool = False) -> list[str]:
    """One block per finding: severity, code, [section] target [key], the message with its
    numbers, then the fix."""
    lines = []
    for f in sorted(findings, key=lambda f: _ORDER.get(f.severity, 3)):
        where = " ".join(
            x for x in (f.section if with_section else "", f.target, f"[{f.key}]" if f.key else "") if x
        )
        lines.append(f"{indent}{f.severity:<7} {f.code}" + (f"  {where}" if where else ""))
        lines.append(f"{indent}        {f.message}")
        if f.fix:
            lines.append(f"{indent}        fix: {f.fix}")
    return lines


def _g(n: float) -> str:
    from mopt.estimate import gib

    return gib(n) if n else "-"


def estimate_rows(estimates: list[NodeEstimate]) -> tuple[list[str], list[list[str]]]:
    """The breakdown table: columns and one row per estimate."""
    cols = ["target", "weights", "KV cache", "activations", "other", "total", "of GPU", "largest that fits"]
    rows = []
    for ne in estimates:
        e = ne.estimate
        cap = e.capacity or 0
        kv = f"{_g(e.kv_cache)} (room: {_g(e.kv_available or 0)})" if e.workload.kv_cache else "-"
        share = (f"{e.total / cap:.0%}" if cap else "-") + ("" if e.fits else " !")
        largest = ", ".join(f"{k} ≤ {v:,}" if v else f"{k}: none" for k, v in ne.largest.items())
        rows.append(
            [
                ne.target,
                _g(e.weights),
                kv,
                _g(e.activations),
                _g(e.workspace + e.runtime),
                _g(e.total),
                share,
                largest or "-",
            ]
        )
    return cols, rows


def _short_path(p: str) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return p


def _print_check(s: Any, report: CheckReport) -> None:
    reg = s.registry
    by_sec: dict[str, list[Finding]] = {}
    for f in report.findings:
        by_sec.setdefault(f.section, []).append(f)
    sections = {sec.id: sec for sec in s.recipe.sections}
    order = [k for k in by_sec if k not in report.sections] + report.sections
    out.print(
        f"{_short_path(str(s.recipe.path))}: {len(report.sections)} section(s) checked in {report.seconds:.2f} s"
    )
    for sec_id in order:
        sec = sections.get(sec_id)
        hw = reg.hardware[sec.hardware] if sec is not None else None
        out.print()
        if hw is None:
            out.print(sec_id)
        elif hw.is_gpu:
            cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else "?"
            gpus = f"{hw.memory_gb:g} GiB" + (f" × {hw.gpu_count}" if hw.gpu_count > 1 else "")
            out.print(f"{sec_id}  ({hw.name}: {hw.gpu_name or hw.name} · CC {cc} · {gpus})")
        else:
            out.print(f"{sec_id}  ({hw.name}: {hw.description})")
        fs = by_sec.get(sec_id, [])
        for line in finding_lines(fs) if fs else ["  no findings"]:
            out.print(line)
        ests = [e for e in report.estimates if e.section == sec_id]
        if ests:
            cfg = report.configs.get(sec.model, "") if sec is not None else ""
            per = "per GPU" if hw is not None and hw.is_gpu else "in the process"
            out.print(f"  memory, estimated {per} (model config: {_short_path(cfg)}):")
            cols, rows = estimate_rows(ests)
            out.table(cols, rows, indent="    ", right=(1, 3, 4, 5, 6))
            for ne in ests:
                out.print(f"    {ne.target}: {ne.basis}")
    out.print()
    counts = report.counts.items()
    out.print(", ".join(f"{n} {sev}{'s' if n != 1 and sev != 'info' else ''}" for sev, n in counts))


def _print_doctor(report: DoctorReport) -> None:
    m = report.machine
    out.print(f"mopt doctor: {m.hostname}")
    width = max(len(c.name) for c in report.checks)
    pad = " " * (width + 13)
    for c in report.checks:
        out.print(f"  {c.status:<8} {c.name:<{width}}  {c.summary}")
        if c.cause:
            out.print(f"{pad}cause: {c.cause}")
        if c.fix:
            out.print(f"{pad}fix:   {c.fix}")
    out.print()
    out.print("hardware profiles this machine matches: " + (", ".join(report.profiles) or "none"))
    if report.recipe is None:
        return
    ok = [t for t in report.targets if t.buildable]
    out.print()
    out.print(f"{_short_path(report.recipe)}: {len(ok)} of {len(report.targets)} target(s) buildable here")
    for t in report.targets:
        if t.buildable:
            out.print(f"  ok  {t.id}")
        else:
            out.print(f"  no  {t.id}  unbuildable here: {'; '.join(t.reasons)}")


def register(app: click.Group) -> None:
    """Add `check` and `doctor` to the main app."""
    @app.command(context_settings=CONTEXT)
    @recipe_arg
    @selectors_arg
    @json_opt
    @click.option("--strict", is_flag=True, help="treat warnings as errors (exit 2)")
    def check(recipe: Path, selectors: tuple[str, ...], as_json: bool, strict: bool) -> None:
        """Check RECIPE against its hardware profiles before any build: precision vs compute
        capability, estimated memory vs the GPU (with the breakdown and the largest setting
        that fits), tensor parallelism vs heads and GPUs, sequence lengths vs the model.
        Exit 2 on errors.

        SELECTORS are model.hardware:target, globs allowed ('*.h200', '*:trt-engine')."""
        from mopt.check import run_checks

        s = Session(recipe)
        report = run_checks(s.graph, s.graph.select(list(selectors)))
        if as_json:
            _print_json({"recipe": str(s.recipe.path), **report.to_json()})
        else:
            _print_check(s, report)
        if report.errors or (strict and any(f.severity == "warning" for f in report.findings)):
            raise click.exceptions.Exit(2)

    @app.command(context_settings=CONTEXT)
    @click.argument("recipe", required=False, type=click.Path(path_type=Path))
    @json_opt
    def doctor(recipe: Path | None, as_json: bool) -> None:
        """This machine: CPU, memory, GPUs, driver, CUDA, backend libraries, container tooling,
        and the hardware profiles it matches; with RECIPE, which of its targets can be built
        here. Every missing or failed check names the likely cause and the fix."""
        from mopt.doctor import doctor as make_report

        session = Session(recipe) if recipe is not None else None
        registry = session.registry if session is not None else _registry()
        report = make_report(registry, session)
        if as_json:
            _print_json(report.to_json())
        else:
            _print_doctor(report)
