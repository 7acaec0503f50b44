"""The no-op stamp's checks, file by file: a touch with the same bytes of a recipe or a
loaded module stays a no-op; hard-linked names are watched through one stat; the half of
the stats a forked child takes misses like the rest; read-only callers write nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mopt import noop
from tests.test_noop import RECIPE, build, fast, settled


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    """test_noop's project: two models, an input file each, two chained commands."""
    (tmp_path / "in").mkdir()
    for m in ("m1", "m2"):
        (tmp_path / "in" / f"{m}.txt").write_text(f"hello {m}\n")
    (tmp_path / "r.toml").write_text(RECIPE)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    return tmp_path


def test_touched_recipe_and_settings_stay_a_noop(proj: Path) -> None:
    """Bazel and DVC key on content: a recipe or mopt.toml with a new mtime and the same
    bytes is rehashed by the no-op, which then holds; a changed byte is a miss."""
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    os.utime(proj / "r.toml")
    os.utime(proj / "mopt.toml")
    time.sleep(0.3)  # past the racy window: the new stats can be remembered
    data = build(proj)
    assert fast(data), data["io"].get("noop_miss")
    assert data["io"]["hashed_files"] == 2
    assert data["counts"] == {"cached": 4}
    again = build(proj)
    assert fast(again) and again["io"]["hashed_files"] == 0
    text = (proj / "r.toml").read_text()
    (proj / "r.toml").write_text(text.replace("[models.m2]", "[models.m2]  # a comment"))
    edited = build(proj)
    assert not fast(edited)
    assert edited["io"]["noop_miss"] == f"changed: {proj / 'r.toml'}"
    assert edited["counts"] == {"cached": 4}


def test_read_only_check_writes_nothing(proj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`stamp_holds(..., learn=False)` (for `mopt plan`) settles a touch by rehashing but
    leaves the stamp and the stat cache as they were: the next build rehashes again."""
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    (stamp,) = (proj / ".mopt" / "noop").glob("*.stamp")
    before = stamp.read_bytes()
    os.utime(proj / "in" / "m1.txt")
    time.sleep(0.3)
    monkeypatch.setenv("GREETING", "hi")  # the environment the builds ran in (see `build`)
    monkeypatch.delenv("MOPT_DISABLE_PLUGINS", raising=False)
    done = noop.stamp_holds(str(proj / "r.toml"), [], False, learn=False)
    assert done is not None, noop.last_miss
    assert done["hashed_files"] == 1 and done["n"] == 4
    assert {n["id"] for n in noop.stamp_nodes(done)} == {"m1.cpu:a", "m1.cpu:b", "m2.cpu:a", "m2.cpu:b"}
    assert stamp.read_bytes() == before
    data = build(proj)
    assert fast(data) and data["io"]["hashed_files"] == 1
    assert noop.stamp_holds(str(proj / "r.toml"), ["m1.cpu"], False) is None
    assert noop.last_miss == "no stamp"


def _write(path: Path, files: list[Path]) -> None:
    """A stamp of `files` written by a fresh process: a stamp also lists the writer's loaded
    modules, and is not written if one changed while it ran (this test process may be that
    old; a subprocess started now is not)."""
    code = (
        "import sys; from mopt import noop; "
        "noop.write(sys.argv[1], files=sys.argv[2:], exist=[], absent=[], dirs=[], env_extra=[], "
        "result={'recipe': 'r', 'n': 0, 'build_dir': 'b', 'nodes': []})"
    )
    cwd = path.parent / "cwd"  # sys.path[0] of `-c`, so a watched folder: one nothing writes in
    cwd.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), *map(str, files)], capture_output=True, text=True, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("change", ["unlink", "rename_over", "chmod", "edit_in_place", "none"])
def test_hard_linked_names_are_watched_through_one_stat(tmp_path: Path, change: str) -> None:
    """Two names of one inode (a build/ file hard-linked to its blob) are stat-ed once: any
    change to the other name changes the inode's ctime, which that one stat sees."""
    blob, copy, other = tmp_path / "blob", tmp_path / "copy", tmp_path / "other"
    blob.write_bytes(b"x" * 100)
    os.chmod(blob, 0o444)
    os.link(blob, copy)
    other.write_bytes(b"y")
    time.sleep(0.25)  # a stamp is not written within the racy window of a change
    stamp = tmp_path / "s.stamp"
    _write(stamp, [blob, copy, other])
    held = noop._read(str(stamp))
    assert isinstance(held, dict)
    listed = noop._paths(held["groups"])
    assert str(copy) in listed and str(blob) not in listed and str(other) in listed
    assert noop.check(str(stamp)) is not None, noop.last_miss
    if change == "unlink":
        blob.unlink()
    elif change == "rename_over":
        (tmp_path / "new").write_bytes(b"x" * 100)
        os.replace(tmp_path / "new", blob)
    elif change == "chmod":
        os.chmod(blob, 0o644)
    elif change == "edit_in_place":
        os.chmod(blob, 0o644)
        os.chmod(copy, 0o444)  # the mode put back: only the bytes and the ctime changed
        with open(blob, "r+b") as fh:
            fh.write(b"z")
    if change == "none":
        assert noop.check(str(stamp)) is not None, noop.last_miss
    else:
        assert noop.check(str(stamp)) is None
        assert noop.last_miss == f"changed: {copy}"


_FORKED = """
import json, os, sys, time
from mopt import noop
noop.PARALLEL_MIN, noop.GROUP_MIN = 8, 3
root = sys.argv[1]
files = [os.path.join(root, d, f"f{i}") for d in ("a", "b", "c", "d") for i in range(5)]
stamp = os.path.join(root, "st", "s.stamp")  # not in sys.path[0]: writing it changes no watched folder
if sys.argv[2] == "write":
    noop.write(stamp, files=files, exist=[], absent=[], dirs=[], env_extra=[],
               result={"recipe": "r", "n": 0, "build_dir": root, "nodes": []})
    held = noop._read(stamp)
    print(json.dumps({"parts": len(held["stats"]), "cut": held["cut"], "groups": len(held["groups"])}))
else:
    done = noop.check(stamp)
    print(json.dumps({"forks": noop._can_fork(), "held": done is not None, "why": noop.last_miss}))
"""


@pytest.mark.parametrize("change", ["none", "edit_second_half", "delete_second_half", "edit_first_half"])
def test_stats_taken_by_the_forked_half_miss_like_the_rest(tmp_path: Path, change: str) -> None:
    """From PARALLEL_MIN files on, a forked child stats the second half: a change there is
    a miss naming the file, exactly as one in the first half."""
    for d in ("a", "b", "c", "d"):
        (tmp_path / d).mkdir()
        for i in range(5):
            (tmp_path / d / f"f{i}").write_text(f"{d}{i}")
    (tmp_path / "st").mkdir()
    script = tmp_path / "forked.py"  # a loaded module too (__main__): written before the pause
    script.write_text(_FORKED)
    time.sleep(0.25)

    def run(mode: str) -> dict:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    shape = run("write")
    assert shape["parts"] == 2 and 0 < shape["cut"] < shape["groups"]
    target = {
        "none": None,
        "edit_second_half": tmp_path / "d" / "f3",
        "delete_second_half": tmp_path / "d" / "f4",
        "edit_first_half": tmp_path / "a" / "f1",
    }[change]
    if change.startswith("edit"):
        assert target is not None
        target.write_text("changed")
    elif change.startswith("delete"):
        assert target is not None
        target.unlink()
    got = run("check")
    if (os.cpu_count() or 1) >= 2 and sys.platform == "linux":
        assert got["forks"]
    if target is None:
        assert got["held"], got["why"]
    else:
        assert not got["held"]
        assert got["why"] == f"changed: {target}"


def test_touched_module_with_the_same_bytes_stays_a_noop(tmp_path: Path) -> None:
    """A loaded module file (a plugin's, say) touched without a change is rehashed; an edit
    of it is a miss: the code that ran is no longer the code on disk."""
    (tmp_path / "mymod.py").write_text("VALUE = 1\n")
    (tmp_path / "f").write_text("f")
    (tmp_path / "st").mkdir()  # the stamp's folder: tmp_path is on the writer's sys.path (watched)
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            import mymod
            from mopt import noop
            noop.write({str(tmp_path / "st" / "s.stamp")!r}, files=[{str(tmp_path / "f")!r}], exist=[], absent=[],
                       dirs=[], env_extra=[], result={{"recipe": "r", "n": 0, "build_dir": "b", "nodes": []}})
            """
        )
    )
    time.sleep(0.25)  # a stamp is not written within the racy window of a change
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    stamp = str(tmp_path / "st" / "s.stamp")
    mod = tmp_path / "mymod.py"
    os.utime(mod)
    assert noop.check(stamp, learn=False) is not None, noop.last_miss
    assert noop.rehashed[0] == 1
    mod.write_text("VALUE = 2\n")
    assert noop.check(stamp, learn=False) is None
    assert noop.last_miss == f"changed: {mod}"


def test_a_stamp_left_in_the_default_store_does_not_shadow_the_configured_one(proj: Path) -> None:
    """The no-op looks for the stamp in the default store first (without parsing mopt.toml);
    a stamp left there by earlier settings misses, and the configured store's stamp holds."""
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    assert list((proj / ".mopt" / "noop").glob("*.stamp"))
    (proj / "mopt.toml").write_text('[store]\npath = ".other"\n')
    assert build(proj)["counts"] == {"built": 4}  # a new, empty store
    time.sleep(0.2)
    build(proj)
    data = settled(proj)
    assert fast(data), data["io"]["noop_miss"]
    assert list((proj / ".other" / "noop").glob("*.stamp"))
