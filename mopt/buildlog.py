"""The build log (Ninja's `.ninja_log`): what the last build of a recipe and selection found,
so that the next one checks again only what changed.

One file per (recipe, selectors, --offline), `<store>/log/<name>.log`, written by the Engine
at the end of every build and replaced whole (fsync, rename). It records:

- the head: the recipe files, the settings and the lock file; the settings files that must
  not appear; every Python module the build had loaded (mopt, plugins, libraries: an upgrade
  or an edited kind changes one) and the folders of sys.path (an install changes their
  listing); the declared input files and folders and the model sources; the environment
  variables that may change a key;
- per node: its action key, its action entry (less the key parts) and the files it stands
  on: the entry's file and its blobs, then the build/ files and folders it was laid out in.

Every file is recorded with its `FileStat` and, where known, its digest. One rule decides
whether a recorded file still holds: its stat is the recorded one and that stat was not taken
within RACY_NS of its last change. A file recorded within that window (a build's own writes,
mopt.lock among them) is checked by its digest, as git checks "racily clean" entries, so a
build's own writes never cost the next build its fast path; a head file whose stat moved (a
`touch`, a copy of the same bytes) is hashed, and holds if its bytes and mode are the same.
Anything else is a change.

A no-op build is "the last build succeeded and every recorded file holds": it loads no plugin,
parses no recipe and keys nothing. A node whose key is the recorded one and whose files hold
is a hit without reading its entry or blobs again (`Log.node_holds`); anything else is asked
of the store (`Store.ac_entry`), which checks every blob.

This module imports nothing heavy: the no-op runs before pydantic, pluggy or click are loaded.
"""

from __future__ import annotations

import marshal
import operator
import os
import sys
import time
import zlib

# not `typing` (it loads re, enum, functools...: ~3 ms of a no-op); blake3 is loaded only
# where a file is hashed or a log written
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from mopt.filehash import FileStat

VERSION = 1
MAGIC = b"mopt build log 1\n"
#: environment variables that may change what a build does (the kinds' own `env_values`
#: names are recorded besides); HOME and XDG_CACHE_HOME say where Hugging Face's cache is
ENV_PREFIXES = ("MOPT_", "HF_", "TRANSFORMERS_", "CUDA_", "NVIDIA_")
ENV_NAMES = ("HOME", "XDG_CACHE_HOME")
#: see `mopt.filehash.RACY_NS` (not imported from there: that loads blake3)
RACY_NS = 200_000_000
#: the switch itself changes nothing a build makes
ENV_IGNORED = ("MOPT_NO_LOG",)

_FIELDS = operator.attrgetter("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
#: the recorded stats are marshalled in format 2 (no back-references: equal lists give equal
#: bytes), so a no-op compares the stats it takes with them as bytes
STATS_MARSHAL = 2
#: from this many recorded files on, a forked child takes the stats of the second half
FORK_MIN = 16384


def ident_of(recipe: str, selectors: list[str] | tuple[str, ...], offline: bool) -> tuple[str, tuple[str, ...], bool]:
    """What names one log: the recipe, the selectors and --offline."""
    return (os.path.abspath(recipe), tuple(sorted(selectors)), bool(offline))


def log_path(store_dir: str, ident: tuple[str, tuple[str, ...], bool]) -> str:
    # zlib's checksums, not hashlib (~5 ms to load OpenSSL): a collision only costs a full
    # build, since the log's own `ident` is compared
    raw = repr(ident).encode("utf-8", "surrogateescape")
    return os.path.join(store_dir, "log", f"{zlib.crc32(raw):08x}{zlib.adler32(raw):08x}.log")


def environment(extra: list[str] | tuple[str, ...] = ()) -> dict[str, str | None]:
    names = {k for k in os.environ if k.startswith(ENV_PREFIXES)} | set(ENV_NAMES) | set(extra)
    return {k: os.environ.get(k) for k in sorted(names - set(ENV_IGNORED))}


def stores_of(recipe: str) -> Iterator[str]:
    """The store folders where the log of a build of `recipe` may be, most likely first: the
    default store beside the nearest mopt.toml (found without parsing it: the log records the
    settings file, which holds only while its bytes are those that put the store there), then
    the store that file names, if it names another."""
    d = os.path.dirname(os.path.abspath(recipe))
    while not os.path.isfile(os.path.join(d, "mopt.toml")):
        if os.path.dirname(d) == d:  # no settings: the store beside the recipe
            yield os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(recipe))), ".mopt")
            return
        d = os.path.dirname(d)
    real = os.path.realpath(d)
    yield os.path.join(real, ".mopt")
    try:
        import tomllib

        with open(os.path.join(d, "mopt.toml"), "rb") as fh:
            named = os.path.realpath(os.path.join(real, tomllib.load(fh).get("store", {}).get("path", ".mopt")))
    except Exception:  # unreadable, or not the simple form: the full path reports it
        return
    if named != os.path.join(real, ".mopt"):
        yield named


# --------------------------------------------------------------------------- reading


def _cached(method: Any) -> Any:
    """`functools.cached_property`, without loading functools on the no-op's path."""
    name = method.__name__

    def get(self: Any) -> Any:
        got = self.__dict__.get(name)
        if got is None:
            got = self.__dict__[name] = method(self)
        return got

    return property(get, doc=method.__doc__)


def read(path: str) -> dict[str, Any] | str:
    """The log at `path`, or why there is none ("no log", "unreadable log"). Never a blocking
    open: a fifo or a folder in its place is unreadable."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "no log"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unreadable log"
        with open(fd, "rb", closefd=False) as fh:
            data = fh.read()
    except OSError:
        return "unreadable log"
    finally:
        os.close(fd)
    n = len(MAGIC)
    payload = memoryview(data)[n + 4 :]
    if data[:n] != MAGIC or zlib.crc32(payload) != int.from_bytes(data[n : n + 4], "little"):
        return "unreadable log"  # another version, or a torn or damaged file
    try:
        doc = marshal.loads(payload)
    except (EOFError, ValueError, TypeError):
        return "unreadable log"
    return doc if isinstance(doc, dict) and doc.get("version") == VERSION else "unreadable log"


def load(path: str, ident: Any, store: str) -> Log | str:
    """The log at `path` of the build `ident` in `store`, every recorded file's stat taken
    (`Log.stat_all`), or why there is none. Kept for this process: the full path after a
    no-op's miss takes the no-op's (the same file, unchanged since), not its stats again."""
    try:
        st = _FIELDS(os.stat(path))
    except OSError:
        return "no log"
    kept = _kept.get(path)
    if kept is not None and kept[0] == st:
        return kept[1]
    doc = read(path)
    if isinstance(doc, str):
        return doc
    try:
        if doc["ident"] != ident or doc["store"] != store:
            return "a log of another build"
        log = Log(path, doc)
        log.stat_all()
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return "unreadable log"
    _kept[path] = (st, log)
    return log


#: path → (its stat, the `Log` read from it) of the logs this process loaded
_kept: dict[str, tuple[FileStat, Log]] = {}


class Log:
    """A build log as read, with the verdict on each recorded file taken once. What a no-op
    does not need (the recorded stats until one differs, the digests, the nodes) is kept
    marshalled until it is asked for."""

    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.path = path
        self.doc = doc
        self.paths: list[str] = doc["paths"].split("\0") if doc["paths"] else []
        self.racy: set[int] = set(doc["racy"])
        self.touchable: set[int] = set(doc["touchable"])
        #: the stat of every recorded file now (None: gone), taken by `stat_all`
        self.now: list[FileStat | None] = []
        #: every file holds (`stat_all` found them all as recorded)
        self.all_hold = False
        #: after `stat_all`: the files whose stat is not the recorded one, or racy (the rest hold)
        self.suspect: set[int] | None = None
        #: index → verdict, of those decided
        self.verdict: dict[int, bool] = {}
        #: index → the stat a moved file was found holding under (its digest rechecked)
        self.learnt: dict[int, FileStat] = {}
        #: [files, bytes] hashed to decide
        self.hashed = [0, 0]

    @_cached
    def stats(self) -> list[FileStat]:
        got: list[FileStat] = marshal.loads(self.doc["stats"])
        if not isinstance(got, list) or len(got) != len(self.paths):
            raise ValueError("paths and stats differ in length")
        return got

    @_cached
    def digests(self) -> dict[int, tuple[str, int]]:
        got: dict[int, tuple[str, int]] = marshal.loads(self.doc["digests"])
        return got

    @_cached
    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.paths)}

    # -- one file

    def holds(self, i: int) -> bool:
        """Whether the file at index `i` still holds what the log recorded (see the module)."""
        if self.all_hold or (self.suspect is not None and i not in self.suspect):
            return True
        got = self.verdict.get(i)
        if got is None:
            got = self.verdict[i] = self._decide(i, self.now[i])
        return got

    def _decide(self, i: int, now: FileStat | None) -> bool:
        if now is None:
            return False
        same = now == self.stats[i]
        if same and i not in self.racy:
            return True
        if not same and i not in self.touchable:
            return False
        want = self.digests.get(i)
        if want is None:
            return False
        got = self._digest(self.paths[i], now)
        if got != tuple(want):
            return False
        if not same:
            self.learnt[i] = now
        return True

    def _digest(self, path: str, now: FileStat) -> tuple[str, int] | None:
        """(digest, tree mode) of the file or folder at `path` if its stat is still `now`."""
        import stat

        from mopt.filehash import hash_bytes, hash_file, mode_of

        try:
            st = os.stat(path)
            if stat.S_ISDIR(st.st_mode):
                names = "\0".join(sorted(os.listdir(path)))
                got = (hash_bytes(names.encode("utf-8", "surrogateescape")), 0)
            else:
                got = (hash_file(path, size=st.st_size), mode_of(st.st_mode))
            if _FIELDS(os.stat(path)) != now:
                return None  # changed while it was read
        except OSError:
            return None
        self.hashed[0] += 1
        self.hashed[1] += st.st_size
        return got

    def digest_of(self, path: str, now: FileStat) -> str | None:
        """The recorded digest of the file `path` if its stat `now` is the one recorded (or
        learnt) and not within the racy window: what the stat cache would answer, for a file
        the last build read (an input the no-op found touched but holding, among them)."""
        i = self.index.get(path)
        if i is None or i not in self.digests or self.learnt.get(i, self.stats[i]) != now:
            return None
        if i in self.racy and not self.verdict.get(i):
            return None
        return self.digests[i][0]

    def first_change(self, indices: Any) -> int | None:
        """The first of `indices` that does not hold, or None."""
        for i in indices:
            if not self.holds(i):
                return i
        return None

    # -- nodes

    @_cached
    def nodes(self) -> dict[str, list[Any]]:
        """node id → [key, entry fields, store file indices, build/ file indices, build/
        folders]: kept marshalled apart from the rest, which is all a no-op reads."""
        got: dict[str, list[Any]] = marshal.loads(self.doc["nodes"])
        if not isinstance(got, dict):
            raise ValueError("unexpected layout")
        return got

    def node(self, node_id: str, key: str) -> list[Any] | None:
        """The record of `node_id` if it was built or found under `key`:
        [key, entry fields, store file indices, build/ file indices, build/ folders]."""
        rec = self.nodes.get(node_id)
        return rec if rec is not None and rec[0] == key else None

    def node_holds(self, rec: list[Any], *, build: bool) -> bool:
        """Whether a node's entry file and blobs (and, with `build`, its build/ files and
        folders) are as the log recorded them."""
        return self.first_change(rec[2]) is None and (not build or self.first_change(rec[3]) is None)

    # -- the whole log

    def stat_all(self) -> None:
        """Take the stat of every recorded file now, in one run (the no-op's loop: the stats
        are taken in C, map and attrgetter, marshalled and compared as bytes). From FORK_MIN
        files on, a forked child takes the second half where there are two CPUs: os.stat is
        mostly kernel time, and threads would contend for the GIL at every call (10,000
        nodes, 62,000 files, quiet 2-core AMD EPYC: 0.16 s in one process, 0.11 s in two)."""
        paths = self.paths
        half = len(paths) // 2
        child = _fork(lambda: marshal.dumps(_stat_list(paths[half:]), STATS_MARSHAL)) if half >= FORK_MIN // 2 else None
        now = _stat_list(paths[:half] if child is not None else paths)
        if child is not None:
            rest = _join(*child)
            now += rest if isinstance(rest, list) else _stat_list(paths[half:])
        self.now = now
        self.all_hold = not self.racy and marshal.dumps(now, STATS_MARSHAL) == self.doc["stats"]
        if not self.all_hold:
            self.suspect = {i for i, (a, b) in enumerate(zip(now, self.stats)) if a != b} | self.racy

    def why_not(self, store: str, env: dict[str, str | None] | None = None) -> str:
        """Why the last build is not a no-op now ("" if it is): everything it recorded holds."""
        doc = self.doc
        if doc.get("noop"):
            return f"no-op off: {doc['noop']}"
        if doc["python"] != sys.executable or doc["host"] != os.uname().nodename:
            return "another Python or host"
        if doc["store"] != store:
            return "a log of another store"
        if (env if env is not None else environment(doc["env_names"])) != doc["env"]:
            return "environment changed"
        for p in doc["absent"]:
            if os.path.lexists(p):
                return f"appeared: {p}"
        if self.all_hold:
            return ""
        i = self.first_change(range(len(self.paths)))
        return "" if i is None else f"changed: {self.paths[i]}"

    def learn(self) -> None:
        """Record the files found holding under a new stat (or racy no more), so the next build
        does not hash them again; a log that cannot be written is only slower next time."""
        from mopt.filehash import is_racy

        now = time.time_ns()
        settled = {i for i in self.racy if self.verdict.get(i) and not is_racy(self.stats[i], now)}
        fresh = {i: st for i, st in self.learnt.items() if not is_racy(st, now)}
        if not settled and not fresh:
            return
        stats = list(self.stats)
        for i, st in fresh.items():
            stats[i] = st
        doc = dict(self.doc, stats=marshal.dumps(stats, STATS_MARSHAL), racy=sorted(self.racy - settled - set(fresh)))
        try:
            _save(self.path, doc)
        except (OSError, ValueError):
            pass


def _stat_list(paths: list[str]) -> list[FileStat | None]:
    try:
        return list(map(_FIELDS, map(os.stat, paths)))
    except (OSError, ValueError):  # one is gone: take them one by one
        out: list[FileStat | None] = []
        for p in paths:
            try:
                out.append(_FIELDS(os.stat(p)))
            except (OSError, ValueError):
                out.append(None)
        return out


def _fork(work: Any) -> tuple[int, int] | None:
    """(pid, read end of a pipe) of a child that writes what `work()` returns and exits; None
    where forking is not safe or not worth it: a process running other threads (the child
    would hold locks they held), or fewer than two CPUs."""
    try:
        if sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2 or len(os.listdir("/proc/self/task")) != 1:
            return None
        r, w = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: only os calls and marshal, then _exit (no atexit, no flush)
        try:
            os.close(r)
            view = memoryview(work())
            while view:
                view = view[os.write(w, view) :]
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _join(pid: int, fd: int) -> Any:
    """What the child of `_fork` sent, unmarshalled; None if it failed."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return marshal.loads(b"".join(chunks))
    except (OSError, EOFError, ValueError, TypeError):
        return None
    finally:
        os.close(fd)
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass


# --------------------------------------------------------------------------- the no-op


def noop(
    recipe: str, selectors: list[str] | tuple[str, ...], offline: bool, *, learn: bool = True
) -> tuple[Log | None, str]:
    """(the log of the last build, "") if `mopt build RECIPE SELECTORS` would do nothing now,
    else (None, why not). With `learn`, files found holding under a new stat are recorded so
    (`Log.learn`); `mopt plan` learns nothing: it writes nothing."""
    ident = ident_of(recipe, selectors, offline)
    if _asked.get("ident") != ident:  # `python -m mopt` asked before click: the same answer
        _asked.pop("seen", None)
        _asked["ident"], _asked["answer"] = ident, _noop(recipe, ident)
    log, why = _asked["answer"]
    if log is not None and learn:
        log.learn()
    return log, why


#: the last `noop` in this process: its ident, its answer, the log it looked at ("seen")
_asked: dict[str, Any] = {}


def plugins_of_last_build() -> list[str] | None:
    """The plugins the build whose log the last `noop` looked at used, while every module
    file and sys.path folder of that log holds (nothing installed, removed or edited since);
    else None (every plugin is to be loaded)."""
    log = _asked.get("seen")
    if log is None or log.doc.get("plugins") is None:
        return None
    try:
        return None if log.first_change(log.doc["plugin_files"]) is not None else list(log.doc["plugins"])
    except (KeyError, TypeError, IndexError):
        return None


def _noop(recipe: str, ident: tuple[str, tuple[str, ...], bool]) -> tuple[Log | None, str]:
    why = "no store folder"
    for store in stores_of(recipe):
        log = load(log_path(store, ident), ident, store)
        if isinstance(log, str):
            why = log
            continue
        _asked["seen"] = log
        try:
            why = log.why_not(store)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):  # well-formed bytes, wrong shape
            why = "unreadable log"
        if not why:
            return log, ""
    return None, why


def report(log: Log, seconds: float, as_json: bool, quiet: bool) -> None:
    """Print what a no-op `mopt build` prints."""
    res = log.doc["result"]
    ids: list[str] = res["ids"]
    sys.stderr.write("".join(f"warning: {w}\n" for w in res["warnings"]))  # as the full path printed them
    if as_json:
        import json

        nodes = [
            {"id": i, "kind": kind, "status": "cached", "key": key, "outputs": tree, "duration_s": secs}
            for i, (kind, key, tree, secs) in zip(ids, res["nodes"])
        ]
        doc = {
            "recipe": res["recipe"],
            "seconds": round(seconds, 3),
            "counts": {"cached": len(ids)},
            "io": {"hashed_files": log.hashed[0], "hashed_bytes": log.hashed[1], "noop": True},
            "build_dir": res["build_dir"],
            "nodes": nodes,
        }
        indent = 2 if sys.stdout.isatty() else None
        sys.stdout.write(json.dumps(doc, indent=indent, separators=None if indent else (",", ":")) + "\n")
        return
    n = len(ids)
    if not quiet:
        sys.stderr.write("".join(f"[{k}/{n}] cached {i}\n" for k, i in enumerate(ids, 1)))
    sys.stderr.write(f"{n} action(s): {n} cached in {seconds:.2f}s (no-op: nothing changed)\n")
    for line in res["selected"]:
        sys.stderr.write(line + "\n")
    sys.stderr.write(f"artifacts under {res['build_dir']}\n")


# --------------------------------------------------------------------------- writing


class Writer:
    """A new log, filled by the Engine: files first (`file`), nodes after (`node`)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.stats: list[FileStat] = []
        self.digests: dict[int, tuple[str, int]] = {}
        self.racy: list[int] = []
        self.index: dict[str, int] = {}
        self.touchable: list[int] = []
        self.nodes: dict[str, list[Any]] = {}
        self.now = time.time_ns()

    def file(
        self,
        path: str,
        st: FileStat | None = None,
        digest: tuple[str, int] | None = None,
        *,
        touchable: bool = False,
        taken: int | None = None,
    ) -> int | None:
        """Record `path` (its stat `st`, taken at `taken` when it was checked, or now), with the
        digest and tree mode of its bytes where known (`touchable`: a new stat with that digest
        still holds); its index, or None if it cannot be recorded (gone, a NUL in its name, or
        changed within the racy window with no digest to check it by: what stands on it is
        checked in full next time)."""
        i = self.index.get(path)
        if i is not None:
            return i
        if st is None:
            try:
                st = _FIELDS(os.stat(path))
            except (OSError, ValueError):
                return None
            taken = None
        assert st is not None
        racy = (self.now if taken is None else taken) - st[4] < RACY_NS
        if "\0" in path or (racy and digest is None) or (touchable and digest is None):
            return None
        i = self.index[path] = len(self.paths)
        self.paths.append(path)
        self.stats.append(st)
        if digest is not None:
            self.digests[i] = digest
        if racy:
            self.racy.append(i)
        if touchable:
            self.touchable.append(i)
        return i

    def save(self, path: str, **fields: Any) -> None:
        """Write the log (fields: ident, store, env, env_names, absent, noop, result)."""
        doc = {
            "version": VERSION,
            "python": sys.executable,
            "host": os.uname().nodename,
            **fields,
            "paths": "\0".join(self.paths),
            "stats": marshal.dumps(self.stats, STATS_MARSHAL),
            "digests": marshal.dumps(self.digests, 4),
            "racy": self.racy,
            "touchable": self.touchable,
            "nodes": marshal.dumps(self.nodes, 4),
        }
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _save(path, doc)


def _save(path: str, doc: dict[str, Any]) -> None:
    payload = marshal.dumps(doc, 4)
    from mopt.filehash import replace_durably

    replace_durably(path, MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload)


def forget(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def loaded_modules() -> list[str]:
    """The files of the Python modules this process loaded, outside the standard library."""
    out = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and not f.startswith(sys.base_prefix + os.sep):
            out.add(os.path.abspath(f))
    return sorted(out)


def path_dirs() -> list[str]:
    """sys.path folders: installing or removing a distribution changes their listing."""
    return sorted({os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)})
