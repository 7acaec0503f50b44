"""Issue #13, the store half: each case reproduced through the real CLI, from an empty folder.

Every test asserts the exit code, that stderr holds no traceback, that nothing outside the
project and its store changed (a sentinel folder beside the project, and its parent), and
that the store checker (tests/storecheck.py, which does not import mopt) passes afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TOY_MODEL, run_mopt
from tests.storecheck import check_store

TOY = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[toy.cpu]
hardware = "cpu"
targets = ["toy-weights", "toy-export"]
"""

# a second weights target: its output holds the same weights.bin and config.json bytes
W16 = (
    TOY.replace('"toy-export"]', '"toy-export", "w16"]')
    + '[toy.cpu.w16]\nkind = "toy-weights"\ndtype = "fp16"\n[toy.cpu.toy-export]\ninput = "toy-weights"\n'
)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _can_unshare(), reason="needs root and `unshare -m` (private mounts)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to own a store as another uid)")


class World:
    """tmp/proj (the project, with its store .mopt and build/) beside tmp/victim (a sentinel)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proj = root / "proj"
        self.victim = root / "victim"
        shutil.copytree(TOY_MODEL, self.proj / "toy-model")
        (self.proj / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
        (self.proj / "r.toml").write_text(TOY)
        self.victim.mkdir()
        (self.victim / "precious.txt").write_text("do not touch\n")
        (self.victim / "sub").mkdir()
        (self.victim / "sub" / "more.txt").write_text("nor this\n")
        self.before = self.outside()

    @property
    def store(self) -> Path:
        return self.proj / ".mopt"

    @property
    def build_dir(self) -> Path:
        return self.proj / "build"

    def outside(self) -> dict[str, tuple[int, int, str]]:
        """Everything under tmp/ but outside the project: mode, mtime and bytes of each."""
        snap: dict[str, tuple[int, int, str]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root:  # the project, and what a test adds beside it on purpose
                dirnames[:] = [d for d in dirnames if d != "proj" and not d.startswith("extra-")]
                filenames = [f for f in filenames if not f.startswith("extra-")]
            for name in dirnames + filenames:
                p = Path(dirpath, name)
                st = p.lstat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
                snap[str(p.relative_to(self.root))] = (st.st_mode, st.st_mtime_ns, digest)
        return snap

    def mopt(self, *args: str, code: int | None = 0, cwd: Path | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
        proc = run_mopt(*args, cwd=cwd or self.proj, **kw)  # type: ignore[arg-type]
        assert "Traceback" not in proc.stderr, proc.stderr
        if code is not None:
            assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def build(self, *args: str, code: int = 0, recipe: str = "r.toml", **kw: object) -> dict:
        proc = self.mopt("build", recipe, "--json", "--no-check", *args, code=code, **kw)
        data = json.loads(proc.stdout)
        data["stderr"] = proc.stderr
        return data

    def check(self, store: Path | None = None, build_dir: Path | None = None, *, with_build: bool = True) -> None:
        """Nothing outside changed, and the store (and build/, unless gc emptied the store
        under it on purpose) passes the checker."""
        assert self.outside() == self.before, "something outside the project changed"
        store = store or self.store
        if store.exists():  # no store: nothing was ever stored (a recipe refused up front)
            assert check_store(store, (build_dir or self.build_dir) if with_build else None) == []


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    world = World(tmp_path)
    yield world
    # a test may leave folders read-only: let pytest clean up
    for dirpath, dirnames, _files in os.walk(tmp_path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755)


def statuses(data: dict) -> dict[str, str]:
    return {n["id"]: n["status"] for n in data["nodes"]}


def blob(store: Path, digest: str) -> Path:
    return store / "cas" / digest[:2] / digest


def entries(store: Path) -> dict[str, dict]:
    return {json.loads(p.read_bytes())["target"]: json.loads(p.read_bytes()) for p in store.glob("ac/*.json")}


def manifest(store: Path, tree: str) -> list[list]:
    return json.loads(blob(store, tree).read_bytes())["entries"]


def damage(p: Path) -> None:
    """Flip the first byte in place (same size, same inode), leaving the mode as it was."""
    mode = p.stat().st_mode
    os.chmod(p, 0o644)
    data = p.read_bytes()
    p.write_bytes(bytes([data[0] ^ 0x20]) + data[1:])
    os.chmod(p, mode)


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# ----------------------------------------------------------------------------- case 1: names


@pytest.mark.parametrize(
    ("recipe", "where"),
    [
        (
            TOY.replace('targets = ["toy-weights", "toy-export"]', 'targets = ["../../../victim"]')
            + '[toy.cpu."../../../victim"]\nkind = "command"\nargv = ["sh", "-c", "echo x > {out}/x"]\n',
            "[toy.cpu] targets",
        ),
        (TOY.replace("[models.toy]", '[models."/abs/path"]').replace("[toy.cpu]", '["/abs/path".cpu]'), "[models]"),
        (TOY.replace("[models.toy]", '[models."../../escape"]').replace("[toy.cpu]", '["../../escape".cpu]'), "[models]"),
        (TOY.replace("[toy.cpu]", '[toy."../../victim"]'), "[toy]"),
        (TOY.replace("[toy.cpu]", '[toy.".hidden"]'), "[toy]"),
    ],
    ids=["target-dotdot", "model-absolute", "model-dotdot", "section-dotdot", "section-leading-dot"],
)
def test_case1_unsafe_names_are_exit_2_and_touch_nothing(w: World, recipe: str, where: str) -> None:
    (w.proj / "r.toml").write_text(recipe)
    for cmd in ("build", "plan"):
        proc = w.mopt(cmd, "r.toml", "--no-check", code=2) if cmd == "build" else w.mopt(cmd, "r.toml", code=2)
        line = one_line_error(proc.stderr)
        assert "r.toml" in line and where in line and "not a safe name" in line, line
    assert not w.build_dir.exists()
    w.check()


def test_case1_dotted_model_names_get_their_own_folders(w: World) -> None:
    (w.proj / "r.toml").write_text(
        TOY.replace("[models.toy]", '[models."qwen2.5-0.5b"]').replace("[toy.cpu]", '["qwen2.5-0.5b".cpu]')
    )
    data = w.build()
    assert set(statuses(data).values()) == {"built"}
    assert (w.build_dir / "qwen2.5-0.5b" / "cpu" / "toy-export" / "model.txt").is_file()
    assert not (w.build_dir / "qwen2").exists()
    show = json.loads(w.mopt("show", "r.toml", "qwen2.5-0.5b.cpu:toy-export", "--json").stdout)
    assert show["path"] == str(w.build_dir / "qwen2.5-0.5b" / "cpu" / "toy-export")
    ls = json.loads(w.mopt("ls", "r.toml", "--json").stdout)
    assert {a["path"] for a in ls["artifacts"]} == {
        str(w.build_dir / "qwen2.5-0.5b" / "cpu" / t) for t in ("toy-weights", "toy-export")
    }
    w.check()


def test_case1_section_ids_that_collide_are_an_error(w: World) -> None:
    (w.proj / "r.toml").write_text(
        TOY.replace("[toy.cpu]", '["a.b".c]').replace("[models.toy]", '[models."a.b"]')
        + '\n[models.a]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'
        + '[a."b.c"]\nhardware = "cpu"\ntargets = ["toy-weights"]\n'
    )
    line = one_line_error(w.mopt("build", "r.toml", "--no-check", code=2).stderr)
    assert "both have the id a.b.c" in line, line
    w.mopt("plan", "r.toml", code=2)
    w.check()


def test_case1_a_planted_link_in_build_cannot_redirect_writes(w: World) -> None:
    w.build_dir.mkdir()
    (w.build_dir / "toy").symlink_to(w.victim)
    proc = w.mopt("build", "r.toml", "--no-check", code=None)
    assert proc.returncode == 1, proc.stderr
    assert "outside the store and the build folder" in proc.stderr
    assert sorted(p.name for p in w.victim.iterdir()) == ["precious.txt", "sub"]
    (w.build_dir / "toy").unlink()
    w.build()
    w.check()


# ----------------------------------------------------------------------------- case 3: dedup


def test_case3_a_damaged_blob_is_not_reused_by_a_new_target(w: World) -> None:
    w.build()
    weights = next(e for e in manifest(w.store, entries(w.store)["toy.cpu:toy-weights"]["outputs_tree"])
                   if e[0] == "weights.bin")
    damage(blob(w.store, weights[3]))
    # a new target whose output holds the same bytes (another dtype changes only manifest.json)
    (w.proj / "r.toml").write_text(
        W16
    )
    data = w.build("toy.cpu:w16")
    assert statuses(data)["toy.cpu:w16"] == "built"
    got = (w.build_dir / "toy" / "cpu" / "w16" / "weights.bin").read_bytes()
    assert got == (w.proj / "toy-model" / "weights.bin").read_bytes()
    w.check()


# ----------------------------------------------------------------------------- case 4: build/ edits


def test_case4_editing_a_build_file_never_edits_the_blob_and_is_repaired(w: World) -> None:
    (w.proj / "r.toml").write_text(
        W16
    )
    w.build()
    mine = w.build_dir / "toy" / "cpu" / "toy-weights" / "config.json"
    other = w.build_dir / "toy" / "cpu" / "w16" / "config.json"
    original = mine.read_bytes()
    other_stat = other.stat()
    os.chmod(mine.parent, 0o755)
    os.chmod(mine, 0o644)
    mine.write_bytes(b'{"edited": true}')
    # the blob and the other target's file (the same bytes) are untouched
    assert other.read_bytes() == original
    assert check_store(w.store) == []
    data = w.build()
    assert set(statuses(data).values()) == {"cached"}
    assert mine.read_bytes() == original
    after = other.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        other_stat.st_ino,
        other_stat.st_mtime_ns,
        other_stat.st_ctime_ns,
    ), "the other target's folder was rewritten"
    w.check()


# ----------------------------------------------------------------------------- case 5: manifests


def test_case5_a_corrupt_tree_manifest_is_replaced_and_the_action_rebuilt(w: World) -> None:
    w.build()
    tree = entries(w.store)["toy.cpu:toy-export"]["outputs_tree"]
    damage(blob(w.store, tree))
    data = w.build()
    assert statuses(data)["toy.cpu:toy-export"] == "built"
    assert set(statuses(w.build()).values()) == {"cached"}
    w.check()


# ----------------------------------------------------------------------------- case 6: gc


def test_case6_lock_files_pin_even_under_a_folder_named_build(tmp_path: Path) -> None:
    w = World(tmp_path / "build" / ".git")  # names that disabled every lock file before
    w.build()
    lock = w.proj / "mopt.lock"
    assert lock.stat().st_mode & 0o777 == 0o644
    rep = json.loads(w.mopt("gc", "--max-size", "0", "--json").stdout)
    assert rep["kept_by_lock_files"] == 2 and rep["removed_entries"] == 0
    assert set(statuses(w.build()).values()) == {"cached"}
    w.check()


@pytest.mark.parametrize("bad", ["not json", '{"recipes": []}', "dir"])
def test_case6_an_unreadable_lock_file_stops_gc_unless_forced(w: World, bad: str) -> None:
    w.build()
    lock = w.proj / "mopt.lock"
    n = len(list(w.store.glob("ac/*.json")))
    lock.unlink()
    if bad == "dir":
        lock.mkdir()
    else:
        lock.write_text(bad)
    line = one_line_error(w.mopt("gc", "--max-size", "0", code=2).stderr)
    assert str(lock) in line and "--force" in line, line
    assert len(list(w.store.glob("ac/*.json"))) == n
    proc = w.mopt("gc", "--max-size", "0", "--force", "--json")
    assert json.loads(proc.stdout)["removed_entries"] == n
    assert str(lock) in proc.stderr
    w.check(with_build=False)


def test_case6_projects_sharing_a_store_see_each_others_lock_files(w: World, tmp_path: Path) -> None:
    shared = tmp_path / "extra-shared-store"
    (w.proj / "mopt.toml").write_text(f'[store]\npath = "{shared}"\n')
    other = tmp_path / "extra-other"
    shutil.copytree(w.proj, other, ignore=shutil.ignore_patterns("build", ".mopt"))
    (other / "r.toml").write_text(TOY.replace('"toy-export"]', '"toy-export"]\n[toy.cpu.toy-export]\nopset = 13'))
    w.build()
    w.build(cwd=other)
    mine = {k for k in (json.loads((w.proj / "mopt.lock").read_text())["recipes"]["r.toml"]["artifacts"].values())}
    roots = sorted(os.readlink(p) for p in (shared / "roots").iterdir())
    assert roots == sorted([str(w.proj / "mopt.lock"), str(other / "mopt.lock")])
    # gc from the other project keeps what this one pinned
    w.mopt("gc", "--max-size", "0", cwd=other)
    assert mine <= {p.stem for p in shared.glob("ac/*.json")}
    assert set(statuses(w.build()).values()) == {"cached"}
    # once a project's lock file is gone, its root is pruned and its entries may go
    (w.proj / "mopt.lock").unlink()
    w.mopt("gc", "--max-size", "0", cwd=other)
    assert [os.readlink(p) for p in (shared / "roots").iterdir()] == [str(other / "mopt.lock")]
    assert not (mine - {json.loads((other / "mopt.lock").read_text())["recipes"]["r.toml"]["artifacts"][
        "toy.cpu:toy-weights"]}) & {p.stem for p in shared.glob("ac/*.json")}
    w.check(store=shared, with_build=False)


def test_case6_gc_beside_a_running_build_keeps_what_the_build_uses(w: World) -> None:
    w.build("--no-lock")  # nothing pinned by a lock file: only the build's own locks keep it
    (w.proj / "r.toml").write_text(TOY + '[toy.cpu.toy-export]\nsleep = 4\n')
    env = dict(os.environ)
    p = subprocess.Popen(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--no-check", "--no-lock", "--json"],
        cwd=w.proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 60
        while not any(w.store.glob("tmp/action-*")) and time.time() < deadline:
            time.sleep(0.05)
        weights = entries(w.store)["toy.cpu:toy-weights"]["key"]
        rep = json.loads(w.mopt("gc", "--max-size", "0", "--json").stdout)
        assert (w.store / "ac" / f"{weights}.json").exists(), rep  # in use by the running build
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "Traceback" not in err
    assert statuses(json.loads(out))["toy.cpu:toy-export"] == "built"
    w.check()
    # with no build running, gc may now take it
    w.mopt("gc", "--max-size", "0")
    assert not (w.store / "ac" / f"{weights}.json").exists()


# ----------------------------------------------------------------------------- case 7: local state


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_case7_a_damaged_state_db_is_moved_aside_with_one_warning(w: World, how: str) -> None:
    w.build()
    db = w.store / "state.db"
    for side in ("state.db-wal", "state.db-shm"):
        (w.store / side).unlink(missing_ok=True)
    if how == "garbage":
        db.write_bytes(os.urandom(8192))
    else:
        with open(db, "r+b") as fh:
            fh.truncate(1000)
    (w.proj / "r.toml").write_text(TOY + "# a change, so the no-op fast path is not taken\n")
    data = w.build()
    assert set(statuses(data).values()) == {"cached"}
    warnings = [ln for ln in data["stderr"].splitlines() if "state.db" in ln]
    assert len(warnings) == 1 and "moved it to" in warnings[0], data["stderr"]
    assert (w.store / "state.db.broken").exists()
    w.mopt("plan", "r.toml")
    w.check()


@pytest.mark.parametrize("shape", ["dir", "json", "types"])
def test_case7_a_malformed_ac_entry_is_a_miss_with_one_warning(w: World, shape: str) -> None:
    w.build()
    path = w.store / "ac" / f"{entries(w.store)['toy.cpu:toy-export']['key']}.json"
    os.chmod(path, 0o644)
    path.unlink()
    if shape == "dir":
        path.mkdir()
    elif shape == "json":
        path.write_text("{oops")
    else:
        path.write_text(json.dumps({"key": 5, "outputs_tree": ["x"]}))
    (w.proj / "r.toml").write_text(TOY + "# changed\n")
    # read-only commands report it and leave it alone
    plan = w.mopt("plan", "r.toml")
    assert "malformed" in plan.stderr
    assert path.exists() and (path.is_dir() == (shape == "dir"))
    data = w.build()
    assert statuses(data)["toy.cpu:toy-export"] == "built"
    assert len([ln for ln in data["stderr"].splitlines() if "malformed" in ln]) == 1, data["stderr"]
    w.check()


@needs_root
def test_case7_a_store_of_another_owner_reads_but_does_not_build(w: World) -> None:
    w.build()
    for dirpath, dirnames, filenames in os.walk(w.store):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), 12345, 12345)
    os.chown(w.store, 12345, 12345)
    (w.proj / "r.toml").write_text(TOY + "# changed\n")
    line = one_line_error(w.mopt("build", "r.toml", "--no-check", code=1).stderr)
    assert str(w.store) in line and "uid 12345" in line, line
    plan = w.mopt("plan", "r.toml", "--json")
    assert {n["status"]["state"] for n in json.loads(plan.stdout)["nodes"]} == {"up-to-date"}
    w.mopt("ls", "r.toml")
    w.mopt("show", "r.toml", "toy.cpu:toy-export")
    # a container running as root on a mounted checkout opts in
    assert set(statuses(w.build(env={"MOPT_STORE_ANY_OWNER": "1"})).values()) == {"cached"}
    w.check()


def _in_private_mounts(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **(env or {}))
    full.pop("MOPT_DISABLE_PLUGINS", None)
    return subprocess.run(["unshare", "-m", "sh", "-e", "-c", script], capture_output=True, text=True,
                          env=full, timeout=300)


@needs_mounts
def test_case7_a_read_only_store_reads_but_does_not_build(w: World) -> None:
    w.build()
    (w.proj / "r.toml").write_text(TOY + "# changed\n")
    py = sys.executable
    proc = _in_private_mounts(
        f"mount --bind {w.store} {w.store}; mount -o remount,bind,ro {w.store}; cd {w.proj};"
        f"{py} -m mopt plan r.toml --json > plan.json; {py} -m mopt ls r.toml > /dev/null;"
        f"{py} -m mopt show r.toml toy.cpu:toy-export > /dev/null;"
        f"{py} -m mopt build r.toml --no-check || echo exit=$?"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "exit=1" in proc.stdout
    line = one_line_error(proc.stderr)
    assert str(w.store) in line and "Read-only file system" in line, line
    assert {n["status"]["state"] for n in json.loads((w.proj / "plan.json").read_text())["nodes"]} == {"up-to-date"}
    w.check()


def _without_log_tail(stderr: str) -> str:
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith("  | "))


@needs_mounts
def test_case7_a_full_disk_names_the_store_and_the_bytes(w: World) -> None:
    big = 3 * 1024 * 1024
    (w.proj / "r.toml").write_text(
        TOY.replace('"toy-export"]', '"toy-export", "big"]')
        + f'[toy.cpu.big]\nkind = "command"\nargv = ["sh", "-c", "head -c {big} /dev/zero > {{out}}/big.bin"]\n'
    )
    py = sys.executable
    # 4 MiB: the action's 3 MiB output fits in its scratch folder, storing a copy does not
    proc = _in_private_mounts(
        f"mkdir -p {w.store}; mount -t tmpfs -o size=4m tmpfs {w.store}; cd {w.proj};"
        f"{py} -m mopt build r.toml --no-check -k || echo exit=$?"
    )
    # (the failed action's log, quoted after "  | ", is the execution path's to shape)
    assert "Traceback" not in _without_log_tail(proc.stderr), proc.stderr
    assert "exit=1" in proc.stdout, proc.stderr
    assert re.search(rf"no space left on the disk of the store {re.escape(str(w.store))} .*3\.0 MiB needed", proc.stderr), proc.stderr
    # and an action that fails for lack of space shows its own error
    (w.proj / "r.toml").write_text(
        TOY.replace('"toy-export"]', '"toy-export", "big"]')
        + '[toy.cpu.big]\nkind = "command"\nargv = ["sh", "-c", "head -c 8000000 /dev/zero > {out}/big.bin"]\n'
    )
    proc = _in_private_mounts(
        f"mkdir -p {w.store}; mount -t tmpfs -o size=4m tmpfs {w.store}; cd {w.proj};"
        f"{py} -m mopt build r.toml --no-check -k || echo exit=$?"
    )
    assert "Traceback" not in _without_log_tail(proc.stderr), proc.stderr
    assert "exit=1" in proc.stdout and "FAILED toy.cpu:big" in proc.stderr, proc.stderr
    assert "No space left on device" in proc.stderr
    w.check(with_build=False)  # the store was a private tmpfs, gone now; build/ outlived it


@needs_mounts
def test_case7_a_read_only_recipe_folder_builds_and_says_so(w: World) -> None:
    rdir = w.proj / "recipes"
    rdir.mkdir()
    (rdir / "r.toml").write_text(TOY.replace('"toy-model"', '"../toy-model"'))
    py = sys.executable
    proc = _in_private_mounts(
        f"mount --bind {rdir} {rdir}; mount -o remount,bind,ro {rdir}; cd {w.proj};"
        f"{py} -m mopt build recipes/r.toml --no-check; echo first-ok;"
        f"{py} -m mopt build recipes/r.toml --no-check --no-lock 2> nolock.err; echo second-ok"
    )
    assert proc.returncode == 0 and "first-ok" in proc.stdout and "second-ok" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if "lock file" in ln]
    assert len(warn) == 1 and "--no-lock" in warn[0] and str(rdir / "mopt.lock") in warn[0], proc.stderr
    assert "lock file" not in (w.proj / "nolock.err").read_text()
    assert (w.build_dir / "toy" / "cpu" / "toy-export" / "model.txt").is_file()
    w.check()


# ----------------------------------------------------------------------------- case 10: read-only commands


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    out = {}
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            if f in ("state.db-shm", "state.db-wal"):
                continue  # SQLite's side files: a reader of a WAL database may create them empty
            p = Path(dirpath, f)
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_mtime_ns, p.read_bytes())
    return out


def test_case10_read_only_commands_never_delete_or_change_anything(w: World) -> None:
    w.build()
    e = entries(w.store)["toy.cpu:toy-weights"]
    damage(blob(w.store, manifest(w.store, e["outputs_tree"])[0][3]))  # really corrupt
    # and a stat-cache row that lies about an intact blob (stat as recorded, digest wrong)
    import sqlite3

    intact = blob(w.store, entries(w.store)["toy.cpu:toy-export"]["outputs_tree"])
    st = intact.stat()
    conn = sqlite3.connect(w.store / "state.db")
    conn.execute("INSERT OR REPLACE INTO stat VALUES (?,?,?,?,?,?,?)",
                 (str(intact), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, "0" * 64))
    conn.commit()
    conn.close()
    before = _snapshot(w.store) | _snapshot(w.build_dir)
    w.mopt("plan", "r.toml")
    w.mopt("plan", "r.toml", "--json")
    w.mopt("ls", "r.toml")
    w.mopt("explain", "r.toml", "toy.cpu:toy-export")
    w.mopt("show", "r.toml", "toy.cpu:toy-export", code=None)
    w.mopt("report", "r.toml", "--json")
    assert _snapshot(w.store) | _snapshot(w.build_dir) == before
    # a build that checks every hit in the store repairs the damaged blob, and rehashes
    # rather than deleting the one the stat cache lied about
    w.build("--no-log")
    assert intact.stat().st_ino == st.st_ino
    w.check()


# ----------------------------------------------------------------------------- case 11: bad input


@pytest.mark.parametrize("depth", [40, 1000])
def test_case11_deep_nesting_is_exit_2(w: World, depth: int) -> None:
    (w.proj / "r.toml").write_text(TOY + "[toy.cpu.toy-export]\nx = " + "[" * depth + "]" * depth + "\n")
    for cmd in (("build", "r.toml", "--no-check"), ("plan", "r.toml")):
        line = one_line_error(w.mopt(*cmd, code=2).stderr)
        assert "r.toml" in line and "nested" in line, line
    w.check()


def test_case11_nul_in_a_name_is_exit_2(w: World) -> None:
    (w.proj / "r.toml").write_text(TOY.replace("[models.toy]", '[models."to\\u0000y"]'))
    line = one_line_error(w.mopt("build", "r.toml", "--no-check", code=2).stderr)
    assert "NUL" in line and "[models]" in line, line
    w.check()


def test_case11_nul_in_a_source_path_and_a_folder_as_the_recipe_are_exit_2(w: World) -> None:
    (w.proj / "r.toml").write_text(TOY.replace('"toy-model"', '"toy\\u0000model"'))
    for cmd in (("build", "r.toml", "--no-check"), ("plan", "r.toml")):
        line = one_line_error(w.mopt(*cmd, code=2).stderr)
        assert "[models.toy] source" in line and "null" in line, line
    (w.proj / "folder.toml").mkdir()
    line = one_line_error(w.mopt("build", "folder.toml", "--no-check", code=2).stderr)
    assert "folder.toml" in line and "Is a directory" in line, line
    w.check()


@pytest.mark.parametrize("bad", ["loop", "dangling", "fifo"])
def test_case11_bad_files_in_a_path_source_are_exit_2(w: World, bad: str) -> None:
    src = w.proj / "toy-model"
    if bad == "loop":
        (src / "sub").mkdir()
        (src / "sub" / "up").symlink_to(src)
    elif bad == "dangling":
        (src / "gone.bin").symlink_to(src / "nowhere")
    else:
        os.mkfifo(src / "pipe")
    line = one_line_error(w.mopt("build", "r.toml", "--no-check", code=2).stderr)
    assert str(src) in line and "source" in line, line
    w.check()


@pytest.mark.parametrize("target", ["/dev/zero", "dangling", "loop"])
def test_case11_a_declared_file_that_is_not_a_file_is_exit_2(w: World, target: str) -> None:
    if target == "dangling":
        (w.proj / "in.txt").symlink_to(w.proj / "nowhere")
        name = "in.txt"
    elif target == "loop":
        (w.proj / "in.txt").symlink_to(w.proj / "in.txt")
        name = "in.txt"
    else:
        name = target
    (w.proj / "r.toml").write_text(
        TOY.replace('"toy-export"]', '"toy-export", "c"]')
        + f'[toy.cpu.c]\nkind = "command"\nfiles = ["{name}"]\nargv = ["sh", "-c", "echo > {{out}}/x"]\n'
    )
    line = one_line_error(w.mopt("build", "r.toml", "--no-check", code=2).stderr)
    # (the kind resolves its declared files, so a dangling link is named by its target)
    shown = {"/dev/zero": "/dev/zero", "dangling": str(w.proj / "nowhere"), "loop": str(w.proj / "in.txt")}
    assert shown[target] in line, line
    w.mopt("plan", "r.toml", code=2)
    w.check()


def test_case11_plan_rejects_what_build_rejects_and_keeps_statuses(w: World, tmp_path: Path) -> None:
    (w.proj / "r.toml").write_text(TOY.replace('source = { path = "toy-model" }\n', ""))
    b = one_line_error(w.mopt("build", "r.toml", "--no-check", code=2).stderr)
    p = one_line_error(w.mopt("plan", "r.toml", code=2).stderr)
    assert "no `source`" in b and "no `source`" in p
    # a source that is only not here yet is a status, exit 0
    (w.proj / "r.toml").write_text(TOY.replace('{ path = "toy-model" }', '{ hf = "org/none", revision = "abc" }'))
    proc = w.mopt("plan", "r.toml", "--json", env={"HF_HUB_CACHE": str(tmp_path / "extra-hf")})
    states = {n["status"]["state"] for n in json.loads(proc.stdout)["nodes"]}
    assert "unavailable" in states
    w.check()


# ----------------------------------------------------------------------------- case 12: scratch, fsync


def test_case12_the_next_build_removes_a_killed_builds_scratch(w: World) -> None:
    (w.proj / "r.toml").write_text(TOY + "[toy.cpu.toy-export]\nsleep = 60\n")
    p = subprocess.Popen([sys.executable, "-m", "mopt", "build", "r.toml", "--no-check"], cwd=w.proj,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not any(w.store.glob("tmp/action-*")) and time.time() < deadline:
            time.sleep(0.05)
        scratch = next(w.store.glob("tmp/action-*"))
        assert (scratch / ".mopt-owner").read_text().split()[0] == str(p.pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    # older than the grace (a minute) for creating and locking a scratch folder
    old = time.time() - 120
    os.utime(scratch, (old, old))
    (w.proj / "r.toml").write_text(TOY)
    w.build()
    assert not scratch.exists()
    w.check()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_case12_every_file_renamed_into_place_was_fsynced_first(w: World) -> None:
    # `command` kinds have a static fingerprint: a build of them is a no-op next time
    (w.proj / "r.toml").write_text(
        TOY.replace('targets = ["toy-weights", "toy-export"]', 'targets = ["a"]')
        + '[toy.cpu.a]\nkind = "command"\nargv = ["sh", "-c", "echo hi > {out}/a.txt"]\n'
    )
    synced: set[str] = set()
    renamed: dict[str, str] = {}  # final name → temp name
    # the first build writes entries, mopt.lock and the build log; the second (the no-op)
    # may learn the racy files' stats into the log
    for n in range(2):
        trace = w.root / f"extra-trace-{n}.txt"
        proc = subprocess.run(
            ["strace", "-f", "-y", "-qq", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
             "-o", str(trace), sys.executable, "-m", "mopt", "build", "r.toml", "--no-check"],
            cwd=w.proj, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        split: dict[str, str] = {}  # pid → file of an fsync that strace printed in two lines
        for line in trace.read_text().splitlines():
            pid = line.split(" ", 1)[0]
            m = re.search(r"f(?:data)?sync\(\d+<([^>]*)>\)\s*= 0", line)
            if m:
                synced.add(m.group(1))
            # another traced task's call in the middle: `fsync(5</f> <unfinished ...>` ...
            # `<... fsync resumed>) = 0` (under load, e.g. a worker exiting meanwhile)
            m = re.search(r"f(?:data)?sync\(\d+<([^>]*)> <unfinished", line)
            if m:
                split[pid] = m.group(1)
            if re.search(r"<\.\.\. f(?:data)?sync resumed>\)\s*= 0", line) and pid in split:
                synced.add(split.pop(pid))
            m = re.search(r'rename(?:at2?)?\((?:[^,"]+, )?"([^"]+)", (?:[^,"]+, )?"([^"]+)"', line)
            if m and ".mopt-tmp-" not in m.group(1) and ".mopt-old-" not in m.group(1):
                renamed[os.path.join(str(w.proj), m.group(2))] = os.path.join(str(w.proj), m.group(1))
        time.sleep(0.5)
    kinds = {"lock" if f.endswith("/mopt.lock") else f.split("/")[-2] for f in renamed}
    assert {"lock", "ac", "log"} <= kinds, renamed
    # (roots/ holds symlinks: nothing to fsync but their folder)
    unsynced = {f: t for f, t in renamed.items() if t not in synced and "/roots/" not in f}
    assert not unsynced, unsynced
    w.check()
