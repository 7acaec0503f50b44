"""`noop.prehash`: the touched input files digested on background threads (the no-op's
rehash, and the full path's head start) give the digests `hash_file` gives."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from mopt import filehash, noop
from mopt.digest import MMAP_THRESHOLD, hash_file


def _files(tmp_path: Path) -> list[Path]:
    """Five large files of different sizes (more than CPUs: some are hashed on one thread,
    the last ones on BLAKE3's), two small ones, an empty one and an executable one."""
    out = []
    for i in range(5):
        p = tmp_path / f"big{i}.bin"
        p.write_bytes(os.urandom(MMAP_THRESHOLD + 4096 * i + i))
        out.append(p)
    for name, data in (
        ("small.txt", b"hello\n"),
        ("mid.bin", os.urandom(MMAP_THRESHOLD - 1)),
        ("empty", b""),
    ):
        (tmp_path / name).write_bytes(data)
        out.append(tmp_path / name)
    exe = tmp_path / "run.sh"
    exe.write_bytes(b"#!/bin/sh\n")
    exe.chmod(0o755)
    out.append(exe)
    return out


@pytest.mark.parametrize("cpus", [1, 2, 3])
def test_prehash_gives_the_digests_of_hash_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    files = _files(tmp_path)
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(noop, "_cpus", lambda: cpus)
    paths = [str(p) for p in files] + [str(tmp_path / "folder"), str(tmp_path / "gone")]
    t = noop.prehash(paths)
    t.join(60)
    assert not t.is_alive()
    want = {
        str(p): (
            noop._key(os.stat(p)),
            blake3.blake3(p.read_bytes()).hexdigest(),
            0o755 if p.name == "run.sh" else 0o644,
        )
        for p in files
    }
    assert t.results == want  # folders and missing files are left to the full path
    assert all(t.results[str(p)][1] == hash_file(p) for p in files)


def test_a_file_written_while_it_is_hashed_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path)
    victim = str(files[2])
    real = filehash.hash_file

    def writing(path: str, **kw: object) -> str:
        digest = real(path, **kw)  # type: ignore[arg-type]
        if path == victim:
            with open(path, "ab") as fh:
                fh.write(b"x")
        return digest

    monkeypatch.setattr(filehash, "hash_file", writing)
    t = noop.prehash([str(p) for p in files])
    t.join(60)
    assert victim not in t.results
    assert set(t.results) == {str(p) for p in files} - {victim}


def test_largest_files_are_hashed_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(so that the threads end together); one CPU: one thread, the order is exact."""
    files = _files(tmp_path)
    monkeypatch.setattr(noop, "_cpus", lambda: 1)
    taken: list[str] = []
    real = filehash.hash_file

    def noting(path: str, **kw: object) -> str:
        taken.append(path)
        return real(path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(filehash, "hash_file", noting)
    t = noop.prehash([str(p) for p in reversed(files)])
    t.join(60)
    assert len(t.results) == len(files)
    assert [os.stat(p).st_size for p in taken] == sorted((p.stat().st_size for p in files), reverse=True)


def _hash_in_child(path: str) -> str:
    return hash_file(path)


def test_forked_child_can_hash_after_prehash_spread_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the last files are hashed on BLAKE3's threads, which do not survive fork()
    p = tmp_path / "big.bin"
    p.write_bytes(os.urandom(MMAP_THRESHOLD * 2))
    monkeypatch.setattr(noop, "_cpus", lambda: 2)
    t = noop.prehash([str(p)])
    t.join(60)
    want = t.results[str(p)][1]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map_async(_hash_in_child, [str(p)] * 4).get(timeout=60)
    assert got == [want] * 4


def test_the_stat_cache_loads_neither_logging_nor_the_tree_digests() -> None:
    """The no-op's learning imports the stat cache while it hashes: logging, json and
    dataclasses (mopt.digest) would take ~25 ms of CPU from the hashing. -S: only what
    mopt itself imports counts, not what a site's .pth files load."""
    code = (
        "import sys; before = set(sys.modules); import mopt.statcache; "
        "print(' '.join(sorted({'logging', 'json', 'dataclasses', 'mopt.digest'} & (set(sys.modules) - before))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_a_touched_input_settled_by_the_noop_is_learnt_by_the_stat_cache(tmp_path: Path) -> None:
    """The no-op's rehash records the new stat in the store's stat cache too (opened while
    the file is hashed), so the full path does not hash the file again."""
    from mopt.statcache import StatCache
    from tests.test_noop import RECIPE, build, fast, settled

    (tmp_path / "in").mkdir()
    for m in ("m1", "m2"):
        (tmp_path / "in" / f"{m}.txt").write_text(f"hello {m}\n")
    (tmp_path / "r.toml").write_text(RECIPE)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    build(tmp_path)
    time.sleep(0.2)
    build(tmp_path)
    assert fast(settled(tmp_path))
    f = tmp_path / "in" / "m1.txt"
    os.utime(f)
    time.sleep(0.3)  # past the racy window: the new stat can be remembered
    data = build(tmp_path)
    assert fast(data) and data["io"]["hashed_files"] == 1, data["io"]
    with StatCache(tmp_path / ".mopt" / "state.db", read_only=True) as cache:
        assert cache.lookup(str(f), os.stat(f)) == blake3.blake3(f.read_bytes()).hexdigest()
