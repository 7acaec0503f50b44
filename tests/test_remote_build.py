"""The engine with a remote cache: a second machine (fresh store) builds nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.conftest import TOY_MODEL, run_mopt
from tests.test_build import RECIPE


def _machine(root: Path, remote: Path) -> Path:
    shutil.copytree(TOY_MODEL, root / "toy-model")
    (root / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n[remote]\nurl = "file://{remote}"\n')
    (root / "r.toml").write_text(RECIPE)
    return root


def _build(root: Path) -> dict:
    proc = run_mopt("build", "r.toml", "--json", "--no-check", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_second_machine_gets_hits_from_the_remote(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    a = _machine(tmp_path / "a", remote)
    b = _machine(tmp_path / "b", remote)
    assert _build(a)["counts"] == {"built": 7}
    assert any((remote / "ac").iterdir())
    data = _build(b)
    assert data["counts"] == {"cached": 7}
    assert (b / "build/toy/gpu/toy-engine/engine.plan").read_text() == \
        (a / "build/toy/gpu/toy-engine/engine.plan").read_text()


def test_tampered_remote_blob_is_rejected_and_rebuilt(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    a = _machine(tmp_path / "a", remote)
    b = _machine(tmp_path / "b", remote)
    first = _build(a)
    node = next(n for n in first["nodes"] if n["id"] == "toy.gpu:toy-engine")
    manifest = json.loads((remote / "cas" / node["outputs"][:2] / node["outputs"]).read_text())
    blob = remote / "cas" / manifest["entries"][0][3][:2] / manifest["entries"][0][3]
    os.chmod(blob, 0o644)
    blob.write_text("tampered")
    data = _build(b)
    statuses = {n["id"]: n["status"] for n in data["nodes"]}
    assert statuses["toy.gpu:toy-engine"] == "built"
    assert "tampered" not in (b / "build/toy/gpu/toy-engine/engine.plan").read_text()
    assert sum(1 for s in statuses.values() if s == "cached") == 6


def test_an_executor_session_takes_a_remote_hit_without_its_bytes_unless_laid_out(tmp_path: Path) -> None:
    # what an executor (mopt-ray) sees of a node another machine built: a hit, verified on the
    # remote; its bytes come down only for a node laid out under build/ (the session's docstring)
    from mopt.build import Engine
    from mopt.cli import Session
    from mopt.executor import BuildSession

    remote = tmp_path / "remote"
    a = _machine(tmp_path / "a", remote)
    b = _machine(tmp_path / "b", remote)
    assert _build(a)["counts"] == {"built": 7}
    cwd = os.getcwd()
    os.chdir(b)
    try:
        engine = Engine(Session(b / "r.toml"))
        ids = list(engine.graph.nodes)
        last = ids[-1]
        session = BuildSession(engine, ids, remote=engine.remote, materialize={last})
        for i in ids:
            assert session.readiness(i)[0] == "ready"
            session.key(i)
            assert session.cached(i), i
        engine.store.close()
    finally:
        os.chdir(cwd)
    assert all(session.status(i) == "cached" for i in ids)
    # downloaded: the laid-out node's files only
    blobs = [p for p in (b / ".mopt" / "cas").rglob("*") if p.is_file()]
    laid_out = engine.address_path(last)
    assert laid_out.is_dir() and blobs
    assert len(blobs) < sum(1 for p in (a / ".mopt" / "cas").rglob("*") if p.is_file())
