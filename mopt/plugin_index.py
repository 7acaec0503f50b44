"""The plugin index's key and its reading, without pydantic or pluggy (`mopt.plugins.PluginIndex`
uses them; `mopt plan` answered from the no-op stamp asks whether the index still holds, so
that it answers only where the full path would load no plugin it does not name: no warning of
a full load is then left out).

The key is everything that can change what plugins register: the Python and its import path
(and each site folder's stat: an install or removal changes it), mopt's version and its
built-in plugin files, the disabled plugins, and per entry point its name, value, distribution
and version and the stat of every .py file of its package."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable
from typing import Any

ENTRY_POINT_GROUP = "mopt"
INDEX_VERSION = 1
INDEX_NAME = "plugin-index.json"


def _entry_points() -> list[md.EntryPoint]:
    """The `mopt` entry points in registration order: mopt's own plugin distributions
    (mopt-*, modules mopt_*) first, then the others, each by name; so a third party that
    registers a name mopt's plugins already have is the one blamed, however pip ordered them."""

    def third_party(ep: md.EntryPoint) -> bool:
        dist = getattr(ep, "dist", None)
        dist_name = (dist.name if dist is not None else "") or ""
        return not (dist_name.startswith("mopt-") and ep.value.startswith("mopt_"))

    eps = list(md.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(eps, key=lambda ep: (third_party(ep), ep.name))


def _py_files(spec_dirs: Iterable[str]) -> list[list[Any]]:
    """(path, size, mtime_ns, ctime_ns, ino) of every .py file under the folders."""
    out: list[list[Any]] = []
    for top in spec_dirs:
        for root, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(root, f)
                    try:
                        st = os.stat(p)
                    except OSError:
                        continue
                    out.append([p, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return out


def _package_dirs(module: str) -> list[str]:
    """The folders (or the file) of `module`'s top-level package, found without importing it."""
    import importlib.util

    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted(spec.submodule_search_locations)
    return [spec.origin] if spec.origin else []


def index_key(eps: list[md.EntryPoint], blocked: tuple[str, ...]) -> str:
    """The key of this installation's entry in the index (`eps`: the entry points not blocked)."""
    import site

    from mopt import __version__
    from mopt.digest import canonical_json, hash_bytes

    # the folders packages are installed into: an install or removal changes their stat
    # (the recipe's folder, often sys.path[0], changes with every lock file written)
    sites = {*site.getsitepackages(), site.getusersitepackages()}
    sites |= {d for d in sys.path if os.path.basename(d) in ("site-packages", "dist-packages")}
    path_dirs: list[list[Any]] = [[d] for d in sys.path]
    for d in sorted(sites):
        try:
            st = os.stat(d)
        except OSError:
            path_dirs.append([d, None])
            continue
        path_dirs.append([d, st.st_mtime_ns, st.st_ino])
    builtin = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")
    entries = []
    for ep in eps:
        dist = getattr(ep, "dist", None)
        entries.append(
            [
                ep.name,
                ep.value,
                dist.name if dist is not None else None,
                dist.version if dist is not None else None,
                _py_files(_package_dirs(ep.value.split(":")[0])),
            ]
        )
    parts = {
        "version": INDEX_VERSION,
        "python": sys.executable,
        "mopt": __version__,
        "path": path_dirs,
        "builtin": _py_files([builtin]),
        "blocked": list(blocked),
        "entry_points": entries,
    }
    return hash_bytes(canonical_json(parts))


def read_index(path: str, key: str, eps: list[md.EntryPoint]) -> dict[str, Any] | None:
    """The entry for `key` in the index file at `path` if it is well formed and lists exactly
    the entry points `eps`, else None."""
    import json

    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
        return None
    entry = data.get("by_key", {}).get(key) if isinstance(data.get("by_key"), dict) else None
    if not isinstance(entry, dict):
        return None
    offers, order = entry.get("offers"), entry.get("order")
    if not (isinstance(offers, dict) and isinstance(order, list)):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in offers.items()):
        return None
    if sorted(order) != sorted(ep.name for ep in eps):
        return None
    return entry


def index_holds(store_dir: str, blocked: tuple[str, ...]) -> bool:
    """Whether the store's plugin index has an entry for this installation and `blocked`: a
    session would then import only the plugins its recipe names (`PluginIndex.lazy_registry`)."""
    eps = [ep for ep in _entry_points() if ep.name not in blocked]
    return read_index(os.path.join(store_dir, INDEX_NAME), index_key(eps, blocked), eps) is not None
