"""BLAKE3 of bytes and of files, and a file's tree mode: the part of `mopt.digest` the
no-op path needs (it rehashes touched files before json, re or dataclasses are loaded)."""

from __future__ import annotations

import os
import stat

import blake3

#: files at least this large are hashed through mmap with several threads
MMAP_THRESHOLD = 4 * 1024 * 1024
#: the two modes a tree entry can have (git's choice: only the executable bit survives)
MODE_FILE = 0o644
MODE_EXEC = 0o755

StrPath = str | os.PathLike[str]

# BLAKE3's worker threads do not survive fork(): a child of a process that hashed with them
# (multiprocessing's default on Linux) deadlocks on the first threaded hash. Children of such
# a process hash on one thread instead.
_threads_started = False
_threads_lost = False


def _after_fork_in_child() -> None:
    global _threads_lost
    _threads_lost = _threads_lost or _threads_started


os.register_at_fork(after_in_child=_after_fork_in_child)


def hash_bytes(b: bytes | bytearray | memoryview) -> str:
    """BLAKE3 hex digest of `b`."""
    return blake3.blake3(b).hexdigest()


def hash_file(path: StrPath, *, threads: bool = True, size: int | None = None) -> str:
    """BLAKE3 hex digest of the file at `path`. `threads=False`: one thread for it (a caller
    hashing as many large files at once as there are CPUs: BLAKE3's own threads then only
    contend, ~13 % slower for 40 × 64 MiB on two cores). `size`: its size as the caller
    just stat-ed it; a large one is mapped at once, without opening it here first (the
    digest is the same either way: only how the bytes are read depends on the size)."""
    if size is None or size < MMAP_THRESHOLD:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < MMAP_THRESHOLD:
                return blake3.blake3(f.read()).hexdigest()
    # Large files: mmap avoids copying into Python and lets BLAKE3 hash on every core
    # (about 2x on two cores). mmap of an empty file would fail, hence the threshold first
    # (BLAKE3's update_mmap reads a file that is small by then, e.g. truncated meanwhile).
    global _threads_started
    if _threads_lost or not threads:
        h = blake3.blake3()
    else:
        _threads_started = True
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(os.fspath(path))
    return h.hexdigest()


def mode_of(st_mode: int) -> int:
    """The tree mode of a file: 0o755 if its owner may execute it, else 0o644."""
    return MODE_EXEC if st_mode & stat.S_IXUSR else MODE_FILE
