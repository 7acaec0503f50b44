"""The no-op fast path: after a successful build, a stamp of everything the result depends
on; the next identical `mopt build` that finds every stat unchanged is done without loading
plugins, parsing the recipe or keying the graph (Ninja's model: a no-op only stats).

The stamp lists: the recipe files and mopt.toml; the folders a new mopt.toml or plugin
would appear in; every Python module file the build had loaded (mopt, plugins, libraries:
an upgrade or an edited kind changes one); the model sources' and declared input files;
every action entry and blob the result uses and every materialized file; the relevant
environment. Any difference, or a kind whose fingerprint may depend on anything else
(`TargetKind.static_fingerprint = False`, e.g. the GPU driver), means the full path runs.

This module imports nothing heavy: it runs before pydantic and pluggy are loaded.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import sys
import zlib
from collections.abc import Mapping
from typing import Any

STAMP_VERSION = 5
#: the first bytes of a stamp file; then the CRC-32 of the rest (4 bytes, little-endian),
#: then the marshalled stamp (marshal format 4: stdlib, ~10x faster to load than JSON)
MAGIC = b"mopt noop stamp 5\n"
MARSHAL_VERSION = 4
RACY_NS = 200_000_000
ENV_PREFIXES = ("MOPT_", "HF_", "TRANSFORMERS_", "CUDA_", "NVIDIA_")
#: where Hugging Face's cache is when HF_HOME is unset (~/.cache or $XDG_CACHE_HOME): a
#: model source resolved there may resolve elsewhere when they change
ENV_NAMES = ("HOME", "XDG_CACHE_HOME")
#: the stamp's stats: a list of (size, mtime_ns, ctime_ns, inode) per file, marshalled
#: in format 2 (no back-references, so equal lists give equal bytes: compared as bytes)
STATS_MARSHAL = 2
#: files of one folder stat-ed through one descriptor of it (a shorter path walk per stat)
#: when the folder holds at least this many of the stamp's files (the store's shards)
GROUP_MIN = 16
#: a group holds at most this many files: groups are split between two threads
GROUP_MAX = 2048
#: from this many files on, the stamp's stats are in two halves, the second taken by a
#: forked child (see `_Half`)
PARALLEL_MIN = 4096


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _env(extra: list[str]) -> dict[str, str | None]:
    names = {k for k in os.environ if k.startswith(ENV_PREFIXES)} | set(ENV_NAMES) | set(extra)
    return {k: os.environ.get(k) for k in sorted(names)}


def ident_of(recipe: str, selectors: list[str], offline: bool) -> tuple[str, tuple[str, ...], bool]:
    """What names one stamp: the recipe, the selectors and --offline (stored in the stamp
    and compared, so that two builds whose file names collide never share one)."""
    return (os.path.abspath(recipe), tuple(sorted(selectors)), bool(offline))


def stamp_path(store_dir: str, recipe: str, selectors: list[str], offline: bool) -> str:
    # zlib's checksums, not hashlib: hashlib loads OpenSSL (~5 ms) on the no-op path; a
    # collision only costs a full build, since the stamp's own `ident` is compared.
    ident = repr(ident_of(recipe, selectors, offline)).encode("utf-8", "surrogateescape")
    name = f"{zlib.crc32(ident):08x}{zlib.adler32(ident):08x}"
    return os.path.join(store_dir, "noop", name + ".stamp")


def _legacy_stamp_path(folder: str, ident: tuple[str, tuple[str, ...], bool]) -> str:
    """Where stamp version 1 (JSON) of the build `ident` lived, in the stamps' `folder`."""
    import hashlib
    import json

    text = json.dumps([ident[0], list(ident[1]), ident[2]])
    return os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


def find_store_dir(recipe: str) -> str | None:
    """The store folder per the nearest mopt.toml, read without the TOML/pydantic stack.

    Only the simple, common forms are understood; anything else returns None (full path).
    """
    d = os.path.dirname(os.path.abspath(recipe))
    while True:
        cfg = os.path.join(d, "mopt.toml")
        if os.path.isfile(cfg):
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover
                return None
            try:
                with open(cfg, "rb") as fh:
                    data = tomllib.load(fh)
            except (OSError, ValueError, RecursionError):
                return None  # the full path reports it
            store = data.get("store", {})
            path = store.get("path", ".mopt") if isinstance(store, dict) else None
            return os.path.normpath(os.path.join(d, path)) if isinstance(path, str) else None
        parent = os.path.dirname(d)
        if parent == d:
            return os.path.join(os.path.dirname(os.path.abspath(recipe)), ".mopt")
        d = parent


def _default_stamp(recipe: str, selectors: list[str], offline: bool) -> str | None:
    """The stamp this build has if its mopt.toml leaves the store where it is by default,
    found without parsing that file (tomllib and its regexes cost ~7 ms of a no-op): the
    stamp records the settings file and the store it was written for, and it holds only
    while that file's bytes are the same (so the store is still the one it names). None if
    there is no stamp there."""
    d = os.path.dirname(os.path.abspath(recipe))
    while True:
        cfg = os.path.join(d, "mopt.toml")
        if os.path.isfile(cfg):
            store = os.path.normpath(os.path.join(d, ".mopt"))
            path = stamp_path(store, recipe, selectors, offline)
            # the settings file as the full path names it (`load_project`: a resolved folder)
            _expected[path] = (store, os.path.join(os.path.realpath(d), "mopt.toml"))
            return path if os.path.exists(path) else None
        parent = os.path.dirname(d)
        if parent == d:
            return None  # no settings: find_store_dir's default, without parsing anything
        d = parent


#: stamp path → (store folder, settings file) a stamp found by `_default_stamp` must record
_expected: dict[str, tuple[str, str]] = {}

#: why the last `check` found no usable stamp ("" when it did): `mopt build --json` reports it
last_miss = ""
#: the declared input files whose stat changed, as the last missed `check` found them
changed_inputs: list[str] = []
#: [files, bytes] the last `check` hashed to find touched input files unchanged
rehashed: list[int] = [0, 0]
#: the digesting of `changed_inputs` that `consult` started after a miss (see `prehash`)
prehashing: Any = None
#: (stamp path, ident, result) of the last `consult` in this process
_consulted: tuple[str, Any, dict[str, Any] | None] | None = None


def consult(path: str, ident: Any) -> dict[str, Any] | None:
    """`check` once per process: the click-free entry (`fast_main`) and `mopt build` ask
    for the same stamp; after a miss, digesting the changed input files starts at once."""
    global _consulted, prehashing
    if _consulted is not None and _consulted[:2] == (path, ident):
        return _consulted[2]
    done = check(path, ident)
    _consulted = (path, ident, done)
    if done is None and changed_inputs and prehashing is None:
        prehashing = prehash(list(changed_inputs))
    return done


def stamp_holds(
    recipe: str, selectors: list[str], offline: bool, *, learn: bool = False
) -> dict[str, Any] | None:
    """The result of the last successful `mopt build RECIPE SELECTORS [--offline]` if its
    stamp still holds: nothing that build depended on changed (a touched input or recipe
    file whose bytes and mode are the same counts as unchanged: it is rehashed). Else None,
    and why is in `last_miss`. `learn=False` writes nothing (for read-only commands, e.g.
    `mopt plan`); `learn=True` records a touched file's new stat (what `mopt build` does).

    The dict: recipe, n, build_dir, ids (every node of that build, in build order), selected,
    hashed_files, hashed_bytes; `stamp_nodes(result)` gives the nodes as `--json` lists them."""
    global last_miss
    try:
        store_dir = find_store_dir(recipe) if os.path.exists(recipe) else None
    except Exception:  # an unreadable mopt.toml: the full path reports it
        store_dir = None
    if store_dir is None:
        last_miss = "no store folder"
        return None
    path = stamp_path(store_dir, recipe, selectors, offline)
    return check(path, ident_of(recipe, selectors, offline), learn=learn)


def stamp_nodes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes of a `stamp_holds` / `check` result, as `mopt build --json` lists them."""
    import json

    nodes: list[dict[str, Any]] = json.loads("{" + result["json_tail"][1:])["nodes"]
    return nodes


def check(path: str, ident: Any = None, *, learn: bool = True) -> dict[str, Any] | None:
    """The stamp's recorded result if nothing it depends on changed, else None (the reason
    is left in `last_miss`). With `ident` (see `ident_of`), a stamp of another build misses.
    `learn`: record the new stats of touched files found unchanged (else nothing is written)."""
    global last_miss
    del changed_inputs[:]
    rehashed[:] = [0, 0]
    stamp: dict[str, Any] = {}
    try:
        last_miss = _miss(path, stamp, ident, learn)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, EOFError):
        last_miss = "unreadable stamp"  # well-formed bytes of the wrong shape: a miss
    if last_miss:
        return None
    result: dict[str, Any] = dict(stamp["result"], hashed_files=rehashed[0], hashed_bytes=rehashed[1])
    return result


def _read(path: str) -> dict[str, Any] | str:
    """The stamp at `path`, or why there is none."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        try:
            with open(path + ".skipped") as fh:
                return "no stamp: " + fh.read().strip()
        except OSError:
            return "no stamp"
    n = len(MAGIC)
    if data[:n] != MAGIC or len(data) < n + 4:
        return "unreadable stamp"
    payload = memoryview(data)[n + 4 :]
    if zlib.crc32(payload) != int.from_bytes(data[n : n + 4], "little"):
        return "unreadable stamp"  # a torn or damaged file
    try:
        stamp = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return "unreadable stamp"
    return stamp if isinstance(stamp, dict) else "unreadable stamp"


def _miss(path: str, out: dict[str, Any], ident: Any, learn: bool = True) -> str:
    """Why the stamp at `path` does not hold ("" if it does); the stamp is put in `out`."""
    global prehashing, last_seen
    if last_seen is not None and last_seen["pending"] is not None:
        last_seen["pending"].abandon()  # another stamp is checked now
    last_seen = None
    stamp = _read(path)
    if isinstance(stamp, str):
        return stamp
    out.update(stamp)
    if stamp.get("version") != STAMP_VERSION or stamp.get("python") != sys.executable:
        return "another stamp version or Python"
    if ident is not None and stamp.get("ident") != ident:
        return "a stamp of another build"
    if path in _expected and (stamp.get("store_dir"), stamp.get("config")) != _expected[path]:
        return "a stamp of other settings"
    if stamp.get("host") != _host():  # platform() parts (CPU class) are per machine
        return "another host"
    # a stamp of this build: what changed is kept for `vouch` (the full path then need not
    # check again what the stamp shows unchanged)
    seen: dict[str, Any] = {"path": path, "ident": ident, "stamp": stamp, "changed": None, "pending": None}
    seen["others"] = None
    last_seen = seen
    if _env(stamp.get("env_extra", [])) != stamp.get("env"):
        seen["others"] = "environment changed"
        return "environment changed"
    early = _head_changed(stamp)
    if early is not None:
        # a recipe or settings file holds other bytes: a miss, said without first statting
        # every file of the stamp; that comparison goes on in a forked child while the full
        # path loads the recipe (`vouch` takes its result)
        seen["pending"] = _Diff(_diff_jobs(stamp))
        return f"changed: {early}"
    # The loop that is the whole no-op at 10,000 nodes (~40,000 files): the stats are taken
    # in C (map, attrgetter), marshalled and compared as bytes; the second half by a forked
    # child where there are two CPUs (os.stat is mostly kernel time; threads would contend
    # for the GIL at every call), while this process takes the first half and the rest.
    groups: list[tuple[str, str, int]] = stamp["groups"]
    parts: list[bytes] = stamp["stats"]
    cut: int = stamp["cut"] if len(parts) == 2 else len(groups)
    child = _Half(groups[cut:], parts[1]) if len(parts) == 2 else None
    try:
        first = _stat_part(groups[:cut] if child is not None else groups)
        same = first is not None and marshal.dumps(first, STATS_MARSHAL) == parts[0]
        # why else it misses (said after a changed file), while the child stats
        also = _others(stamp) if child is not None else None
        if child is None:
            second: list[tuple[int, ...]] | None = []
            same_second = True
        else:
            same_second, second = child.result()
            child = None
    finally:
        if child is not None:
            child.abandon()
    touched: dict[int, tuple[int, ...]] = {}
    where: dict[int, str] = {}
    if not (same and same_second):
        # which files changed: only a half that differs is decoded and compared
        changed: dict[int, tuple[int, ...] | None] = {}
        halves = [(groups[:cut], parts[0], first, same)]
        if len(parts) == 2:
            halves.append((groups[cut:], parts[1], second, same_second))
        offset = 0
        for part_groups, want, taken, ok in halves:
            n = sum(g[2] for g in part_groups)
            if not ok:
                recorded = marshal.loads(want)
                if not isinstance(recorded, list) or len(recorded) != n:
                    return "unreadable stamp"
                now: list[tuple[int, ...] | None]
                if taken is not None and len(taken) == n:
                    now = list(taken)
                else:  # a file gone: see which
                    now = [None if (rec := _stat(p)) is None else tuple(rec) for p in _paths(part_groups)]
                changed.update((offset + k, a) for k, (a, b) in enumerate(zip(now, recorded)) if a != b)
            offset += n
        where = _paths_at(groups, changed)
        seen["changed"] = changed
        inputs = set(stamp.get("inputs", ()))
        # the full path will digest the changed input files first: name them, so that
        # hashing them can start while it loads (see `prehash`)
        changed_inputs[:] = [where[k] for k, st in changed.items() if where[k] in inputs and st is not None]
        digests = stamp.get("digests", {})
        for k, st in changed.items():
            if st is None or where[k] not in digests:
                return f"changed: {where[k]}"
            touched[k] = st
    else:
        seen["changed"] = {}
    hashing = None
    if touched:
        # hashing first (BLAKE3 leaves the GIL): the other checks run meanwhile; on a miss
        # the full path takes the digests (`Engine.prehashed`)
        hashing = prehashing = prehash([where[k] for k in touched])
    if also is None:
        also = _others(stamp)
    seen["others"] = also
    if also:
        return also
    if hashing is not None:
        return _rehash(path, stamp, where, touched, learn, hashing)
    return ""


def _others(stamp: dict[str, Any]) -> str:
    """Why the stamp misses for anything but its files' stats ("" if nothing)."""
    for folder, names in stamp["exist"].items():
        gone = _missing(folder, names)
        if gone is not None:
            return f"gone: {gone}"
    for p in stamp["absent"]:
        if os.path.exists(p):
            return f"appeared: {p}"
    for p, want_mtime in stamp["dirs"].items():
        try:
            if os.stat(p).st_mtime_ns != want_mtime:
                return f"folder changed: {p}"
        except OSError:
            if want_mtime is not None:
                return f"folder gone: {p}"
    return ""


#: what the last `_miss` in this process saw of a readable stamp of its build (None: no such
#: stamp): path, ident, stamp, changed (stat index → the stat now, None if gone; None while
#: not known), pending (the `_Diff` comparing them, after an early miss), others (why it
#: misses for anything but its files' stats, "" for nothing; None while not known)
last_seen: dict[str, Any] | None = None
#: why the last `vouch` vouched for nothing ("" when it did)
vouch_miss = ""
#: a head file (recipe, settings, lock) whose stat changed is hashed at once up to this size
HEAD_HASH_MAX = 16 << 20


def _head_changed(stamp: dict[str, Any]) -> str | None:
    """A recipe, settings or lock file of the stamp (its `head`, checked first) that holds
    other bytes or another mode than the stamp's digest of it, or is gone or new; None if
    none does (a touched one with the same bytes is left to the full check, which rehashes
    and learns it)."""
    head = stamp.get("head")
    if not isinstance(head, list):
        return None
    digests = stamp.get("digests", {})
    for p, want in head:
        now = _stat(p)
        if now is None or want is None:
            if now is None and want is None:
                continue
            return str(p)
        if now == list(want):
            continue
        d = digests.get(p)
        if d is None:
            return str(p)
        if now[0] > HEAD_HASH_MAX:
            return None  # the full check hashes it
        from mopt.filehash import hash_bytes, mode_of

        try:
            with open(p, "rb") as fh:
                st = os.fstat(fh.fileno())
                data = fh.read()
        except OSError:
            return str(p)
        if (hash_bytes(data), mode_of(st.st_mode)) != tuple(d):
            return str(p)
    return None


def _diff_jobs(stamp: dict[str, Any]) -> list[tuple[list[tuple[str, str, int]], bytes, bool]]:
    """What `vouch` compares: each half of the stamp's files (stat), then the build/ folders
    of its nodes (lstat), as (groups, recorded stats, follow links)."""
    groups: list[tuple[str, str, int]] = stamp["groups"]
    parts: list[bytes] = stamp["stats"]
    cut: int = stamp["cut"] if len(parts) == 2 else len(groups)
    jobs = [(groups[:cut], parts[0], True)]
    if len(parts) == 2:
        jobs.append((groups[cut:], parts[1], True))
    v = stamp.get("vouch")
    if isinstance(v, dict) and "dir_groups" in v:
        jobs.append((v["dir_groups"], v["dir_stats"], False))
    return jobs


def _diff_part(groups: list[tuple[str, str, int]], want: bytes, follow: bool = True) -> dict[int, Any] | None:
    """index → stat now (None: gone) of each file of `groups` whose stat is not the one
    recorded in `want`; None if `want` is not a record of them."""
    got = _stat_part(groups, follow)
    if got is not None and marshal.dumps(got, STATS_MARSHAL) == want:
        return {}
    recorded = marshal.loads(want)
    n = sum(g[2] for g in groups)
    if not isinstance(recorded, list) or len(recorded) != n:
        return None
    taken: list[tuple[int, ...] | None]
    if got is None or len(got) != n:  # a file gone: see which
        one = _stat if follow else _lstat
        taken = [None if (rec := one(p)) is None else tuple(rec) for p in _paths(groups)]
    else:
        taken = list(got)
    return {k: a for k, (a, b) in enumerate(zip(taken, recorded)) if a != b}


def _lstat(path: str) -> list[int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class _Forked:
    """The bytes `work()` returns, computed by a forked child (started now, read by `_read`)
    while this process goes on: only os calls and marshal there, then _exit (no atexit, no
    stdio flush). `pid` stays 0 without fork (or if it fails): the caller works here."""

    def __init__(self, work: Any) -> None:
        self.pid = 0
        self.fd = -1
        if not _can_fork():
            return
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return
        if pid == 0:  # the child
            code = 1
            try:
                os.close(r)
                view = memoryview(work())
                while view:
                    view = view[os.write(w, view) :]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self.fd = pid, r

    def _read(self) -> bytes | None:
        """What the child sent (None if reading failed); the child is reaped."""
        chunks = []
        try:
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
        except OSError:
            return None
        finally:
            self.abandon()
        return b"".join(chunks)

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # a child still writing gets EPIPE and exits
            self.fd = -1
        if self.pid:
            with contextlib.suppress(OSError):
                os.waitpid(self.pid, 0)
            self.pid = 0


class _Diff(_Forked):
    """`_diff_part` of each job, taken by a forked child (started now, read by `result`):
    the full path loads meanwhile. Without fork, or if the child fails, taken here."""

    def __init__(self, jobs: list[tuple[list[tuple[str, str, int]], bytes, bool]]) -> None:
        self.jobs = jobs
        super().__init__(lambda: marshal.dumps([_diff_part(*job) for job in jobs], STATS_MARSHAL))

    def result(self) -> list[dict[int, Any] | None]:
        if self.pid:
            data = self._read()
            with contextlib.suppress(EOFError, ValueError, TypeError):
                got = marshal.loads(data or b"")
                if isinstance(got, list) and len(got) == len(self.jobs):
                    return got
        return [_diff_part(*job) for job in self.jobs]


def vouch(path: str, ident: Any, *, store_dir: str, build_dir: str, plan: bool = False) -> dict[str, Any] | None:
    """What the stale stamp at `path` (of the build `ident`) still shows, for the full path
    (Bazel's Skyframe re-checks only what changed): per node of that build, its key, its
    outputs tree and the build/ folders it was materialized to ("nodes": id → [key, tree,
    folders]), when none of the store's blobs (nor, unless `plan`, any build/ file or
    folder) the stamp watches changed since. A node whose key now is the one recorded then
    needs no check of its blobs or build/ folders (`Engine.vouched`): they are as they were
    when that build found them intact. What may have changed is what the full path reads
    again and keys on (recipe, settings, lock, modules, inputs, environment): the keys show
    it. Also "changed" (path → stat now or None, of each stamped file that changed),
    "others" (why the stamp misses for anything else, "" if nothing) and "stamp". None if
    there is no such stamp, or anything it watches in the store changed (`vouch_miss`
    says why): the full path checks every hit. Read-only."""
    global vouch_miss
    if os.environ.get("MOPT_NO_VOUCH"):  # the full path checks every hit (tests compare the two)
        vouch_miss = "MOPT_NO_VOUCH is set"
        return None
    try:
        got = _vouch(path, ident, os.path.abspath(store_dir), os.path.abspath(build_dir), plan)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, EOFError):
        got = "unreadable stamp"
    if isinstance(got, str):
        vouch_miss = got
        return None
    vouch_miss = ""
    return got


def _vouch(path: str, ident: Any, store_dir: str, build_dir: str, plan: bool) -> dict[str, Any] | str:
    seen = last_seen
    if seen is None or seen["path"] != path or seen["ident"] != ident:
        check(path, ident, learn=False)  # read-only (nothing learnt); it fills `last_seen`
        seen = last_seen
        if seen is None or seen["path"] != path or seen["ident"] != ident:
            return last_miss or "no stamp"
    stamp = seen["stamp"]
    v = stamp.get("vouch")
    if not isinstance(v, dict):
        return "the stamp records no nodes to vouch for"
    if stamp.get("store_dir") != store_dir or stamp["result"]["build_dir"] != build_dir:
        return "a stamp of another store or build folder"
    nodes = _read_vouch(stamp, path)
    if isinstance(nodes, str):
        return nodes
    jobs = _diff_jobs(stamp)
    pending = seen["pending"]
    if pending is not None:
        seen["pending"] = None
        diffs = pending.result()
        for d in diffs:
            if d is None:
                return "unreadable stamp"
        n_files = 2 if len(stamp["stats"]) == 2 else 1
        changed: dict[int, Any] = {}
        offset = 0
        for (groups, _want, _f), d in zip(jobs[:n_files], diffs[:n_files]):
            assert d is not None
            changed.update((offset + k, st) for k, st in d.items())
            offset += sum(g[2] for g in groups)
        seen["changed"] = changed
        seen["dirs"] = diffs[n_files] if len(diffs) > n_files else None
    if seen["changed"] is None:  # a miss before the stats were compared (the environment)
        changed = {}
        offset = 0
        for groups, want, follow in jobs[: 2 if len(stamp["stats"]) == 2 else 1]:
            d = _diff_part(groups, want, follow)
            if d is None:
                return "unreadable stamp"
            changed.update((offset + k, st) for k, st in d.items())
            offset += sum(g[2] for g in groups)
        seen["changed"] = changed
    where = _paths_at(stamp["groups"], seen["changed"])
    inputs = set(stamp.get("inputs", ()))
    cas = os.path.join(store_dir, "cas") + os.sep
    built = build_dir.rstrip(os.sep) + os.sep
    for p in where.values():
        if p in inputs:
            continue  # the full path digests it again: its key shows it
        if p.startswith(cas) or (not plan and p.startswith(built)):
            return f"changed: {p}"
    if not plan:
        if "dir_groups" not in v:
            return "the stamp records no build/ folders"
        dirs = seen.get("dirs")
        if dirs is None:
            dirs = _diff_part(v["dir_groups"], v["dir_stats"], False)
            if dirs is None:
                return "unreadable stamp"
        if dirs:
            k = min(dirs)
            return f"changed: {_paths_at(v['dir_groups'], {k: None})[k]}"
    others = seen["others"]
    if others is None:
        others = seen["others"] = _others(stamp)
    changed_paths = {where[k]: st for k, st in seen["changed"].items()}
    return {"nodes": nodes, "changed": changed_paths, "others": others, "stamp": stamp}


def _recorded(parts: list[bytes]) -> list[Any] | None:
    out: list[Any] = []
    for b in parts:
        got = marshal.loads(b)
        if not isinstance(got, list):
            return None
        out.extend(got)
    return out


def _split_stats(stats: list[tuple[int, ...]], groups: list[tuple[str, str, int]], cut: int) -> list[bytes]:
    """The stamp's `stats`: the stats of groups[:cut] and of groups[cut:], marshalled."""
    n = sum(g[2] for g in groups[:cut])
    if cut >= len(groups):
        return [marshal.dumps(stats, STATS_MARSHAL)]
    return [marshal.dumps(stats[:n], STATS_MARSHAL), marshal.dumps(stats[n:], STATS_MARSHAL)]


class _Half(_Forked):
    """The stats of `groups` taken by a forked child and compared with `want` there; the
    child sends "=" (the same), "x" (a file gone) or "!" and the stats it took. Without
    fork (or if it fails) the stats are taken here, when the result is asked for."""

    def __init__(self, groups: list[tuple[str, str, int]], want: bytes) -> None:
        self.groups, self.want = groups, want
        super().__init__(self._compare)

    def _compare(self) -> bytes:
        got = _stat_part(self.groups)
        if got is None:
            return b"x"
        data = marshal.dumps(got, STATS_MARSHAL)
        return b"=" if data == self.want else b"!" + data

    def result(self) -> tuple[bool, list[tuple[int, ...]] | None]:
        """(the same as `want`, the stats taken or None if a file is gone / unknown)."""
        if self.pid == 0:
            got = _stat_part(self.groups)
            return got is not None and marshal.dumps(got, STATS_MARSHAL) == self.want, got
        msg = self._read() or b""
        if msg == b"=":
            return True, None
        if msg[:1] == b"!":
            with contextlib.suppress(EOFError, ValueError, TypeError):
                got = marshal.loads(msg[1:])
                if isinstance(got, list):
                    return False, got
        return False, None  # a file gone, or the child failed: the caller stats each file


def _can_fork() -> bool:
    """Fork only a process that runs one thread (the no-op's: before any plugin, pool or
    database is opened), on two or more CPUs: the child then holds no lock another thread
    held, and it only stats, writes to its pipe and `_exit`s."""
    if not hasattr(os, "fork") or sys.platform != "linux":
        return False
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        return False
    try:  # threads a C library started (BLAKE3's, OpenMP's) are not in `threading`
        if len(os.listdir("/proc/self/task")) != 1:
            return False
    except OSError:
        return False
    return _cpus() >= 2


def _paths_at(groups: list[tuple[str, str, int]], indices: Mapping[int, Any]) -> dict[int, str]:
    """The paths of the stamp's files at `indices` (in the order of its stats)."""
    out: dict[int, str] = {}
    want = sorted(indices)
    offset, j = 0, 0
    for folder, names, n in groups:
        if j < len(want) and want[j] < offset + n:
            split = names.split("\0")
            while j < len(want) and want[j] < offset + n:
                name = split[want[j] - offset]
                out[want[j]] = os.path.join(folder, name) if folder else name
                j += 1
        offset += n
    return out


def _paths(groups: list[tuple[str, str, int]]) -> list[str]:
    """The stamp's files, in the order of its stats."""
    out: list[str] = []
    for folder, names, _n in groups:
        if not names:
            continue
        if folder:
            out.extend(os.path.join(folder, n) for n in names.split("\0"))
        else:
            out.extend(names.split("\0"))
    return out


def _stat_part(groups: list[tuple[str, str, int]], follow: bool = True) -> list[tuple[int, ...]] | None:
    """The stats of the files of `groups`, in order; None if one is gone. `follow=False`:
    their lstats (the build/ folders `vouch` checks: a folder replaced by a link differs)."""
    import functools

    out: list[tuple[int, ...]] = []
    stat_ = os.stat if follow else os.lstat
    try:
        for folder, names, _n in groups:
            if not names:
                continue
            if not folder:  # files of folders holding few of them: by their full paths
                out.extend(map(_FIELDS, map(stat_, names.split("\0"))))
                continue
            fd = os.open(folder, _DIR_FLAGS)
            try:
                by_fd = functools.partial(os.stat, dir_fd=fd, follow_symlinks=follow)
                out.extend(map(_FIELDS, map(by_fd, names.split("\0"))))
            finally:
                os.close(fd)
    except OSError:
        return None
    return out


_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0)


def _cpus() -> int:
    """The CPUs this process may run on (taskset, cpuset)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _rehash(
    path: str,
    stamp: dict[str, Any],
    paths: Mapping[int, str],
    touched: dict[int, tuple[int, ...]],
    learn: bool,
    t: Any,
) -> str:
    """The stamp holds but for input files whose stat changed (a `touch`, a copy of the same
    bytes): hash them (in parallel; BLAKE3 leaves the GIL) and, if each still holds the bytes
    and the mode it was stamped with, the build is a no-op after all (Ninja's `restat`, DVC's
    state). The new stats go to the stat cache and to the stamp, so the next build does not
    hash them again. Else "" is not returned and the digests are the full path's head start.
    `t`: the `prehash` of the touched files, started."""
    import time

    inputs = set(stamp.get("inputs", ()))
    # the stat cache is loaded and opened while the files are hashed
    learner = _Learner(stamp.get("state_db")) if learn and any(paths[k] in inputs for k in touched) else None
    try:
        t.join()
        digests = stamp["digests"]
        fresh: dict[str, tuple[tuple[int, ...], str]] = {}
        for k, st in touched.items():
            p = paths[k]
            got = t.results.get(p)
            if got is None:
                return f"changed: {p}"
            key, digest, mode = got
            if (digest, mode) != tuple(digests[p]):
                return f"changed: {p}"
            if (key[2], key[3], key[4], key[1]) != st:
                return f"changed: {p}"  # written again since it was stat-ed above
            fresh[p] = (key, digest)
        rehashed[:] = [len(fresh), sum(key[2] for key, _ in fresh.values())]
        # Remember the new stats unless a file changed too recently to trust its stat ("racy").
        now = time.time_ns()
        keep = {p: v for p, v in fresh.items() if now - v[0][4] >= RACY_NS}
        if keep and learn:
            if learner is not None:
                # the stat cache is the full path's: it only learns the input files (the
                # recipe and modules are not digested by the full path); written beside
                # the stamp (each fsynced)
                learner.give({p: v for p, v in keep.items() if p in inputs})
            stats = _recorded(stamp["stats"]) or []
            for k, st in touched.items():
                if paths[k] in keep:
                    stats[k] = st
            stamp["stats"] = _split_stats(stats, stamp["groups"], stamp["cut"])
            with contextlib.suppress(OSError, ValueError):
                _save(path, stamp)
    finally:
        if learner is not None:
            learner.finish()
    return ""


class _Learner:
    """Records digests in the store's stat cache (the full path then does not hash those
    files) on a thread of its own, which loads and opens the cache at once (while the files
    are hashed) and writes what `give` hands it; `finish` waits for it. A cache: losing
    records only costs hashing the files again, so any failure is silent."""

    def __init__(self, db: Any) -> None:
        import threading

        self._fresh: dict[str, tuple[tuple[int, ...], str]] = {}
        self._given = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(db,), name="mopt-noop-learn", daemon=True)
        self._thread.start()

    def give(self, fresh: dict[str, tuple[tuple[int, ...], str]]) -> None:
        """Record `fresh` (path → (stat key, digest)) for each file whose stat is still that key."""
        self._fresh = fresh
        self._given.set()

    def finish(self) -> None:
        self._given.set()
        self._thread.join()

    def _run(self, db: Any) -> None:
        if not isinstance(db, str):
            return
        try:
            from mopt.statcache import StatCache

            with StatCache(db) as cache:
                cache.open()
                self._given.wait()
                if not self._fresh:
                    return
                with cache.batch():
                    for p, (key, digest) in self._fresh.items():
                        st = os.stat(p)
                        if _key(st) == key:
                            cache.record(os.path.abspath(p), st, digest)
        except Exception:  # a cache: losing records only costs hashing them again
            pass


def _save(path: str, stamp: dict[str, Any], magic: bytes = MAGIC) -> None:
    payload = marshal.dumps(stamp, MARSHAL_VERSION)
    replace_durably(path, magic + zlib.crc32(payload).to_bytes(4, "little") + payload)


#: the first bytes of a stamp's vouch file (`vouch_path`); then as a stamp's
VOUCH_MAGIC = b"mopt noop vouch 5\n"


def vouch_path(stamp: str) -> str:
    """Beside the stamp: per node of its build, what `vouch` needs (a file of its own, bound
    to the stamp by a token: the no-op never reads it)."""
    return stamp + ".vouch"


def _read_vouch(stamp: dict[str, Any], path: str) -> dict[str, Any] | str:
    """The nodes of the vouch file of the stamp `stamp` at `path`, or why there are none."""
    v = stamp.get("vouch")
    if not isinstance(v, dict) or "token" not in v:
        return "the stamp records no nodes to vouch for"
    try:
        with open(vouch_path(path), "rb") as fh:
            data = fh.read()
    except OSError:
        return "no vouch file"
    n = len(VOUCH_MAGIC)
    payload = memoryview(data)[n + 4 :]
    if data[:n] != VOUCH_MAGIC or zlib.crc32(payload) != int.from_bytes(data[n : n + 4], "little"):
        return "unreadable vouch file"
    try:
        doc = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return "unreadable vouch file"
    if not isinstance(doc, dict) or doc.get("token") != v["token"] or not isinstance(doc.get("nodes"), dict):
        return "the vouch file is not the stamp's"
    nodes: dict[str, Any] = doc["nodes"]
    return nodes


def _fields() -> Any:
    import operator

    return operator.attrgetter("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")


_FIELDS = _fields()


def _missing(folder: str, names: list[str]) -> str | None:
    """A path of `names` in `folder` that is gone, or None. Many names in a folder not much
    larger than them are checked with one listing (the action entries: ~10,000 in one
    folder at 10,000 nodes), else one stat each."""
    if len(names) >= 32:
        try:
            size = os.stat(folder).st_size
        except OSError:
            return os.path.join(folder, names[0])
        if size <= 1024 * len(names):
            try:
                here = set(os.listdir(folder))
            except OSError:
                return os.path.join(folder, names[0])
            for n in names:
                if n not in here:
                    return os.path.join(folder, n)
            return None
    for n in names:
        p = os.path.join(folder, n)
        try:
            os.stat(p)
        except OSError:
            return p
    return None


def write(
    path: str,
    *,
    files: list[str],
    exist: list[str],
    absent: list[str],
    dirs: list[str],
    env_extra: list[str],
    result: dict[str, Any],
    inputs: list[str] | None = None,
    digests: dict[str, tuple[str, int]] | None = None,
    state_db: str | None = None,
    ident: Any = None,
    known: Mapping[str, os.stat_result] | None = None,
    unsure: list[str] | None = None,
    config: str | None = None,
    head: list[str] | None = None,
    vouch: dict[str, Any] | None = None,
    expect: Mapping[str, Any] | None = None,
) -> None:
    """Record a successful build's dependencies (stats taken now). `inputs`: those of
    `files` that are declared input files or model sources (see `changed_inputs`);
    `digests`: what some of them held (digest, tree mode), by the stat cache in the file
    `state_db`, so that a touched one can be rehashed instead of taking the full path.
    `known`: the stat of files the build checked (blobs found intact, build/ files found
    holding them; the recipe files as they were read), filed as taken then: a change since
    is a miss next time. `unsure`: files the build read within a moment of their last change
    (no stamp: they may have changed again unseen). `config`: the settings file (mopt.toml)
    the build read, if any (one of `files`). `head`: the recipe files, settings and lock
    (of `files`), checked first next time. `vouch`: {"nodes": id → [key, outputs tree,
    build/ folders], "build_dir"}, what a later full path may take unchecked (see `vouch`).
    `expect`: path → the stat (size, mtime_ns, ctime_ns, inode) a file of `files` was last
    found intact under, when not checked again by this build (a node `vouch` vouched for):
    filed under that stat, so a change since is a miss next time, as with `known`.
    `result`: recipe, n, build_dir, nodes (as `mopt build --json` lists them), selected."""

    mods = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and not f.startswith(sys.base_prefix + os.sep):  # the stdlib does not change
            mods.add(os.path.abspath(f))
    # the caller's order (the recipe and settings first: what a user edits is found
    # changed before 50,000 blobs are looked at), then the modules
    all_files = list(dict.fromkeys([*files, *sorted(mods)]))
    known = known or {}
    full: dict[str, os.stat_result | None] = {}
    for p in all_files:
        st = known.get(p)
        if st is None:
            try:
                st = os.stat(p)
            except OSError:
                st = None
        full[p] = st
    stats = {
        p: None if st is None else [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        for p, st in full.items()
    }
    for p, want in (expect or {}).items():
        if stats.get(p) is not None:
            stats[p] = list(want)
    # A file changed within the last moment may change again within the same timestamp
    # tick without its stat changing ("racily clean", as git calls it): stamp next time.
    import time

    now = time.time_ns()
    racy = [p for p, st in stats.items() if st is not None and now - st[2] < RACY_NS]
    # A module edited while this build ran: the stamp would take its new stat for the code
    # this process ran (an edited kind would then look built). Its ctime says so.
    started = getattr(sys.modules.get("mopt"), "STARTED_NS", now)
    racy += [p for p in sorted(mods) if (rec := stats.get(p)) is not None and rec[2] >= started]
    racy += unsure or []
    if racy:
        invalidate(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".skipped", "w") as fh:
            fh.write(f"the last build did not write one: {racy[0]} had just changed\n")
        return
    present = [p for p, st in stats.items() if st is not None and "\0" not in p]
    if len(present) != sum(st is not None for st in stats.values()):
        return skip(path, "a path holds a NUL character")
    digests = dict(digests or {})
    digests.update(_module_digests(sorted(mods), full, digests))
    watched = _one_name_per_inode(present, full, stats, digests)
    groups, order = _group(watched)
    cut = _halve(groups)
    exist_by_folder: dict[str, list[str]] = {}
    for p in sorted(set(exist)):
        folder, name = os.path.split(p)
        exist_by_folder.setdefault(folder, []).append(name)

    stamp = {
        "version": STAMP_VERSION,
        "ident": ident,
        # where this stamp is and the settings that put it there (see `_default_stamp`)
        "store_dir": os.path.dirname(os.path.dirname(os.path.abspath(path))),
        "config": config,
        "python": sys.executable,
        "host": _host(),
        "env_extra": sorted(set(env_extra)),
        "env": _env(list(env_extra)),
        "groups": groups,
        "stats": _split_stats([tuple(stats[p]) for p in order], groups, cut),  # type: ignore[arg-type]
        "cut": cut,
        "exist": exist_by_folder,
        # a file that was not there (e.g. no mopt.lock) must still not be there
        "absent": sorted(set(absent) | {p for p, st in stats.items() if st is None}),
        "dirs": {d: _dir_mtime(d) for d in sorted(set(dirs) | set(_path_dirs()))},
        "inputs": sorted(set(inputs or ())),
        "digests": {p: (d, m) for p, (d, m) in (digests or {}).items() if p in stats},
        "state_db": state_db,
        "result": stamp_result(result),
        # checked first: an edited recipe is a miss without statting every other file
        "head": [[p, stats.get(p)] for p in dict.fromkeys(head or ())],
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _remove(vouch_path(path))
    if vouch is not None:
        record = _vouch_record(vouch, now)
        if record is not None:
            token = os.urandom(12).hex()
            try:
                _save(vouch_path(path), {"version": STAMP_VERSION, "token": token, "nodes": vouch["nodes"]}, VOUCH_MAGIC)
                stamp["vouch"] = dict(record, token=token)
            except (OSError, ValueError):
                _remove(vouch_path(path))
    try:
        _save(path, stamp)
    except ValueError:  # a value marshal cannot hold (it takes only builtins)
        return skip(path, "the build's result cannot be recorded")
    _remove(path + ".skipped")
    if ident is not None:  # the JSON stamp an older mopt left for this build
        old = _legacy_stamp_path(os.path.dirname(path), ident)
        _remove(old, old + ".skipped")


def stamp_result(result: dict[str, Any]) -> dict[str, Any]:
    """The stamp's `result` of a build's `result` (see `write`)."""
    import json

    # what `mopt build --json` prints on a hit, encoded now: a hit only splices in the
    # seconds (the compact form of cli.dump_json; a terminal gets it indented)
    def compact(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"), default=str)

    head = compact({"recipe": result["recipe"]})[:-1] + ',"seconds":'
    tail = "," + compact({"build_dir": result["build_dir"], "nodes": result["nodes"]})[1:]
    return {
        "recipe": result["recipe"],
        "n": result["n"],
        "build_dir": result["build_dir"],
        "ids": [node["id"] for node in result["nodes"]],
        "selected": list(result.get("selected", [])),
        "json_head": head,
        "json_tail": tail,
        # binds the plan file the build writes beside the stamp (`mopt.planstamp`)
        "plan_token": result.get("plan_token"),
    }


def _vouch_record(vouch: dict[str, Any], now: int) -> dict[str, Any] | None:
    """The stamp's `vouch`: the nodes, and the lstat of every build/ folder they were
    materialized to and of each folder above it up to the build folder (a file added to
    one, or a folder replaced by a link, changes one of them); None (nothing to vouch for
    next time) if one changed within RACY_NS or cannot be read."""
    nodes: dict[str, Any] = vouch["nodes"]
    top = os.path.abspath(vouch["build_dir"])
    folders: set[str] = {top}
    for _key, _tree, bases, _entry in nodes.values():
        for b in bases:
            d = b
            while d not in folders and len(d) > len(top):
                folders.add(d)
                d = os.path.dirname(d)
    # grouped by parent, however few (the names stay short: the stamp is read by every no-op)
    groups, _order = _group(sorted(folders), least=1)
    taken = _stat_part(groups, follow=False)
    if taken is None or any(now - st[2] < RACY_NS for st in taken):
        return None
    return {"dir_groups": groups, "dir_stats": marshal.dumps(taken, STATS_MARSHAL)}


def patch(
    path: str,
    stamp: dict[str, Any],
    updates: Mapping[str, tuple[list[int], Any]],
    result: dict[str, Any],
    nodes: dict[str, Any] | None = None,
) -> bool:
    """Write the stamp `stamp` (read from `path` by this process, its files found unchanged
    since but for `updates`: path → (stat now, (digest, mode) or None)) with those files'
    stats and digests and the build's `result`: what `write` would record for a build of
    the same nodes, keys, outputs and files. `nodes`: the vouch file's nodes now, if they
    changed (entries touched: their new records), written first under the same token (a
    crash between leaves the old stamp with records of the entries as they are). False
    (nothing written, or only the vouch file) if a file of `updates` is not one of the
    stamp's."""
    stamp = dict(stamp)
    groups = stamp["groups"]
    index = indices(groups, list(updates))
    if len(index) != len(updates):
        return False
    parts = list(stamp["stats"])
    n0 = sum(g[2] for g in (groups[: stamp["cut"]] if len(parts) == 2 else groups))
    # only a half that holds an updated file is decoded and marshalled again
    for half, lo in enumerate([0, n0][: len(parts)]):
        mine = {k - lo: p for p, k in index.items() if (k >= n0) == (half == 1)}
        if not mine:
            continue
        stats = marshal.loads(parts[half])
        if not isinstance(stats, list):
            return False
        for k, p in mine.items():
            stats[k] = tuple(updates[p][0])
        parts[half] = marshal.dumps(stats, STATS_MARSHAL)
    digests = dict(stamp.get("digests", {}))
    for p, (_st, digest) in updates.items():
        if digest is None:
            digests.pop(p, None)
        else:
            digests[p] = tuple(digest)
    stamp["stats"] = parts
    stamp["digests"] = digests
    stamp["head"] = [[p, list(updates[p][0]) if p in updates else want] for p, want in stamp.get("head", [])]
    stamp["result"] = stamp_result(result)
    if nodes is not None:
        token = stamp.get("vouch", {}).get("token")
        if token is None:
            return False
        try:
            _save(vouch_path(path), {"version": STAMP_VERSION, "token": token, "nodes": nodes}, VOUCH_MAGIC)
        except (OSError, ValueError):
            _remove(vouch_path(path))  # the stamp then vouches for nothing
            return False
    try:
        _save(path, stamp)
    except ValueError:
        return False
    _remove(path + ".skipped")
    return True


def indices(groups: list[tuple[str, str, int]], paths: list[str]) -> dict[str, int]:
    """path → its index in the stamp's stats, of those of `paths` the stamp's `groups`
    hold (only the groups that may hold one are split into names)."""
    want = set(paths)
    folders = {os.path.dirname(p) for p in paths}
    out: dict[str, int] = {}
    offset = 0
    for folder, names, n in groups:
        if not folder or folder in folders:
            for k, name in enumerate(names.split("\0") if names else ()):
                p = os.path.join(folder, name) if folder else name
                if p in want:
                    out[p] = offset + k
        offset += n
    return out


def _module_digests(
    mods: list[str], full: Mapping[str, os.stat_result | None], known: Mapping[str, Any]
) -> dict[str, tuple[str, int]]:
    """What each loaded module file held, read now and kept only if its stat after reading
    is the one the stamp records (taken before, and older than the build, see `write`):
    a touched module whose bytes are the same is then rehashed, not a miss. Python runs the
    same code from the same bytes (a stale .pyc is compiled again from them)."""
    from mopt.filehash import hash_bytes, mode_of

    out: dict[str, tuple[str, int]] = {}
    for p in mods:
        st = full.get(p)
        if st is None or p in known:
            continue
        try:
            with open(p, "rb") as fh:
                data = fh.read()
            after = os.stat(p)
        except OSError:
            continue
        if _key(after) == _key(st):
            out[p] = (hash_bytes(data), mode_of(st.st_mode))
    return out


def _one_name_per_inode(
    present: list[str],
    full: Mapping[str, os.stat_result | None],
    stats: Mapping[str, list[int] | None],
    digests: Mapping[str, Any],
) -> list[str]:
    """`present` less the names whose inode another name of it stands for (a build/ file
    is a hard link of its blob: one stat of either is the inode's). Safe because every
    change to a name of an inode changes the inode's ctime, which the kept name's stat
    shows: an edit or chmod of either name (the same inode); removing or replacing one
    (the link count drops: unlink and rename-over update the ctime, and a stamp is never
    written within RACY_NS of a ctime, so the new ctime differs). The last name is kept
    (the build/ file: a hand edit that writes a new file there changes its own stat too);
    files with a recorded digest are kept, so that a touch is rehashed by their name."""
    last: dict[tuple[int, int], str] = {}
    for p in present:
        st = full[p]
        if st is not None and st.st_nlink > 1:
            last[(st.st_dev, st.st_ino)] = p
    out = []
    for p in present:
        st = full[p]
        if st is not None and st.st_nlink > 1 and p not in digests:
            keep = last[(st.st_dev, st.st_ino)]
            if keep != p and stats[keep] == stats[p]:
                continue
        out.append(p)
    return out


def _group(paths: list[str], least: int | None = None) -> tuple[list[tuple[str, str, int]], list[str]]:
    """The stamp's groups (folder, NUL-joined names, count) of `paths`, and the paths in
    the groups' order. A folder holding GROUP_MIN or more of them (the store's shards) is
    one group, stat-ed through a descriptor of it; the rest are by full path, in order."""
    by_folder: dict[str, list[str]] = {}
    for p in paths:
        folder, name = os.path.split(p)
        by_folder.setdefault(folder, []).append(name)
    if least is None:
        least = GROUP_MIN
    loose = [p for p in paths if len(by_folder[os.path.dirname(p)]) < least]
    groups: list[tuple[str, str, int]] = []
    order: list[str] = []
    for k in range(0, len(loose), GROUP_MAX):
        part = loose[k : k + GROUP_MAX]
        groups.append(("", "\0".join(part), len(part)))
        order.extend(part)
    for folder, names in by_folder.items():
        if len(names) < least:
            continue
        for k in range(0, len(names), GROUP_MAX):
            part = names[k : k + GROUP_MAX]
            groups.append((folder, "\0".join(part), len(part)))
            order.extend(os.path.join(folder, n) for n in part)
    return groups, order


def _halve(groups: list[tuple[str, str, int]]) -> int:
    """Where the groups are cut in two halves of about as many files (len(groups): none)."""
    total = sum(g[2] for g in groups)
    if total < PARALLEL_MIN:
        return len(groups)
    acc = 0
    for i, g in enumerate(groups):
        acc += g[2]
        if 2 * acc >= total:
            return i + 1
    return len(groups)


def report(done: dict[str, Any], seconds: float, as_json: bool, quiet: bool) -> None:
    """Print what a no-op build prints, from the stamp (`mopt build`'s own output)."""
    n = done["n"]
    if as_json:
        io = (
            f'{{"hashed_files":{int(done.get("hashed_files", 0))},'
            f'"hashed_bytes":{int(done.get("hashed_bytes", 0))},"stat_hits":0,"noop_stamp":true}}'
        )
        text = (
            f'{done["json_head"]}{round(seconds, 3)!r},"counts":{{"cached":{int(n)}}},"io":{io}'
            f"{done['json_tail']}"
        )
        if sys.stdout.isatty():  # cli.dump_json's indented form
            import json

            text = json.dumps(json.loads(text), indent=2, default=str)
        sys.stdout.write(text + "\n")
        return
    if not quiet:
        sys.stderr.write("".join(f"[{k}/{n}] cached {i}\n" for k, i in enumerate(done["ids"], 1)))
    sys.stderr.write(f"{n} action(s): {n} cached in {seconds:.2f}s (no-op: nothing changed)\n")
    for line in done.get("selected", []):
        sys.stderr.write(line + "\n")
    sys.stderr.write(f"artifacts under {done['build_dir']}\n")


#: `mopt build` options the click-free entry understands; any other argument (a typo,
#: --help, a combined short flag) leaves the command to click
_FLAGS = {
    "--json": "json",
    "--quiet": "quiet",
    "-q": "quiet",
    "--offline": "offline",
    "--no-check": None,
    "--keep-going": None,
    "-k": None,
    "--frozen": None,
    "--no-lock": None,
}


def _parse_build(argv: list[str]) -> tuple[str, list[str], dict[str, bool]] | None:
    """(recipe, selectors, flags) of a plain `mopt build ...` command line, else None."""
    if not argv or argv[0] != "build":
        return None
    flags = {"json": False, "quiet": False, "offline": False}
    positional: list[str] = []
    args = iter(argv[1:])
    for a in args:
        if a.startswith("-") and a != "-":
            if a in _FLAGS:
                name = _FLAGS[a]
                if name is not None:
                    flags[name] = True
                continue
            value = None
            if a in ("--jobs", "-j"):
                value = next(args, None)
            elif a.startswith("--jobs="):
                value = a[len("--jobs=") :]
            if value is None or not value.isdigit() or int(value) < 1 or not value.isascii():
                return None
            continue
        positional.append(a)
    if not positional:
        return None
    return positional[0], positional[1:], flags


def fast_main(argv: list[str]) -> bool:
    """`mopt build` without click, pydantic or plugins when its stamp holds (Ninja's no-op):
    True if it printed the no-op build's output. Anything else (another command, an option
    it does not know, a miss) returns False, and the CLI runs as usual."""
    global _consulted
    import time

    t0 = time.time()
    try:
        parsed = _parse_build(argv)
        if parsed is None:
            return False
        recipe, selectors, flags = parsed
        if not os.path.exists(recipe):
            return False
        ident = ident_of(recipe, selectors, flags["offline"])
        guessed = _default_stamp(recipe, selectors, flags["offline"])
        done = None if guessed is None else consult(guessed, ident)
        if done is None:  # the settings, parsed, say where the stamp is
            other = last_miss == "a stamp of other settings"
            _expected.clear()
            store_dir = find_store_dir(recipe)
            if store_dir is None:
                return False
            path = stamp_path(store_dir, recipe, selectors, flags["offline"])
            if path != guessed or other:
                _consulted = None
                done = consult(path, ident)
    except Exception:  # the full path runs and reports whatever this was
        return False
    if done is None:
        return False
    report(done, time.time() - t0, flags["json"], flags["quiet"])
    return True


def prehash(paths: list[str]) -> Any:
    """Start digesting the files `paths` on background threads; return the thread, whose
    `results` (path → (stat, digest)) the engine takes once it is joined (`Engine.prehashed`).
    After a `touch` of many large input files, hashing them is most of the build: this runs
    while the full path loads plugins and the recipe (BLAKE3 leaves the GIL to the loading
    thread). A digest is kept only if the file's stat was the same before and after hashing,
    and the engine uses it only while the file's stat still is that one; anything that
    fails here is left to the full path to digest and report.

    Returns once every hashing thread is in its first file (a millisecond or two): a caller
    that went on at once to import modules would hold the GIL the new threads need to get
    there (a thread that waits for it waits a switch interval, 5 ms, at each system call)."""
    import threading

    results: dict[str, tuple[tuple[int, ...], str, int]] = {}  # path → (stat key, digest, tree mode)
    started = threading.Event()

    from mopt.filehash import hash_file, mode_of  # BLAKE3 loaded here, before the threads

    def work() -> None:
        try:
            _hash_all(paths, results, hash_file, mode_of, started)
        except Exception:  # a head start only: the full path digests what is missing
            pass
        finally:
            started.set()

    t = threading.Thread(target=work, name="mopt-prehash", daemon=True)
    t.results = results  # type: ignore[attr-defined]
    t.start()
    started.wait(1.0)
    return t


def _hash_all(
    paths: list[str],
    results: dict[str, tuple[tuple[int, ...], str, int]],
    hash_file: Any,
    mode_of: Any,
    started: Any,
) -> None:
    """`prehash`'s work: as many files at once as CPUs, each on one thread (BLAKE3's own
    threads would only contend), largest first; the last `cpus` files (all of them when
    they are fewer) are spread over BLAKE3's threads, so that no CPU idles while another
    thread finishes a file alone. The calling thread is one of the workers (no pool:
    concurrent.futures' import alone delayed the first byte by ~10 ms). `started` is set
    once each worker has taken its first file."""
    import collections
    import stat as stat_
    import threading

    todo: list[tuple[int, str, os.stat_result]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except (OSError, ValueError):
            continue
        if stat_.S_ISREG(st.st_mode):  # folders: the full path digests them
            todo.append((-st.st_size, p, st))
    todo.sort(key=lambda x: x[0])
    queue = collections.deque(todo)  # popleft is atomic: each file is taken once
    cpus = _cpus()
    workers = max(1, min(cpus, len(todo)))
    waiting = [workers]
    lock = threading.Lock()

    def worker() -> None:
        first = True
        while True:
            item: tuple[int, str, os.stat_result] | None
            try:
                item = queue.popleft()
            except IndexError:
                item = None
            if first:
                first = False
                with lock:
                    waiting[0] -= 1
                    if waiting[0] == 0:
                        started.set()
            if item is None:
                return
            _, p, st = item
            # one of the last `cpus` files: BLAKE3's threads take it, and the other
            # threads' last files too, sharing the CPUs until every file is done
            spread = cpus > 1 and len(queue) < cpus
            try:
                digest = hash_file(p, threads=spread, size=st.st_size)
                after = os.stat(p)
            except (OSError, ValueError):
                continue
            if _key(after) == _key(st):  # not written meanwhile
                results[p] = (_key(st), digest, mode_of(st.st_mode))

    others = [threading.Thread(target=worker, name="mopt-prehash", daemon=True) for _ in range(workers - 1)]
    for o in others:
        o.start()
    try:
        worker()
    finally:
        for o in others:
            o.join()


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def replace_durably(path: str, data: bytes, mode: int = 0o644) -> None:
    """Put `data` at `path` through a temp file that is fsynced before the rename, and fsync
    the folder after it: a power cut leaves the old file or the new one, never an empty one
    (ext4/xfs may otherwise commit the rename before the data)."""
    import tempfile

    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _host() -> str:
    return os.uname().nodename


def invalidate(path: str) -> None:
    _remove(path, path + ".skipped", vouch_path(path))


def skip(path: str, why: str) -> None:
    """No stamp for this build, and a note of why (the next build's `noop_miss` says it)."""
    invalidate(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".skipped", "w") as fh:
        fh.write(f"the last build did not write one: {why}\n")


def _remove(*paths: str) -> None:
    """Remove what exists of `paths` (a stamp, or its note, may never have been written)."""
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)


def _dir_mtime(d: str) -> int | None:
    try:
        return os.stat(d).st_mtime_ns
    except OSError:
        return None


def _path_dirs() -> list[str]:
    """sys.path folders: installing or removing a distribution changes their listing."""
    return [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
