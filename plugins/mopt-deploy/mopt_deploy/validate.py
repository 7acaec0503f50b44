"""The bundle checked by the real tools, each recorded with its version:
kubernetes-validate (the manifests against a named Kubernetes version's JSON schemas,
strict: unknown fields are errors), promtool (`check config`, `check rules`, `test rules`)
and Helm (`helm lint`, `helm template`) where they are installed. A tool that is not
installed is recorded as not run, never as passed."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml


class BundleInvalid(RuntimeError):
    """A tool rejected a file of the bundle (a bug of the generator, or of the recipe's values)."""


def tool_version(argv: list[str]) -> str | None:
    """The version a tool prints (`promtool --version`: `promtool, version 2.42.0+ds ...`), or None."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"v?(\d+\.\d+\.\d+[^\s,]*)", r.stdout + r.stderr)
    return m[1] if m else None


def kubernetes_validate(files: list[Path], version: str) -> dict[str, Any]:
    """Every document of `files` against Kubernetes `version`'s schemas (strict); raises
    BundleInvalid naming the file, the resource and the field."""
    import kubernetes_validate as kv

    done = {}
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc:
                continue
            what = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
            try:
                used = kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                raise BundleInvalid(
                    f"kubernetes-validate: {f.name}: {what} is not valid Kubernetes {exc.version}: {path}: {exc.message}"
                ) from None
            except kv.SchemaNotFoundError as exc:
                raise BundleInvalid(f"kubernetes-validate: {f.name}: {exc.message}") from None
            done[f"{f.name}: {what}"] = f"valid against Kubernetes {used} (strict)"
    return {"tool": "kubernetes-validate", "version": md.version("kubernetes-validate"), "kubernetes": version,
            "strict": True, "checked": done}  # fmt: skip


def _run(argv: list[str], cwd: Path) -> tuple[int, str]:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    return r.returncode, (r.stdout + r.stderr).strip()


def promtool(folder: Path, configs: list[str], rules: str, tests: str) -> dict[str, Any]:
    """`promtool check config` of each scrape config, `check rules` and `test rules` in
    `folder`; BundleInvalid on a failure; not run where promtool is not installed."""
    version = tool_version(["promtool", "--version"])
    if version is None:
        return {
            "tool": "promtool",
            "version": None,
            "not_run": "promtool is not installed here (apt-get install prometheus): the rules were not checked",
        }
    checked: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for argv in (*(["promtool", "check", "config", c] for c in configs), ["promtool", "check", "rules", rules],
                 ["promtool", "test", "rules", tests]):  # fmt: skip
        rc, out = _run(argv, folder)
        if rc != 0 and "field kubernetes_sd_configs not found" in out:
            # Debian builds Prometheus without Kubernetes service discovery (no client-go)
            skipped[" ".join(argv[1:])] = (
                "not checked: this promtool is built without Kubernetes service "
                "discovery (Debian's package); the static scrape config was"
            )
            continue
        if rc != 0:
            raise BundleInvalid(f"{' '.join(argv)} failed (exit {rc}):\n{out[-3000:]}")
        checked[" ".join(argv[1:])] = "ok"
    return {
        "tool": "promtool",
        "version": version,
        "checked": checked,
        **({"skipped": skipped} if skipped else {}),
    }


def helm(chart: Path) -> dict[str, Any]:
    """`helm lint` and `helm template` of the chart, where Helm is installed."""
    version = tool_version(["helm", "version", "--short"])
    if version is None:
        return {
            "tool": "helm",
            "version": None,
            "not_run": "helm is not installed here: helm lint / helm template were not run (the chart's "
            "templates are checked against k8s/ by substituting values.yaml, in mopt-deploy's tests)",
        }
    checked = {}
    for argv in (["helm", "lint", str(chart)], ["helm", "template", str(chart)]):
        rc, out = _run(argv, chart.parent)
        if rc != 0:
            raise BundleInvalid(f"{' '.join(argv)} failed (exit {rc}):\n{out[-3000:]}")
        checked[argv[1]] = "ok"
    return {"tool": "helm", "version": version, "checked": checked}
