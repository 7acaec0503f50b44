"""A store checker that does not import mopt: what a test asserts after damaging things.

It re-derives mopt's on-disk formats from their description (mopt/digest.py, mopt/store.py)
rather than calling mopt, so a bug in mopt's own checks cannot hide itself:

* blobs live at ``cas/<first 2 hex>/<BLAKE3 hex of the bytes>`` and are read-only;
* an action entry is ``ac/<key>.json``: a JSON object with ``key`` (= the file's stem),
  ``target`` (``<section>:<label>``), ``outputs_tree`` and ``log`` (a digest or null);
* a tree manifest is the blob of the canonical JSON ``{"entries": [[path, mode, size,
  digest], ...]}`` sorted by path (keys sorted, no whitespace, UTF-8), mode 0o644 or 0o755;
* ``build/<model>/<hardware>/<label>/`` holds the files of the entry it was materialized
  from: a file's tree mode is 0o755 when its owner may execute it, else 0o644;
* ``state.db`` is an SQLite database (the stat cache) that must pass ``PRAGMA
  integrity_check``, and a row whose recorded stat still matches its file must name the
  file's real digest (else the cache would vouch for damaged bytes);
* ``log/*.log`` (the build logs, optional): the line ``mopt build log 1``, the CRC-32 of the
  rest (4 bytes, little-endian), then a ``marshal`` (stdlib) dump of a dict with ``paths``
  (NUL-joined), ``stats`` (marshalled list of ``(dev, ino, size, mtime_ns, ctime_ns)``),
  ``digests`` (marshalled ``{index: (digest, mode)}``) and ``racy`` (indices); if the CRC
  matches (else mopt ignores it), every recorded file whose stat is still the recorded one and
  that is not racy must hold the recorded digest: its bytes (a file) or the NUL-joined sorted
  names in it (a folder) (else the log would vouch for other bytes than the disk holds).

Use it as ``check_store(store_dir, build_dir=None) -> list[str]`` (empty: all good), or as a
script: ``python tests/storecheck.py STORE [BUILD_DIR]`` (exit 1 and one line per problem).
"""

from __future__ import annotations

import json
import marshal
import os
import re
import sqlite3
import stat
import sys
from pathlib import Path
from typing import Any

import blake3

_DIGEST = re.compile(r"[0-9a-f]{64}")
_MODES = (0o644, 0o755)


def _hash_file(path: Path) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _tree_of_folder(folder: Path) -> tuple[str, list[list[Any]]] | str:
    """(tree digest, rows) of a folder as mopt digests it, or a problem string."""
    rows: list[list[Any]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                return f"{os.path.join(dirpath, name)}: a symbolic link in a built folder"
        for name in sorted(filenames):
            p = Path(dirpath, name)
            st = p.lstat()
            if not stat.S_ISREG(st.st_mode):
                return f"{p}: not a regular file in a built folder"
            rel = p.relative_to(folder).as_posix()
            mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
            rows.append([rel, mode, st.st_size, _hash_file(p)])
    rows.sort(key=lambda r: r[0])
    return blake3.blake3(_canonical({"entries": rows})).hexdigest(), rows


class _Checker:
    def __init__(self, store: Path) -> None:
        self.store = store
        self.problems: list[str] = []
        self._blob_ok: dict[str, bool] = {}

    def say(self, msg: str) -> None:
        self.problems.append(msg)

    def blob(self, digest: str, what: str) -> Path | None:
        """The blob's path if it exists, is read-only and hashes to its name (else a problem)."""
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            self.say(f"{what}: {digest!r} is not a BLAKE3 digest")
            return None
        path = self.store / "cas" / digest[:2] / digest
        if digest not in self._blob_ok:
            ok = False
            try:
                st = path.lstat()
            except FileNotFoundError:
                self.say(f"{what}: blob {digest} is missing ({path})")
            else:
                if not stat.S_ISREG(st.st_mode):
                    self.say(f"{what}: blob {path} is not a regular file")
                elif st.st_mode & 0o222:
                    self.say(f"{what}: blob {path} is writable (mode {stat.S_IMODE(st.st_mode):o})")
                elif _hash_file(path) != digest:
                    self.say(f"{what}: blob {path} does not hash to its name (corrupt)")
                else:
                    ok = True
            self._blob_ok[digest] = ok
        return path if self._blob_ok[digest] else None

    def manifest(self, digest: str, what: str) -> list[list[Any]] | None:
        path = self.blob(digest, what)
        if path is None:
            return None
        try:
            doc = json.loads(path.read_bytes().decode("utf-8"))
            rows = doc["entries"]
            if set(doc) != {"entries"} or not isinstance(rows, list):
                raise ValueError("keys other than 'entries'")
            for r in rows:
                if not (
                    isinstance(r, list)
                    and len(r) == 4
                    and isinstance(r[0], str)
                    and r[1] in _MODES
                    and type(r[2]) is int
                    and r[2] >= 0
                ):
                    raise ValueError(f"bad row {r!r}")
                parts = r[0].split("/")
                if r[0].startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in r[0]:
                    raise ValueError(f"unsafe path {r[0]!r}")
            if [r[0] for r in rows] != sorted(r[0] for r in rows):
                raise ValueError("rows not sorted by path")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            self.say(f"{what}: tree manifest {digest} is malformed: {e}")
            return None
        for r in rows:
            p = self.blob(r[3], f"{what}, file {r[0]}")
            if p is not None and p.stat().st_size != r[2]:
                self.say(f"{what}: file {r[0]}: manifest says {r[2]} bytes, blob {r[3]} has {p.stat().st_size}")
        return rows


def check_store(store_dir: str | os.PathLike[str], build_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Every problem found in the store (and, if given, in build/), one line each."""
    store = Path(store_dir)
    c = _Checker(store)
    if not store.is_dir():
        return [f"{store}: no store folder"]
    # (label, tree) of every readable entry: what build/ folders may hold
    trees: dict[str, set[str]] = {}
    ac = store / "ac"
    for p in sorted(ac.iterdir()) if ac.is_dir() else []:
        what = f"action entry {p.name}"
        if p.name.startswith(".") or not p.name.endswith(".json"):
            c.say(f"{p}: not an action entry (stray file in ac/)")
            continue
        if not p.is_file() or p.is_symlink():
            c.say(f"{p}: action entry is not a regular file")
            continue
        try:
            e = json.loads(p.read_bytes())
            if not isinstance(e, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as err:
            c.say(f"{p}: action entry is not valid JSON: {err}")
            continue
        if e.get("key") != p.name[: -len(".json")]:
            c.say(f"{p}: entry key {e.get('key')!r} does not match its file name")
        tree = e.get("outputs_tree")
        rows = c.manifest(tree, what) if tree is not None else None
        if tree is None:
            c.say(f"{p}: entry has no outputs_tree")
        if e.get("log") is not None:
            c.blob(e["log"], f"{what}, log")
        target = e.get("target")
        if rows is not None and isinstance(target, str):
            trees.setdefault(target.rpartition(":")[2], set()).add(tree)

    # Blobs no entry references must still hash to their names: they may be reused by dedup.
    cas = store / "cas"
    for sub in sorted(cas.iterdir()) if cas.is_dir() else []:
        if not sub.is_dir():
            c.say(f"{sub}: stray file in cas/")
            continue
        for b in sorted(sub.iterdir()):
            if not _DIGEST.fullmatch(b.name) or b.name[:2] != sub.name:
                c.say(f"{b}: stray file in cas/ (not named by its digest)")
                continue
            c.blob(b.name, "blob")

    db = store / "state.db"
    if db.exists():
        _check_db(c, db)

    for log in sorted((store / "log").glob("*.log")) if (store / "log").is_dir() else []:
        _check_log(c, log)

    if build_dir is not None and Path(build_dir).is_dir():
        _check_build(c, Path(build_dir), trees)
    return c.problems


def _check_log(c: _Checker, log: Path) -> None:
    import zlib

    magic = b"mopt build log 1\n"
    try:
        data = log.read_bytes()
    except OSError:
        return
    body = data[len(magic) + 4 :]
    if not data.startswith(magic) or zlib.crc32(body) != int.from_bytes(data[len(magic) : len(magic) + 4], "little"):
        return  # mopt ignores (and replaces) a log whose CRC does not match
    try:
        doc = marshal.loads(body)
        paths = doc["paths"].split("\0") if doc["paths"] else []
        stats, digests, racy = marshal.loads(doc["stats"]), marshal.loads(doc["digests"]), set(doc["racy"])
    except (ValueError, EOFError, KeyError, TypeError, AttributeError) as err:
        c.say(f"{log}: CRC matches but it is not a build log's marshal data: {err}")
        return
    for i, path in enumerate(paths):
        if i in racy or i not in digests:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != tuple(stats[i]):
            continue  # changed since: mopt checks it again
        if stat.S_ISDIR(st.st_mode):
            got = blake3.blake3("\0".join(sorted(os.listdir(path))).encode("utf-8", "surrogateescape")).hexdigest()
        else:
            got = _hash_file(Path(path))
        if got != digests[i][0]:
            c.say(f"{log}: {path} has the recorded stat but not the recorded digest")


def _check_db(c: _Checker, db: Path) -> None:
    try:
        # Read-only, so checking never changes what it checks.
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.Error as err:
        c.say(f"{db}: cannot open: {err}")
        return
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
        if rows != [("ok",)]:
            c.say(f"{db}: integrity_check says {rows[:3]}")
            return
        try:
            stats = conn.execute("SELECT path, inode, size, mtime_ns, ctime_ns, digest FROM stat").fetchall()
        except sqlite3.Error:
            return  # no table yet: an empty cache
        for path, inode, size, mtime_ns, ctime_ns, digest in stats:
            try:
                st = os.stat(path)
            except OSError:
                continue  # gone: a stale row is harmless (its stat can never match)
            same = (st.st_ino % (1 << 64), st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
                inode % (1 << 64),
                size,
                mtime_ns,
                ctime_ns,
            )
            if same and stat.S_ISREG(st.st_mode) and _hash_file(Path(path)) != digest:
                c.say(f"{db}: stat cache row for {path} matches its stat but not its bytes")
    except sqlite3.DatabaseError as err:
        c.say(f"{db}: {err}")
    finally:
        conn.close()


def _check_build(c: _Checker, build: Path, trees: dict[str, set[str]]) -> None:
    # build/<model>/<hardware>/<label>/: only those folders are materialized outputs; files
    # higher up (reports) and mopt's own leftovers (.mopt-tmp-*, .mopt-old-*) are not.
    for model in sorted(build.iterdir()):
        if not model.is_dir() or model.name.startswith(".mopt-"):
            continue
        for hw in sorted(model.iterdir()):
            if not hw.is_dir() or hw.name.startswith(".mopt-"):
                continue
            for out in sorted(hw.iterdir()):
                if out.name.startswith(".mopt-"):
                    continue
                if out.is_symlink() or not out.is_dir():
                    c.say(f"{out}: not a folder where a built output belongs")
                    continue
                got = _tree_of_folder(out)
                if isinstance(got, str):
                    c.say(got)
                    continue
                digest, _rows = got
                if digest not in trees.get(out.name, set()):
                    c.say(f"{out}: holds tree {digest[:16]}, which no action entry for {out.name!r} produced")
                for dirpath, _dirs, files in os.walk(out):
                    for name in files:
                        p = Path(dirpath, name)
                        if p.lstat().st_mode & 0o222:
                            c.say(f"{p}: a built file is writable")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: storecheck.py STORE_DIR [BUILD_DIR]", file=sys.stderr)
        return 2
    problems = check_store(argv[1], argv[2] if len(argv) == 3 else None)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
