"""The store: blobs, action cache, materialized folders, locks, crash safety and gc."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from mopt.digest import canonical_json, hash_bytes, hash_file, hash_tree
from mopt.filehash import file_stat
from mopt.statcache import RACY_WINDOW_S
from mopt.store import ActionEntry, BlobMissingError, Store, StoreError

REPO = Path(__file__).resolve().parents[1]


def make_tree(root: Path, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> Path:
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        if name in executable:
            p.chmod(0o755)
    return root


def build(store: Store, tmp: Path, key: str, files: dict[str, bytes], log: bytes | None = b"ok\n") -> str:
    """Store an action's outputs and its entry, as the executor does; return the tree digest."""
    out = make_tree(tmp / f"out-{key}", files)
    tree, _ = store.put_tree(out)
    log_digest = None
    if log is not None:
        (tmp / f"{key}.log").write_bytes(log)
        log_digest = store.put_log(tmp / f"{key}.log")
    store.ac_put(key, {"key": key, "kind": "onnx", "target": "t", "outputs_tree": tree, "log": log_digest})
    return tree


def all_blobs(store: Store) -> list[Path]:
    return sorted(p for p in store.cas_dir.rglob("*") if p.is_file())


def permissions_enforced(tmp: Path) -> bool:
    """False where permission bits are ignored (root with CAP_DAC_OVERRIDE)."""
    probe = tmp / "probe"
    probe.write_bytes(b"")
    probe.chmod(0o444)
    try:
        probe.write_bytes(b"x")
        return False
    except PermissionError:
        return True
    finally:
        probe.unlink()


def rm_read_only(path: Path) -> None:
    for dirpath, _dirs, _files in os.walk(path):
        os.chmod(dirpath, 0o755)
    shutil.rmtree(path)


def age(path: Path, seconds: float) -> None:
    """Make `path` look last used `seconds` ago."""
    t = time.time() - seconds
    os.utime(path, (t, t))


# -- blobs ---------------------------------------------------------------------------------


def test_put_bytes_and_file_store_read_only_blobs_by_digest(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    d = store.put_bytes(b"hello")
    assert d == hash_bytes(b"hello")
    assert store.blob_path(d) == tmp_path / "store" / "cas" / d[:2] / d
    assert store.read_bytes(d) == b"hello"
    assert stat.S_IMODE(store.blob_path(d).stat().st_mode) == 0o444

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 * 1024 * 1024))
    d2 = store.put_file(big)
    assert d2 == hash_file(big)
    assert store.read_bytes(d2) == big.read_bytes()
    assert store.has(d) and store.has(d2)
    assert not store.has(hash_bytes(b"absent"))
    assert list(store.tmp_dir.iterdir()) == []


def test_putting_an_existing_blob_writes_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    d = store.put_bytes(b"x" * 100)
    before = store.blob_path(d).stat()
    src = tmp_path / "same.bin"
    src.write_bytes(b"x" * 100)
    assert store.put_file(src) == d
    assert store.put_bytes(b"x" * 100) == d
    after = store.blob_path(d).stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )


def test_missing_blob_read_names_the_digest(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    d = hash_bytes(b"nope")
    with pytest.raises(BlobMissingError, match=d):
        store.read_bytes(d)
    with pytest.raises(ValueError, match="not a BLAKE3 digest"):
        store.blob_path("../../etc/passwd")


def test_put_tree_stores_every_file_and_its_manifest(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    files = {"model.onnx": os.urandom(5 * 1024 * 1024), "cfg/a.json": b"{}", "run.sh": b"#!/bin/sh\n"}
    out = make_tree(tmp_path / "out", files, executable=("run.sh",))
    tree, entries = store.put_tree(out)
    assert (tree, entries) == hash_tree(out)
    assert store.tree_entries(tree) == entries
    assert {e.path: e.mode for e in entries}["run.sh"] == 0o755
    for e in entries:
        assert store.read_bytes(e.digest) == files[e.path]
    assert len(all_blobs(store)) == 4  # three files and the manifest


def test_tampered_blob_fails_verify(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    d = store.put_bytes(b"original")
    assert store.verify(d)
    blob = store.blob_path(d)
    blob.chmod(0o644)
    blob.write_bytes(b"0riginal")
    assert not store.verify(d)
    blob.unlink()
    assert not store.verify(d)


# -- action cache --------------------------------------------------------------------------


def test_action_entry_round_trips_and_a_hit_touches_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree = build(store, tmp_path, "k1", {"a.txt": b"a"})
    entry_path = store.ac_dir / "k1.json"
    age(entry_path, 3600)
    hit = store.ac_entry("k1")
    assert hit is not None
    assert hit.outputs_tree == tree
    assert hit.kind == "onnx"
    assert hit.key == "k1"
    assert time.time() - entry_path.stat().st_mtime < 60  # LRU: used just now
    assert json.loads(entry_path.read_bytes()) == json.loads(canonical_json(hit.model_dump()))
    assert store.ac_entry("other") is None


def test_an_entry_read_or_written_is_recorded_with_its_files_stat_and_digest(tmp_path: Path) -> None:
    """What the build log files an entry under: the stat of the bytes read (or written) and
    their digest; a touch keeps the digest and records the new stat."""
    root = tmp_path / "store"
    with Store(root) as store:
        build(store, tmp_path, "k1", {"a.txt": b"a"})
        entry = root / "ac" / "k1.json"
        assert store.entry_files["k1"] == (file_stat(entry.stat()), hash_bytes(entry.read_bytes()))
    with Store(root) as store:
        assert store.ac_entry("k1") is not None
        assert store.entry_files["k1"] == (file_stat(entry.stat()), hash_bytes(entry.read_bytes()))
        age(entry, 3600)
        touched = store.touch_if_due("k1", file_stat(entry.stat()))
        assert touched == file_stat(entry.stat()) and store.entry_files["k1"][0] == touched
        assert store.touch_if_due("k1", touched) is None  # just used: not due


@pytest.mark.parametrize("what", ["fifo", "folder", "link"])
def test_an_entry_that_is_not_a_regular_file_is_a_miss_and_never_blocks(tmp_path: Path, what: str) -> None:
    root = tmp_path / "store"
    with Store(root) as store:
        build(store, tmp_path, "k1", {"a.txt": b"a"})
    entry = root / "ac" / "k1.json"
    os.chmod(entry, 0o644)
    entry.unlink()
    if what == "fifo":
        os.mkfifo(entry)
    elif what == "folder":
        entry.mkdir()
    else:
        (tmp_path / "elsewhere.json").write_text("{}")
        entry.symlink_to(tmp_path / "elsewhere.json")
    with Store(root, read_only=True) as store:
        assert store.ac_entry("k1") is None


def test_a_hit_touches_an_entry_only_when_its_last_use_is_old(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Store(root) as store:
        build(store, tmp_path, "k1", {"a.txt": b"a"})
    entry_path = root / "ac" / "k1.json"
    age(entry_path, 60)  # used a minute ago: within TOUCH_AFTER_S, left as it is
    before = entry_path.stat().st_mtime_ns
    with Store(root) as store:
        assert store.ac_entry("k1") is not None
    assert entry_path.stat().st_mtime_ns == before
    age(entry_path, 3600)
    with Store(root) as store:
        assert store.ac_entry("k1") is not None
    assert time.time() - entry_path.stat().st_mtime < 60


def test_hit_with_missing_blob_is_a_miss(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree = build(store, tmp_path, "k1", {"a.txt": b"a", "b.txt": b"b"})
    member = store.tree_entries(tree)[1].digest
    store.blob_path(member).unlink()
    assert store.ac_entry("k1") is None


def test_hit_with_missing_log_or_manifest_is_a_miss(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    build(store, tmp_path, "k1", {"a.txt": b"a"}, log=b"log 1")
    entry = store.ac_entry("k1")
    assert entry is not None and entry.log == hash_bytes(b"log 1")
    store.blob_path(entry.log).unlink()
    assert store.ac_entry("k1") is None

    tree = build(store, tmp_path, "k2", {"b.txt": b"b"})
    store.blob_path(tree).unlink()
    assert store.ac_entry("k2") is None


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"key": "k1"}',
        b'{"key": "other", "kind": "x", "target": "t", "outputs_tree": "%s"}',
    ],
)
def test_corrupt_or_foreign_entry_is_a_miss(tmp_path: Path, content: bytes) -> None:
    store = Store(tmp_path / "store")
    tree = store.put_bytes(canonical_json({"entries": []}))
    (store.ac_dir / "k1.json").write_bytes(content.replace(b"%s", tree.encode()))
    assert store.ac_entry("k1") is None


def test_entry_whose_blobs_are_not_stored_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with pytest.raises(BlobMissingError, match="not recording"):
        store.ac_put("k1", {"key": "k1", "kind": "x", "target": "t", "outputs_tree": hash_bytes(b"?")})
    assert not (store.ac_dir / "k1.json").exists()
    with pytest.raises(ValueError):
        store.ac_put("../evil", {"key": "../evil", "kind": "x", "target": "t", "outputs_tree": "0" * 64})


def test_failure_is_not_cached_but_its_log_is_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    log = tmp_path / "run.log"
    log.write_text("Traceback: out of memory\n")
    kept = store.keep_failed_log("k1", log)
    assert kept == tmp_path / "store" / "logs" / "failed-k1.log"
    assert kept.read_text() == "Traceback: out of memory\n"
    assert list(store.ac_dir.iterdir()) == []
    assert store.ac_entry("k1") is None


# -- materialize ---------------------------------------------------------------------------


def test_materialize_is_read_only_and_identical(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    files = {"model.onnx": os.urandom(5 * 1024 * 1024), "sub/deep/cfg.json": b"{}", "empty.txt": b""}
    tree, _ = store.put_tree(make_tree(tmp_path / "out", files))
    dest = tmp_path / "build" / "m" / "cpu" / "onnx"
    method = store.materialize(tree, dest)
    assert method in ("reflink", "hardlink", "copy")
    assert hash_tree(dest)[0] == tree
    for name, data in files.items():
        p = dest / name
        assert p.read_bytes() == data
        assert stat.S_IMODE(p.stat().st_mode) == 0o444
    for d in (dest, dest / "sub", dest / "sub" / "deep"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o555
    if permissions_enforced(tmp_path):
        with pytest.raises(PermissionError):
            (dest / "model.onnx").write_bytes(b"edited")
        with pytest.raises(PermissionError):
            (dest / "new.txt").write_bytes(b"new")
    assert [p.name for p in dest.parent.iterdir()] == ["onnx"]  # no temp siblings left


def test_materialized_executable_keeps_its_bit_and_is_copied_not_linked(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree, _ = store.put_tree(make_tree(tmp_path / "out", {"run.sh": b"#!/bin/sh\n"}, executable=("run.sh",)))
    dest = tmp_path / "dest"
    assert store.materialize(tree, dest) in ("reflink", "copy")
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o555
    # The blob itself stays 0o444: a hard link would have shared (and changed) its mode.
    blob = store.blob_path(store.tree_entries(tree)[0].digest)
    assert stat.S_IMODE(blob.stat().st_mode) == 0o444
    assert hash_tree(dest)[0] == tree


def test_materialize_again_is_unchanged_and_reads_no_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree, _ = store.put_tree(make_tree(tmp_path / "out", {"w.bin": os.urandom(5 << 20), "x/y": b"y"}))
    dest = tmp_path / "dest"
    first = store.materialize(tree, dest)
    time.sleep(RACY_WINDOW_S * 1.5)
    inode = (dest / "w.bin").stat().st_ino
    assert store.materialize(tree, dest) == "unchanged"
    if first != "hardlink":  # copies are hashed once, then known by stat
        assert store.materialize(tree, dest) == "unchanged"
    read = store.state.hashed_bytes
    assert store.materialize(tree, dest) == "unchanged"
    assert store.state.hashed_bytes == read
    assert (dest / "w.bin").stat().st_ino == inode


def test_a_hit_folder_is_checked_file_by_file_and_repaired(tmp_path: Path) -> None:
    """A cache hit's folder (blobs just checked) that holds the tree is left as it is; a file
    added, edited or replaced is found and the folder repaired; the folder swapped for a link
    is refused."""
    from mopt.store import OutsideError

    store = Store(tmp_path / "store")
    build = tmp_path / "build"
    build.mkdir()
    store.allow(build)
    files = {"a.txt": b"one", "w.bin": b"w" * 1000}
    tree, _ = store.put_tree(make_tree(tmp_path / "out", files))
    dest = build / "m" / "cpu" / "t"

    def again() -> str:
        method = store.materialize(tree, str(dest), blobs_checked=True)
        assert hash_tree(dest)[0] == tree
        return method

    assert again() != "unchanged"
    assert again() == "unchanged"
    assert store.holds(tree, dest)
    dest.chmod(0o755)  # a file added
    (dest / "extra.txt").write_bytes(b"mine")
    assert not store.holds(tree, dest)
    assert again() != "unchanged"
    assert sorted(p.name for p in dest.iterdir()) == ["a.txt", "w.bin"]
    (dest / "a.txt").chmod(0o644)  # a file edited in place
    (dest / "a.txt").write_bytes(b"two")
    assert again() != "unchanged"
    assert (dest / "a.txt").read_bytes() == b"one"
    victim = tmp_path / "victim"
    shutil.move(str(dest.parent), victim)  # the folder moved out, a link in its place
    dest.parent.symlink_to(victim)
    store = Store(tmp_path / "store")  # the next build
    store.allow(build)
    (victim / "t").chmod(0o755)
    (victim / "t" / "a.txt").chmod(0o644)
    (victim / "t" / "a.txt").write_bytes(b"three")  # so that it must be written
    with pytest.raises(OutsideError):
        again()
    assert sorted(p.name for p in (victim / "t").iterdir()) == ["a.txt", "w.bin"]


def test_materialize_replaces_a_different_or_damaged_tree(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    old, _ = store.put_tree(make_tree(tmp_path / "v1", {"a.txt": b"one", "gone.txt": b"bye"}))
    new, _ = store.put_tree(make_tree(tmp_path / "v2", {"a.txt": b"two", "b/c.txt": b"c"}))
    dest = tmp_path / "dest"
    store.materialize(old, dest)
    assert store.materialize(new, dest) != "unchanged"
    assert hash_tree(dest)[0] == new
    assert not (dest / "gone.txt").exists()

    # A user who adds a file (after making the folder writable) gets it rebuilt.
    dest.chmod(0o755)
    (dest / "extra.txt").write_bytes(b"mine")
    assert store.materialize(new, dest) != "unchanged"
    assert hash_tree(dest)[0] == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "store", "v1", "v2"]


def test_materialize_over_a_plain_file_or_writable_folder(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree, _ = store.put_tree(make_tree(tmp_path / "out", {"a.txt": b"a"}))
    as_file = tmp_path / "was-a-file"
    as_file.write_text("x")
    store.materialize(tree, as_file)
    assert hash_tree(as_file)[0] == tree
    writable = make_tree(tmp_path / "was-writable", {"a.txt": b"a"})
    assert store.materialize(tree, writable) != "unchanged"  # same bytes, but writable
    assert stat.S_IMODE((writable / "a.txt").stat().st_mode) == 0o444


def test_materialize_on_another_filesystem_copies(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than tmp_path's")
    store = Store(tmp_path / "store")
    tree, _ = store.put_tree(make_tree(tmp_path / "out", {"a.txt": b"a", "b/c.bin": os.urandom(1000)}))
    dest = Path(tempfile.mkdtemp(dir=shm)) / "dest"
    try:
        assert store.materialize(tree, dest) == "copy"  # no reflink, and links cannot cross
        assert hash_tree(dest)[0] == tree
        assert store.materialize(tree, dest) == "unchanged"
    finally:
        rm_read_only(dest.parent)


def test_materialize_with_missing_blob_fails_and_leaves_dest_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree, entries = store.put_tree(make_tree(tmp_path / "out", {"a.txt": b"a"}))
    dest = make_tree(tmp_path / "dest", {"keep.txt": b"k"})
    store.blob_path(entries[0].digest).unlink()
    with pytest.raises(BlobMissingError, match="1 blob"):
        store.materialize(tree, dest)
    assert (dest / "keep.txt").read_bytes() == b"k"


def test_manifest_escaping_dest_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    d = store.put_bytes(b"evil")
    bad = store.put_bytes(canonical_json({"entries": [["../outside.txt", 0o644, 4, d]]}))
    with pytest.raises(StoreError, match="not a tree manifest"):
        store.materialize(bad, tmp_path / "dest")
    assert not (tmp_path / "outside.txt").exists()


# -- concurrency and crashes ---------------------------------------------------------------


def _put_same(args: tuple[str, str]) -> tuple[str, str]:
    root, src = args
    store = Store(root)
    return store.put_file(src), store.put_bytes(Path(src).read_bytes()[:1000])


def test_concurrent_put_of_same_blob_is_safe(tmp_path: Path) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(16 * 1024 * 1024))
    root = str(tmp_path / "store")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_put_same, [(root, str(src))] * 8)
    assert len(set(results)) == 1
    store = Store(root)
    big, small = results[0]
    assert store.verify(big) and store.verify(small)
    assert len(all_blobs(store)) == 2
    assert list(store.tmp_dir.iterdir()) == []


def _hold_lock(root: str, key: str, journal: str, hold_s: float) -> None:
    store = Store(root)
    with store.lock(key):
        with open(journal, "a") as f:
            f.write(f"start {os.getpid()}\n")
        time.sleep(hold_s)
        with open(journal, "a") as f:
            f.write(f"end {os.getpid()}\n")


def test_lock_serialises_two_processes(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_hold_lock, args=(str(tmp_path / "store"), "k1", str(journal), 0.3))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = journal.read_text().split()
    # start A, end A, start B, end B: the second waited for the first.
    assert lines[0::2] == ["start", "end", "start", "end"]
    assert lines[1] == lines[3] and lines[5] == lines[7] and lines[1] != lines[5]


def test_lock_reports_waiting_and_other_keys_do_not_wait(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    journal = tmp_path / "journal"
    p = multiprocessing.get_context("fork").Process(
        target=_hold_lock, args=(str(tmp_path / "store"), "k1", str(journal), 0.5)
    )
    p.start()
    while not journal.exists():
        time.sleep(0.01)
    waited: list[bool] = []
    with store.lock("k2", on_wait=lambda: waited.append(True)):
        pass
    assert waited == []
    with store.lock("k1", on_wait=lambda: waited.append(True)):
        assert "end" in journal.read_text()
    assert waited == [True]
    p.join(30)


KILL_SCRIPT = """
import sys
from mopt.store import Store
Store(sys.argv[1]).put_file(sys.argv[2])
"""


def test_kill_mid_write_leaves_no_final_blob(tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:  # large enough that copy and fsync take a while
        for _ in range(8):
            f.write(os.urandom(16 * 1024 * 1024))
    root = tmp_path / "store"
    store = Store(root)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root), str(src)], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        temps = list(store.tmp_dir.iterdir())
        if temps and temps[0].stat().st_size > 0:
            break
        assert child.poll() is None, "put_file finished before it could be killed"
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL

    for blob in all_blobs(store):  # whatever is under a final name is complete
        assert hash_file(blob) == blob.name
    assert not store.has(hash_file(src))
    assert len(list(store.tmp_dir.iterdir())) == 1
    assert store.cleanup_tmp(max_age_s=3600) == 0  # too recent: might still be written
    assert store.cleanup_tmp(max_age_s=0) == 1
    assert list(store.tmp_dir.iterdir()) == []
    assert store.verify(store.put_file(src))


def _hold_scratch(root: str, ready: str) -> None:
    with Store(root).scratch_dir(prefix="action-") as d:
        (d / "partial.bin").write_bytes(b"half an engine")
        Path(ready).write_text(str(d))
        time.sleep(60)


def test_cleanup_spares_a_scratch_dir_in_use_however_old(tmp_path: Path) -> None:
    # A long engine build may not touch its scratch folder for hours; another `mopt build`
    # starting meanwhile must not sweep it away.
    store = Store(tmp_path / "store")
    ready = tmp_path / "ready"
    child = multiprocessing.get_context("fork").Process(
        target=_hold_scratch, args=(str(store.root), str(ready))
    )
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        scratch = Path(ready.read_text())
        age(scratch, 5 * 3600)
        assert store.cleanup_tmp(max_age_s=0) == 0
        assert (scratch / "partial.bin").exists()
    finally:
        child.kill()
        child.join(30)
    assert store.cleanup_tmp(max_age_s=3600) == 1  # its writer died: a leftover now
    assert list(store.tmp_dir.iterdir()) == []


def test_scratch_dir_is_removed_on_exit(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with store.scratch_dir() as d:
        make_tree(d, {"out/model.onnx": b"x"})
        (d / "out").chmod(0o555)
        assert d.parent == store.tmp_dir
    assert not d.exists()


def test_materialize_removes_leftovers_of_an_interrupted_one_beside_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    tree, _ = store.put_tree(make_tree(tmp_path / "out", {"a.txt": b"a"}))
    build_dir = tmp_path / "build"
    left = make_tree(build_dir / ".mopt-tmp-onnx-abc123", {"a": b"a"})
    (left / "a").chmod(0o444)
    left.chmod(0o555)
    age(left, 7200)
    fresh = make_tree(build_dir / ".mopt-tmp-trt-def456", {"b": b"b"})
    mine = make_tree(build_dir / "onnx", {"c": b"c"})
    age(mine, 7200)
    store.materialize(tree, build_dir / "trt")
    assert sorted(p.name for p in build_dir.iterdir()) == [fresh.name, "onnx", "trt"]


# -- gc ------------------------------------------------------------------------------------


def test_gc_removes_least_recently_used_until_under_size(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    trees = {k: build(store, tmp_path, k, {"w.bin": os.urandom(100_000)}, log=None) for k in "abc"}
    for i, k in enumerate("abc"):  # a used longest ago, c most recently
        age(store.ac_dir / f"{k}.json", 3000 - i * 1000)
    store.ac_entry("a")  # a hit makes a the most recently used
    total = store.usage().total_bytes
    report = store.gc(max_size_bytes=total - 150_000)
    assert (report.removed_entries, report.kept_entries) == (2, 1)
    assert report.removed_blobs == 4  # two trees: manifest and file each
    assert store.usage().total_bytes == report.kept_bytes <= total - 150_000
    assert store.ac_entry("a") is not None
    assert store.ac_entry("b") is None and store.ac_entry("c") is None
    assert all(store.verify(e.digest) for e in store.tree_entries(trees["a"]))
    assert store.materialize(trees["a"], tmp_path / "dest") != "unchanged"


def test_gc_keeps_locked_roots(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    shared = os.urandom(50_000)
    for k in ("a", "b", "c"):
        build(store, tmp_path, k, {"shared.bin": shared, f"{k}.bin": os.urandom(10_000)})
        age(store.ac_dir / f"{k}.json", 10 * 86400)
    report = store.gc(max_size_bytes=0, older_than_s=86400, keep_keys={"b"})
    assert (report.removed_entries, report.kept_entries) == (2, 1)
    assert sorted(p.stem for p in store.ac_dir.iterdir()) == ["b"]
    entry = store.ac_entry("b")
    assert entry is not None
    # b's blobs (including the one it shared with a and c) all survive; a's and c's go.
    members = {e.digest for e in store.tree_entries(entry.outputs_tree)}
    assert {p.name for p in all_blobs(store)} == {entry.outputs_tree, entry.log, *members}


def test_gc_by_age_keeps_recent_entries(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    build(store, tmp_path, "old", {"a": b"old"})
    build(store, tmp_path, "new", {"a": b"new"})
    age(store.ac_dir / "old.json", 31 * 86400)
    report = store.gc(older_than_s=30 * 86400)
    assert report.removed_entries == 1
    assert store.ac_entry("old") is None and store.ac_entry("new") is not None


def test_gc_dry_run_removes_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    build(store, tmp_path, "a", {"a": b"a"})
    before = sorted(store.root.rglob("*"))
    report = store.gc(max_size_bytes=0, dry_run=True)
    assert report.dry_run and report.removed_entries == 1 and report.removed_blobs == 3
    assert sorted(store.root.rglob("*")) == sorted([*before, store.locks_dir / "_gc.lock"])


def test_gc_keeps_young_orphans_and_drops_old_ones_and_broken_entries(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    young = store.put_bytes(b"written by a build whose entry is not written yet")
    old = store.put_bytes(b"left by a build that died long ago")
    age(store.blob_path(old), 7200)
    tree = build(store, tmp_path, "broken", {"a": b"a"})
    store.blob_path(store.tree_entries(tree)[0].digest).unlink()
    (store.ac_dir / "junk.json").write_text("{")
    report = store.gc()
    assert report.removed_entries == 2
    assert store.has(young) and not store.has(old)
    assert list(store.ac_dir.iterdir()) == []


def test_gc_removes_old_failure_logs(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    (tmp_path / "l").write_text("boom")
    age(store.keep_failed_log("old", tmp_path / "l"), 40 * 86400)
    store.keep_failed_log("new", tmp_path / "l")
    assert store.gc(older_than_s=30 * 86400).removed_logs == 1
    assert [p.name for p in store.logs_dir.iterdir()] == ["failed-new.log"]


def _hold_in_use(root: str, journal: str) -> None:
    with Store(root).in_use():
        Path(journal).write_text("held\n")
        time.sleep(0.5)
        with open(journal, "a") as f:
            f.write("released\n")


def test_gc_waits_for_stores_in_use(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    journal = tmp_path / "journal"
    p = multiprocessing.get_context("fork").Process(target=_hold_in_use, args=(str(store.root), str(journal)))
    p.start()
    while not journal.exists():
        time.sleep(0.01)
    store.gc()
    assert journal.read_text() == "held\nreleased\n"
    p.join(30)


def test_usage_counts_blobs_entries_and_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    assert store.usage().total_bytes == 0
    build(store, tmp_path, "a", {"w": b"w" * 1000}, log=b"log")
    u = store.usage()
    assert (u.blobs, u.ac_entries) == (3, 1)
    assert u.blob_bytes == sum(p.stat().st_size for p in all_blobs(store))
    assert u.total_bytes == u.blob_bytes + u.ac_bytes + u.log_bytes


def test_entry_model_rejects_unknown_fields_and_bad_digests() -> None:
    base: dict[str, Any] = {"key": "k", "kind": "x", "target": "t", "outputs_tree": "0" * 64}
    ActionEntry(**base)
    with pytest.raises(ValueError):
        ActionEntry(**{**base, "surprise": 1})
    with pytest.raises(ValueError):
        ActionEntry(**{**base, "outputs_tree": "XYZ"})
    with pytest.raises(ValueError):
        ActionEntry(**{**base, "log": "short"})


def test_the_path_guard_refuses_a_path_through_a_link_out_but_not_the_link_itself(tmp_path: Path) -> None:
    from mopt.store import OutsideError, guard_path

    (tmp_path / "root" / "build").mkdir(parents=True)
    (tmp_path / "elsewhere" / "cpu").mkdir(parents=True)
    (tmp_path / "root" / "build" / "m").symlink_to(tmp_path / "elsewhere")
    roots = [tmp_path / "root"]
    assert guard_path(tmp_path / "root/build/m", roots) == str(tmp_path / "root/build/m")  # the link itself
    for p in ["root/build/m/cpu/t", "root/build/m/absent/t"]:  # through the link: outside
        with pytest.raises(OutsideError):
            guard_path(tmp_path / p, roots)


def test_gc_in_another_process_keeps_the_entries_a_store_uses_until_it_closes(tmp_path: Path) -> None:
    with Store(tmp_path / "store") as store:
        for k in ("k1", "k2", "k3"):
            build(store, tmp_path, k, {f"{k}.txt": k.encode()})
    store = Store(tmp_path / "store")
    with store.in_use():
        store.use("k1")
    assert store.ac_entry("k2") is not None  # a hit uses its entry too
    assert _gc_in_child(tmp_path / "store") == 1  # k3 goes; k1 and k2 are held
    store.close()
    assert _gc_in_child(tmp_path / "store") == 2


def _gc_child(root: str, q: Any) -> None:
    with Store(root) as s:
        q.put(s.gc(older_than_s=0, min_blob_age_s=0).removed_entries)


def _gc_in_child(root: Path) -> int:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_gc_child, args=(str(root), q))
    p.start()
    n = q.get(timeout=30)
    p.join(30)
    return int(n)
