"""The build log (`mopt.buildlog`): its one rule for a recorded file, and the full path that
takes a node from it (key recorded, entry file and blobs as recorded) or asks the store.

Every behaviour of a build is checked both ways: with the log, and with `--no-log` (the full
path: every hit checked in the store); the answers must be the same."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mopt import buildlog
from mopt.digest import hash_bytes, hash_file, mode_of
from mopt.filehash import file_stat
from tests.conftest import run_mopt

RECIPE = """\
schema = 1

[defaults]
targets = ["a", "b"]

[defaults.a]
kind = "command"
files = ["in/{model}.txt"]
argv = ["sh", "-c", "cat {file} > {out}/a"]

[defaults.b]
kind = "command"
input = "a"
argv = ["sh", "-c", "wc -c < {in}/a > {out}/b"]

[models.m1]
[m1.cpu]

[models.m2]
[m2.cpu]
"""

NODES = {"m1.cpu:a", "m1.cpu:b", "m2.cpu:a", "m2.cpu:b"}


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    for m in ("m1", "m2"):
        (tmp_path / "in" / f"{m}.txt").write_text(f"hello {m}\n")
    (tmp_path / "r.toml").write_text(RECIPE)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    return tmp_path


def build(p: Path, *args: str, env: dict[str, str] | None = None, recipe: str = "r.toml") -> dict:
    proc = run_mopt("build", recipe, "--json", "--no-check", *args, cwd=p, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def edit(p: Path, extra: str = "") -> None:
    with open(p / "r.toml", "a") as fh:
        fh.write(f"\n# edited {time.time_ns()}\n{extra}")


def tree(p: Path) -> dict[str, tuple[int, bytes]]:
    """build/ as (mode, bytes) per file, and each folder's mode."""
    out: dict[str, tuple[int, bytes]] = {}
    for root, dirs, files in os.walk(p / "build"):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), p) + "/"] = (stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode), b"")
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, p)] = (stat.S_IMODE(os.stat(full).st_mode), Path(full).read_bytes())
    return out


def same_answer(a: dict, b: dict) -> None:
    assert a["counts"] == b["counts"]
    assert a["build_dir"] == b["build_dir"] and a["recipe"] == b["recipe"]
    assert a["nodes"] == b["nodes"]


# --------------------------------------------------------------------------- the rule, file by file


def _log(tmp_path: Path, files: list[tuple[Path, tuple[str, int] | None, bool, bool]]) -> None:
    """Write a log of `files` (path, digest, touchable, recorded as racy)."""
    w = buildlog.Writer()
    for path, digest, touchable, racy in files:
        st = file_stat(os.stat(path))
        assert w.file(str(path), st, digest, touchable=touchable, taken=st[4] if racy else None) is not None
    w.save(str(tmp_path / "store" / "log" / "x.log"), ident=("r", (), False), store=str(tmp_path / "store"),
           env=buildlog.environment(), env_names=[], absent=[], noop="",
           result={"recipe": "r", "ids": [], "selected": [], "build_dir": "b"})


def _check(tmp_path: Path) -> tuple[str, buildlog.Log]:
    """(why the log of `_log` does not hold now, "" if it does; the log as read)."""
    log = buildlog.load(str(tmp_path / "store" / "log" / "x.log"), ("r", (), False), str(tmp_path / "store"))
    assert isinstance(log, buildlog.Log), log
    return log.why_not(str(tmp_path / "store")), log


def _digest(p: Path) -> tuple[str, int]:
    return hash_file(p), mode_of(os.stat(p).st_mode)


def test_a_recorded_file_holds_while_its_stat_is_the_one_recorded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    old = time.time_ns() - 10**9
    os.utime(f, ns=(old, old))
    time.sleep(0.25)  # its ctime (set by utime) out of the racy window
    _log(tmp_path, [(f, None, False, False)])
    why, log = _check(tmp_path)
    assert why == "" and log.hashed == [0, 0]
    for change in ("touch", "edit"):
        _log(tmp_path, [(f, _digest(f), False, False)])
        if change == "touch":
            os.utime(f)
        else:
            f.write_text("y")
        # not touchable (a blob, a build/ file): any new stat is a change
        assert _check(tmp_path)[0] == f"changed: {f}"


def test_a_touched_head_file_is_rehashed_and_holds_with_the_same_bytes(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("schema = 1\n")
    _log(tmp_path, [(f, _digest(f), True, False)])
    os.utime(f, ns=(time.time_ns() - 10**9, time.time_ns() - 10**9))
    why, log = _check(tmp_path)
    assert why == "" and log.hashed[0] == 1
    assert list(log.learnt) == [0]
    f.chmod(0o755)  # the mode is part of what is recorded: an executable input is another input
    _log(tmp_path, [(f, (hash_file(f), 0o644), True, False)])
    assert _check(tmp_path)[0] == f"changed: {f}"


def test_a_file_recorded_within_the_racy_window_is_checked_by_its_digest(tmp_path: Path) -> None:
    """A change within the same timestamp tick keeps the stat: a file recorded that close to
    its last change holds only if its bytes are the recorded ones (git's racily clean rule)."""
    f = tmp_path / "out"
    f.write_text("built")
    _log(tmp_path, [(f, _digest(f), False, True)])
    why, log = _check(tmp_path)
    assert why == "" and log.hashed[0] == 1
    # the same stat, other bytes than recorded: what a rewrite within the tick looks like
    _log(tmp_path, [(f, (hash_bytes(b"other"), 0o644), False, True)])
    assert _check(tmp_path)[0] == f"changed: {f}"
    # and one with no digest to check it by is not recorded at all
    w = buildlog.Writer()
    assert w.file(str(f), file_stat(os.stat(f)), None, taken=os.stat(f).st_ctime_ns) is None


def test_a_folder_recorded_within_the_racy_window_is_checked_by_its_listing(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "a").write_text("a")
    _log(tmp_path, [(d, (hash_bytes(b"a"), 0), False, True)])
    assert _check(tmp_path)[0] == ""
    _log(tmp_path, [(d, (hash_bytes(b"a\0b"), 0), False, True)])
    assert _check(tmp_path)[0] == f"changed: {d}"


def test_learning_records_the_new_stat_so_the_next_check_hashes_nothing(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("schema = 1\n")
    _log(tmp_path, [(f, _digest(f), True, False)])
    past = time.time_ns() - 10**9
    os.utime(f, ns=(past, past))
    time.sleep(0.25)  # the new ctime out of the racy window: it can be learnt
    why, log = _check(tmp_path)
    assert why == ""
    log.learn()
    why, again = _check(tmp_path)
    assert why == "" and again.hashed == [0, 0]


_FORKED = """
import json, os, sys
from mopt import buildlog
from mopt.filehash import file_stat
buildlog.FORK_MIN = 8
forks = []
real = buildlog._fork
def counted(work):
    got = real(work)
    forks.extend([got] if got is not None else [])
    return got
buildlog._fork = counted
root, mode = sys.argv[1], sys.argv[2]
files = [os.path.join(root, "f", f"f{i}") for i in range(20)]
log = os.path.join(root, "store", "log", "x.log")
if mode == "write":
    w = buildlog.Writer()
    for f in files:
        w.file(f, file_stat(os.stat(f)))
    w.save(log, ident=("r", (), False), store=os.path.join(root, "store"), env=buildlog.environment(),
           env_names=[], absent=[], noop="", result={})
else:
    got = buildlog.load(log, ("r", (), False), os.path.join(root, "store")).why_not(os.path.join(root, "store"))
    print(json.dumps({"forked": len(forks), "why": got}))
"""


@pytest.mark.parametrize("change", ["none", "edit_second_half", "delete_second_half", "edit_first_half"])
def test_stats_taken_by_the_forked_half_miss_like_the_rest(tmp_path: Path, change: str) -> None:
    """From FORK_MIN files on, a forked child stats the second half (where two CPUs and one
    thread allow): a change there is a miss naming the file, exactly as one in the first."""
    (tmp_path / "f").mkdir()
    for i in range(20):
        (tmp_path / "f" / f"f{i}").write_text(f"{i}")
    past = time.time_ns() - 10**9
    for i in range(20):
        os.utime(tmp_path / "f" / f"f{i}", ns=(past, past))
    time.sleep(0.25)  # their ctimes out of the racy window

    def run(mode: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path), mode], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout) if mode == "check" else {}

    run("write")
    target = {"none": None, "edit_second_half": 17, "delete_second_half": 19, "edit_first_half": 2}[change]
    if target is not None:
        f = tmp_path / "f" / f"f{target}"
        if change.startswith("delete"):
            f.unlink()
        else:
            f.write_text("changed")
    got = run("check")
    if len(os.sched_getaffinity(0)) >= 2:
        assert got["forked"] == 1
    assert got["why"] == ("" if target is None else f"changed: {tmp_path / 'f' / f'f{target}'}")


# --------------------------------------------------------------------------- builds


def test_an_edit_takes_every_node_from_the_log_and_answers_as_the_full_path(proj: Path) -> None:
    build(proj)
    before = tree(proj)
    edit(proj)
    logged = build(proj)
    assert logged["io"]["logged"] == 4 and logged["counts"] == {"cached": 4}, logged["io"]
    assert logged["io"]["noop_miss"] == f"changed: {proj / 'r.toml'}"
    assert tree(proj) == before
    assert build(proj)["io"].get("noop")  # the log it wrote holds: the next build is the no-op
    edit(proj)
    full = build(proj, "--no-log")
    assert full["io"]["logged"] == 0 and full["io"]["log_miss"] == "--no-log"
    same_answer(logged, full)
    assert tree(proj) == before


def test_a_changed_key_is_rebuilt_and_the_rest_taken_from_the_log(proj: Path) -> None:
    build(proj)
    edit(proj, '[m2.cpu.b]\nargv = ["sh", "-c", "wc -l < {in}/a > {out}/b"]\n')
    data = build(proj)
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {"m2.cpu:b"}
    assert data["io"]["logged"] == 3
    assert (proj / "build/m2/cpu/b/b").read_text().strip() == "1"
    again = build(proj)
    assert again["io"].get("noop"), again["io"]
    edit(proj)
    assert build(proj)["io"]["logged"] == 4


def test_an_input_changed_with_the_recipe_is_read_again(proj: Path) -> None:
    build(proj)
    time.sleep(0.01)
    (proj / "in" / "m1.txt").write_text("HELLO m1\n")  # the same size
    edit(proj)
    data = build(proj)
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {"m1.cpu:a", "m1.cpu:b"}, data["counts"]
    assert (proj / "build/m1/cpu/a/a").read_text() == "HELLO m1\n"
    assert data["io"]["logged"] == 2 and data["io"]["hashed_files"] >= 1, data["io"]


def build_touch_due(p: Path) -> dict:
    """`build` with every entry's last-use touch due (gc's LRU: 10 minutes after the last)."""
    code = (
        "import sys, mopt.store; mopt.store.TOUCH_AFTER_S = -1.0; "
        "sys.argv = ['mopt', 'build', 'r.toml', '--json', '--no-check']; "
        "from mopt.__main__ import main; main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=p, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def entry_mtimes(p: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mtime_ns for f in (p / ".mopt" / "ac").rglob("*.json")}


def test_a_touch_due_is_taken_from_the_log_and_recorded(proj: Path) -> None:
    build(proj)
    before, files = entry_mtimes(proj), tree(proj)
    time.sleep(0.01)
    edit(proj)
    data = build_touch_due(proj)
    # every entry touched (gc's "last used") without leaving the log's way
    assert data["io"]["logged"] == 4 and data["counts"] == {"cached": 4}, data["io"]
    after = entry_mtimes(proj)
    assert set(after) == set(before) and all(after[k] > before[k] for k in before)
    assert tree(proj) == files
    # the log records the entries' new stats: the next build is a no-op, an edit logged again
    assert build(proj)["io"].get("noop")
    edit(proj)
    assert build(proj)["io"]["logged"] == 4


@pytest.mark.parametrize("damage", ["edit_build_file", "extra_build_file", "remove_blob", "damage_blob", "log"])
def test_anything_changed_in_the_store_or_build_is_checked_and_repaired(proj: Path, damage: str) -> None:
    build(proj)
    want = tree(proj)
    cas = proj / ".mopt" / "cas"
    target = proj / "build/m1/cpu/a/a"
    if damage == "edit_build_file":
        os.chmod(target, 0o644)
        target.write_text("hand edited\n")
    elif damage == "extra_build_file":
        os.chmod(target.parent, 0o755)
        (target.parent / "extra").write_text("x\n")
        os.chmod(target.parent, 0o555)
    elif damage in ("remove_blob", "damage_blob"):
        blob = next(b for b in cas.glob("*/*") if b.read_bytes() == target.read_bytes())
        if damage == "remove_blob":
            blob.unlink()
        else:
            os.chmod(blob, 0o644)
            blob.write_bytes(b"X" * blob.stat().st_size)
            os.chmod(blob, 0o444)
    else:
        (log,) = (proj / ".mopt" / "log").glob("*.log")
        data = bytearray(log.read_bytes())
        data[len(data) // 2] ^= 0xFF
        log.write_bytes(bytes(data))
    edit(proj)
    got = build(proj)
    assert {n["id"] for n in got["nodes"]} == NODES
    assert all(n["status"] in ("cached", "built") for n in got["nodes"])
    assert tree(proj) == want  # repaired
    if damage in ("remove_blob", "damage_blob"):
        assert any(n["status"] == "built" for n in got["nodes"])  # its blob's bytes were wrong or gone
    if damage == "log":
        assert got["io"]["logged"] == 0 and got["io"]["log_miss"] == "unreadable log"
    assert build(proj)["io"].get("noop")  # and the log then written holds


def plan(p: Path, *args: str, env: dict[str, str] | None = None, recipe: str = "r.toml") -> str:
    proc = run_mopt("plan", recipe, *args, cwd=p, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_plan_after_an_edit_answers_as_the_full_path_and_writes_nothing(proj: Path) -> None:
    build(proj)
    edit(proj, '[m2.cpu.b]\nargv = ["sh", "-c", "wc -l < {in}/a > {out}/b"]\n')
    def files() -> dict[str, int]:  # (SQLite's own -wal and -shm files come and go with a reader)
        return {str(f): f.stat().st_mtime_ns for f in (proj / ".mopt").rglob("*") if f.is_file() and "-" not in f.name}

    store = files()
    for args in ((), ("--json",)):
        assert plan(proj, *args) == plan(proj, "--no-log", *args)
    text = plan(proj)
    assert "up to date" in text and "argv" in text
    assert files() == store


def test_two_recipes_in_one_folder_never_show_each_others_bytes(proj: Path) -> None:
    """Two recipes with the same model, section and target names lay out into the same
    build/ folder; each build lays out its own bytes again, and plan says when the folder
    holds the other recipe's."""
    other = RECIPE.replace("cat {file} > {out}/a", "tr a-z A-Z < {file} > {out}/a")
    (proj / "other.toml").write_text(other)
    build(proj)
    assert (proj / "build/m1/cpu/a/a").read_text() == "hello m1\n"
    build(proj, recipe="other.toml")
    assert (proj / "build/m1/cpu/a/a").read_text() == "HELLO M1\n"
    stale = plan(proj)
    assert "holds other bytes" in stale and "up to date" in stale
    assert "holds other bytes" in plan(proj, "--no-log")
    shown = run_mopt("show", "r.toml", "m1.cpu:a", cwd=proj)
    assert shown.returncode == 0 and "does not hold these bytes" in shown.stdout
    again = build(proj)
    assert not again["io"].get("noop") and again["counts"] == {"cached": 4}
    assert (proj / "build/m1/cpu/a/a").read_text() == "hello m1\n"
    assert "holds other bytes" not in plan(proj)
    shown = run_mopt("show", "r.toml", "m1.cpu:a", "--json", cwd=proj)
    assert shown.returncode == 0, shown.stderr
    (f,) = json.loads(shown.stdout)["files"]
    assert f["digest"] == hash_file(proj / "build/m1/cpu/a/a") and json.loads(shown.stdout)["laid_out"]


def test_a_touched_input_settled_by_the_noop_is_not_hashed_again_after_an_edit(proj: Path) -> None:
    build(proj)
    time.sleep(0.25)
    assert build(proj)["io"]["hashed_files"] > 0  # the first build's own writes, checked by digest once
    past = time.time_ns() - 10**9
    os.utime(proj / "in" / "m1.txt", ns=(past, past))
    time.sleep(0.25)  # its new ctime out of the racy window: the no-op can learn it
    data = build(proj)
    assert data["io"].get("noop") and data["io"]["hashed_files"] == 1, data["io"]
    edit(proj)
    after = build(proj)
    assert after["counts"] == {"cached": 4} and after["io"]["hashed_files"] == 0, after["io"]


def test_a_stamp_left_in_the_default_store_does_not_shadow_the_configured_one(proj: Path) -> None:
    """The no-op looks for the log in the default store first (without parsing mopt.toml); a
    log left there by earlier settings misses, and the configured store's log holds."""
    build(proj)
    assert build(proj)["io"].get("noop")
    (proj / "mopt.toml").write_text('[store]\npath = ".other"\n')
    assert build(proj)["counts"] == {"built": 4}  # a new, empty store
    data = build(proj)
    assert data["io"].get("noop"), data["io"]["noop_miss"]
    assert list((proj / ".other" / "log").glob("*.log"))


def test_after_an_edit_only_the_plugins_the_last_build_used_are_loaded(proj: Path) -> None:
    """The log names the plugins its build used; while no module file or sys.path folder it
    recorded changed, the next build loads only those (here: none but the built-ins). A recipe
    that then names another plugin's kind loads every plugin, as it would have anyway."""
    first = build(proj)
    assert "fixture" in first["io"]["plugins"]  # no log yet: every plugin
    edit(proj)
    assert build(proj)["io"]["plugins"] == []  # `command` is built in
    edit(proj)
    assert "fixture" in build(proj, "--no-log")["io"]["plugins"]
    # another plugin's kind (the fixture's), named in the recipe now
    (proj / "toy-model").mkdir()
    (proj / "toy-model" / "config.json").write_text("{}")
    (proj / "toy-model" / "w.bin").write_bytes(b"w")
    with open(proj / "r.toml", "a") as fh:
        fh.write('\n[models.toy]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n[toy.cpu]\ntargets = ["toy-weights"]\n')
    data = build(proj)
    assert "fixture" in data["io"]["plugins"]
    assert {n["id"] for n in data["nodes"]} == NODES | {"toy.cpu:toy-weights"}
    edit(proj)
    assert build(proj)["io"]["plugins"] == ["fixture"]
