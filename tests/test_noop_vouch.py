"""The full path after an edit, with the stale no-op stamp's word for unchanged nodes
(`noop.vouch`): a node whose key is the one the stamp recorded, whose blobs and build/
files and folders are as the stamp shows them, is a hit without checking them again. The
answer must be the full path's (MOPT_NO_VOUCH=1 turns vouching off), and anything changed
in the store or build/ takes the full check and is repaired."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def build(p: Path, env: dict[str, str] | None = None, *args: str) -> dict:
    proc = run_mopt("build", "r.toml", "--json", "--no-check", *args, cwd=p, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stamped(p: Path) -> None:
    """Built, and a stamp (with its vouch file) written by a build whose files had settled:
    the racy window (files changed within 0.2 s are stamped next time) has passed."""
    build(p)
    for _ in range(4):
        time.sleep(0.25)
        data = build(p)
        if list((p / ".mopt" / "noop").glob("*.stamp.vouch")):
            return
    raise AssertionError(f"no stamp with a vouch file: {data['io']}")


def edit(p: Path, extra: str = "") -> None:
    with open(p / "r.toml", "a") as fh:
        fh.write(f"\n# edited {time.time_ns()}\n{extra}")
    # past the racy window: a build that reads the recipe within 0.2 s of its change writes
    # no stamp (it may change again unseen), and the tests here look at the stamp it writes
    time.sleep(0.25)


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


def test_a_vouched_build_answers_as_the_full_path(proj: Path) -> None:
    stamped(proj)
    before = tree(proj)
    edit(proj)
    vouched = build(proj)
    assert vouched["io"]["vouched"] == 4, vouched["io"]
    assert vouched["counts"] == {"cached": 4}
    assert "changed: " in vouched["io"]["noop_miss"] and "r.toml" in vouched["io"]["noop_miss"]
    assert tree(proj) == before
    # the stamp it patched holds: the next build is the no-op
    assert build(proj)["io"].get("noop_stamp")
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2:
        # on one CPU nothing is forked: the stamp's files are compared in this process
        edit(proj)
        proc = subprocess.run(
            ["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m", "mopt", "build", "r.toml",
             "--json", "--no-check"],
            cwd=proj, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        one_cpu = json.loads(proc.stdout)
        assert one_cpu["io"]["vouched"] == 4, one_cpu["io"]
        same_answer(vouched, one_cpu)
    edit(proj)
    full = build(proj, {"MOPT_NO_VOUCH": "1"})
    assert full["io"]["vouched"] == 0
    same_answer(vouched, full)
    assert tree(proj) == before


def test_a_changed_key_is_rebuilt_and_the_rest_vouched_for(proj: Path) -> None:
    stamped(proj)
    edit(proj, '[m2.cpu.b]\nargv = ["sh", "-c", "wc -l < {in}/a > {out}/b"]\n')
    data = build(proj)
    built = {n["id"] for n in data["nodes"] if n["status"] == "built"}
    assert built == {"m2.cpu:b"}
    assert data["io"]["vouched"] == 3
    assert (proj / "build/m2/cpu/b/b").read_text().strip() == "1"
    # the stamp then written (the vouched nodes' files filed as the old stamp showed them)
    # holds for the next build, and an edit after it vouches for every node again
    time.sleep(0.25)
    again = build(proj)
    if not again["io"].get("noop_stamp"):  # written within the racy window: next time
        time.sleep(0.25)
        again = build(proj)
    assert again["io"].get("noop_stamp"), again["io"]
    edit(proj)
    assert build(proj)["io"]["vouched"] == 4


def test_an_input_changed_with_the_recipe_is_digested_again(proj: Path) -> None:
    """The stale stamp's digests of unchanged input files stand in for the stat cache's
    (`Engine.vouched_digests`); a changed one (same size, other bytes) is read again."""
    stamped(proj)
    time.sleep(0.01)
    (proj / "in" / "m1.txt").write_text("HELLO m1\n")
    edit(proj)
    data = build(proj)
    # m1's a reads it; its b reads a's output (other bytes: another key)
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {"m1.cpu:a", "m1.cpu:b"}, data["counts"]
    assert (proj / "build/m1/cpu/a/a").read_text() == "HELLO m1\n"
    assert data["io"]["vouched"] == 2 and data["io"]["hashed_files"] >= 1, data["io"]
    edit(proj)
    full = build(proj, {"MOPT_NO_VOUCH": "1"})
    assert full["counts"] == {"cached": 4}
    same_answer(dict(data, counts=full["counts"], nodes=[dict(n, status="cached") for n in data["nodes"]]), full)


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


def test_a_touch_due_is_taken_on_the_vouched_path_and_the_stamp_records_it(proj: Path) -> None:
    stamped(proj)
    before, files = entry_mtimes(proj), tree(proj)
    time.sleep(0.01)
    edit(proj)
    data = build_touch_due(proj)
    # every entry touched (gc's "last used") without leaving the vouched path
    assert data["io"]["vouched"] == 4 and data["counts"] == {"cached": 4}, data["io"]
    after = entry_mtimes(proj)
    assert set(after) == set(before) and all(after[k] > before[k] for k in before)
    assert tree(proj) == files
    # the patched stamp's vouch file records the entries' new stats: the next edit is
    # vouched for again (the old records would match none of them)
    edit(proj)
    assert build(proj)["io"]["vouched"] == 4
    # the same when a node is rebuilt (the stamp written in full)
    edit(proj, '[m2.cpu.b]\nargv = ["sh", "-c", "wc -l < {in}/a > {out}/b"]\n')
    data = build_touch_due(proj)
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {"m2.cpu:b"}
    assert data["io"]["vouched"] == 3, data["io"]
    time.sleep(0.25)
    again = build(proj)
    if not again["io"].get("noop_stamp"):  # written within the racy window: next time
        time.sleep(0.25)
        again = build(proj)
    edit(proj)
    assert build(proj)["io"]["vouched"] == 4


@pytest.mark.parametrize(
    "damage", ["edit_build_file", "extra_build_file", "remove_blob", "damage_blob", "vouch_file", "stamp"]
)
def test_anything_changed_in_the_store_or_build_takes_the_full_check(proj: Path, damage: str) -> None:
    stamped(proj)
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
    elif damage == "vouch_file":
        vf = next((proj / ".mopt" / "noop").glob("*.stamp.vouch"))
        data = bytearray(vf.read_bytes())
        data[-3] ^= 0xFF
        vf.write_bytes(bytes(data))
    elif damage == "stamp":
        st = next((proj / ".mopt" / "noop").glob("*.stamp"))
        data = bytearray(st.read_bytes())
        data[len(data) // 2] ^= 0xFF
        st.write_bytes(bytes(data))
    edit(proj)
    got = build(proj)
    assert got["io"]["vouched"] == 0, got["io"]
    assert {n["id"] for n in got["nodes"]} == NODES
    assert all(n["status"] in ("cached", "built") for n in got["nodes"])
    assert tree(proj) == want  # repaired
    if damage == "damage_blob":
        assert any(n["status"] == "built" for n in got["nodes"])  # its blob's bytes were wrong
    if damage == "edit_build_file":  # and the stamp then written vouches again after an edit
        time.sleep(0.25)
        build(proj)
        edit(proj)
        assert build(proj)["io"]["vouched"] == 4


def plan(p: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = run_mopt("plan", "r.toml", *args, cwd=p, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_plan_after_an_edit_is_the_full_paths(proj: Path) -> None:
    stamped(proj)
    edit(proj, '[m2.cpu.b]\nargv = ["sh", "-c", "wc -l < {in}/a > {out}/b"]\n')
    for args in ((), ("--json",)):
        assert plan(proj, *args) == plan(proj, *args, env={"MOPT_NO_VOUCH": "1"})
    assert "up to date" in plan(proj) and "argv" in plan(proj)
    # it was answered with the stamp's word (the same checks `mopt plan` makes, in-process)
    code = (
        "from pathlib import Path\n"
        "from mopt import planstamp\n"
        "from mopt.cli import Session\n"
        "from mopt.build import Engine, _plan_vouched\n"
        "assert planstamp.lookup('r.toml', []) is None\n"
        "s = Session(Path('r.toml'))\n"
        "e = Engine(s, read_only=True)\n"
        "_plan_vouched(e)\n"
        "r = e.plan(s.graph.select([]))\n"
        "print(e.vouched_n, sorted(i for i, x in r.items() if x['state'] == 'up-to-date'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=proj, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 1)[0] == "3"
    assert "'m1.cpu:a', 'm1.cpu:b', 'm2.cpu:a'" in out.stdout
    # a plan checks no build/ file: a hand-edited one still vouches; a damaged blob does not
    target = proj / "build/m1/cpu/a/a"
    os.chmod(target, 0o644)
    target.write_text("hand edited\n")
    assert plan(proj, "--json") == plan(proj, "--json", env={"MOPT_NO_VOUCH": "1"})
