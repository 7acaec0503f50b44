"""Shared fixtures: real files in tmp_path, the real CLI in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TOY_MODEL = HERE / "data" / "toy-model"


def run_mopt(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real `mopt` CLI in a subprocess."""
    full_env = dict(os.environ)
    full_env.pop("MOPT_DISABLE_PLUGINS", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "mopt", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write dedented text files under root."""
    for name, body in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(body).lstrip())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder with a toy model checkpoint and its own store."""
    shutil.copytree(TOY_MODEL, tmp_path / "toy-model")
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    return tmp_path
