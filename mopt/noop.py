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
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

STAMP_VERSION = 1
RACY_NS = 200_000_000
ENV_PREFIXES = ("MOPT_", "HF_", "TRANSFORMERS_", "CUDA_", "NVIDIA_")


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _env(extra: list[str]) -> dict[str, str | None]:
    names = {k for k in os.environ if k.startswith(ENV_PREFIXES)} | set(extra)
    return {k: os.environ.get(k) for k in sorted(names)}


def stamp_path(store_dir: str, recipe: str, selectors: list[str], offline: bool) -> str:
    ident = json.dumps([os.path.abspath(recipe), sorted(selectors), offline])
    return os.path.join(store_dir, "noop", hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")


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
            path = data.get("store", {}).get("path", ".mopt")
            return os.path.normpath(os.path.join(d, path)) if isinstance(path, str) else None
        parent = os.path.dirname(d)
        if parent == d:
            return os.path.join(os.path.dirname(os.path.abspath(recipe)), ".mopt")
        d = parent


#: why the last `check` found no usable stamp ("" when it did): `mopt build --json` reports it
last_miss = ""
#: the declared input files whose stat changed, as the last missed `check` found them
changed_inputs: list[str] = []


def check(path: str) -> dict[str, Any] | None:
    """The stamp's recorded result if nothing it depends on changed, else None (the reason
    is left in `last_miss`)."""
    global last_miss
    del changed_inputs[:]
    stamp: dict[str, Any] = {}
    last_miss = _miss(path, stamp)
    if last_miss:
        return None
    result: dict[str, Any] = stamp.get("result", {})
    return result


def _miss(path: str, out: dict[str, Any]) -> str:
    """Why the stamp at `path` does not hold ("" if it does); the stamp is put in `out`
    (read once: at 10,000 nodes it is ~10 MB of JSON)."""
    try:
        with open(path, "rb") as fh:
            stamp = json.loads(fh.read())
    except OSError:
        try:
            with open(path + ".skipped") as fh:
                return "no stamp: " + fh.read().strip()
        except OSError:
            return "no stamp"
    except ValueError:
        return "unreadable stamp"
    if not isinstance(stamp, dict):
        return "unreadable stamp"
    out.update(stamp)
    if stamp.get("version") != STAMP_VERSION or stamp.get("python") != sys.executable:
        return "another stamp version or Python"
    if stamp.get("host") != _host():  # platform() parts (CPU class) are per machine
        return "another host"
    if _env(stamp.get("env_extra", [])) != stamp.get("env"):
        return "environment changed"
    files = stamp.get("files", {})
    stat = os.stat  # the loop below is the whole no-op at 10,000 nodes: no call per file
    for p, want in files.items():
        try:
            st = stat(p)
            now: list[int] | None = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        except OSError:
            now = None
        if now != want:
            # the full path will digest the changed input files first: name them, so that
            # hashing them can start while it loads (see `prehash`)
            changed_inputs[:] = [q for q in stamp.get("inputs", []) if q in files and _stat(q) != files[q]]
            return f"changed: {p}"
    for p in stamp.get("exist", []):
        try:
            stat(p)
        except OSError:
            return f"gone: {p}"
    for p in stamp.get("absent", []):
        if os.path.exists(p):
            return f"appeared: {p}"
    for p, want in stamp.get("dirs", {}).items():
        try:
            if os.stat(p).st_mtime_ns != want:
                return f"folder changed: {p}"
        except OSError:
            if want is not None:
                return f"folder gone: {p}"
    return ""


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
    known: Mapping[str, os.stat_result] | None = None,
) -> None:
    """Record a successful build's dependencies (stats taken now). `inputs`: those of
    `files` that are declared input files or model sources (see `changed_inputs`).
    `known`: the stat of files the build checked (blobs found intact, build/ files found
    holding them), filed as taken then: a change since is a miss next time."""
    mods = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and not f.startswith(sys.base_prefix + os.sep):  # the stdlib does not change
            mods.add(os.path.abspath(f))
    # the caller's order (the recipe and settings first: what a user edits is found
    # changed before 50,000 blobs are looked at), then the modules
    all_files = list(dict.fromkeys([*files, *sorted(mods)]))
    known = known or {}
    stats = {}
    for p in all_files:
        st = known.get(p)
        stats[p] = _stat(p) if st is None else [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    # A file changed within the last moment may change again within the same timestamp
    # tick without its stat changing ("racily clean", as git calls it): stamp next time.
    import time

    now = time.time_ns()
    racy = [p for p, st in stats.items() if st is not None and now - st[2] < RACY_NS]
    # A module edited while this build ran: the stamp would take its new stat for the code
    # this process ran (an edited kind would then look built). Its ctime says so.
    started = getattr(sys.modules.get("mopt"), "STARTED_NS", now)
    racy += [p for p in sorted(mods) if (st := stats.get(p)) is not None and st[2] >= started]
    if racy:
        invalidate(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".skipped", "w") as fh:
            fh.write(f"the last build did not write one: {racy[0]} had just changed\n")
        return
    stamp = {
        "version": STAMP_VERSION,
        "python": sys.executable,
        "host": _host(),
        "env_extra": sorted(set(env_extra)),
        "env": _env(list(env_extra)),
        "files": stats,
        "exist": sorted(set(exist)),
        "absent": sorted(set(absent)),
        "dirs": {d: _dir_mtime(d) for d in sorted(set(dirs) | set(_path_dirs()))},
        "inputs": sorted(set(inputs or ())),
        "result": result,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_durably(path, json.dumps(stamp, separators=(",", ":")).encode())
    _remove(path + ".skipped")


def prehash(paths: list[str]) -> Any:
    """Start digesting the files `paths` on background threads; return the thread, whose
    `results` (path → (stat, digest)) the engine takes once it is joined (`Engine.prehashed`).
    After a `touch` of many large input files, hashing them is most of the build: this runs
    while the full path loads plugins and the recipe (BLAKE3 leaves the GIL to the loading
    thread). A digest is kept only if the file's stat was the same before and after hashing,
    and the engine uses it only while the file's stat still is that one; anything that
    fails here is left to the full path to digest and report."""
    import stat as stat_
    import threading

    results: dict[str, tuple[tuple[int, ...], str]] = {}  # path → (stat key, digest)

    def one(p: str, hash_file: Any) -> None:
        try:
            st = os.stat(p)
            if not stat_.S_ISREG(st.st_mode):
                return  # folders: the full path digests them
            digest = hash_file(p)
            after = os.stat(p)
        except (OSError, ValueError):
            return
        if _key(after) == _key(st):  # not written meanwhile
            results[p] = (_key(st), digest)

    def work() -> None:
        try:
            from concurrent.futures import ThreadPoolExecutor

            from mopt.digest import hash_file

            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                list(pool.map(lambda p: one(p, hash_file), paths))
        except Exception:  # a head start only: the full path digests what is missing
            pass

    t = threading.Thread(target=work, name="mopt-prehash", daemon=True)
    t.results = results  # type: ignore[attr-defined]
    t.start()
    return t


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def replace_durably(path: str, data: bytes, mode: int = 0o644) -> None:
    """Put `data` at `path` through a temp file that is fsynced before the rename, and fsync
    the folder after it: a power cut leaves the old file or the new one, never an empty one
    (ext4/xfs may otherwise commit the rename before the data)."""
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
    _remove(path, path + ".skipped")


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
