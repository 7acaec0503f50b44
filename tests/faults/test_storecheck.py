"""The store checker itself: quiet on a real build's store, and it reports each damage."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_mopt
from tests.storecheck import check_store

RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[toy.cpu]
hardware = "cpu"
targets = ["toy-weights", "toy-export"]
"""


@pytest.fixture
def built(project: Path) -> Path:
    (project / "r.toml").write_text(RECIPE)
    proc = run_mopt("build", "r.toml", "--no-check", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert check_store(project / ".mopt", project / "build") == []
    return project


def _entries(store: Path) -> list[dict]:
    return [json.loads(p.read_bytes()) for p in sorted((store / "ac").glob("*.json"))]


def _blob(store: Path, digest: str) -> Path:
    return store / "cas" / digest[:2] / digest


def _manifest(store: Path, tree: str) -> list[list]:
    return json.loads(_blob(store, tree).read_bytes())["entries"]


def _overwrite(p: Path, data: bytes) -> None:
    mode = p.stat().st_mode
    os.chmod(p, 0o644)
    p.write_bytes(data)
    os.chmod(p, mode)


def test_a_damaged_file_blob_is_reported(built: Path) -> None:
    store = built / ".mopt"
    row = _manifest(store, _entries(store)[0]["outputs_tree"])[0]
    blob = _blob(store, row[3])
    data = blob.read_bytes()
    _overwrite(blob, bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    problems = check_store(store, built / "build")
    assert any("does not hash to its name" in p and row[3] in p for p in problems), problems


def test_a_missing_blob_and_a_corrupt_manifest_are_reported(built: Path) -> None:
    store = built / ".mopt"
    e1, e2 = _entries(store)[:2]
    victim = _manifest(store, e1["outputs_tree"])[0][3]
    os.unlink(_blob(store, victim))
    tree = _blob(store, e2["outputs_tree"])
    _overwrite(tree, b"[" + tree.read_bytes()[1:])
    problems = check_store(store)
    assert any(f"blob {victim} is missing" in p for p in problems), problems
    assert any(e2["outputs_tree"] in p and "does not hash" in p for p in problems), problems


def test_a_manifest_whose_sizes_lie_is_reported(built: Path) -> None:
    store = built / ".mopt"
    path = next(store.glob("ac/*.json"))
    e = json.loads(path.read_bytes())
    rows = _manifest(store, e["outputs_tree"])
    rows[0][2] += 1
    data = json.dumps({"entries": rows}, sort_keys=True, separators=(",", ":")).encode()
    import blake3

    digest = blake3.blake3(data).hexdigest()
    _blob(store, digest).parent.mkdir(exist_ok=True)
    _blob(store, digest).write_bytes(data)
    os.chmod(_blob(store, digest), 0o444)
    e["outputs_tree"] = digest
    os.chmod(path, 0o644)
    path.write_text(json.dumps(e))
    problems = check_store(store)
    assert any("manifest says" in p for p in problems), problems


def test_malformed_entries_are_reported(built: Path) -> None:
    store = built / ".mopt"
    (store / "ac" / ("a" * 64 + ".json")).mkdir()
    (store / "ac" / ("b" * 64 + ".json")).write_text("{not json")
    problems = check_store(store)
    assert any("is not a regular file" in p for p in problems), problems
    assert any("not valid JSON" in p for p in problems), problems


def test_an_edited_build_file_is_reported(built: Path) -> None:
    f = built / "build" / "toy" / "cpu" / "toy-export" / "model.txt"
    os.chmod(f, 0o644)
    with open(f, "ab") as fh:
        fh.write(b"x")
    problems = check_store(built / ".mopt", built / "build")
    assert any("toy-export" in p and "no action entry" in p for p in problems), problems
    assert any("is writable" in p for p in problems), problems


def test_a_damaged_state_db_is_reported(built: Path) -> None:
    db = built / ".mopt" / "state.db"
    for side in (db.with_name("state.db-wal"), db.with_name("state.db-shm")):
        side.unlink(missing_ok=True)
    size = db.stat().st_size
    with open(db, "r+b") as fh:  # keep the header, scribble over the pages
        fh.seek(100)
        fh.write(os.urandom(size - 100))
    problems = check_store(built / ".mopt")
    assert any("state.db" in p for p in problems), problems


def test_a_stat_row_vouching_for_other_bytes_is_reported(built: Path) -> None:
    store = built / ".mopt"
    victim = built / "toy-model" / "config.json"
    st = victim.stat()
    conn = sqlite3.connect(store / "state.db")
    conn.execute(
        "INSERT OR REPLACE INTO stat VALUES (?,?,?,?,?,?,?)",
        (str(victim), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, "0" * 64),
    )
    conn.commit()
    conn.close()
    problems = check_store(store)
    assert any("matches its stat but not its bytes" in p for p in problems), problems


def test_script_exit_codes(built: Path) -> None:
    script = Path(__file__).parent.parent / "storecheck.py"
    ok = subprocess.run([sys.executable, script, built / ".mopt", built / "build"], capture_output=True)
    assert ok.returncode == 0, ok.stdout
    (built / ".mopt" / "ac" / "stray.txt").write_text("x")
    bad = subprocess.run([sys.executable, script, built / ".mopt"], capture_output=True, text=True)
    assert bad.returncode == 1 and "stray" in bad.stdout
