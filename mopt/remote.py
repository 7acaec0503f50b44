"""The remote cache: the local store's `ac/` + `cas/` layout on any fsspec URL.

Layout under the URL (the same as a local store)::

    ac/<key>.json          an action entry (canonical JSON of `ActionEntry`), written last
    cas/<2 hex>/<digest>   a blob named by the BLAKE3 digest of its bytes
    tmp/                   temp names of in-flight uploads (filesystems with rename only)

Reads are "build without the bytes": `fetch_entry` reads and validates one entry and
downloads nothing else; `fetch_tree` / `fetch_blob` download only what the local store
lacks. Every downloaded blob is written to a temp file in the local store, re-hashed, and
renamed into the local CAS only if its bytes match its digest; otherwise it is deleted and
`RemoteIntegrityError` raised, so a corrupt or tampered remote blob never reaches a build.

Writes (`push`) upload the blobs the remote lacks first (tree members, the manifest, the
log) and the action entry last, so an entry on the remote always names blobs that are
there. Each object reaches its final name whole: object stores (s3, gs, az, memory) make a
PUT atomic; on filesystems (file://, and others with rename) the bytes go to a unique temp
name under `tmp/` and are renamed into place. Concurrent pushes of the same action are
safe: blobs are content addressed (identical bytes, either copy wins) and every writer's
entry names only blobs it uploaded before writing it (last writer wins).

Credentials come from fsspec's and the cloud SDKs' usual configuration (environment,
~/.aws, instance roles, `options` passed to fsspec). They never enter action keys or
entries, and every URL or error message this module logs or raises has user info, query
values and known secret option values replaced by `***`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from pydantic import ValidationError

from mopt.digest import TreeEntry, TreeError, canonical_json, check_digest, hash_file
from mopt.store import ActionEntry, BlobMissingError, Store, StoreError, check_key

log = logging.getLogger(__name__)

#: protocols whose single-object writes are atomic (no temp name + rename needed)
OBJECT_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2", "memory", "hf"}
)
#: option names whose values are secrets (matched case-insensitively, as substrings)
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "sas", "key", "signature")
#: an action entry larger than this is not an action entry
MAX_ENTRY_BYTES = 16 * 1024 * 1024
_TMP_PREFIX = ".mopt-tmp-"


class RemoteError(StoreError):
    """The remote cache could not be read or written (the message has no credentials)."""


class RemoteBlobMissingError(RemoteError, BlobMissingError):
    """A blob that an entry names is not on the remote."""


class RemoteIntegrityError(RemoteError):
    """A downloaded blob's bytes do not hash to its digest; it was not stored."""


# --------------------------------------------------------------------------- redaction


def redact_url(url: str) -> str:
    """`url` without user info and with query values masked (for logs and messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        query = "&".join(f"{k}=***" for k, _v in parse_qsl(query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _secret_values(url: str, options: Mapping[str, Any]) -> list[str]:
    """Strings that must never appear in a log line or message."""
    out: list[str] = []
    try:
        parts = urlsplit(url)
        if parts.username:
            out.append(parts.username)
        if parts.password:
            out.append(parts.password)
        if "@" in parts.netloc:
            out.append(parts.netloc.rsplit("@", 1)[0])
        out += [v for _k, v in parse_qsl(parts.query)]
    except ValueError:
        pass

    def walk(obj: Any, secret: bool) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, secret or any(w in str(k).lower() for w in _SECRET_WORDS))
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, secret)
        elif secret and isinstance(obj, str) and obj:
            out.append(obj)

    walk(options, False)
    # longest first, so that a secret containing another is masked whole
    return sorted({s for s in out if len(s) >= 3}, key=len, reverse=True)


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class PushReport:
    """What one `push` did."""

    key: str | None
    uploaded_blobs: int = 0
    uploaded_bytes: int = 0
    present_blobs: int = 0
    entry_written: bool = False


@dataclass(frozen=True)
class RemoteStatus:
    """The remote cache as `mopt cache status` shows it."""

    url: str
    protocol: str
    push: bool
    reachable: bool
    error: str | None = None
    ac_entries: int | None = None
    blobs: int | None = None
    blob_bytes: int | None = None
    tmp_files: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Counters:
    downloaded_blobs: int = 0
    downloaded_bytes: int = 0
    uploaded_blobs: int = 0
    uploaded_bytes: int = 0
    rejected_blobs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


# --------------------------------------------------------------------------- the cache


class RemoteCache:
    """A remote action cache + CAS at an fsspec `url`, feeding the local `store`.

    `options` are fsspec storage options (e.g. `{"client_kwargs": {"endpoint_url": ...}}`
    for an S3-compatible server); credentials are best left to the SDK's own configuration.
    `transfers` is how many blobs move in parallel.
    """

    def __init__(
        self,
        url: str,
        store: Store,
        *,
        push: bool = True,
        options: Mapping[str, Any] | None = None,
        transfers: int = 8,
    ) -> None:
        import fsspec  # an optional dependency: mopt[remote]

        self.store = store
        self.push_enabled = push
        self.transfers = max(1, transfers)
        self._options = dict(options or {})
        self._secrets = _secret_values(url, self._options)
        self._raw_url = url
        self.url = redact_url(url)
        try:
            fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **self._options)
        except (ImportError, ValueError) as exc:
            raise RemoteError(f"remote cache {self.url}: {self._scrub(str(exc))}") from None
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.protocol = str(protocols[0])
        self.is_local = self.protocol in ("file", "local")
        self.atomic_put = bool(set(protocols) & OBJECT_STORES)
        self.root = root.rstrip("/") if root not in ("/", "") else root
        if self.is_local:
            self.root = os.path.abspath(self.root)
        self.stats = _Counters()
        #: digests known to be on the remote (uploaded or seen) during this process
        self._present: set[str] = set()
        #: digests whose remote bytes were found corrupt: push re-uploads them
        self._bad: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Any, local_store: Store, *, offline: bool = False) -> RemoteCache | None:
        """A cache from `[remote]` settings (`url`, `push`, optional `options`), or None
        when no URL is set, or when `offline` and the URL is not on a local filesystem."""
        url = getattr(settings, "url", None)
        if not url:
            return None
        opts = getattr(settings, "options", None)
        cache = cls(url, local_store, push=bool(getattr(settings, "push", True)), options=opts)
        if offline and not cache.is_local:
            return None
        return cache

    def __repr__(self) -> str:
        return f"RemoteCache({self.url!r}, push={self.push_enabled})"

    def connection(self) -> dict[str, Any]:
        """What another process needs to open this cache: `RemoteCache(store=..., **conn)`.

        The URL and options as given: they may hold credentials, so pass them on (to a
        worker) but never log or store them.
        """
        return {"url": self._raw_url, "push": self.push_enabled, "options": dict(self._options)}

    # ------------------------------------------------------------------ paths

    def _join(self, *parts: str) -> str:
        if self.is_local:
            return os.path.join(self.root, *parts)
        return "/".join([self.root, *parts]) if self.root else "/".join(parts)

    def blob_rpath(self, digest: str) -> str:
        """Where blob `digest` lives on the remote (a path for `self.fs`)."""
        check_digest(digest)
        return self._join("cas", digest[:2], digest)

    def ac_rpath(self, key: str) -> str:
        """Where the entry of action `key` lives on the remote."""
        return self._join("ac", f"{check_key(key)}.json")

    # ------------------------------------------------------------------ errors

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _error(self, what: str, exc: BaseException) -> RemoteError:
        return RemoteError(f"remote cache {self.url}: {what}: {type(exc).__name__}: {self._scrub(str(exc))}")

    def _warn_once(self, what: str, exc: BaseException) -> None:
        msg = str(self._error(what, exc))
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        log.log(level, "%s (treated as a miss)", msg)

    # ------------------------------------------------------------------ reads

    def fetch_entry(self, key: str, *, verify: bool = False) -> ActionEntry | None:
        """The remote entry of `key`, validated, or None (absent, invalid, unreachable).

        Downloads no output blob. With `verify`, also downloads the tree manifest (into the
        local CAS, re-hashed) and checks that every blob the entry names is on the remote.
        """
        check_key(key)
        try:
            data = self.fs.cat_file(self.ac_rpath(key))
        except FileNotFoundError:
            return None
        except Exception as exc:
            self._warn_once("reading the action cache", exc)
            return None
        if len(data) > MAX_ENTRY_BYTES:
            log.warning("remote cache %s: entry %s is %d bytes; ignoring it", self.url, key, len(data))
            return None
        try:
            entry = ActionEntry.model_validate_json(data)
        except ValidationError as exc:
            log.warning(
                "remote cache %s: entry %s is not a valid action entry, treating it as a miss: %s",
                self.url,
                key,
                self._scrub(str(exc).splitlines()[0]),
            )
            return None
        if entry.key != key:
            log.warning("remote cache %s: entry %s names key %s; ignoring it", self.url, key, entry.key)
            return None
        if verify:
            try:
                members = self.fetch_tree(entry.outputs_tree, blobs=False)
                todo = list(dict.fromkeys([m.digest for m in members] + ([entry.log] if entry.log else [])))
                with ThreadPoolExecutor(max_workers=min(self.transfers, max(1, len(todo)))) as pool:
                    missing = [d for d, ok in zip(todo, pool.map(self.has_blob, todo)) if not ok]
            except RemoteError as exc:
                log.warning("remote cache %s: entry %s: %s; treating it as a miss", self.url, key, exc)
                return None
            if missing:
                log.warning(
                    "remote cache %s: entry %s names %d missing blob(s); treating it as a miss",
                    self.url,
                    key,
                    len(missing),
                )
                return None
        return entry

    def has_blob(self, digest: str) -> bool:
        """Whether blob `digest` is on the remote (RemoteError if that cannot be told)."""
        if digest in self._present and digest not in self._bad:
            return True
        try:
            ok = bool(self.fs.exists(self.blob_rpath(digest)))
        except Exception as exc:
            raise self._error(f"checking blob {digest[:12]}", exc) from None
        if ok:
            with self._lock:
                self._present.add(digest)
        return ok

    def fetch_blob(self, digest: str) -> str:
        """Download blob `digest` into the local CAS unless it is there; return its local path.

        The bytes are re-hashed before they get their final name: RemoteIntegrityError when
        they do not match (nothing is stored), RemoteBlobMissingError when the remote lacks
        the blob.
        """
        local = self.store.blob_path(digest)
        if local.exists():
            return os.fspath(local)
        fd, tmp = tempfile.mkstemp(prefix="remote-", dir=self.store.tmp_dir)
        os.close(fd)
        try:
            try:
                self.fs.get_file(self.blob_rpath(digest), tmp)
            except FileNotFoundError:
                raise RemoteBlobMissingError(f"remote cache {self.url}: blob {digest} is missing") from None
            except Exception as exc:
                raise self._error(f"downloading blob {digest[:12]}", exc) from None
            got = hash_file(tmp)
            if got != digest:
                self.stats.add(rejected_blobs=1)
                with self._lock:
                    self._bad.add(digest)
                    self._present.discard(digest)
                removed = self._remove_corrupt(digest)
                raise RemoteIntegrityError(
                    f"remote cache {self.url}: blob {digest} is corrupt (its bytes hash to "
                    f"{got[:16]}…); rejected, not stored"
                    + ("; removed from the remote so that the next push replaces it" if removed else "")
                )
            size = os.path.getsize(tmp)
            os.chmod(tmp, 0o444)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            local.parent.mkdir(exist_ok=True)
            os.replace(tmp, local)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.stats.add(downloaded_blobs=1, downloaded_bytes=size)
        with self._lock:
            self._present.add(digest)
        return os.fspath(local)

    def _remove_corrupt(self, digest: str) -> bool:
        """Delete a remote blob found corrupt (when this cache may write), so that entries
        naming it become misses everywhere and the next push of its action re-uploads it."""
        if not self.push_enabled:
            return False
        try:
            self.fs.rm_file(self.blob_rpath(digest))
        except FileNotFoundError:
            return True
        except Exception as exc:
            self._warn_once("removing a corrupt blob", exc)
            return False
        log.warning("remote cache %s: removed corrupt blob %s", self.url, digest)
        return True

    def fetch_tree(self, tree_digest: str, *, blobs: bool = True) -> list[TreeEntry]:
        """Download the tree manifest and (with `blobs`) every member the local store lacks.

        Returns the tree's entries. Members are fetched in parallel; the first error
        (missing, corrupt, transport) is raised after the others finish, and only verified
        blobs are kept.
        """
        self.fetch_blob(tree_digest)
        try:
            entries = self.store.tree_entries(tree_digest)
        except StoreError as exc:
            # The manifest hashed right, so its bytes are what was pushed: not a tree.
            raise RemoteError(f"remote cache {self.url}: {exc}") from None
        if not blobs:
            return entries
        todo = sorted({e.digest for e in entries if not self.store.has(e.digest)})
        errors: list[BaseException] = []
        if todo:
            with ThreadPoolExecutor(max_workers=min(self.transfers, len(todo))) as pool:
                for fut in [pool.submit(self.fetch_blob, d) for d in todo]:
                    failure = fut.exception()
                    if failure is not None:
                        errors.append(failure)
        if errors:
            # Integrity errors first: they say the most about what is wrong.
            errors.sort(key=lambda e: not isinstance(e, RemoteIntegrityError))
            raise errors[0]
        return entries

    def pull(self, key: str, entry: ActionEntry | None = None) -> ActionEntry | None:
        """Make `key` a local hit: fetch its entry (unless given), its tree and log, verify
        them, and record the entry in the local action cache. None on a miss, a missing
        or corrupt blob, or an unreachable remote (each logged, without credentials)."""
        if entry is None:
            entry = self.fetch_entry(key)
            if entry is None:
                return None
        elif entry.key != key:
            raise ValueError(f"entry is for key {entry.key!r}, not {key!r}")
        try:
            self.fetch_tree(entry.outputs_tree)
            if entry.log:
                self.fetch_blob(entry.log)
            with self.store.in_use():
                return self.store.ac_put(key, entry)
        except RemoteError as exc:
            log.warning("%s; action %s will be rebuilt", exc, key[:16])
            return None
        except (StoreError, TreeError) as exc:
            log.warning(
                "remote cache %s: entry %s unusable (%s); action will be rebuilt", self.url, key[:16], exc
            )
            return None

    # ------------------------------------------------------------------ writes

    def push_blob(self, digest: str) -> tuple[bool, int]:
        """Upload local blob `digest` unless the remote has it; (whether it uploaded, its bytes)."""
        if digest not in self._bad and self.has_blob(digest):
            return False, 0
        local = self.store.blob_path(digest)
        try:
            ok = self.store.state.file_digest(local) == digest
        except FileNotFoundError:
            raise BlobMissingError(
                f"cannot push blob {digest}: not in the local store {self.store.root}"
            ) from None
        if not ok:
            raise StoreError(f"cannot push blob {digest}: the local copy is corrupt ({local})")
        size = local.stat().st_size
        try:
            self._put(self.blob_rpath(digest), mode=0o444, local=os.fspath(local))
        except Exception as exc:
            raise self._error(f"uploading blob {digest[:12]}", exc) from None
        with self._lock:
            self._bad.discard(digest)
            self._present.add(digest)
        self.stats.add(uploaded_blobs=1, uploaded_bytes=size)
        return True, size

    def push_tree(self, tree_digest: str) -> PushReport:
        """Upload a local tree (members first, manifest last) where the remote lacks it."""
        members = [e.digest for e in self.store.tree_entries(tree_digest)]
        up, nbytes, present = self._push_blobs(members, [tree_digest])
        return PushReport(key=None, uploaded_blobs=up, uploaded_bytes=nbytes, present_blobs=present)

    def push(self, key: str, entry: ActionEntry | None = None) -> PushReport:
        """Upload action `key`: its blobs the remote lacks first, then its entry.

        `entry` defaults to the local store's. The entry is rewritten only when the remote
        has none, or one that is invalid or names other outputs (last writer wins); an
        identical-output entry already there is left alone.
        """
        check_key(key)
        if entry is None:
            entry = self.store.ac_entry(key)
            if entry is None:
                raise BlobMissingError(f"action {key} is not in the local store {self.store.root}")
        if entry.key != key:
            raise ValueError(f"entry is for key {entry.key!r}, not {key!r}")
        members = [e.digest for e in self.store.tree_entries(entry.outputs_tree)]
        tail = [entry.outputs_tree] + ([entry.log] if entry.log else [])
        up, nbytes, present = self._push_blobs(members, tail)  # members before the manifest
        existing = self._remote_entry_quiet(key)
        written = False
        if existing is None or existing.outputs_tree != entry.outputs_tree or existing.log != entry.log:
            data = canonical_json(entry.model_dump(mode="json"))
            try:
                self._put(self.ac_rpath(key), mode=0o644, data=data)
            except Exception as exc:
                raise self._error(f"writing entry {key[:16]}", exc) from None
            written = True
        return PushReport(
            key=key, uploaded_blobs=up, uploaded_bytes=nbytes, present_blobs=present, entry_written=written
        )

    def _remote_entry_quiet(self, key: str) -> ActionEntry | None:
        try:
            data = self.fs.cat_file(self.ac_rpath(key))
            e = ActionEntry.model_validate_json(data)
        except Exception:
            return None
        return e if e.key == key else None

    def _push_blobs(self, *batches: list[str]) -> tuple[int, int, int]:
        """Upload what the remote lacks of each batch (in parallel), one batch after the
        other; return (blobs uploaded, bytes uploaded, blobs already there)."""
        done: list[tuple[bool, int]] = []
        for batch in batches:
            todo = list(dict.fromkeys(batch))
            if todo:
                with ThreadPoolExecutor(max_workers=min(self.transfers, len(todo))) as pool:
                    done += pool.map(self.push_blob, todo)
        up = sum(1 for uploaded, _n in done if uploaded)
        return up, sum(n for _u, n in done), len(done) - up

    def _put(self, rpath: str, *, mode: int, local: str | None = None, data: bytes = b"") -> None:
        """Write the file `local` (else `data`) whole at `rpath`: a PUT where it is atomic,
        else a temp name under tmp/ and a rename (on a local filesystem, fsynced)."""
        if self.is_local:
            os.makedirs(self._join("tmp"), exist_ok=True)
            os.makedirs(os.path.dirname(rpath), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self._join("tmp"))
            try:
                with os.fdopen(fd, "wb") as out:
                    if local is None:
                        out.write(data)
                    else:
                        with open(local, "rb") as f:
                            shutil.copyfileobj(f, out, 8 * 1024 * 1024)
                    out.flush()
                    os.fchmod(out.fileno(), mode)
                    os.fsync(out.fileno())
                os.replace(tmp, rpath)
            except BaseException:
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return
        target = rpath
        if not self.atomic_put:
            target = self._join("tmp", f"{_TMP_PREFIX}{uuid.uuid4().hex}")
            self.fs.makedirs(self._join("tmp"), exist_ok=True)
            self.fs.makedirs(rpath.rsplit("/", 1)[0], exist_ok=True)
        try:
            if local is None:
                self.fs.pipe_file(target, data)
            else:
                self.fs.put_file(local, target)
            if target != rpath:
                self.fs.mv(target, rpath)
        except BaseException:
            if target != rpath:
                with suppress(Exception):
                    self.fs.rm_file(target)
            raise

    # ------------------------------------------------------------------ listing

    def list_keys(self) -> list[str]:
        """Keys of every entry under `ac/` (sorted)."""
        try:
            names = self._ls(self._join("ac"))
        except Exception as exc:
            raise self._error("listing the action cache", exc) from None
        keys = []
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if base.endswith(".json"):
                with suppress(ValueError):
                    keys.append(check_key(base[: -len(".json")]))
        return sorted(keys)

    def _ls(self, path: str) -> list[str]:
        try:
            out = [str(x) for x in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []
        finally:
            with suppress(Exception):
                self.fs.invalidate_cache()
        return out

    def _iter_blob_sizes(self) -> Iterator[tuple[str, int]]:
        try:
            found = self.fs.find(self._join("cas"), detail=True)
        except FileNotFoundError:
            return
        finally:
            with suppress(Exception):
                self.fs.invalidate_cache()
        for path, info in found.items():
            name = str(path).rsplit("/", 1)[-1]
            if len(name) == 64:
                yield name, int(info.get("size") or 0)

    def status(self) -> RemoteStatus:
        """Whether the remote answers, and how many entries and blobs it holds."""
        here = (self.url, self.protocol, self.push_enabled)
        try:
            entries = len(self.list_keys())
        except RemoteError as exc:
            return RemoteStatus(*here, False, error=str(exc))
        try:
            blobs = list(self._iter_blob_sizes())
            tmp = len(self._ls(self._join("tmp"))) if not self.atomic_put else 0
        except Exception as exc:
            return RemoteStatus(*here, True, error=str(self._error("listing blobs", exc)), ac_entries=entries)
        size = sum(s for _d, s in blobs)
        return RemoteStatus(*here, True, ac_entries=entries, blobs=len(blobs), blob_bytes=size, tmp_files=tmp)


__all__ = [
    "OBJECT_STORES",
    "PushReport",
    "RemoteBlobMissingError",
    "RemoteCache",
    "RemoteError",
    "RemoteIntegrityError",
    "RemoteStatus",
    "redact_url",
]
