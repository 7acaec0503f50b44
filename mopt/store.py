"""The store: content-addressed blobs (cas/), the action cache (ac/), and folders built from them.

Layout under the root::

    cas/<2 hex>/<digest>   immutable read-only blobs, named by their BLAKE3 digest
    ac/<key>.json          one entry per successful action: its outputs tree, log, timings
    tmp/                   temp files; complete ones are renamed into cas/ or ac/
    logs/                  failed-<key>.log: the log of a failed action (failures are not cached)
    locks/                 <key>.lock: one flock per action key; entries-<NN>.lock (64 of
                           them): byte-range locks saying which entries running builds use
                           (gc skips them)
    roots/                 symlinks to the lock files of projects using this store (gc roots)
    state.db               the stat cache (mopt.statcache)

Crash safety follows Bazel's disk cache: every file is written to a temp file, fsynced and
renamed, so a final name never holds a partial file. Blobs are written before the entry
that names them, and an entry whose blobs are missing is a miss, so nothing needs a lock
except "do not build the same action twice at once" (`lock`) and "do not collect garbage
while an entry is being written or used" (`in_use`, `gc`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from mopt.digest import (
    MODE_EXEC,
    StrPath,
    TreeEntry,
    TreeError,
    canonical_json,
    check_digest,
    hash_bytes,
    hash_file,
    is_digest,
    iter_files,
    mode_of,
    parse_tree_manifest,
    tree_manifest_bytes,
)
from mopt.errors import MoptError
from mopt.filehash import FileStat, NotRegularFileError, file_stat, fsync_dir, no_space, read_regular
from mopt.statcache import StatCache

log = logging.getLogger(__name__)

MaterializeMethod = Literal["reflink", "hardlink", "copy", "unchanged"]

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_COPY_CHUNK = 64 * 1024 * 1024
_FULL = (errno.ENOSPC, errno.EDQUOT)
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_FICLONE = 0x40049409  # _IOW(0x94, 9, int) from linux/fs.h
_TMP_PREFIX = ".mopt-tmp-"
_OLD_PREFIX = ".mopt-old-"
_GC_LOCK = "_gc"  # not a valid action key, so it cannot collide with one
#: files at least this large are hard-linked into build/ (read-only) when no reflink is
#: possible; smaller ones are copied. A copy makes a build/ file independent of the blob (an
#: edit after chmod +w cannot reach the store or another target's file) and costs little for
#: configs, tokenizers and small ONNX files; copying multi-GB checkpoints would double the disk
#: used and the time of every materialization, so those stay links, checked by inode and
#: stat on every build (an edit of one changes the blob's stat, so it is rehashed and
#: rebuilt, see `Store.intact_stat`).
HARDLINK_MIN_BYTES = 16 * 1024 * 1024
#: a hit touches its entry (gc's "last used") only when the entry's mtime is older than
#: this: a touch changes the entry's stat, which the build log then checks by its digest;
#: gc's least-recently-used order is kept to this grain
TOUCH_AFTER_S = 600.0
#: temp files younger than this are left alone by cleanup (their writer may not have locked them yet)
TMP_GRACE_S = 60.0


class StoreError(MoptError):
    """The store cannot do what was asked; the message says which blob, entry or path.

    A MoptError so that, uncaught, it is one line and exit 1, never a traceback."""

    exit_code = 1


class BlobMissingError(StoreError):
    """A blob that should be in the store is not."""


class StoreFullError(StoreError):
    """The store's filesystem is full (ENOSPC / EDQUOT); the message names it and the bytes."""


class StoreUnusableError(StoreError):
    """The store cannot be written here (read-only filesystem, another owner, permissions)."""


class OutsideError(StoreError):
    """A path to write or delete resolves outside the store and the build folders."""


class StoreLayoutError(StoreError):
    """A folder or file of the store's own layout is something else (a file where a folder
    belongs, a symbolic link, a fifo): exit 2, the message names the path and what to do."""

    exit_code = 2


#: the store's own folders and files (see the module): each must be what it is meant to be
_LAYOUT_DIRS = ("cas", "ac", "tmp", "logs", "locks", "roots", "log", "cache")
_LAYOUT_FILES = ("state.db", "state.db-wal", "state.db-shm", "state.db-journal")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")


def _what(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    return "a device or socket"


def check_layout(root: StrPath) -> None:
    """StoreLayoutError unless every folder and metadata file of the store at `root` that
    exists is what mopt keeps there: a folder (not a file or a link to one elsewhere) for
    the store itself, cas/ (and its shards), ac/, tmp/, logs/, locks/, roots/, log/, cache/;
    a regular file (not a link, which SQLite would write through, nor a fifo, which would
    block the open) for state.db and its -wal/-shm/-journal files. The store's own path may
    be a link to a folder (a store on another disk)."""
    root = Path(root).absolute()
    hint = "remove it and mopt recreates it, or point [store] path elsewhere"
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StoreLayoutError(f"the store {root} cannot be read: {e.strerror or e}", hint=hint) from None
    if not stat.S_ISDIR(st.st_mode):
        raise StoreLayoutError(
            f"the store {root} is {_what(st.st_mode)}, not a folder", hint="remove it or point [store] path elsewhere"
        )
    shards = [d.path for d in _scandir_quiet(root / "cas") if _SHARD_RE.fullmatch(d.name)]
    for d in [*(str(root / name) for name in _LAYOUT_DIRS), *shards]:
        try:
            mode = os.lstat(d).st_mode
        except OSError:
            continue  # missing: created when needed
        if not stat.S_ISDIR(mode):
            raise StoreLayoutError(f"{d} is {_what(mode)}, not the folder mopt keeps there", hint=hint)
    for name in _LAYOUT_FILES:
        p = root / name
        try:
            mode = os.lstat(p).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise StoreLayoutError(
                f"{p} is {_what(mode)}, not the stat cache mopt keeps there",
                hint="remove it (a cache: files are rehashed once), or point [store] path elsewhere",
            )


def guard_path(path: StrPath, roots: Iterable[StrPath], *, resolved: bool = False) -> str:
    """`path` made absolute, if it resolves inside one of `roots`; else OutsideError.

    Every folder mopt writes or deletes under build/ or the store goes through here: a
    name with `..`, an absolute name, or a symlinked folder on the way (build/m -> /etc)
    would otherwise let a recipe or a planted link write or delete anywhere. The last
    component is not followed, so a link itself can be replaced or removed. `resolved`:
    the roots are real paths already.
    """
    p = os.path.abspath(path)
    parent, name = os.path.split(p)
    real = os.path.join(os.path.realpath(parent), name)
    real_roots = [os.fspath(r) for r in roots] if resolved else [os.path.realpath(r) for r in roots]
    for r in real_roots:
        if real != r and (real + "/").startswith(r.rstrip("/") + "/"):
            return p
    raise OutsideError(
        f"refusing to write or delete {p}: it resolves to {real}, outside the store and the "
        f"build folder ({', '.join(real_roots)})",
        hint="a name in the recipe or a symbolic link points outside; fix the name or remove the link",
    )


def check_key(key: str) -> str:
    """Return `key` if it is usable as an action key / file name, else raise ValueError."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"invalid action key {key!r}: use 1-200 of [A-Za-z0-9._-], not starting with . _ -")
    return key


class ActionEntry(BaseModel):
    """What the action cache records for one successful action."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: Annotated[str, AfterValidator(check_key)]
    kind: str
    target: str
    outputs_tree: Annotated[str, AfterValidator(check_digest)]
    log: Annotated[str, AfterValidator(check_digest)] | None = None
    duration_s: float = 0.0
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    host: str = Field(default_factory=socket.gethostname)
    created: float = Field(default_factory=time.time)
    meta: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """Disk used by the store."""

    total_bytes: int
    blobs: int
    blob_bytes: int
    ac_entries: int
    ac_bytes: int
    log_bytes: int


@dataclass(frozen=True)
class GcReport:
    """What `Store.gc` removed (or would remove, with dry_run) and what it kept."""

    dry_run: bool
    removed_entries: int
    removed_blobs: int
    removed_logs: int
    removed_bytes: int
    kept_entries: int
    kept_blobs: int
    kept_bytes: int


class Store:
    """A content-addressed store and action cache rooted at `root` (created if missing).

    With `read_only`, nothing is created, touched, repaired or deleted (plan, ls, show,
    explain, report): damage is reported as a miss, and the stat cache is only read.
    """

    def __init__(self, root: StrPath, *, read_only: bool = False) -> None:
        self.root = Path(root).absolute()
        self.read_only = read_only
        self.cas_dir = self.root / "cas"
        self.ac_dir = self.root / "ac"
        self.tmp_dir = self.root / "tmp"
        self.logs_dir = self.root / "logs"
        self.locks_dir = self.root / "locks"
        self.roots_dir = self.root / "roots"
        self._cas_prefix = f"{self.cas_dir}/"
        self._ac_prefix = f"{self.ac_dir}/"
        self._trees: dict[str, list[TreeEntry]] = {}  # manifests are immutable: parse once
        # the real paths of the store and the folders `allow`ed (build/), resolved once: a link
        # that appears later on the way to one makes paths under it resolve elsewhere, so they
        # are refused (it fails closed)
        self._real_roots: list[str] = [os.path.realpath(self.root)]
        #: path → lstat of each blob found intact (`intact_stat`) by this Store: what the build
        #: log records them under (a stat taken when it was checked: a change since is a miss)
        self.verified: dict[str, os.stat_result] = {}
        #: key → (stat, digest) of the entry file this Store read, wrote or touched
        self.entry_files: dict[str, tuple[FileStat, str]] = {}
        self._use_fds: dict[int, int | None] = {}  # shard → descriptor of locks/entries-<NN>.lock
        self._used: set[str] = set()
        self._use_lock = threading.Lock()
        check_layout(self.root)
        if not read_only:
            for d in (self.cas_dir, self.ac_dir, self.tmp_dir, self.logs_dir, self.locks_dir):
                with self._writing(f"the folder {d}"):
                    d.mkdir(parents=True, exist_ok=True)
        #: the stat cache kept in `root/state.db` (opened at its first use)
        self.state = StatCache(self.root / "state.db", read_only=read_only)

    def close(self) -> None:
        """Flush and close the stat cache; release the locks on used entries."""
        self.state.close()
        with self._use_lock, _closing(self._use_fds):
            self._used.clear()

    def allow(self, folder: StrPath) -> None:
        """Let this store write and delete under `folder` too (a build/ folder)."""
        self._real_roots.append(os.path.realpath(folder))

    def guard(self, path: StrPath) -> str:
        """`path` if it resolves inside the store or an allowed folder, else OutsideError."""
        return guard_path(path, self._real_roots, resolved=True)

    def _guard_dest(self, dest: StrPath) -> str:
        # The engine names the build folder (`allow`), so every name a recipe gives is held
        # inside it; a library caller that allowed none chose the destination itself.
        if len(self._real_roots) > 1:
            return self.guard(dest)
        return os.path.abspath(dest)

    def check_writable(self) -> None:
        """Raise StoreUnusableError (one line) unless this process can write the store."""
        with self._writing("a probe file"):
            fd, tmp = tempfile.mkstemp(prefix="probe-", dir=self.tmp_dir)
        os.close(fd)
        os.unlink(tmp)
        try:
            owner = os.stat(self.root).st_uid
        except OSError:
            return
        if owner != os.geteuid() and os.geteuid() == 0 and os.environ.get("MOPT_STORE_ANY_OWNER") != "1":
            # root can write anything, but files it leaves in another user's store are files
            # that user's mopt can no longer replace or collect (git refuses such repositories
            # for the same reason; a container running as root on a mounted checkout opts in)
            raise StoreUnusableError(
                f"the store {self.root} belongs to uid {owner}; not writing it as root",
                hint="build as its owner, set [store] path in mopt.toml to a store of your own, "
                "or set MOPT_STORE_ANY_OWNER=1",
            )

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- blobs --------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Where the blob `digest` lives (whether or not it is there)."""
        return Path(self.blob_str(digest))

    def blob_str(self, digest: str) -> str:
        """`blob_path` as a string (hot paths avoid pathlib)."""
        check_digest(digest)
        return f"{self._cas_prefix}{digest[:2]}/{digest}"

    def has(self, digest: str) -> bool:
        """Whether the blob `digest` is in the store (present; see `intact_stat` for its bytes)."""
        return os.path.exists(self.blob_str(digest))

    def intact_stat(self, digest: str, *, repair: bool = True) -> os.stat_result | None:
        """The lstat of blob `digest` if it is present, read-only and holds its bytes, else None.

        Checked through the stat cache: an untouched blob costs a stat, one whose stat changed
        (or that someone made writable) is rehashed. With `repair`, a damaged blob is removed
        (it is then a miss: the action reruns, or the next put writes the bytes again) and a
        writable but intact one made read-only again.
        """
        path = self.blob_str(digest)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        ok = False
        if stat.S_ISREG(st.st_mode):
            try:
                ok = self.state.digest_of(path, st) == digest
            except OSError:
                # the stat cache gave up: the stat kept moving while it read (siblings linking
                # the blob into their inputs move its ctime); the bytes decide below
                ok = False
            if not ok:
                # Never condemn a blob on the stat cache's word alone: a wrong row
                # (restored backup, clock skew) must not delete intact bytes.
                try:
                    ok = hash_file(path) == digest
                    if ok:
                        self.state.record(path, st, digest)
                except OSError:
                    ok = False
        if ok and st.st_mode & 0o222 and repair and not self.read_only:
            with suppress(OSError):
                os.chmod(path, 0o444)
                st = os.lstat(path)  # its ctime changed
        if not ok:
            log.warning("blob %s is damaged (its bytes no longer match its name)%s", path,
                        "; removing it" if repair and not self.read_only else "")
            if repair and not self.read_only:
                self.discard_blob(digest)
            return None
        self.verified[path] = st
        return st

    def discard_blob(self, digest: str) -> bool:
        """Remove blob `digest` (found damaged: a later hit that needs it is a miss and
        rebuilds it); whether it was there."""
        path = self.guard(self.blob_str(digest))
        self.verified.pop(path, None)
        self._trees.pop(digest, None)
        if not os.path.lexists(path):
            return False
        _rmtree_ro(path)  # a folder where a blob belongs is damage too
        return True

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; return its digest. A damaged blob of that name is replaced."""
        digest = hash_bytes(data)
        if self.intact_stat(digest) is not None:
            return digest
        with self._writing("a blob", len(data)), self._temp_file("blob-") as (fd, tmp):
            _write_all(fd, data)
            os.fchmod(fd, 0o444)
            os.fsync(fd)
            self._rename_into_cas(tmp, digest)
        return digest

    def put_file(self, path: StrPath) -> str:
        """Store a copy of the file at `path`; return its digest. A damaged blob of that
        name is replaced (dedup never trusts a blob whose stat changed)."""
        src = os.fspath(path)
        digest = hash_file(src)
        if self.intact_stat(digest) is not None:
            return digest
        size = os.stat(src).st_size
        with self._writing(f"a copy of {src}", size), self._temp_file("blob-") as (fd, tmp):
            with open(src, "rb") as f:
                _copy_fd(f.fileno(), fd)
            os.fchmod(fd, 0o444)
            os.fsync(fd)
            # Name the blob by what was written, not by what was read before: a file
            # rewritten in between must not land under the old digest.
            written = hash_file(tmp)
            if written != digest:
                raise StoreError(
                    f"{src}: changed while being stored (digest {digest[:12]} before copying, "
                    f"{written[:12]} after); is something still writing it?"
                )
            self._rename_into_cas(tmp, digest)
        return digest

    @contextmanager
    def _writing(self, what: str, needed: int | None = None) -> Iterator[None]:
        """Turn a full disk or an unwritable store into a one-line StoreError."""
        if self.read_only:
            raise StoreUnusableError(f"the store {self.root} was opened read-only; not writing {what}")
        try:
            yield
        except OSError as e:
            if e.errno in _FULL:
                raise StoreFullError(
                    no_space(self.root, f"writing {what}", needed, f"the store {self.root}"),
                    hint="free space (e.g. `mopt gc --max-size ...`) or move [store] path to a bigger disk",
                ) from None
            if e.errno in _UNWRITABLE:
                try:
                    owner: int | None = os.stat(self.root).st_uid
                except OSError:
                    owner = None
                mine = os.geteuid()
                who = f"it belongs to uid {owner}, you are uid {mine}; " if owner not in (None, mine) else ""
                raise StoreUnusableError(
                    f"cannot write the store {self.root} ({e.strerror}) while writing {what}",
                    hint=f"{who}set [store] path in mopt.toml to a folder you can write; read-only commands still work",
                ) from None
            raise

    def put_tree(self, directory: StrPath) -> tuple[str, list[TreeEntry]]:
        """Store every file under `directory` and its manifest; return (tree digest, entries)."""
        entries = []
        for rel, abs_, st in list(iter_files(directory)):  # every name checked before a blob is stored
            digest = self.put_file(abs_)
            size = self.blob_path(digest).stat().st_size
            entries.append(TreeEntry(rel, mode_of(st.st_mode), size, digest))
        entries.sort(key=lambda e: e.path)
        return self.put_bytes(tree_manifest_bytes(entries)), entries

    def read_bytes(self, digest: str) -> bytes:
        """The content of blob `digest`; BlobMissingError if it is not in the store."""
        try:
            return read_regular(self.blob_str(digest))  # a fifo or a link in its place: missing
        except FileNotFoundError:
            raise BlobMissingError(f"blob {digest} is not in the store {self.root}") from None
        except (NotRegularFileError, IsADirectoryError):
            raise BlobMissingError(f"blob {digest} in the store {self.root} is not a regular file") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BlobMissingError(f"blob {digest} in the store {self.root} is a symbolic link") from None
            raise

    def verify(self, digest: str) -> bool:
        """Whether blob `digest` is present and its bytes still hash to `digest`."""
        try:
            return hash_file(self.blob_path(digest)) == digest
        except FileNotFoundError:
            return False

    def tree_entries(self, tree_digest: str, *, present: bool = False) -> list[TreeEntry]:
        """The entries of the stored tree `tree_digest` (`present`: the caller has just
        found its blob intact)."""
        known = self._trees.get(tree_digest)
        if known is not None and (present or self.has(tree_digest)):
            return list(known)
        try:
            data = self.read_bytes(tree_digest)
        except IsADirectoryError:
            data = b""
        if hash_bytes(data) != tree_digest:
            raise StoreError(f"blob {tree_digest} in {self.root} is corrupt (its bytes changed)")
        try:
            entries = parse_tree_manifest(data)
        except TreeError as e:
            raise StoreError(f"blob {tree_digest} in {self.root} is not a tree manifest: {e}") from e
        self._trees[tree_digest] = entries
        return list(entries)

    def put_log(self, path: StrPath) -> str:
        """Store an action's log file; return its digest (for `ActionEntry.log`)."""
        return self.put_file(path)

    # -- action cache -------------------------------------------------------------------

    def ac_put(self, key: str, entry: ActionEntry | Mapping[str, Any]) -> ActionEntry:
        """Record a successful action. Call it last, after its blobs are stored."""
        e = entry if isinstance(entry, ActionEntry) else ActionEntry.model_validate(dict(entry))
        check_key(key)
        if e.key != key:
            raise ValueError(f"action entry is for key {e.key!r}, not {key!r}")
        missing = self._missing_blobs(e)
        if missing:
            raise BlobMissingError(
                f"action {key}: not recording an entry whose blobs are not stored: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
            )
        final = self.ac_str(key)
        if os.path.isdir(final) and not os.path.islink(final):
            _rmtree_ro(self.guard(final))  # a malformed entry (a folder) cannot be replaced by rename
        self.use(key)
        data = canonical_json(e.model_dump(mode="json"))
        self._write_atomic(final, data, what=f"the action entry {key}")
        with suppress(OSError):
            self.entry_files[key] = (file_stat(os.lstat(final)), hash_bytes(data))
        return e

    def ac_str(self, key: str) -> str:
        """Where the entry of `key` lives (whether or not it is there)."""
        return f"{self._ac_prefix}{check_key(key)}.json"

    def ac_entry(self, key: str, *, check_blobs: bool = True) -> ActionEntry | None:
        """The entry for `key`, or None on a miss (absent, unreadable, or blobs missing).

        `check_blobs=False` leaves the blob check to the caller (the engine checks them
        through the stat cache, which also catches changed bytes)."""
        path = self.ac_str(key)
        try:
            st = os.lstat(path)
        except OSError:  # absent (or its folder unreadable): a miss
            return None
        if not self.read_only:
            # Say "in use" before reading, so a gc deciding now keeps the entry and its
            # blobs for as long as this build runs (see `use`).
            self.use(key)
        try:
            # through one descriptor, so the stat recorded is the stat of the bytes read (the
            # name may be replaced meanwhile); a fifo put in its place does not block
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                data = fh.read()
            e = ActionEntry.model_validate_json(data)
            if e.key != key:
                raise ValueError(f"it is the entry of {e.key!r}")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:  # ValidationError is a ValueError
            why = " ".join(str(err).split())[:200]
            if self.read_only:
                log.warning("action cache entry %s is malformed, treating it as a miss: %s", path, why)
            else:
                log.warning("action cache entry %s is malformed; removing it (a miss): %s", path, why)
                with suppress(OSError):
                    _rmtree_ro(self.guard(path))
            return None
        self.entry_files[key] = (file_stat(st), hash_bytes(data))
        # Touch the entry before checking its blobs (as Bazel does), so that a gc running
        # now sees it as recently used
        self.touch_if_due(key, file_stat(st))
        if check_blobs and self._missing_blobs(e):
            return None
        return e

    def touch_if_due(self, key: str, fs: FileStat | None) -> FileStat | None:
        """Touch the entry file of `key` (its stat `fs`: gc's "last used") if its last touch is
        older than TOUCH_AFTER_S; its new stat, or None if it was not touched (not due, gone,
        another user's entry in a shared store)."""
        if self.read_only or fs is None or time.time_ns() - fs[3] <= TOUCH_AFTER_S * 1e9:
            return None
        try:
            fd = os.open(self.ac_str(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (fs[0], fs[1]):
                return None
            os.utime(fd)
            new = file_stat(os.fstat(fd))
            seen = self.entry_files.get(key)
            if seen is not None:
                self.entry_files[key] = (new, seen[1])
            return new
        except OSError:
            return None
        finally:
            os.close(fd)

    def use(self, key: str) -> None:
        """Hold a shared lock on entry `key` until `close`: gc leaves it and its blobs alone.

        One byte per key (POSIX record locks on locks/entries-<NN>.lock), so a build using
        ten thousand entries holds at most 64 descriptors, and the locks die with the
        process. gc takes the exclusive lock of each entry it would drop, without waiting.
        The locks are spread over 64 files because the kernel keeps a file's record locks
        in one list that every new lock walks: 10,000 locks on one file cost seconds.
        """
        if self.read_only:
            return
        with self._use_lock:
            if key not in self._used and _lock_entry(self._use_fds, self.locks_dir, key, fcntl.LOCK_SH):
                self._used.add(key)

    def keep_failed_log(self, key: str, log_path: StrPath) -> Path | None:
        """Copy a failed action's log to logs/failed-<key>.log; failures never enter ac/.

        Returns None (with a warning) when the store cannot take it, e.g. a full disk: the
        action's own error must still be what the user sees, not this one."""
        dest = self.logs_dir / f"failed-{check_key(key)}.log"
        data = b""
        try:
            with open(log_path, "rb") as f:
                data = f.read()
            self._write_atomic(dest, data, mode=0o644, what=f"the log of failed action {key[:16]}")
        except (OSError, StoreError) as e:
            # The log is about to go with the action's scratch folder: show its end now,
            # so the action's own error (often the cause, e.g. the same full disk) is seen.
            tail = data[-4096:].decode("utf-8", "replace").splitlines()[-10:]
            log.warning(
                "could not keep the log of failed action %s: %s%s",
                key[:16],
                e,
                "".join(f"\n  | {line}" for line in tail),
            )
            return None
        return dest

    @contextmanager
    def scratch_dir(self, prefix: str = "scratch-") -> Iterator[Path]:
        """A new folder in root/tmp (e.g. an action's output folder), removed on exit.

        `cleanup_tmp` leaves it alone for as long as it is in use, however long that is;
        after a crash it is swept like any other leftover.
        """
        with self._writing("a scratch folder"):
            path = tempfile.mkdtemp(prefix=prefix, dir=self.tmp_dir)
        busy = _mark_being_written(path)
        try:
            with suppress(OSError):  # who holds it, for whoever looks at a leftover
                Path(path, ".mopt-owner").write_text(f"{os.getpid()} {socket.gethostname()}\n")
            yield Path(path)
        finally:
            try:
                _rmtree_ro(path)
            finally:
                os.close(busy)

    # -- locks --------------------------------------------------------------------------

    def lock(self, key: str, *, on_wait: Callable[[], None] | None = None) -> AbstractContextManager[int]:
        """Hold the exclusive lock of action `key` (blocking); `on_wait` runs if it is taken.

        Yields the locked descriptor: a process that inherits a copy of it (the action's
        worker and its children) keeps the lock held until the last copy is closed, so a
        waiting build never runs the action beside an orphan of a killed one.
        """
        return self._flock(check_key(key), shared=False, on_wait=on_wait)

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Keep `gc` out while storing an action's outputs or materializing a hit (a shared
        flock: holding it again inside, on another descriptor, is granted even while a gc waits)."""
        with self._flock(_GC_LOCK, shared=True):
            yield

    # -- materialize --------------------------------------------------------------------

    def materialize(
        self, tree_digest: str, dest: StrPath, *, blobs_checked: bool = False
    ) -> MaterializeMethod:
        """Make `dest` a read-only copy of the stored tree; return how files were placed.

        The tree is built at a temp sibling of `dest` and swapped in, so `dest` is never
        half-built. Files are reflinked, else hard-linked (not executables: a link shares
        the blob's 0o444 mode), else copied. Returns the least efficient method any file
        needed, or "unchanged" when `dest` already held exactly this tree. `blobs_checked`:
        the caller has just found every blob of the tree intact (a cache hit).
        """
        target = Path(self._guard_dest(dest))
        entries = self.tree_entries(tree_digest, present=blobs_checked)
        missing = [] if blobs_checked else sorted({e.digest for e in entries if not self.has(e.digest)})
        if missing:
            raise BlobMissingError(
                f"cannot materialize tree {tree_digest} at {target}: "
                f"{len(missing)} blob(s) missing from {self.root}, e.g. {missing[0]}"
            )
        if self._holds_tree(target, entries):
            return "unchanged"
        with self._writing_build(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            self._guard_dest(target)  # again, now that the folders on the way exist
            _remove_leftovers(target.parent, TMP_GRACE_S, (_TMP_PREFIX, _OLD_PREFIX))
            tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent)
        busy = _mark_being_written(tmp)
        try:
            with self._writing_build(target):
                # Copies are not fsynced (it cost ~8 ms a file here, 1.7 s per 200 targets):
                # they are derived from fsynced blobs and checked on every build (size and
                # mode, then bytes through the stat cache, whose rows are only written after
                # hashing what is on disk); on ext4/xfs (data=ordered) a crash leaves a new
                # file short rather than with wrong bytes, so it is found and rewritten.
                method = self._fill(tmp, entries)
                for dirpath, _dirs, _files in os.walk(tmp, topdown=False):
                    os.chmod(dirpath, 0o555)
                _swap_into_place(tmp, target)
        except BaseException:
            _rmtree_ro(tmp)
            raise
        finally:
            os.close(busy)
        return method

    @contextmanager
    def _writing_build(self, target: Path) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if e.errno in _FULL:
                raise StoreFullError(
                    no_space(target.parent, f"materializing {target.name}"),
                    hint="free space, or set [store] build_dir to a bigger disk",
                ) from None
            if e.errno in _UNWRITABLE:
                raise StoreUnusableError(
                    f"cannot write {target} ({e.strerror})", hint="the build folder must be writable"
                ) from None
            raise

    # -- maintenance --------------------------------------------------------------------

    def cleanup_tmp(self, max_age_s: float = TMP_GRACE_S) -> int:
        """Remove what crashed writers left in tmp/; return how many were removed.

        Only entries older than `max_age_s` whose writer no longer holds them are removed:
        a live writer holds an flock on each (a killed one's dies with it), so the default
        age is only a grace for the moment between creating a file and locking it. (The
        leftovers of an interrupted `materialize` beside a build/ folder are removed by the
        next `materialize` there.)
        """
        if self.read_only:
            return 0
        return _remove_leftovers(self.tmp_dir, max_age_s, guard=self.guard)

    def usage(self) -> Usage:
        """Bytes and counts of blobs, action entries and failed logs."""
        blobs = [size for _digest, size, _mtime in self._iter_blobs()]
        entries = [_size_quiet(d) for d in _scandir_quiet(self.ac_dir) if d.name.endswith(".json")]
        logs = sum(_size_quiet(d) for d in _scandir_quiet(self.logs_dir))
        total = sum(blobs) + sum(entries) + logs
        return Usage(total, len(blobs), sum(blobs), len(entries), sum(entries), logs)

    def gc(
        self,
        max_size_bytes: int | None = None,
        older_than_s: float | None = None,
        keep_keys: Collection[str] = frozenset(),
        dry_run: bool = False,
        *,
        min_blob_age_s: float = 600.0,
    ) -> GcReport:
        """Collect garbage, least recently used first.

        Removes action entries not in `keep_keys` (the roots named by lock files), oldest
        use first, while the store is larger than `max_size_bytes` or the entry is older
        than `older_than_s`; then every blob no remaining entry references (tree members
        and logs included). Broken entries (unreadable, blobs missing) always go. Blobs no
        entry ever referenced are kept for `min_blob_age_s`: they may belong to an action
        whose entry is about to be written. Failed logs older than `older_than_s` go too.
        """
        if self.read_only:
            raise StoreUnusableError(f"the store {self.root} was opened read-only; gc cannot run")
        fds: dict[int, int | None] = {}

        def free(key: str) -> bool:
            # An entry a running build uses (see `use`) is kept; the exclusive lock taken
            # here is held until gc is done, so no build starts using it meanwhile.
            return _lock_entry(fds, self.locks_dir, key, fcntl.LOCK_EX | fcntl.LOCK_NB)

        with self._flock(_GC_LOCK, shared=False), _closing(fds):
            now = time.time()
            live: list[tuple[float, str, int, set[str]]] = []  # (last use, key, size, blobs)
            drop_entries: list[tuple[str, int]] = []
            for d in _scandir_quiet(self.ac_dir):
                if not d.name.endswith(".json"):
                    continue
                try:
                    st = d.stat(follow_symlinks=False)
                    e = ActionEntry.model_validate_json(read_regular(d.path))  # not a link, fifo, folder
                    refs = self._entry_refs(e)
                except FileNotFoundError:
                    continue
                except (ValueError, StoreError, OSError):  # ValidationError is a ValueError
                    drop_entries.append((d.path, _size_quiet(d)))
                    continue
                if e.key != d.name[: -len(".json")]:
                    drop_entries.append((d.path, st.st_size))
                    continue
                live.append((st.st_mtime, e.key, st.st_size, refs))

            # Blobs are listed after entries: an entry is written only once its blobs exist,
            # so every blob of an entry seen above is seen here unless it is really gone.
            blobs = {digest: (size, mtime) for digest, size, mtime in self._iter_blobs()}
            broken = [x for x in live if any(r not in blobs for r in x[3]) and free(x[1])]
            live = [x for x in live if x not in broken]
            drop_entries += [(self.ac_str(k), size) for _t, k, size, _r in broken]

            refcount: Counter[str] = Counter()
            for _t, _k, _s, refs in live:
                refcount.update(refs)

            drop_logs: list[tuple[str, int]] = []
            log_bytes = 0
            for d in _scandir_quiet(self.logs_dir):
                size = _size_quiet(d)
                log_bytes += size
                if older_than_s is not None and now - _mtime_quiet(d) > older_than_s:
                    drop_logs.append((d.path, size))

            total = sum(s for s, _m in blobs.values()) + sum(x[2] for x in live) + log_bytes
            total -= sum(s for _p, s in drop_entries) + sum(s for _p, s in drop_logs)
            drop_blobs: set[str] = set()
            for digest, (size, mtime) in blobs.items():
                if refcount[digest] == 0 and now - mtime >= min_blob_age_s:
                    drop_blobs.add(digest)
                    total -= size

            kept_entries = 0
            for last_use, key, size, refs in sorted(live):
                too_old = older_than_s is not None and now - last_use > older_than_s
                too_big = max_size_bytes is not None and total > max_size_bytes
                if key in keep_keys or not (too_old or too_big) or not free(key):
                    kept_entries += 1
                    continue
                drop_entries.append((self.ac_str(key), size))
                total -= size
                for r in refs:
                    refcount[r] -= 1
                    if refcount[r] == 0:
                        drop_blobs.add(r)
                        total -= blobs[r][0]

            if not dry_run:
                # Entries first: a crash part-way must not leave an entry naming a deleted blob
                # (it would only be a miss, but a miss that gc already decided to drop).
                for path, _size in drop_entries:
                    _rmtree_ro(self.guard(path))  # a malformed entry may be a folder
                for digest in drop_blobs:
                    self.discard_blob(digest)
                for path, _size in drop_logs:
                    _unlink_quiet(self.guard(path))
                self.state.prune()

            removed_bytes = (
                sum(s for _p, s in drop_entries)
                + sum(blobs[d][0] for d in drop_blobs)
                + sum(s for _p, s in drop_logs)
            )
            return GcReport(
                dry_run=dry_run,
                removed_entries=len(drop_entries),
                removed_blobs=len(drop_blobs),
                removed_logs=len(drop_logs),
                removed_bytes=removed_bytes,
                kept_entries=kept_entries,
                kept_blobs=len(blobs) - len(drop_blobs),
                kept_bytes=total,
            )

    # -- internals ----------------------------------------------------------------------

    def _entry_refs(self, e: ActionEntry) -> set[str]:
        """Every blob entry `e` needs: its tree manifest, the tree's files and its log."""
        refs = {e.outputs_tree, *(x.digest for x in self.tree_entries(e.outputs_tree))}
        if e.log is not None:
            refs.add(e.log)
        return refs

    def _missing_blobs(self, e: ActionEntry) -> list[str]:
        try:
            refs = self._entry_refs(e)
        except StoreError:  # the manifest is missing or damaged
            return [e.outputs_tree]
        return sorted(d for d in refs if not self.has(d))

    def _iter_blobs(self) -> Iterator[tuple[str, int, float]]:
        for sub in _scandir_quiet(self.cas_dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for d in _scandir_quiet(Path(sub.path)):
                if not is_digest(d.name):
                    continue
                try:
                    st = d.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield d.name, st.st_size, st.st_mtime

    @contextmanager
    def _temp_file(self, prefix: str) -> Iterator[tuple[int, str]]:
        """A new file in root/tmp, locked while open (see `_being_written`), removed on error."""
        # root/tmp is on the same filesystem as cas/ and ac/, so the final rename is
        # atomic, and it is the one folder cleanup_tmp sweeps after a crash.
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=self.tmp_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd, tmp
        except BaseException:
            _unlink_quiet(tmp)
            raise
        finally:
            os.close(fd)

    def _rename_into_cas(self, tmp: str, digest: str) -> None:
        final = self.blob_path(digest)
        final.parent.mkdir(exist_ok=True)
        if os.path.isdir(final) and not os.path.islink(final):
            _rmtree_ro(self.guard(final))  # a folder where the blob belongs: damage, not data
        # Another process may have stored the same digest meanwhile; the bytes are equal,
        # so replacing its blob with ours is harmless. Unlike ac/, the cas/ folder is not
        # fsynced: a blob lost to a power cut only turns a later hit into a miss.
        os.replace(tmp, final)

    def _write_atomic(self, final: StrPath, data: bytes, mode: int = 0o444, what: str = "a file") -> None:
        with self._writing(what, len(data)), self._temp_file("write-") as (fd, tmp):
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
            os.replace(tmp, self.guard(final))
            fsync_dir(os.path.dirname(final))

    # -- gc roots -----------------------------------------------------------------------

    def add_root(self, lock_file: StrPath) -> None:
        """Register a project's lock file as a gc root of this store (as Nix's gcroots).

        A symlink roots/<hash of the path> → the lock file: every project's `mopt gc` then
        keeps what any project sharing the store has pinned. Pruned by `roots` once the
        lock file is gone."""
        target = os.path.abspath(lock_file)
        link = self.roots_dir / (hash_bytes(target.encode())[:32] + ".lock")
        with suppress(OSError):
            if os.readlink(link) == target:
                return
        try:
            self.roots_dir.mkdir(exist_ok=True)
            tmp = f"{link}.{os.getpid()}.tmp"
            _unlink_quiet(tmp)
            os.symlink(target, tmp)
            os.replace(tmp, self.guard(link))
            fsync_dir(self.roots_dir)  # a link has no data of its own: its folder holds it
        except OSError as e:
            log.warning("could not register %s as a gc root in %s: %s", target, self.roots_dir, e)

    def roots(self, *, prune: bool = True) -> list[Path]:
        """The lock files registered in roots/ that still exist (dangling links are pruned)."""
        found: list[Path] = []
        for d in sorted(_scandir_quiet(self.roots_dir), key=lambda d: d.name):
            try:
                target = os.readlink(d.path)
            except OSError:
                continue  # not a link: not ours
            if os.path.lexists(target):
                found.append(Path(target))
            elif prune and not self.read_only:
                _unlink_quiet(self.guard(d.path))
        return found

    @contextmanager
    def _flock(self, name: str, *, shared: bool, on_wait: Callable[[], None] | None = None) -> Iterator[int]:
        # Lock files are never deleted: unlinking one while another process waits on it
        # would let a third process lock a new file of the same name at the same time.
        # O_NOFOLLOW: a link planted in locks/ is refused (ELOOP), never created or written through
        path = self.locks_dir / f"{name}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise StoreLayoutError(
                f"{path} is a symbolic link, not the lock file mopt keeps there",
                hint="remove it and mopt recreates it",
            ) from None
        try:
            op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, op)
            yield fd
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def holds(self, tree_digest: str, dest: StrPath) -> bool:
        """Whether the folder `dest` holds exactly the stored tree `tree_digest` (read-only)."""
        try:
            return self._holds_tree(Path(dest), self.tree_entries(tree_digest))
        except StoreError:
            return False

    def _holds_tree(self, target: Path, entries: list[TreeEntry]) -> bool:
        """Whether `target` holds exactly `entries`, read-only, checked by stat where possible."""
        try:
            if not stat.S_ISDIR(os.lstat(target).st_mode):
                return False
        except OSError:
            return False
        want = {e.path: e for e in entries}
        try:
            found = list(iter_files(target))
        except (TreeError, OSError):
            return False
        if len(found) != len(want):
            return False
        for rel, _abs, st in found:
            e = want.get(rel)
            if e is None or st.st_size != e.size or stat.S_IMODE(st.st_mode) != _ro_mode(e.mode):
                return False
        with self.state.batch():
            for rel, abs_, st in found:
                e = want[rel]
                try:
                    blob = os.stat(self.blob_str(e.digest))
                except FileNotFoundError:
                    return False
                # A hard link to the blob is the blob: no need to read it.
                if (blob.st_dev, blob.st_ino) == (st.st_dev, st.st_ino):
                    continue
                # iter_files took `st` without following links, and it is a regular file
                if self.state.digest_of(abs_, st) != e.digest:
                    return False
        return True

    def _fill(self, root: str, entries: list[TreeEntry]) -> MaterializeMethod:
        methods: tuple[MaterializeMethod, ...] = ("reflink", "hardlink", "copy")
        worst = 0
        can_reflink = can_hardlink = True
        made: set[str] = {root}
        for e in entries:
            dst = os.path.join(root, e.path)
            parent = os.path.dirname(dst)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            blob = self.blob_str(e.digest)
            mode = _ro_mode(e.mode)
            used = -1
            if can_reflink:
                if _copy_file(blob, dst, mode, clone=True):
                    used = 0
                else:
                    can_reflink = False  # not on this filesystem: do not retry per file
            # Small files are copied, large ones linked (see HARDLINK_MIN_BYTES).
            if used < 0 and can_hardlink and mode == 0o444 and e.size >= HARDLINK_MIN_BYTES:
                try:
                    os.link(blob, dst)
                    used = 1
                except OSError as err:
                    if err.errno in (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP):
                        can_hardlink = False
                    elif err.errno != errno.EMLINK:  # too many links to this one blob
                        raise
            if used < 0:
                _copy_file(blob, dst, mode)
                used = 2
            worst = max(worst, used)
        return methods[worst]


# -- file helpers -------------------------------------------------------------------------


#: how many locks/entries-<NN>.lock files the entries' byte-range locks are spread over
_LOCK_SHARDS = 64


@contextmanager
def _closing(fds: dict[int, int | None]) -> Iterator[None]:
    """Close the descriptors in `fds` at the end, which drops every lock taken through them."""
    try:
        yield
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        fds.clear()


def _lock_entry(fds: dict[int, int | None], locks_dir: Path, key: str, op: int) -> bool:
    """Lock (`op`, see `Store.use`) the byte that stands for entry `key` (48 bits of its hash)
    in locks/entries-<NN>.lock, opened once into `fds`; False if another process holds it."""
    offset = int(hash_bytes(key.encode())[:12], 16)
    shard = offset % _LOCK_SHARDS
    if shard not in fds:
        fds[shard] = None
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            with suppress(OSError):
                fds[shard] = os.open(
                    locks_dir / f"entries-{shard:02x}.lock", flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666
                )
                break
    fd = fds[shard]
    if fd is None:
        return True  # no lock file can be opened here: nothing to hold (gc cannot either)
    try:
        fcntl.lockf(fd, op, 1, offset)
    except OSError:
        return False
    return True


def _ro_mode(tree_mode: int) -> int:
    return 0o555 if tree_mode == MODE_EXEC else 0o444


def _mark_being_written(path: str) -> int:
    """Lock `path` (a temp file or folder) until the returned descriptor is closed."""
    # An open flock, not an age, says "in use": a two-hour engine build may leave its
    # scratch folder's mtime untouched, and a crashed writer's lock dies with it.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _being_written(path: str) -> bool:
    """Whether a live process holds the lock `_mark_being_written`/`_temp_file` took."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, a link, or unreadable: nobody is writing it through us
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_fd(src: int, dst: int) -> None:
    """Copy the rest of `src` to `dst`, in the kernel where it can (reflinks on btrfs/xfs)."""
    try:
        while os.copy_file_range(src, dst, _COPY_CHUNK):
            pass
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
    # Fall back from wherever the offsets are: copy_file_range advanced both.
    while chunk := os.read(src, 8 * 1024 * 1024):
        _write_all(dst, chunk)


def _copy_file(src: str, dst: str, mode: int, *, clone: bool = False) -> bool:
    """Copy `src` to a new file `dst`. `clone`: only as a reflink (sharing its extents);
    False, leaving no `dst`, where the filesystem cannot."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with open(src, "rb") as f:
            if not clone:
                _copy_fd(f.fileno(), fd)
            else:
                try:
                    fcntl.ioctl(fd, _FICLONE, f.fileno())
                except OSError:
                    os.unlink(dst)
                    return False
        os.fchmod(fd, mode)
        return True
    finally:
        os.close(fd)


def _swap_into_place(new: str, dest: Path) -> None:
    """Put the folder `new` at `dest`, removing what was there."""
    if not os.path.lexists(dest):
        try:
            os.rename(new, dest)
            return
        except OSError as e:
            # Someone created dest meanwhile; replace it like any existing dest.
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
    if _exchange(new, os.fspath(dest)):
        _rmtree_ro(new)  # now holds the old tree
        return
    # No atomic exchange here: move the old one aside, then the new one in. A crash in
    # between leaves the old tree at a .mopt-old- name for the next materialize there.
    old = tempfile.mkdtemp(prefix=f"{_OLD_PREFIX}{dest.name}-", dir=dest.parent)
    os.rmdir(old)
    os.rename(dest, old)
    os.rename(new, dest)
    _rmtree_ro(old)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _remove_leftovers(
    folder: StrPath, max_age_s: float, prefixes: tuple[str, ...] = ("",), guard: Callable[[str], str] = str
) -> int:
    """Remove what in `folder` is named with one of `prefixes`, is older than `max_age_s` and
    is held by no live writer (see `_mark_being_written`); return how many were removed."""
    removed = 0
    now = time.time()
    for d in _scandir_quiet(folder):
        if not d.name.startswith(prefixes):
            continue
        try:
            if now - d.stat(follow_symlinks=False).st_mtime < max_age_s or _being_written(d.path):
                continue
            _rmtree_ro(guard(d.path))
            removed += 1
        except FileNotFoundError:
            continue  # another process finished or removed it meanwhile
        except OSError as e:
            log.warning("could not remove the leftover %s: %s", d.path, e)
    return removed


def _rmtree_ro(path: StrPath) -> None:
    """Remove a file or a folder tree even where we made it read-only."""
    p = os.fspath(path)
    if not os.path.lexists(p):
        return
    # Another process sweeping leftovers may be removing the same tree: what it removed
    # first is simply gone.
    with suppress(FileNotFoundError):
        if os.path.isdir(p) and not os.path.islink(p):
            # Unlinking needs write permission on each folder; file modes do not matter.
            os.chmod(p, 0o700)
            for dirpath, dirnames, _files in os.walk(p):
                for name in dirnames:
                    sub = os.path.join(dirpath, name)
                    if not os.path.islink(sub):
                        os.chmod(sub, 0o700)
            shutil.rmtree(p)
        else:
            os.unlink(p)


def _unlink_quiet(path: StrPath) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _scandir_quiet(path: StrPath) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _size_quiet(d: os.DirEntry[str]) -> int:
    try:
        return d.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


def _mtime_quiet(d: os.DirEntry[str]) -> float:
    try:
        return d.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return 0.0
