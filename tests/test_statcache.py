"""The stat cache: unchanged files are never read; any change is rehashed once."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import time
from pathlib import Path

import pytest

from mopt.digest import hash_bytes, hash_tree
from mopt.statcache import RACY_WINDOW_S, StatCache


def settle() -> None:
    """Wait until files written so far are old enough to be cached (see StatCache._is_racy)."""
    time.sleep(RACY_WINDOW_S * 1.5)


def make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"hidden_size": 64}',
        "weights/model.bin": os.urandom(5 * 1024 * 1024),
        "weights/extra.bin": os.urandom(1000),
        "tok/vocab.txt": b"a\nb\n",
    }
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def test_opening_touches_nothing_until_first_use(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "state.db"
    StatCache(db).close()
    assert not db.exists()


def test_up_to_date_tree_reads_no_file_bytes(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "m")
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        first, entries = sc.tree(tmp_path / "m")
        assert sc.hashed_bytes == sum(len(b) for b in files.values())
        assert sc.hashed_files == 4
    assert (first, entries) == hash_tree(tmp_path / "m")

    # A new instance (a later `mopt build`) answers from the database alone.
    with StatCache(tmp_path / "state.db") as sc:
        again, _ = sc.tree(tmp_path / "m")
        assert again == first
        assert sc.hashed_bytes == 0
        assert sc.hashed_files == 0
        assert sc.hits == 4


def test_touch_without_change_rehashes_once_then_reads_nothing(tmp_path: Path) -> None:
    p = tmp_path / "w.bin"
    p.write_bytes(b"weights" * 1000)
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        d = sc.file_digest(p)
        assert sc.hashed_files == 1

        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        settle()
        assert sc.file_digest(p) == d
        assert (sc.hashed_files, sc.hashed_bytes) == (2, 2 * 7000)

        assert sc.file_digest(p) == d
        assert sc.file_digest(p) == d
        assert (sc.hashed_files, sc.hashed_bytes, sc.hits) == (2, 2 * 7000, 2)


def test_same_size_rewrite_with_restored_mtime_is_detected(tmp_path: Path) -> None:
    # tar and `cp -p` restore mtimes; only ctime (set by the kernel) shows the change.
    p = tmp_path / "w.bin"
    p.write_bytes(b"A" * 100)
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        old = sc.file_digest(p)
        st = p.stat()
        p.write_bytes(b"B" * 100)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert p.stat().st_mtime_ns == st.st_mtime_ns
        assert sc.file_digest(p) == hash_bytes(b"B" * 100) != old


def test_other_file_moved_into_place_is_detected(tmp_path: Path) -> None:
    p, other = tmp_path / "w.bin", tmp_path / "other.bin"
    p.write_bytes(b"A" * 100)
    other.write_bytes(b"B" * 100)
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        sc.file_digest(p)
        os.replace(other, p)
        assert sc.file_digest(p) == hash_bytes(b"B" * 100)


def test_file_changed_just_before_hashing_is_not_trusted_yet(tmp_path: Path) -> None:
    # A write in the same timestamp tick as our hash could leave the stat unchanged, so a
    # digest taken right after a change is used once but not remembered.
    # (A window of a minute for the first part: however loaded the machine, the write is
    # still "just now" when hashed; the default 0.1 s made this flaky under load.)
    p = tmp_path / "w.bin"
    p.write_bytes(b"fresh")
    with StatCache(tmp_path / "state.db", racy_window_s=60.0) as sc:
        d = sc.file_digest(p)
        assert sc.file_digest(p) == d
        assert sc.hashed_files == 2
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        sc.file_digest(p)
        sc.file_digest(p)
        assert (sc.hashed_files, sc.hits) == (1, 1)


def test_tree_sees_added_removed_and_changed_files(tmp_path: Path) -> None:
    root = tmp_path / "m"
    make_tree(root)
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        before, _ = sc.tree(root)
        read_before = sc.hashed_bytes
        (root / "tok" / "vocab.txt").write_bytes(b"a\nc\n")
        (root / "new.txt").write_bytes(b"new")
        (root / "weights" / "extra.bin").unlink()
        after, entries = sc.tree(root)
        assert after != before
        assert (after, entries) == hash_tree(root)
        # Only the two changed files were read.
        assert sc.hashed_bytes - read_before == len(b"a\nc\n") + len(b"new")


def test_path_digest_is_file_digest_or_tree_digest(tmp_path: Path) -> None:
    make_tree(tmp_path / "m")
    with StatCache(tmp_path / "state.db") as sc:
        assert sc.path_digest(tmp_path / "m") == hash_tree(tmp_path / "m")[0]
        assert sc.path_digest(tmp_path / "m" / "config.json") == hash_bytes(b'{"hidden_size": 64}')
        with pytest.raises(IsADirectoryError):
            sc.file_digest(tmp_path / "m")


def _tree_in_child(args: tuple[str, str]) -> str:
    db, root = args
    with StatCache(db) as sc:
        return sc.tree(root)[0]


def test_several_processes_share_one_database(tmp_path: Path) -> None:
    roots = []
    for i in range(4):
        make_tree(tmp_path / f"m{i}")
        roots.append(str(tmp_path / f"m{i}"))
    settle()
    db = str(tmp_path / "state.db")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        got = pool.map(_tree_in_child, [(db, r) for r in roots * 3])
    assert got == [hash_tree(r)[0] for r in roots * 3]
    with StatCache(db) as sc:
        for r in roots:
            sc.tree(r)
        assert sc.hashed_bytes == 0
        assert sc.hits == 16
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_prune_forgets_files_that_are_gone(tmp_path: Path) -> None:
    make_tree(tmp_path / "m")
    settle()
    with StatCache(tmp_path / "state.db") as sc:
        sc.tree(tmp_path / "m")
        (tmp_path / "m" / "config.json").unlink()
        assert sc.prune() == 1
        assert sc.prune() == 0


def test_database_of_another_schema_is_rebuilt(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE stat (x)")
        conn.execute("PRAGMA user_version = 999")
    p = tmp_path / "f"
    p.write_bytes(b"x")
    settle()
    with StatCache(db) as sc:
        assert sc.file_digest(p) == hash_bytes(b"x")
    with StatCache(db) as sc:
        sc.file_digest(p)
        assert sc.hits == 1
