"""Stat cache: a file's digest remembered by its stat, so an unchanged file is never read.

One SQLite table maps (path, dev, inode, size, mtime_ns, ctime_ns) to a BLAKE3 digest. A
lookup whose stat fields all match returns the stored digest without opening the file;
anything else (a touch, a copy over, a `mv` of another file into place) rehashes once.
ctime is part of the key because tools such as tar and mv can restore an old mtime on new
content; the kernel always sets ctime itself.

Several processes may share one database (WAL mode and a busy timeout). Opening is lazy:
constructing a StatCache touches nothing until the first lookup.

It is a cache, so damage is never fatal: a database SQLite calls corrupt or "not a database"
is moved aside (state.db.broken) with one warning and started afresh; one that cannot be
opened at all (a read-only store) leaves every lookup a miss.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

# mopt.digest (json, dataclasses) and logging are loaded where they are used: the no-op
# path records a touched input's digest here while it hashes the others, and their
# imports (~25 ms) would take that CPU from the hashing
from mopt.filehash import StrPath, hash_file, mode_of

if TYPE_CHECKING:
    import logging

    from mopt.digest import TreeEntry


def _log() -> logging.Logger:
    import logging

    return logging.getLogger(__name__)


_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS stat (
    path TEXT PRIMARY KEY,
    dev INTEGER NOT NULL,
    inode INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    digest TEXT NOT NULL
) WITHOUT ROWID
"""

#: a file whose ctime is this recent when hashed is not cached (see `_is_racy`)
RACY_WINDOW_S = 0.1
# Filesystems with whole-second timestamps (FAT, HFS+, ext3, some network mounts).
_COARSE_WINDOW_NS = 2_000_000_000

_StatKey = tuple[int, int, int, int, int]
# SQLITE_CORRUPT and SQLITE_NOTADB: the file is damaged, not merely busy
_DAMAGED = (11, 26)


def _is_damage(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _DAMAGED
    text = str(e)
    return "malformed" in text or "not a database" in text or "corrupt" in text


def _i64(n: int) -> int:
    # SQLite integers are signed 64-bit; some filesystems hand out inode/dev numbers >= 2**63.
    return n - (1 << 64) if n >= (1 << 63) else n


def _stat_key(st: os.stat_result) -> _StatKey:
    return (_i64(st.st_dev), _i64(st.st_ino), st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class StatCache:
    """Digests of files and folders, remembered by stat in the SQLite file `db_path`."""

    def __init__(
        self,
        db_path: StrPath,
        *,
        timeout_s: float = 60.0,
        racy_window_s: float = RACY_WINDOW_S,
        read_only: bool = False,
    ) -> None:
        self.db_path = os.fspath(db_path)
        #: never write the database (digests found are kept in memory only)
        self.read_only = read_only
        self._unavailable = False  # the database cannot be opened: every lookup misses
        self.timeout_s = timeout_s
        self.racy_window_ns = int(racy_window_s * 1e9)
        #: lookups answered from the cache (no file bytes read)
        self.hits = 0
        #: files hashed because the cache had no up-to-date digest
        self.hashed_files = 0
        #: bytes read to hash those files
        self.hashed_bytes = 0
        self._conn: sqlite3.Connection | None = None
        self._pending: dict[str, tuple[_StatKey, str]] = {}
        self._prefetched: dict[str, tuple[_StatKey, str]] = {}
        self._batch_depth = 0
        self._lock = threading.RLock()

    # -- public -------------------------------------------------------------------------

    def file_digest(self, path: StrPath) -> str:
        """Digest of the file at `path` (links followed), read only if its stat changed."""
        abs_ = os.path.abspath(path)
        st = os.stat(abs_)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{abs_}: not a regular file (use path_digest for folders)")
        if not stat.S_ISREG(st.st_mode):
            from mopt.digest import TreeError

            raise TreeError(f"{abs_}: not a regular file (a device, socket or pipe); give a file or a folder")
        return self.digest_of(abs_, st)

    def digest_of(self, path: str, st: os.stat_result) -> str:
        """Digest of the regular file at absolute `path` whose stat the caller just took."""
        cached = self.lookup(path, st)
        if cached is not None:
            with self._lock:
                self.hits += 1
            return cached
        for _ in range(3):
            digest = hash_file(path)
            after = os.stat(path)
            with self._lock:
                self.hashed_files += 1
                self.hashed_bytes += after.st_size
            # The stat taken after hashing must match the one the digest is filed under,
            # or we hashed a file that was being written or replaced meanwhile.
            if _stat_key(after) == _stat_key(st):
                self.record(path, st, digest)
                return digest
            st = after
        raise OSError(f"{path}: kept changing while being hashed; is something still writing it?")

    def tree(self, path: StrPath) -> tuple[str, list[TreeEntry]]:
        """(tree digest, entries sorted by path) of the folder `path`; unchanged files are not read."""
        from mopt.digest import TreeEntry, iter_files, tree_digest

        base = os.path.abspath(path)
        with self.batch():
            self.prefetch(base)
            entries = [
                TreeEntry(rel, mode_of(st.st_mode), st.st_size, self.digest_of(abs_, st))
                for rel, abs_, st in iter_files(base)
            ]
        entries.sort(key=lambda e: e.path)
        return tree_digest(entries), entries

    def path_digest(self, path: StrPath) -> str:
        """Digest of a file, or the tree digest of a folder."""
        if os.path.isdir(path):
            return self.tree(path)[0]
        return self.file_digest(path)

    def prefetch(self, base: StrPath) -> None:
        """Load every record under folder `base` in one query (e.g. the CAS before a build),
        so that lookups there cost no SELECT each."""
        # paths under `base/` sort between "base/" and "base0" ("0" is the character after "/")
        prefix = os.path.abspath(base).rstrip("/") + "/"
        with self._lock:
            rows = self._query(
                "SELECT path, dev, inode, size, mtime_ns, ctime_ns, digest FROM stat"
                " WHERE path >= ? AND path < ?",
                (prefix, prefix[:-1] + "0"),
            )
            self._prefetched.update((r[0], (r[1:6], r[6])) for r in rows)

    def lookup(self, path: str, st: os.stat_result) -> str | None:
        """The recorded digest of absolute `path` if `st` matches what was recorded."""
        with self._lock:
            row = self._pending.get(path) or self._prefetched.get(path)
            if row is None:
                rows = self._query(
                    "SELECT dev, inode, size, mtime_ns, ctime_ns, digest FROM stat WHERE path = ?", (path,)
                )
                if rows:
                    row = (tuple(rows[0][:5]), rows[0][5])
        if row is not None and row[0] == _stat_key(st):
            return row[1]
        return None

    def record(self, path: str, st: os.stat_result, digest: str) -> bool:
        """Remember that absolute `path` with stat `st` has `digest`; False if too recent."""
        if self._is_racy(st):
            return False
        with self._lock:
            self._pending[path] = (_stat_key(st), digest)
            if path in self._prefetched:
                self._prefetched[path] = (_stat_key(st), digest)
            if self._batch_depth == 0:
                self.flush()
        return True

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group the writes made inside into one transaction, committed on exit."""
        with self._lock:
            self._batch_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._batch_depth -= 1
                if self._batch_depth == 0:
                    self.flush()

    def flush(self) -> None:
        """Commit pending records in one transaction."""
        with self._lock:
            if not self._pending or self.read_only:
                return  # read-only: what was learnt stays in _pending, for this process
            rows = [(p, *key, d) for p, (key, d) in self._pending.items()]
            self._pending.clear()
            self._write(
                "INSERT OR REPLACE INTO stat VALUES (?,?,?,?,?,?,?)",
                rows,
                f"could not save {len(rows)} digests",
            )

    def prune(self) -> int:
        """Forget records whose file is gone or changed; return how many were removed."""
        self.flush()
        if self.read_only:
            return 0
        with self._lock:
            stale: list[tuple[str]] = []
            for path, *key in self._query("SELECT path, dev, inode, size, mtime_ns, ctime_ns FROM stat", ()):
                try:
                    if _stat_key(os.stat(path)) == tuple(key):
                        continue
                except OSError:
                    pass
                stale.append((path,))
            if stale:
                self._write("DELETE FROM stat WHERE path = ?", stale, "could not prune")
        return len(stale)

    def close(self) -> None:
        """Flush and close the database connection (it reopens on next use)."""
        with self._lock:
            self.flush()
            self._drop_connection()

    def __enter__(self) -> StatCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _is_racy(self, st: os.stat_result) -> bool:
        # Timestamps come from a coarse clock (a jiffy, or whole seconds on some
        # filesystems): a write right after we hashed may leave size, mtime and ctime as
        # they were. Once the clock has moved past the file's ctime, any later write must
        # change ctime, so only files changed within the window are left uncached (as git
        # does with "racily clean" entries). mtime is not used: a user can set it.
        window = self.racy_window_ns
        if st.st_ctime_ns % 1_000_000_000 == 0:
            window = max(window, _COARSE_WINDOW_NS)
        return time.time_ns() - st.st_ctime_ns < window

    def _write(self, sql: str, rows: list[tuple[Any, ...]], failed: str) -> None:
        """Run `sql` for each of `rows` in one transaction. A damaged database is moved aside
        (once) and the rows go to a fresh one; any other error is a warning: losing cache
        records only costs a rehash later, and a build must not fail on it."""
        for attempt in (0, 1):
            conn = self._db()
            if conn is None:
                return
            try:
                conn.execute("BEGIN IMMEDIATE")
                with conn:  # commits, or rolls back on any exception
                    conn.executemany(sql, rows)
                return
            except sqlite3.Error as e:
                if attempt == 0 and _is_damage(e):
                    self._move_aside(e)
                    continue
                _log().warning("stat cache %s: %s: %s", self.db_path, failed, e)
                return

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Rows of a read; a damaged database is moved aside (once) and reads as empty."""
        for attempt in (0, 1):
            try:
                conn = self._db()
                if conn is None:
                    return []
                return conn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                if attempt == 0 and _is_damage(e) and not self.read_only:
                    self._move_aside(e)
                    continue
                _log().warning("stat cache %s unusable, hashing instead: %s", self.db_path, e)
                self._drop_connection()
                self._unavailable = True
                return []
        return []

    def _move_aside(self, err: sqlite3.Error) -> None:
        """Rename a damaged database to state.db.broken and start an empty one."""
        self._drop_connection()
        aside = self.db_path + ".broken"
        _log().warning(
            "stat cache %s is damaged (%s); moved it to %s and starting an empty one (it is a cache: "
            "files are rehashed once)",
            self.db_path,
            err,
            aside,
        )
        try:
            os.replace(self.db_path, aside)
        except OSError as e:
            _log().warning("could not move %s aside: %s; not using a stat cache", self.db_path, e)
            self._unavailable = True
        for side in ("-wal", "-shm", "-journal"):
            with contextlib.suppress(OSError):
                os.unlink(self.db_path + side)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def _not_regular(self) -> str | None:
        """The database file or one of its -wal/-shm/-journal files when it is there but is
        not a regular file (a symbolic link, a fifo, a folder): SQLite would write through
        the link or block on the fifo, so the cache is not used."""
        for side in ("", "-wal", "-shm", "-journal"):
            try:
                st = os.lstat(self.db_path + side)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                return self.db_path + side
        return None

    def _db(self) -> sqlite3.Connection | None:
        if self._conn is not None or self._unavailable:
            return self._conn
        bad = self._not_regular()
        if bad is not None:
            _log().warning("stat cache %s is not a regular file; not using a stat cache (remove it)", bad)
            self._unavailable = True
            return None
        if self.read_only:
            return self._open_read_only()
        parent = os.path.dirname(self.db_path)
        for attempt in (0, 1):
            conn = None
            try:
                if parent:
                    os.makedirs(parent, exist_ok=True)
                conn = sqlite3.connect(
                    self.db_path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False
                )
                self._setup(conn)
            except BaseException as e:
                if conn is not None:
                    conn.close()
                if not isinstance(e, (sqlite3.Error, OSError)):
                    raise
                if attempt == 0 and isinstance(e, sqlite3.Error) and _is_damage(e):
                    self._move_aside(e)
                    if self._unavailable:
                        return None
                    continue
                _log().warning("stat cache %s cannot be opened, hashing instead: %s", self.db_path, e)
                self._unavailable = True
                return None
            self._conn = conn
            return conn
        return None

    def _open_read_only(self) -> sqlite3.Connection | None:
        # mode=ro never creates or changes the file; a database that is missing, damaged
        # or in a folder we cannot write (WAL needs its -shm) just means no cache.
        if not os.path.exists(self.db_path):
            self._unavailable = True
            return None
        try:
            conn = sqlite3.connect(
                f"file:{self.db_path}?mode=ro",
                uri=True,
                timeout=self.timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
            if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                conn.close()
                self._unavailable = True
                return None
        except sqlite3.Error as e:
            _log().debug("stat cache %s not readable: %s", self.db_path, e)
            self._unavailable = True
            return None
        self._conn = conn
        return conn

    def _setup(self, conn: sqlite3.Connection) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                # WAL persists in the file, so after the first open this is a read.
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                # Switching to WAL needs an exclusive lock and does not wait on the
                # busy handler; several processes opening a new database race here.
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        conn.execute("PRAGMA synchronous=NORMAL")
        if conn.execute("PRAGMA user_version").fetchone()[0] == _SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        with conn:  # commits, or rolls back on any exception
            if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                # It is a cache: an old layout is dropped, not migrated.
                conn.execute("DROP TABLE IF EXISTS stat")
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
