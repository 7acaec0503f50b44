"""Content digests: BLAKE3 of bytes, of files, and of directory trees (a Merkle manifest).

A file's digest is BLAKE3 of its bytes. A directory's digest is BLAKE3 of its manifest:
the canonical JSON of `{"entries": [[path, mode, size, digest], ...]}` sorted by path, one
entry per regular file. Empty directories are not represented (as in git); symlinks and
special files are rejected, so a digest always names bytes that can be stored and restored.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from mopt.errors import MoptError
from mopt.filehash import MMAP_THRESHOLD as MMAP_THRESHOLD
from mopt.filehash import MODE_EXEC as MODE_EXEC
from mopt.filehash import MODE_FILE as MODE_FILE
from mopt.filehash import StrPath as StrPath
from mopt.filehash import hash_bytes as hash_bytes
from mopt.filehash import hash_file as hash_file
from mopt.filehash import mode_of as mode_of

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class TreeError(MoptError, ValueError):
    """A folder cannot be digested or a manifest is malformed (the message says where).

    A MoptError: uncaught (a symlink or a device in a declared input folder), it is one
    line naming the path and exit 2, not a traceback."""


class SymlinkError(TreeError):
    """A folder to digest contains a symbolic link; mopt stores only files and folders."""


def is_digest(value: object) -> bool:
    """Whether `value` is a BLAKE3 hex digest as this module writes them (64 lowercase hex)."""
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def check_digest(value: str) -> str:
    """Return `value` if it is a digest, else raise ValueError naming it."""
    if not is_digest(value):
        raise ValueError(f"not a BLAKE3 digest (64 lowercase hex characters): {value!r}")
    return value


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace; NaN and infinities are rejected."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """One regular file of a tree: relative posix path, mode (0o644/0o755), size, digest."""

    path: str
    mode: int
    size: int
    digest: str

    def __post_init__(self) -> None:
        # Manifests may come from a shared or remote cache: a path that escapes the tree
        # would let a bad manifest write outside the folder being materialized.
        p = self.path
        if not isinstance(p, str) or not p or "\0" in p or any(s in f"/{p}/" for s in ("//", "/./", "/../")):
            raise TreeError(f"tree entry path must be relative, normalised posix: {p!r}")
        if type(self.mode) is not int or self.mode not in (MODE_FILE, MODE_EXEC):
            raise TreeError(f"tree entry {p!r}: mode must be 0o644 or 0o755, got {self.mode!r}")
        if type(self.size) is not int or self.size < 0:
            raise TreeError(f"tree entry {p!r}: size must be a non-negative int, got {self.size!r}")
        if not is_digest(self.digest):
            raise TreeError(f"tree entry {p!r}: not a digest: {self.digest!r}")


def tree_manifest_bytes(entries: Iterable[TreeEntry]) -> bytes:
    """The canonical manifest of `entries` (sorted by path); its hash is the tree digest."""
    ordered = sorted(entries, key=lambda e: e.path)
    _check_paths(ordered)
    return canonical_json({"entries": [[e.path, e.mode, e.size, e.digest] for e in ordered]})


def tree_digest(entries: Iterable[TreeEntry]) -> str:
    """The digest of a tree made of `entries`."""
    return hash_bytes(tree_manifest_bytes(entries))


def parse_tree_manifest(data: bytes) -> list[TreeEntry]:
    """Entries of a manifest written by `tree_manifest_bytes`; TreeError if malformed."""
    try:
        doc = json.loads(data.decode("utf-8"))
        rows = doc["entries"]
        if set(doc) != {"entries"} or not isinstance(rows, list):
            raise TypeError("unexpected keys")
        entries = [TreeEntry(*row) for row in rows]
    except TreeError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise TreeError(f"malformed tree manifest: {e}") from None
    if [e.path for e in entries] != sorted(e.path for e in entries):
        raise TreeError("malformed tree manifest: entries are not sorted by path")
    _check_paths(entries)
    return entries


def _check_paths(ordered: list[TreeEntry]) -> None:
    # A path cannot be both a file and a folder ("a" and "a/b"). Sorting does not put the
    # two next to each other ("a-b" sorts between them), so compare against every parent.
    files: set[str] = set()
    folders: set[str] = set()
    for e in ordered:
        if e.path in files:
            raise TreeError(f"tree has {e.path!r} twice")
        files.add(e.path)
        p = e.path
        while (i := p.rfind("/")) > 0:
            p = p[:i]
            if p in folders:
                break  # its parents are in already
            folders.add(p)
    both = files & folders
    if both:
        raise TreeError(f"tree has {min(both)!r} both as a file and as a folder")


def iter_files(root: StrPath) -> Iterator[tuple[str, str, os.stat_result]]:
    """Yield (relative posix path, absolute path, lstat) for each regular file under `root`.

    Walks each folder in name order without following links. A symlink raises SymlinkError and any
    other non-regular file, or a name that is not UTF-8, raises TreeError, both naming the path and what to do.
    """
    base = os.path.abspath(root)
    if not os.path.isdir(base):
        raise TreeError(f"{base}: not a folder")
    stack: list[tuple[str, str]] = [(base, "")]
    while stack:
        dir_abs, dir_rel = stack.pop()
        with os.scandir(dir_abs) as it:
            items = sorted(it, key=lambda d: d.name)
        subdirs: list[tuple[str, str]] = []
        for d in items:
            rel = f"{dir_rel}{d.name}"
            if not d.name.isascii() and os.fsencode(d.name).decode("utf-8", "replace") != d.name:
                shown = os.fsencode(d.path).decode("utf-8", "backslashreplace")  # manifests are UTF-8 JSON
                raise TreeError(f"{shown}: not a UTF-8 name (mopt stores file names as UTF-8; rename it)")
            if d.is_symlink():
                raise SymlinkError(
                    f"{d.path}: is a symbolic link (to {os.readlink(d.path)!r}); mopt stores "
                    "only regular files and folders. Replace the link with a copy of what it "
                    "points to (e.g. `cp -rL`), or point the recipe at the link's target."
                )
            if d.is_dir(follow_symlinks=False):
                subdirs.append((d.path, rel + "/"))
                continue
            st = d.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise TreeError(f"{d.path}: not a regular file or folder (a socket, pipe or device)")
            yield rel, d.path, st
        # Depth-first, reversed so that children pop in sorted order.
        stack.extend(reversed(subdirs))


def hash_tree(root: StrPath) -> tuple[str, list[TreeEntry]]:
    """(tree digest, entries sorted by path) of the folder `root`, hashing every file (no cache)."""
    entries = [
        TreeEntry(rel, mode_of(st.st_mode), st.st_size, hash_file(abs_)) for rel, abs_, st in iter_files(root)
    ]
    entries.sort(key=lambda e: e.path)
    return tree_digest(entries), entries
