"""Digests of bytes, files and folders."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from pathlib import Path

import blake3
import pytest

from mopt.digest import (
    MMAP_THRESHOLD,
    SymlinkError,
    TreeEntry,
    TreeError,
    canonical_json,
    hash_bytes,
    hash_file,
    hash_tree,
    parse_tree_manifest,
    tree_digest,
    tree_manifest_bytes,
)

EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"  # BLAKE3 of b""


def write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def test_hash_bytes_is_blake3_hex() -> None:
    assert hash_bytes(b"") == EMPTY
    assert hash_bytes(b"abc") == blake3.blake3(b"abc").hexdigest()
    assert len(hash_bytes(b"abc")) == 64


@pytest.mark.parametrize("size", [0, 1, MMAP_THRESHOLD - 1, MMAP_THRESHOLD, MMAP_THRESHOLD * 3 + 7])
def test_file_digest_equals_digest_of_its_bytes_small_or_large(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert hash_file(p) == hash_bytes(data)
    assert hash_file(str(p)) == hash_bytes(data)


def test_canonical_json_is_sorted_compact_utf8() -> None:
    out = canonical_json({"b": 1, "a": [1.5, "é", None], "c": {"z": True, "y": False}})
    assert out == '{"a":[1.5,"é",null],"b":1,"c":{"y":false,"z":true}}'.encode()
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_json_rejects_nan_and_infinity(bad: float) -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": bad})


def test_tree_digest_ignores_creation_order_and_empty_folders(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, {"x/1.txt": b"one", "y.txt": b"why", "x/z/2.txt": b"two"})
    write(b, {"x/z/2.txt": b"two", "y.txt": b"why", "x/1.txt": b"one"})
    (b / "empty" / "deeper").mkdir(parents=True)
    da, ea = hash_tree(a)
    db, eb = hash_tree(b)
    assert da == db
    assert ea == eb
    assert [e.path for e in ea] == ["x/1.txt", "x/z/2.txt", "y.txt"]
    assert ea[0] == TreeEntry("x/1.txt", 0o644, 3, hash_bytes(b"one"))


def test_tree_digest_changes_with_content_path_and_executable_bit(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, {"run.sh": b"echo hi\n", "data/w.bin": b"\0" * 10})
    base, _ = hash_tree(root)

    (root / "data" / "w.bin").write_bytes(b"\0" * 9 + b"\1")
    changed_content, _ = hash_tree(root)
    (root / "data" / "w.bin").write_bytes(b"\0" * 10)
    assert hash_tree(root)[0] == base

    os.chmod(root / "run.sh", 0o755)
    changed_mode, entries = hash_tree(root)
    assert {e.path: e.mode for e in entries}["run.sh"] == 0o755
    os.chmod(root / "run.sh", 0o644)

    os.rename(root / "data", root / "weights")
    changed_path, _ = hash_tree(root)
    assert len({base, changed_content, changed_mode, changed_path}) == 4


def test_manifest_is_canonical_json_sorted_by_path() -> None:
    d = hash_bytes(b"x")
    entries = [TreeEntry("b", 0o644, 1, d), TreeEntry("a/c", 0o755, 1, d)]
    data = tree_manifest_bytes(entries)
    assert json.loads(data) == {"entries": [["a/c", 0o755, 1, d], ["b", 0o644, 1, d]]}
    assert data == canonical_json(json.loads(data))
    assert tree_digest(entries) == hash_bytes(data)
    assert parse_tree_manifest(data) == sorted(entries, key=lambda e: e.path)


def test_symlink_in_a_folder_is_rejected_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, {"real.txt": b"x"})
    (root / "sub").mkdir()
    os.symlink("../real.txt", root / "sub" / "link.txt")
    with pytest.raises(SymlinkError, match=r"sub/link\.txt.*symbolic link"):
        hash_tree(root)


@pytest.mark.parametrize("path", ["../evil", "/etc/passwd", "a/../../b", "a//b", "./a", "", "a/"])
def test_manifest_path_escaping_the_tree_is_rejected(path: str) -> None:
    d = hash_bytes(b"x")
    bad = canonical_json({"entries": [[path, 0o644, 1, d]]})
    with pytest.raises(TreeError):
        parse_tree_manifest(bad)


@pytest.mark.parametrize(
    "rows",
    [
        [["a", 0o777, 1, EMPTY]],  # mode other than 644/755
        [["a", 0o644, -1, EMPTY]],  # negative size
        [["a", 0o644, 1, "abc"]],  # not a digest
        [["a", 0o644, 1, EMPTY], ["a", 0o644, 1, EMPTY]],  # twice
        [["a", 0o644, 1, EMPTY], ["a/b", 0o644, 1, EMPTY]],  # file and folder
        [["b", 0o644, 1, EMPTY], ["a", 0o644, 1, EMPTY]],  # not sorted
        [["a", 0o644, 1]],  # short row
    ],
)
def test_malformed_manifest_is_rejected(rows: list[list[object]]) -> None:
    with pytest.raises(TreeError):
        parse_tree_manifest(canonical_json({"entries": rows}))


def test_manifest_that_is_not_json_is_rejected() -> None:
    for data in (b"\xff", b"[]", b'{"entries": 1}', b'{"entries": [], "x": 1}'):
        with pytest.raises(TreeError):
            parse_tree_manifest(data)


def _hash_in_child(path: str) -> str:
    return hash_file(path)


def test_forked_child_can_hash_large_files_after_parent_did(tmp_path: Path) -> None:
    # BLAKE3's thread pool does not survive fork(); a child must not wait on it forever.
    p = tmp_path / "big.bin"
    p.write_bytes(os.urandom(MMAP_THRESHOLD * 2))
    want = hash_file(p)  # starts the thread pool in this process
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map_async(_hash_in_child, [str(p)] * 4).get(timeout=60)
    assert got == [want] * 4


@pytest.mark.parametrize("n", [0, 1, 16 * 1024, MMAP_THRESHOLD - 1, MMAP_THRESHOLD, MMAP_THRESHOLD * 2 + 3])
def test_a_size_given_changes_how_a_file_is_read_not_its_digest(tmp_path: Path, n: int) -> None:
    # `size` is the caller's stat: a file that is smaller by the time it is hashed (even
    # empty, which mmap could not map) still gets the digest of its bytes
    p = tmp_path / "f.bin"
    data = os.urandom(n)
    p.write_bytes(data)
    want = blake3.blake3(data).hexdigest()
    for size in (None, 0, n, MMAP_THRESHOLD, MMAP_THRESHOLD * 8):
        assert hash_file(p, size=size) == want
