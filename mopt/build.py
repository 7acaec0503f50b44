"""Running the graph: key every node, take hits from the action cache, run the misses.

The driver computes keys in topological order (a key needs its inputs' output digests),
so a node's key is known once its inputs are built or found in the cache. A miss runs in a
scratch folder under the store; only a complete, successful output is stored (blobs first,
the action entry last) and then materialized read-only under build/. Failures are never
cached; their log is kept and shown.
"""

from __future__ import annotations

import json
import logging
import marshal
import os
import socket
import sys
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from mopt import procs
from mopt.api import Artifact, Missing, SourceContext, SourceError, TargetKind
from mopt.digest import canonical_json, hash_bytes
from mopt.errors import MoptError
from mopt.graph import Node
from mopt.keys import KEY_FORMAT, Layout, diff_parts, member
from mopt.runner import InputWatch, ProcessRunner, SpawnRunner, action_logger, close_logger
from mopt.schedule import NodeState, Reporter, built_inputs, missing_inputs, readiness
from mopt.spawn import Spawn
from mopt.store import ActionEntry, Store, StoreError

LOCK_NAME = "mopt.lock"

#: the first bytes of an index's key sidecar (`Engine._last_keys`), then a CRC-32 of the rest
_KEYS_MAGIC = b"mk1\n"


def _stat_list(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _write_index(path: str, data: bytes) -> list[int] | None:
    """`noop.replace_durably(path, data)`, returning the new file's stat after the rename,
    or None when `path` is no longer the file written (another build replaced it since)."""
    import tempfile

    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), 0o644)
            os.fsync(fh.fileno())
            ino = os.fstat(fh.fileno()).st_ino
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    st = os.lstat(path)  # after the rename (it may change the ctime)
    return _stat_list(st) if st.st_ino == ino else None


def _unlink_keys(index: Path) -> None:
    try:
        os.unlink(f"{index}.keys")
    except FileNotFoundError:
        pass


def address_path(build_dir: Path, address: str, recipe: Any = None) -> Path:
    """build/<model>/<section>/<target> for an address `<section id>:<label>`.

    The folders come from the section's own model and section names (`recipe`: the recipe,
    a list of its sections, or a dict of section id → (model, section name)), never from splitting the id at a dot: a model may be named
    `qwen2.5-0.5b`. Without `recipe` the id is split at its first dot (names without dots).
    Each part must be one path component (the recipe checks names when it loads; this
    holds for addresses from anywhere else too).
    """
    m, h, label = address_parts(build_dir, address, recipe)
    return build_dir / m / h / label


def address_parts(build_dir: Path, address: str, recipe: Any = None) -> tuple[str, str, str]:
    """(model, section, target): the folder names of `address_path`, checked."""
    section_id, _, label = address.partition(":")
    parts: tuple[str, str] | None = None
    if isinstance(recipe, dict):  # section id → (model, section name), made by the caller
        parts = recipe.get(section_id)
    elif recipe is not None:
        for sec in getattr(recipe, "sections", recipe):
            if sec.id == section_id:
                parts = (sec.model, sec.key)
                break
    if parts is None:
        m, _, h = section_id.partition(".")
        parts = (m, h)
    for part in (*parts, label):
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise MoptError(
                f"address {address!r} does not name a folder under {build_dir} ({part!r} is not one path "
                "component)",
                hint="model, section and target names are single folder names",
            )
    return parts[0], parts[1], label


def _check_input_files(kind: TargetKind) -> None:
    """Make `kind.input_files` fail with a one-line error naming the file.

    A kind resolves its declared files itself (e.g. `Path.resolve()`, which raises
    RuntimeError on a loop of symbolic links in Python 3.11, ValueError on a NUL): every
    caller, the schedulers' upfront hashing included, gets this wrapped method."""
    inner = kind.input_files

    def input_files(params: Any, project_dir: Path) -> list[Path]:
        try:
            return list(inner(params, project_dir))
        except (OSError, RuntimeError, ValueError) as exc:
            raise MoptError(
                f"a declared input file of kind {kind.name!r} cannot be resolved: {exc}",
                hint="fix the path or the symbolic link it goes through",
            ) from None

    kind.input_files = input_files  # type: ignore[method-assign]


def _abspath(p: Any) -> str:
    """`os.path.abspath(p)`; for an absolute pathlib path that `normpath` leaves as it is
    (pathlib writes no `.` part, no doubled or trailing slash: only a `..` part or a
    leading `//` could change), its string without the work."""
    if isinstance(p, PurePath):
        s = str(p)
        if s.startswith("/") and not s.startswith("//") and "/.." not in s:
            return s
    return os.path.abspath(p)


def _relative(path: str, base: str) -> str:
    """`str(PurePosixPath(path).relative_to(base))`, else `path` (it is not under `base`),
    for the strings of two pathlib paths (no trailing, doubled or `.` parts): the same
    lexical rule, with no exception raised for the usual case of a file outside the project."""
    if path == base:
        return "."
    if path.startswith("//") != base.startswith("//") or base == ".":  # another root
        return path
    prefix = base if base.endswith("/") else base + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _gathers(kind: TargetKind) -> list[str]:
    """The names of `kind`'s gathering slots (asked once per node when keying)."""
    consumes = kind.consumes
    hit = _GATHERS.get(id(consumes))
    if hit is None or hit[0] is not consumes:  # held with its tuple: an id is never reused
        hit = _GATHERS[id(consumes)] = (consumes, [slot.name for slot in consumes if slot.gather])
    return hit[1]


_GATHERS: dict[int, tuple[Any, list[str]]] = {}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: `taskset`, a container's
    `--cpuset-cpus`, a batch scheduler's allotment), not the machine's count: the default
    `-j` on 2 allotted cores of a 16-core host is 2, as in Ninja and Bazel."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class SourceUnavailable(MoptError):
    """A model's source cannot be resolved here and now (e.g. not in the local cache while
    planning): `plan` shows it as a status, `build` fails with it."""


class Engine:
    """Keys, plans and builds the nodes of a session's graph."""

    def __init__(self, session: Any, *, offline: bool = False, salt: str = "", read_only: bool = False) -> None:
        self.session = session
        self.project = session.project
        self.recipe = session.recipe
        self.graph = session.graph
        self.registry = session.registry
        self.offline = offline
        self.salt = salt
        #: plan, ls, show, explain, report: nothing in the store is created, repaired or removed
        self.read_only = read_only
        self.store = Store(self.project.store_dir, read_only=read_only)
        self.build_dir = self.project.build_dir
        self.store.allow(self.build_dir)
        if not read_only:
            self.store.check_writable()
        self._kinds: dict[str, TargetKind] = {}
        self._fingerprints: dict[str, dict[str, str]] = {}
        self._sources: dict[str, tuple[Path, str, dict[str, Any]]] = {}
        self._file_digests: dict[Path, str] = {}
        self._meta: dict[str, dict[str, Any]] = {}  # output tree → its action's run() result
        self._source_errors: dict[str, MoptError] = {}
        self._source_files: list[str] = []
        self._index_data: dict[str, Any] | None = None
        self._index_dirty = False
        #: address → key of the index, from its sidecar or the index (`_last_keys`)
        self._index_keys: dict[str, Any] | None = None
        self._index_keys_stale = False  # the sidecar does not hold `_index_keys`: rewrite it
        self._index_stat: list[int] | None = None  # the stat of the index `_index_data` came from
        self._keys_stat: list[int] | None = None  # the index stat the sidecar's keys were filed under
        self._prefetched = False
        self._prefetched_dirs: set[str] = set()
        self._node_files: dict[str, list[Path]] = {}
        self._files_by_params: dict[tuple[str, int], tuple[Any, list[Path]]] = {}
        #: outputs tree → the lstat of each blob of a hit just checked (`hit`), taken by
        #: `_materialize`
        self._hit_stats: dict[str, dict[str, os.stat_result]] = {}
        self._pass_thread: int | None = None  # the driver's thread while it is in a pass
        #: digests of input files hashed while the build loaded (`noop.prehash`): path →
        #: (stat key, digest), used only while the file's stat is still that one
        self.prehashed: dict[str, tuple[tuple[int, ...], str]] = {}
        # input file → digest, of those the stale no-op stamp recorded and showed unchanged
        # (`noop.vouch`): their stat is the one the stat cache had their digest under
        self.vouched_digests: dict[str, str] = {}
        self.prehashed_files = 0
        self.prehashed_bytes = 0
        self.planning = False  # plan never downloads a source
        #: node id → [key, outputs tree, build/ folders] of the last build, per its stale
        #: no-op stamp (`noop.vouch`): a node whose key is that one is a hit whose blobs and
        #: build/ folders need no check (the stamp shows them as that build found them)
        self.vouched: Mapping[str, Any] | None = None
        self.vouched_n = 0  # the hits taken so (`mopt build --json`'s io.vouched)
        self.vouched_ids: set[str] = set()
        #: the runner `prestart` started, until `build` takes it
        self._early_runner: SpawnRunner | None = None
        self.index_dir = self.store.root / "index"
        if not read_only:
            self.index_dir.mkdir(exist_ok=True)
        self.remote = _remote_for(self.project, self.store, offline)
        if offline:  # libraries that honour these never touch the network
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"

    # ------------------------------------------------------------------ key parts

    def kind(self, name: str) -> TargetKind:
        if name not in self._kinds:
            k = self.registry.targets[name]()
            _check_input_files(k)
            self._kinds[name] = k
        return self._kinds[name]

    def fingerprint(self, kind: str) -> dict[str, str]:
        if kind not in self._fingerprints:
            self._fingerprints[kind] = dict(self.kind(kind).fingerprint())
        return self._fingerprints[kind]

    def source(self, model_name: str) -> tuple[Path, str, dict[str, Any]]:
        """(folder, content digest, lock info) of a model's source checkpoint."""
        if model_name in self._source_errors:
            raise self._source_errors[model_name]
        if model_name not in self._sources:
            model = self.recipe.models[model_name]
            if model.spec.source is None:
                raise MoptError(
                    "model has no `source`, and a target of it reads the checkpoint",
                    file=model.where.file,
                    table=model.where.table,
                    key="source",
                    hint='add e.g. source = { path = "models/x" }',
                )
            src = self.registry.sources[model.source_kind]()
            fam = self.registry.families.get(model.spec.family)
            ctx = SourceContext(
                project_dir=model.base_dir,
                cache_dir=self.store.root / "sources",
                offline=self.offline or self.planning,
                family=fam() if fam else None,
                model_name=model_name,
                families=dict(self.registry.families),
                task=model.spec.task,
            )
            try:
                path = src.resolve(model.source_params, ctx)
            except SourceError as exc:
                err: MoptError = SourceUnavailable(
                    " ".join(str(exc).split()), file=model.where.file, table=model.where.table, key="source"
                )
                self._source_errors[model_name] = err
                raise err from None
            except (OSError, ValueError) as exc:  # e.g. a NUL in a path, a loop of links
                err = MoptError(
                    f"cannot resolve the source: {' '.join(str(exc).split())}",
                    file=model.where.file,
                    table=model.where.table,
                    key="source",
                )
                self._source_errors[model_name] = err
                raise err from None
            try:
                digest = self._source_digest(Path(path))
            except MoptError as exc:
                err = MoptError(
                    exc.message, file=model.where.file, table=model.where.table, key="source", hint=exc.hint
                )
                self._source_errors[model_name] = err
                raise err from None
            except OSError as exc:
                err = MoptError(
                    f"cannot read the source {path}: {exc}",
                    file=model.where.file,
                    table=model.where.table,
                    key="source",
                )
                self._source_errors[model_name] = err
                raise err from None
            info = {"source": src.describe(model.source_params), **src.lock_info(model.source_params, path)}
            self._sources[model_name] = (path, digest, info)
        return self._sources[model_name]

    def _source_digest(self, path: Path) -> str:
        """Tree digest of a source folder; symlinks (the Hugging Face cache) are followed."""
        from mopt.digest import SymlinkError, TreeEntry, mode_of, tree_digest

        try:
            digest, tree = self.store.state.tree(path)
            self._source_files.extend(os.path.join(str(path), e.path) for e in tree)
            return digest
        except SymlinkError:
            pass
        import stat as stat_

        entries = []
        base = str(path)
        seen: set[tuple[int, int]] = set()  # folders on the way, by inode: a loop of links ends here

        def walk_error(exc: OSError) -> None:
            raise MoptError(f"cannot read {exc.filename}: {exc.strerror}", hint="fix the source folder")

        with self.store.state.batch():
            for root, dirs, files in os.walk(base, followlinks=True, onerror=walk_error):
                rst = os.stat(root)
                if (rst.st_dev, rst.st_ino) in seen:
                    raise MoptError(
                        f"{root}: a symbolic link loops back to a folder above it",
                        hint="remove the link from the source folder",
                    )
                seen.add((rst.st_dev, rst.st_ino))
                dirs.sort()
                for f in sorted(files):
                    p = os.path.join(root, f)
                    real = os.path.realpath(p)
                    try:
                        st = os.stat(real)
                    except OSError as exc:
                        raise MoptError(
                            f"{p}: {exc.strerror} (a dangling or looping symbolic link?)",
                            hint="remove the link or restore what it points to",
                        ) from None
                    if not stat_.S_ISREG(st.st_mode):
                        raise MoptError(
                            f"{p}: not a regular file (a device, socket or pipe)",
                            hint="a source folder holds only files and folders",
                        )
                    rel = os.path.relpath(p, base).replace(os.sep, "/")
                    try:
                        digest = self.store.state.file_digest(real)
                    except OSError as exc:
                        raise MoptError(f"cannot read {p}: {exc.strerror}") from None
                    entries.append(TreeEntry(rel, mode_of(st.st_mode), st.st_size, digest))
        entries.sort(key=lambda e: e.path)
        self._source_files.extend(os.path.join(base, e.path) for e in entries)
        return tree_digest(entries)

    def file_digest(self, path: Path) -> str:
        if path not in self._file_digests:
            import stat as stat_

            try:
                st = os.stat(path)
            except OSError as exc:
                if os.path.islink(path):
                    raise MoptError(
                        f"input file {path} is a symbolic link that does not resolve ({exc.strerror})",
                        hint="fix the link or the path in the recipe",
                    ) from None
                if isinstance(exc, FileNotFoundError):
                    raise MoptError(f"input file {path} does not exist", hint="fix the path in the recipe") from None
                raise MoptError(f"input file {path}: {exc.strerror}", hint="fix the path in the recipe") from None
            if not (stat_.S_ISREG(st.st_mode) or stat_.S_ISDIR(st.st_mode)):
                raise MoptError(
                    f"input file {path} is not a regular file or folder (a device, socket or pipe)",
                    hint="declare a file or a folder",
                )
            try:
                self._file_digests[path] = self.store.state.path_digest(path)
            except OSError as exc:
                raise MoptError(f"cannot read input file {path}: {exc.strerror or exc}") from None
        return self._file_digests[path]

    def unmet(self, node: Node) -> str | None:
        """Why this machine cannot build `node` (its kind's requirements for these params on
        the section's profile), or None."""
        from mopt.machine import unmet

        kind = self.kind(node.kind)
        return unmet(
            kind.requirements(node.target.params, node.hardware),
            node.hardware,
            getattr(kind, "install_hints", None),
        )

    def parts(
        self, node: Node, inputs: dict[str, list[str]], missing: dict[str, list[Missing]] | None = None
    ) -> dict[str, Any]:
        """Everything that goes into the node's action key."""
        return self.keyed(node, inputs, missing)[0]

    def keyed(
        self, node: Node, inputs: dict[str, list[str]], missing: dict[str, list[Missing]] | None = None
    ) -> tuple[dict[str, Any], str]:
        """`(parts, action_key(parts))` of the node, the key written from the parts' members
        (`keys.Layout`): those that many nodes share (the format, the kind's names, versions
        and fingerprint, a params object's dump, a model's family and task, a profile's
        dump: all frozen) encoded once a build, the rest for each node."""
        kind = self.kind(node.kind)
        params = node.target.params
        gathers = _gathers(kind)
        env_values = getattr(kind, "env_values", None)
        has_env = callable(env_values)
        files = self._node_files_of(node)
        fixed = self._fixed_members(node, kind, bool(missing), bool(files), has_env)
        layout, fam = fixed[0], fixed[1]
        platform = kind.platform(node.hardware)
        parts: dict[str, Any] = {
            "kind": node.kind,
            "kind_version": node.kind_version,
            "plugin": node.plugin,
            "plugin_version": node.plugin_version,
            "params": node.params_json(),
            "inputs": inputs,
            "model": fam[0],
            "fingerprint": fixed[2],
            "platform": platform,
            "salt": self.salt,
        }
        # in the order of `_fixed_members`'s holes
        members = [
            self._params_member(node),
            fam[1],
            member("inputs", inputs),
            member("platform", platform),
            member("salt", self.salt),
        ]
        if kind.uses_source:
            parts["source"] = self.source(node.model.name)[1]
            members.append(member("source", parts["source"]))
        if gathers:  # a gathering kind names what it took: its output may say so
            gone = {(s, m.label) for s, ms in (missing or {}).items() for m in ms}
            parts["input_labels"] = {
                s: [
                    self.graph.nodes[d].label
                    for d in node.inputs.get(s, [])
                    if (s, self.graph.nodes[d].label) not in gone
                ]
                for s in gathers
            }
            members.append(member("input_labels", parts["input_labels"]))
        if missing:
            parts["missing"] = {s: [[m.label, m.status] for m in ms] for s, ms in sorted(missing.items())}
            members.append(member("missing", parts["missing"]))
        if files:
            parts["files"] = {self._rel(f): self.file_digest(f) for f in files}
            members.append(member("files", parts["files"]))
        if kind.per_hardware:
            parts["hardware"], hw_member = self._hardware_member(node.hardware)
            members.append(hw_member)
        if has_env:
            assert env_values is not None
            parts["env"] = env_values(params)
            members.append(member("env", parts["env"]))
        return parts, hash_bytes(layout.join(*members))

    def _fixed_members(
        self, node: Node, kind: TargetKind, missing: bool, files: bool, env: bool
    ) -> tuple[Layout, tuple[Any, str], Any]:
        """(the layout of the node's parts, (the model's family/task, its member), the
        fingerprint) for `keyed`, each made once (per kind, fingerprint and which optional
        parts there are; per model object)."""
        memo: dict[Any, Any] = self.__dict__.setdefault("_members", {})
        shape = (node.kind, missing, files, env)
        hit = memo.get(shape)
        fp = self.fingerprint(node.kind)
        if hit is None or hit[1] is not fp or hit[3] != (node.kind_version, node.plugin, node.plugin_version):
            fixed = {
                "format": KEY_FORMAT,
                "kind": node.kind,
                "kind_version": node.kind_version,
                "plugin": node.plugin,
                "plugin_version": node.plugin_version,
                "fingerprint": fp,
            }
            holes = ["params", "model", "inputs", "platform", "salt"]
            for name, present in (
                ("source", kind.uses_source),
                ("input_labels", bool(_gathers(kind))),
                ("missing", missing),
                ("files", files),
                ("hardware", kind.per_hardware),
                ("env", env),
            ):
                if present:
                    holes.append(name)
            layout = Layout({k: member(k, v) for k, v in fixed.items()}, tuple(holes))
            names = (node.kind_version, node.plugin, node.plugin_version)
            hit = memo[shape] = (layout, fp, {}, names)
        models: dict[int, Any] = hit[2]
        m = models.get(id(node.model))
        if m is None or m[0] is not node.model:
            fam = {"family": node.model.spec.family, "task": node.model.spec.task}
            m = models[id(node.model)] = (node.model, (fam, member("model", fam)))
        return hit[0], m[1], hit[1]

    def _params_member(self, node: Node) -> str:
        """`member("params", node.params_json())`, once per params object (frozen; its dump
        is shared by the nodes that share it and read-only)."""
        memo: dict[int, Any] = self.__dict__.setdefault("_params_members", {})
        params = node.target.params
        hit = memo.get(id(params))
        if hit is None or hit[0] is not params or hit[1] is not node.params_json():
            hit = memo[id(params)] = (params, node.params_json(), member("params", node.params_json()))
        return str(hit[2])

    def _hardware_member(self, hw: Any) -> tuple[Any, str]:
        """(the profile's dump, its member), once per profile object (frozen)."""
        memo: dict[int, Any] = self.__dict__.setdefault("_hw_members", {})
        hit = memo.get(id(hw))
        if hit is None or hit[0] is not hw:
            dumped = hw.model_dump(mode="json")
            hit = memo[id(hw)] = (hw, dumped, member("hardware", dumped))
        return hit[1], hit[2]

    def _rel(self, p: Path) -> str:
        rels: dict[Path, str] = self.__dict__.setdefault("_rels", {})  # 10,000 nodes, few files each
        rel = rels.get(p)
        if rel is None:
            rel = rels[p] = _relative(str(p), str(self.recipe.project_dir))
        return rel

    # ------------------------------------------------------------------ index of last builds

    def _index_file(self) -> Path:
        return self.index_dir / (hash_bytes(str(self.recipe.path).encode())[:32] + ".json")

    def _index(self) -> dict[str, Any]:
        """address → {key, parts} of its last build: what `plan` diffs against."""
        if self._index_data is None:
            try:
                with open(self._index_file(), "rb") as fh:
                    st = os.fstat(fh.fileno())  # the stat of the bytes read
                    self._index_data = json.loads(fh.read())
                self._index_stat = _stat_list(st)
            except (OSError, ValueError):
                self._index_data = {}
                self._index_stat = None
            if not isinstance(self._index_data, dict):
                self._index_data = {}
            if self._index_keys is None or self._index_keys_stale or self._keys_stat != self._index_stat:
                self._index_keys = {
                    a: rec.get("key") for a, rec in self._index_data.items() if isinstance(rec, dict)
                }
                self._index_keys_stale = True
        return self._index_data

    def _last_keys(self) -> dict[str, Any]:
        """address → key of the index (`_index`), from its sidecar `<index>.keys` while that
        names the index file's current stat: a build whose keys are all the recorded ones
        then never parses the index (~5 MB of JSON at 10,000 nodes, with every key's parts).
        The sidecar is an accelerator: missing, damaged, of another version or filed under
        another stat, the index itself is read (and the sidecar rewritten at `flush_index`)."""
        if self._index_keys is None:
            index = self._index_file()
            try:
                with open(f"{index}.keys", "rb") as fh:
                    raw = fh.read()
                payload = raw[8:]
                if raw[:4] != _KEYS_MAGIC or zlib.crc32(payload) != int.from_bytes(raw[4:8], "little"):
                    raise ValueError("not a keys file of this version")
                doc = marshal.loads(payload)
                if doc["stat"] != _stat_list(os.lstat(index)):
                    raise ValueError("filed under another stat of the index")
                if not isinstance(doc["keys"], dict):
                    raise ValueError("unexpected layout")
                self._index_keys, self._keys_stat = doc["keys"], doc["stat"]
            except (OSError, ValueError, EOFError, TypeError, KeyError):
                self._index()  # sets _index_keys from the index itself
                if self._index_keys is None:  # the index was read before (plan)
                    self._index_keys = {
                        a: rec.get("key") for a, rec in self._index().items() if isinstance(rec, dict)
                    }
                    self._index_keys_stale = True
        return self._index_keys

    def last_parts(self, address: str) -> dict[str, Any] | None:
        rec = self._index().get(address)
        return rec.get("parts") if isinstance(rec, dict) else None

    def record(self, node: Node, key: str, parts: dict[str, Any]) -> None:
        keys = self._last_keys()
        for address in node.addresses:
            if keys.get(address) != key:
                self._index()[address] = {"key": key, "parts": parts}
                keys[address] = key
                self._index_dirty = True

    def flush_index(self) -> None:
        """Write the index of last builds (one file per recipe, replaced atomically)."""
        if self.read_only or not (self._index_dirty or self._index_keys_stale):
            return
        from mopt.noop import replace_durably

        index = self._index_file()
        try:
            if self._index_dirty and self._index_data is not None:
                _unlink_keys(index)  # first: a crash after the index leaves no sidecar that names it
                self._index_stat = _write_index(str(self.store.guard(index)), canonical_json(self._index_data))
            # the keys are filed under the stat of the index they came from (or were written
            # to), and only while the index still has it: another build's index is not named
            if self._index_keys is not None and self._index_stat is not None and self._index_stat == _stat_list(
                os.lstat(index)
            ):
                payload = marshal.dumps({"stat": self._index_stat, "keys": self._index_keys}, 4)
                replace_durably(
                    str(self.store.guard(f"{index}.keys")),
                    _KEYS_MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload,
                )
        except (OSError, ValueError) as exc:  # it only feeds plan's "why": a build must not fail on it
            logging.getLogger("mopt").warning("could not write %s: %s", index, exc)
        self._index_dirty = False
        self._index_keys_stale = False

    # ------------------------------------------------------------------ plan

    def plan(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """Per node: up to date / new / why it will run, without running anything."""
        self.planning = True
        if self.vouched is None:  # else at the first hit not vouched for (`hit`)
            self._prefetch()
        nodes = self.graph.nodes
        self._prefetch_dirs([f for i in ids for f in self.node_files(nodes[i])])
        outputs: dict[str, str | None] = {}
        result: dict[str, dict[str, Any]] = {}
        gone: dict[str, str] = {}  # nodes that will not build here: id → unbuildable|blocked
        for i in ids:
            node = nodes[i]
            deps = node.input_ids()
            hard = [d for d in deps if d in gone and node.needs(d)] if gone else None
            if hard:
                outputs[i] = None
                gone[i] = "blocked"
                dep = self.graph.nodes[hard[0]]
                result[i] = {
                    "state": "blocked",
                    "summary": f"blocked: input {dep.label} {gone[hard[0]]}",
                    "reasons": [f"input {dep.id} {gone[hard[0]]}"],
                }
                continue
            missing = [d for d in deps if outputs.get(d) is None and d not in gone]
            if missing:
                outputs[i] = None
                result[i] = {
                    "state": "will-run",
                    "summary": f"will run: input {self.graph.nodes[missing[0]].label} will be rebuilt",
                    "reasons": [f"input {self.graph.nodes[m].id} will be rebuilt" for m in missing],
                }
                continue
            inputs = {s: [outputs[d] for d in ds if d not in gone] for s, ds in node.inputs.items()}
            # a partial slot's inputs that will not build: their status is part of the key
            absent = (
                missing_inputs(node, {d: (gone[d], "") for d in deps if d in gone}, self.graph) if gone else {}
            )
            try:
                parts, key = self.keyed(node, inputs, absent)  # type: ignore[arg-type]
            except SourceUnavailable as exc:  # e.g. not in the local cache: say so, go on
                # (every other MoptError is a recipe error `build` rejects too: exit 2)
                outputs[i] = None
                result[i] = {"state": "unavailable", "summary": exc.message, "reasons": [exc.render()]}
                continue
            tree = None
            if self.vouched is not None:
                # the stamp's word: this key, its blobs unchanged, its entry's file as read then
                v = self.vouched.get(i)
                if v is not None and v[0] == key and self.store.recorded_holds(key, v[3]) and v[3][1].get(
                    "outputs_tree"
                ) == v[1]:
                    tree = v[1]
                    self.vouched_n += 1
            if tree is None:
                entry = self.hit(key, fetch=False)
                tree = None if entry is None else entry.outputs_tree
            if tree is not None:
                outputs[i] = tree
                result[i] = {"state": "up-to-date", "summary": "up to date", "key": key}
                continue
            outputs[i] = None
            why = self.unmet(node)
            if why:
                gone[i] = "unbuildable"
                result[i] = {
                    "state": "unbuildable",
                    "summary": f"unbuildable here: {why}",
                    "key": key,
                    "reasons": [why],
                }
                continue
            old = self.last_parts(node.id)
            if old is None:
                result[i] = {"state": "new", "summary": "new", "key": key, "reasons": ["never built"]}
            else:
                reasons = diff_parts(old, parts) or ["cached output missing from the store"]
                result[i] = {
                    "state": "changed",
                    "summary": "; ".join(reasons),
                    "key": key,
                    "reasons": reasons,
                }
        return result

    def explain(self, node_id: str) -> dict[str, Any]:
        """The parts of a node's key (inputs must be built or cached)."""
        node = self.graph.nodes[node_id]
        outputs: dict[str, str] = {}
        for i in self.graph.closure([node_id]):
            n = self.graph.nodes[i]
            inputs = {s: [outputs.get(d, "") for d in ds] for s, ds in n.inputs.items()}
            parts, key = self.keyed(n, inputs)
            if i == node_id:
                pending = [d for d in n.input_ids() if d not in outputs]
                return {
                    "id": node.id,
                    "key": key if not pending else None,
                    "parts": parts,
                    "inputs_not_built": pending,
                }
            entry = self.store.ac_entry(key)
            if entry is not None:
                outputs[i] = entry.outputs_tree
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ build

    def build(
        self,
        ids: list[str],
        *,
        jobs: int | None = None,
        keep_going: bool = False,
        reporter: Reporter | None = None,
        materialize: set[str] | None = None,
    ) -> dict[str, NodeState]:
        """Build `ids` (in topological order); return each node's final state.

        Only nodes in `materialize` (default: all) get folders under build/; the others
        stay in the store (their dependents read them from there).
        """
        self._want = set(ids) if materialize is None else set(materialize)
        cfg = dict(self.project.config.executor)
        ex_name = cfg.get("kind", "local")
        ex_cls = self.registry.executors.get(ex_name)
        if ex_cls is None:
            from mopt.errors import did_you_mean

            raise MoptError(
                f"unknown executor {ex_name!r}",
                file=str(self.project.config_file or "mopt.toml"),
                table="executor",
                key="kind",
                hint=did_you_mean(ex_name, self.registry.executors, "executors"),
            )
        ex_build = getattr(ex_cls, "build", None)
        if ex_build is not None:
            from pydantic import ValidationError

            try:
                settings = ex_cls.Settings.model_validate(cfg)
            except ValidationError as exc:
                e = exc.errors()[0]
                raise MoptError(
                    e["msg"],
                    file=str(self.project.config_file or "mopt.toml"),
                    table="executor",
                    key=".".join(str(x) for x in e["loc"]) or None,
                ) from None
            from mopt.executor import BuildSession

            session = BuildSession(self, ids, remote=self.remote, keep_going=keep_going,
                                   reporter=reporter or Reporter(), materialize=self._want, jobs=jobs)
            result: dict[str, NodeState] = ex_cls().build(session, settings=settings) or session.states()
            self.store.state.flush()
            self.flush_index()
            return result
        from mopt.machine import gpu_count

        reporter = reporter or Reporter()
        jobs = jobs or usable_cpus()
        self.store.cleanup_tmp()
        if self.vouched is None:  # else at the first hit not vouched for (`hit`)
            self._prefetch()
        self._hash_input_files(ids)
        states = {i: NodeState(self.graph.nodes[i]) for i in ids}
        pending = deque(ids)
        outputs: dict[str, str] = {}
        slots = {"cpu": jobs, "gpu": gpu_count()}
        used = {"cpu": 0, "gpu": 0}
        running: dict[Future[NodeState], tuple[str, dict[str, int]]] = {}
        stop = False
        reporter.start(states)
        pool = ThreadPoolExecutor(max_workers=max(1, jobs + slots["gpu"]), thread_name_prefix="mopt")
        self.sandbox_mode()  # a bad setting is an error before anything runs
        # workers start on the first miss (a build of hits starts none), but the runner's
        # zygotes start now and import the kinds' modules while the keys are computed
        # (sources resolved, inputs hashed); they are killed at the end if nothing ran
        runner, self._early_runner = self._early_runner, None
        try:
            if runner is None:
                runner = self._prestarted_runner(ids, max(1, jobs + slots["gpu"]))
            if runner is not None:
                self.runner = runner
            while pending or running:
                progressed = False
                # one shared gc lock over the pass (its hits materialize), not one per hit,
                # and one stat-cache transaction for what its hits record
                with self._pass():
                    for _ in range(len(pending)):
                        i = pending.popleft()
                        st = states[i]
                        node = st.node
                        ready, why_not, missing = readiness(node, states, outputs, self.graph)
                        if ready == "blocked":
                            st.status = "blocked"
                            st.reason = why_not
                            reporter.done(st)
                            progressed = True
                            continue
                        if stop or ready == "wait":
                            if stop and not running:
                                st.status = "blocked"
                                st.reason = "not started after an earlier failure (use --keep-going)"
                                reporter.done(st)
                                progressed = True
                                continue
                            pending.append(i)
                            continue
                        if st.key is None:
                            st.missing = missing
                            st.parts, st.key = self.keyed(node, built_inputs(node, outputs), missing)
                            entry = self._vouched_hit(st) if self.vouched is not None else None
                            if entry is not None:
                                self._finish_hit(st, entry, outputs, vouched=True)
                                reporter.done(st)
                                progressed = True
                                continue
                            entry = self.hit(st.key)
                            if entry is not None:
                                self._finish_hit(st, entry, outputs)
                                reporter.done(st)
                                progressed = True
                                continue
                            why = self.unmet(node)
                            if why:
                                st.status = "unbuildable"
                                st.reason = f"unbuildable here: {why}"
                                reporter.done(st)
                                progressed = True
                                continue
                        need = self._resources(node, slots)
                        if any(used[r] + n > slots.get(r, 0) for r, n in need.items()):
                            if all(v == 0 for v in used.values()) and any(
                                n > slots.get(r, 0) for r, n in need.items()
                            ):
                                st.status = "unbuildable"
                                st.reason = f"unbuildable here: needs {need} slots, this machine has {slots}"
                                reporter.done(st)
                                progressed = True
                                continue
                            pending.append(i)
                            continue
                        for r, n in need.items():
                            used[r] += n
                        if runner is None:
                            runner = self.runner = self._local_runner(max(1, jobs + slots["gpu"]))
                        if not running:
                            _resume_gc()  # an action runs: the collector's time no longer shows
                        st.status = "running"
                        st.started = time.time()
                        reporter.started(st)
                        running[pool.submit(self._execute, st, reporter)] = (i, need)
                        progressed = True
                if not running:
                    if pending and not progressed:
                        raise AssertionError(f"scheduler stuck on {list(pending)[:3]}")
                    continue
                done, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
                for fut in done:
                    i, need = running.pop(fut)
                    for r, n in need.items():
                        used[r] -= n
                    st = fut.result()
                    if st.status in ("built", "cached"):
                        assert st.entry is not None
                        outputs[i] = st.entry.outputs_tree
                    elif not keep_going:
                        stop = True
                    reporter.done(st)
                reporter.tick()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            if runner is not None:
                runner.shutdown()
            self.store.state.flush()
            self.flush_index()
            reporter.stop()
        return states

    @contextmanager
    def _pass(self) -> Any:
        """One scheduling pass of the driver: the shared gc lock held over it (its hits
        materialize) and one stat-cache transaction for what its hits record, not one of
        each per hit; the hits of this thread inside take neither again."""
        with self.store.in_use(), self.store.state.batch(), self.store.deferred_use():
            self._pass_thread = threading.get_ident()
            try:
                yield
            finally:
                self._pass_thread = None

    def _in_pass(self) -> bool:
        return self._pass_thread == threading.get_ident()

    def prestart(self, ids: list[str], jobs: int | None = None) -> None:
        """Start the local runner's zygotes now, ahead of `build(ids, jobs=jobs)`, so that
        they import the kinds' modules while the sources are resolved (the CLI calls this
        before `current_lock`); `build` then uses this runner. `stop_prestarted` ends it
        if the build does not happen. Nothing for another executor, or when no kind of
        `ids` declares `preload`."""
        if self.project.config.executor.get("kind", "local") != "local" or self._early_runner is not None:
            return
        from mopt.machine import gpu_count

        self._early_runner = self._prestarted_runner(ids, max(1, (jobs or usable_cpus()) + gpu_count()))

    def stop_prestarted(self) -> None:
        """Stop the runner `prestart` started, if `build` did not take it over."""
        runner, self._early_runner = self._early_runner, None
        if runner is not None:
            runner.shutdown()

    def _prestarted_runner(self, ids: list[str], workers: int) -> SpawnRunner | None:
        """The local runner with its zygotes importing the modules of `ids`' kinds, or None
        when no kind of them declares `preload` (the runner then starts at the first miss)."""
        kinds = {k for i in ids if (k := self.registry.targets.get(self.graph.nodes[i].kind)) is not None}
        if not any(k.preload for k in kinds):
            return None
        runner = self._local_runner(workers)
        runner.prestart((k.sandbox, k.network, tuple(k.preload)) for k in kinds)
        return runner

    def _local_runner(self, workers: int) -> SpawnRunner:
        """The runner of `[executor] sandbox` ("auto": bubblewrap where it works)."""
        from mopt.runner import resolve_sandbox

        mode = self.sandbox_mode()
        sandboxed, why = resolve_sandbox(mode)
        if mode == "bwrap" and not sandboxed:
            raise MoptError(
                f'[executor] sandbox = "bwrap", but {why}',
                file=str(self.project.config_file or "mopt.toml"),
                table="executor",
                key="sandbox",
                hint='install bubblewrap (apt-get install bubblewrap), or set sandbox = "auto"',
            )
        cache = self.store.root / "cache"
        cache.mkdir(exist_ok=True)
        return ProcessRunner(
            tmp_dir=self.store.tmp_dir,
            max_workers=workers,
            sandbox=sandboxed,
            writable=(str(cache),),
            scratch=lambda: self.store.scratch_dir(prefix="worker-"),
            disabled_plugins=tuple(getattr(self.registry, "disabled", ()) or ()),
        )

    def sandbox_mode(self) -> str:
        """`[executor] sandbox` of mopt.toml, checked."""
        from mopt.runner import SANDBOX_MODES

        mode = self.project.config.executor.get("sandbox", "auto")
        if mode not in SANDBOX_MODES:
            raise MoptError(
                f"sandbox must be one of {', '.join(map(repr, SANDBOX_MODES))}, not {mode!r}",
                file=str(self.project.config_file or "mopt.toml"),
                table="executor",
                key="sandbox",
            )
        return str(mode)

    def _hash_input_files(self, ids: list[str]) -> None:
        """Digest every declared input file up front, several at a time: after a `touch`
        of many large files, rehashing them is the whole cost of a no-op."""
        paths: set[Path] = set()
        for i in ids:
            node = self.graph.nodes[i]
            paths.update(self.node_files(node))
        vouched = self.vouched_digests
        if vouched:
            for p in paths:
                d = vouched.get(str(p))
                if d is not None and p not in self._file_digests:
                    self._file_digests[p] = d
                    self.store.state.hits += 1
            paths = {p for p in paths if p not in self._file_digests}
        self._prefetch_dirs(paths)
        import stat as stat_

        todo = []
        with self.store.state.batch():
            for p in paths:
                if p in self._file_digests:
                    continue
                try:
                    st = os.stat(p)
                except OSError:
                    continue  # file_digest says what is wrong with it
                pre = self.prehashed.pop(str(p), None)
                if pre is not None and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == pre[0]:
                    self._file_digests[p] = pre[1]
                    self.prehashed_files += 1
                    self.prehashed_bytes += st.st_size
                    self.store.state.record(str(p), st, pre[1])  # the next build finds it by stat
                    continue
                if stat_.S_ISREG(st.st_mode):
                    # an unchanged file is a stat-cache row (prefetched above): no thread
                    known = self.store.state.lookup(_abspath(p), st)
                    if known is not None:
                        self._file_digests[p] = known
                        self.store.state.hits += 1
                        continue
                todo.append(p)
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
            for p, d in zip(todo, pool.map(self.store.state.path_digest, todo)):
                self._file_digests[p] = d

    def node_files(self, node: Node) -> list[Path]:
        """The declared input files of `node` (its kind's `input_files`, asked once a build)."""
        return list(self._node_files_of(node))

    def _node_files_of(self, node: Node) -> list[Path]:
        """`node_files`, not copied: the caller only reads it. Asked once per kind and
        params object (frozen: the nodes that share one declare the same files)."""
        files = self._node_files.get(node.id)
        if files is None:
            params = node.target.params
            shared = self._files_by_params.get((node.kind, id(params)))
            if shared is None or shared[0] is not params:
                found = list(self.kind(node.kind).input_files(params, self.recipe.project_dir))
                shared = self._files_by_params[(node.kind, id(params))] = (params, found)
            files = self._node_files[node.id] = shared[1]
        return files

    def _prefetch_dirs(self, paths: Any) -> None:
        """The stat records under the folders of `paths` in one query per folder."""
        for d in sorted({os.path.dirname(_abspath(p)) for p in paths} - self._prefetched_dirs):
            self._prefetched_dirs.add(d)
            self.store.state.prefetch(d)

    def _prefetch(self) -> None:
        """One query for the stat records of every blob and every materialized file (a plan
        checks no build/ file: the blobs' only): hits then cost a stat each (not a SELECT
        each)."""
        if not self._prefetched:
            self._prefetched = True
            self.store.state.prefetch(self.store.cas_dir)
            if not self.planning:
                self.store.state.prefetch(self.build_dir)

    def hit(self, key: str, *, fetch: bool = True) -> ActionEntry | None:
        """The cache entry for `key` if it and every blob it names are intact.

        Blobs are checked through the stat cache, so an untouched blob costs a stat; one
        whose stat changed is rehashed, and a blob whose bytes no longer match its digest
        is removed and the entry treated as a miss (the action reruns). On a local miss the
        remote cache (if any) is asked: with `fetch`, its blobs are downloaded, re-hashed
        and recorded locally; without, only the entry is read (plan: no bytes).
        """
        if self.vouched is not None and not self._prefetched:
            self._prefetch()  # not done up front: hits vouched for need no stat records
        quick = self.store.quick_hit(key)  # the common case, in fewer steps (same answer)
        if quick is not None:
            if not self.read_only:
                # each blob's lstat, just found intact: materializing the hit compares its
                # hard-linked build/ files with these instead of taking them again
                self._hit_stats[quick[0].outputs_tree] = quick[1]
            return quick[0]
        entry = self.store.ac_entry(key, check_blobs=False)
        if entry is None:
            if self.remote is None:
                return None
            if not fetch:
                return self.remote.fetch_entry(key)
            entry = self.remote.pull(key)
            if entry is None:
                return None
        repair = not self.read_only
        # The manifest first: its own bytes are checked (tree_entries hashes them once per
        # process, `intact` by stat after that), and a damaged one is removed, so the rerun
        # stores it afresh instead of failing on it for good.
        tree_st = self.store.intact_stat(entry.outputs_tree, repair=repair)
        if tree_st is None:
            return None
        try:
            members = [e.digest for e in self.store.tree_entries(entry.outputs_tree, present=True)]
        except StoreError as exc:
            logging.getLogger("mopt").warning("%s%s", exc, "; removing it and rebuilding" if repair else "")
            if repair:
                self.store._remove_blob(entry.outputs_tree)
            return None
        if entry.log:
            members.append(entry.log)
        stats = {entry.outputs_tree: tree_st}
        with nullcontext() if self._in_pass() else self.store.state.batch():
            for d in members:
                st = self.store.intact_stat(d, repair=repair)
                if st is None:
                    return None
                stats[d] = st
        if not self.read_only:
            # each blob's lstat, just found intact: materializing the hit compares its
            # hard-linked build/ files with these instead of taking them again
            self._hit_stats[entry.outputs_tree] = stats
        return entry

    def _cache_dir(self, kind: str) -> Path:
        d = self.store.root / "cache" / kind
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _resources(self, node: Node, slots: dict[str, int] | None = None) -> dict[str, int]:
        kind = self.kind(node.kind)
        res = dict(kind.resources)
        if kind.exclusive and slots:  # every slot the machine has: nothing runs beside it
            res = {r: max(n, res.get(r, 0)) for r, n in slots.items()}
        return {r: n for r, n in res.items() if n > 0}

    def _vouched_entry(self, node_id: str, key: str, parts: Any) -> ActionEntry | None:
        """The entry of `key` if the stale stamp vouches for it (`vouched`): the last build
        had this node under this key and outputs tree, every blob of it is unchanged since
        (the stamp's stats), and its entry's file is the one that build read (its stat:
        `Store.recorded_entry`, said "in use"). Else None: `hit` decides."""
        assert self.vouched is not None
        v = self.vouched.get(node_id)
        if v is None or v[0] != key:
            return None
        e = self.store.recorded_entry(key, v[3], parts)
        return e if e is not None and e.outputs_tree == v[1] else None

    def _vouched_hit(self, st: NodeState) -> ActionEntry | None:
        """`_vouched_entry` for a build: also materialized to the same build/ folders as
        then (every file and folder of them unchanged since, per the stamp), or not at all
        if it is not to be now: `hit` + `_materialize` would find exactly that."""
        assert self.vouched is not None and st.key is not None
        node = st.node
        v = self.vouched.get(node.id)
        if v is None or v[0] != st.key:
            return None
        bases = [self.address_str(a) for a in node.addresses] if node.id in self._want else []
        if list(v[2]) != bases:
            return None
        return self._vouched_entry(node.id, st.key, st.parts)

    def _finish_hit(self, st: NodeState, entry: ActionEntry, outputs: dict[str, str], vouched: bool = False) -> None:
        st.status = "cached"
        st.entry = entry
        self._meta[entry.outputs_tree] = dict(entry.meta.get("result") or {})
        outputs[st.node.id] = entry.outputs_tree
        if vouched:  # its build/ folders hold it, as the stamp shows (`_vouched_hit`)
            self.vouched_n += 1
            self.vouched_ids.add(st.node.id)
        else:
            self._materialize(st.node, entry.outputs_tree, blobs_checked=True)
        assert st.key is not None and st.parts is not None
        self.record(st.node, st.key, st.parts)

    def address_path(self, address: str) -> Path:
        """build/<model>/<section>/<target> of `address` in this recipe."""
        cache = self.__dict__.setdefault("_address_paths", {})
        if address not in cache:
            names = self.__dict__.get("_section_names")
            if names is None:  # one dict, not a scan of 10,000 sections per address
                names = self._section_names = {sec.id: (sec.model, sec.key) for sec in self.recipe.sections}
            cache[address] = address_path(self.build_dir, address, names)
        return cache[address]

    def address_str(self, address: str) -> str:
        """`address_path` as an absolute path string (the hit path avoids pathlib)."""
        cache = self.__dict__.setdefault("_address_strs", {})
        s = cache.get(address)
        if s is None:
            names = self.__dict__.get("_section_names")
            if names is None:
                names = self._section_names = {sec.id: (sec.model, sec.key) for sec in self.recipe.sections}
            base = self.__dict__.get("_build_str")
            if base is None:
                base = self._build_str = os.path.abspath(self.build_dir)
            m, h, label = address_parts(self.build_dir, address, names)
            s = cache[address] = f"{base}/{m}/{h}/{label}"
        return s

    def _materialize(self, node: Node, tree: str, *, blobs_checked: bool = False) -> None:
        stats = self._hit_stats.pop(tree, None) if blobs_checked else None
        if node.id not in getattr(self, "_want", {node.id}):
            return
        with nullcontext() if self._in_pass() else self.store.in_use():
            for address in node.addresses:
                # materialize checks every file by stat (or by inode for large, linked ones)
                # and rebuilds the folder if one was edited or removed: a repair of this
                # target's folder only, never of the blob another target's file shares
                self.store.materialize(
                    tree, self.address_str(address), blobs_checked=blobs_checked, blob_stats=stats
                )

    def _execute(self, st: NodeState, reporter: Reporter) -> NodeState:
        """Run one action under its lock (another process may have built it meanwhile).

        The kind runs in a worker process (`self.runner`); this thread prepares its inputs,
        checks afterwards that it did not change them, and stores what it wrote.
        """
        node = st.node
        assert st.key is not None and st.parts is not None
        key = st.key
        with self.store.lock(key, on_wait=lambda: reporter.waiting(st)) as lock_fd, ExitStack() as stack:
            entry = self.hit(key)
            if entry is not None:
                self._finish_hit(st, entry, {})
                return st
            # removed when the action ends, after its log is kept (the stack unwinds last)
            scratch = stack.enter_context(self.store.scratch_dir(prefix="action-"))
            in_dir = scratch / "in"
            in_dir.mkdir()
            log_path = scratch / "log.txt"  # until the runner gives the action its own
            t0 = time.time()
            try:
                kind = self.kind(node.kind)
                inputs, digests, names = self._inputs(st, in_dir)
                source = self.source(node.model.name)[0] if kind.uses_source else None
                watched = [in_dir, *([source] if source is not None else [])]
                watched += self.node_files(node)
                watch = InputWatch.take(watched, digests)
                spawn = Spawn(
                    key=key,
                    node_id=node.id,
                    kind=node.kind,
                    plugin=node.plugin,
                    params=node.target.params.model_dump(mode="json"),
                    inputs=inputs,
                    model_name=node.model.name,
                    family=node.model.spec.family,
                    task=node.model.spec.task,
                    source=str(source) if source is not None else None,
                    hardware=node.hardware.model_dump(mode="json"),
                    section=node.section.id,
                    target=node.label,
                    project_dir=str(self.recipe.project_dir),
                    missing=st.missing,
                    env=dict(st.parts.get("env") or {}),
                    offline=self.offline,
                    cache_dir=str(self._cache_dir(node.kind)),
                    network=bool(getattr(kind, "network", True)),
                    sandboxed=bool(getattr(kind, "sandbox", True)),
                    preload=tuple(getattr(kind, "preload", ())),
                    disabled_plugins=tuple(getattr(self.registry, "disabled", ()) or ()),
                )
                res = stack.enter_context(self.runner.exec(spawn, on_line=lambda line: _set_last(st, line),
                                                           lock_fd=lock_fd))
                log_path = res.log
                changed = watch.changes(watched, self.store.state.file_digest)
                if changed:
                    raise InputChanged(self._input_damage(node.kind, changed, in_dir, names))
                if not res.ok:
                    st.duration = res.duration
                    st.status = "failed"
                    st.reason = res.error
                    st.log_path = self.store.keep_failed_log(key, log_path)
                    return st
                meta, duration = res.meta, res.duration
                with self.store.in_use():
                    tree, _entries = self.store.put_tree(res.out)
                    log_digest = self.store.put_log(log_path)
                    entry = self.store.ac_put(
                        key,
                        ActionEntry(
                            key=key,
                            kind=node.kind,
                            target=node.id,
                            outputs_tree=tree,
                            log=log_digest,
                            duration_s=duration,
                            fingerprint=st.parts["fingerprint"],
                            host=socket.gethostname(),
                            meta={
                                "result": meta,
                                "parts": st.parts,
                                "reproducible": bool(kind.reproducible and meta.get("reproducible", True)),
                                "recipe": str(self.recipe.path),
                            },
                        ),
                    )
                st.entry = entry
                self._meta[tree] = meta
                if self.remote is not None and self.remote.push_enabled:
                    try:
                        self.remote.push(key, entry)
                    except Exception as exc:  # the build succeeded; only sharing failed
                        logging.getLogger("mopt").warning(f"mopt: remote cache not updated: {exc}")
                st.status = "built"
                st.duration = duration
                self._materialize(node, tree)
                self.record(node, key, st.parts)
            except BaseException as exc:  # a failing action must not take the build down
                st.duration = time.time() - t0
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                # the log may not take it (a full disk: what failed is in st.reason all the same)
                with suppress(OSError), open(log_path, "a") as fh:
                    if isinstance(exc, InputChanged):
                        fh.write(f"mopt: FAILED: {exc}\n")
                    else:
                        fh.write("mopt: FAILED: " + "".join(traceback.format_exception_only(exc)).strip() + "\n")
                        fh.write(traceback.format_exc())
                st.status = "failed"
                st.reason = str(exc) if isinstance(exc, InputChanged) else f"{type(exc).__name__}: {exc}"
                st.log_path = self.store.keep_failed_log(key, log_path)
        return st

    def _inputs(
        self, st: NodeState, in_dir: Path
    ) -> tuple[dict[str, list[Artifact]], dict[str, str], dict[str, str]]:
        """Materialize the action's inputs under `in_dir`: (slot → artifacts, file → blob
        digest, input folder → the producing node's id)."""
        node = st.node
        assert st.parts is not None
        inputs: dict[str, list[Artifact]] = {}
        digests: dict[str, str] = {}
        names: dict[str, str] = {}
        for slot, dep_ids in node.inputs.items():
            arts = []
            gone = {m.label for m in st.missing.get(slot, [])}
            present = [d for d in dep_ids if self.graph.nodes[d].label not in gone]
            for k, (d, in_tree) in enumerate(zip(present, st.parts["inputs"][slot], strict=True)):
                dep = self.graph.nodes[d]
                dest = in_dir / f"{slot}-{k}"
                with self.store.in_use():
                    self.store.materialize(in_tree, dest)
                for e in self.store.tree_entries(in_tree):
                    digests[os.path.join(str(dest), e.path)] = e.digest
                names[str(dest)] = dep.id
                arts.append(
                    Artifact(
                        dest,
                        dep.kind,
                        dep.target.name,
                        in_tree,
                        self._meta.get(in_tree, {}),
                        label=dep.label,
                        input_labels=self.graph.input_labels(dep),
                    )
                )
            inputs[slot] = arts
        return inputs, digests, names

    def _input_damage(
        self, kind: str, changed: list[tuple[str, str | None]], in_dir: Path, names: dict[str, str]
    ) -> str:
        """Remove the blobs an action damaged through its inputs; say what it changed."""
        shown = []
        removed = 0
        for path, digest in changed:
            if digest is not None and not self.store.verify(digest):
                removed += int(self.store.discard_blob(digest))
            rel = path
            if path.startswith(str(in_dir) + os.sep):
                top, _, rest = os.path.relpath(path, in_dir).partition(os.sep)
                rel = f"{names.get(os.path.join(str(in_dir), top), top)}: {rest}"
            shown.append(rel)
        more = f" (and {len(shown) - 3} more)" if len(shown) > 3 else ""
        msg = f"kind {kind!r} changed its input {', '.join(shown[:3])}{more}"
        if removed:
            msg += f"; {removed} damaged blob(s) removed from the store (a later build rebuilds them)"
        return msg


#: set by `mopt build`, which turns the garbage collector off while it keys the graph and
#: takes hits (see cli_build): the first action the engine runs turns it back on
gc_paused = False


def _resume_gc() -> None:
    """The collector on again, what is alive now out of its sight (`gc.freeze`: the recipe,
    the graph, the keyed nodes and their entries, alive until the process ends): else each
    full collection after it walks those ~1M objects again, ~0.3 s each at 10,000 nodes,
    and a build that runs one action then pays seconds for the stamp's bookkeeping."""
    global gc_paused
    if gc_paused:
        import gc

        gc_paused = False
        gc.freeze()
        gc.enable()


class InputChanged(Exception):
    """An action changed a file it was given to read."""


def _set_last(st: NodeState, line: str) -> None:
    st.last_line = line[-200:]


# ---------------------------------------------------------------------- lock file


@dataclass
class LockData:
    sources: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)


def lock_path(recipe_path: Path) -> Path:
    return recipe_path.parent / LOCK_NAME


def current_lock(engine: Engine, ids: list[str]) -> LockData:
    """Sources and tool versions this build uses."""
    data = LockData()
    for i in ids:
        node = engine.graph.nodes[i]
        kind = engine.kind(node.kind)
        if kind.uses_source and node.model.name not in data.sources:
            _path, digest, info = engine.source(node.model.name)
            data.sources[node.model.name] = {"digest": digest, **info}
        fp = engine.fingerprint(node.kind)
        data.tools[node.kind] = {
            "plugin": f"{node.plugin} {node.plugin_version}",
            "version": node.kind_version,
            **fp,
        }
    return data


class LockFileError(MoptError):
    """A lock file cannot be read or written; the message names it."""


def load_lock_file(p: Path) -> dict[str, Any]:
    """The parsed lock file at `p` ({} if there is none); LockFileError if it cannot be read
    or is not what mopt writes (`gc` must not guess what a damaged one pinned)."""
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise LockFileError(f"cannot read the lock file: {exc}", file=str(p)) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LockFileError(f"lock file is not valid JSON: {exc}", file=str(p), hint="delete it and rebuild") from None
    recipes = data.get("recipes", {}) if isinstance(data, dict) else None
    if not isinstance(recipes, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("artifacts", {}), dict) for e in recipes.values()
    ):
        raise LockFileError(
            "lock file is not a mopt lock file (no `recipes` table of artifacts)",
            file=str(p),
            hint="delete it and rebuild",
        )
    return data


def lock_keys(p: Path) -> set[str]:
    """Action keys the lock file `p` pins (LockFileError if it cannot be read)."""
    data = load_lock_file(p)
    return {
        v
        for entry in data.get("recipes", {}).values()
        for v in entry.get("artifacts", {}).values()
        if isinstance(v, str)
    }


def read_lock(recipe_path: Path) -> dict[str, Any]:
    entry = load_lock_file(lock_path(recipe_path)).get("recipes", {}).get(recipe_path.name, {})
    return entry if isinstance(entry, dict) else {}


def frozen_diff(recipe_path: Path, now: LockData) -> list[str]:
    """What differs from the lock file (empty when the build may proceed under --frozen)."""
    locked = read_lock(recipe_path)
    if not locked:
        return [f"no entry for {recipe_path.name} in {lock_path(recipe_path)}"]
    diffs = []
    for name, cur in now.sources.items():
        old = locked.get("sources", {}).get(name)
        if old is None:
            diffs.append(f"source of model {name!r} is not in the lock file")
        elif old.get("digest") != cur["digest"]:
            diffs.append(
                f"source of model {name!r} changed ({old.get('digest', '')[:12]} → {cur['digest'][:12]})"
            )
    for kind, cur in now.tools.items():
        old = locked.get("tools", {}).get(kind)
        if old is None:
            diffs.append(f"tools of kind {kind!r} are not in the lock file")
        elif old != cur:
            changed = sorted(k for k in set(old) | set(cur) if old.get(k) != cur.get(k))
            diffs.append(
                f"tools of kind {kind!r} changed: "
                + ", ".join(f"{k} {old.get(k)} → {cur.get(k)}" for k in changed)
            )
    return diffs


def write_lock(recipe_path: Path, now: LockData, artifacts: dict[str, str], store: Store | None = None) -> bool:
    """Update this recipe's entry of mopt.lock; return whether the file changed.

    The file is written 0644 through a fsynced temp file and a rename, and registered as a
    gc root of `store`. LockFileError (one line) if the recipe's folder cannot be written."""
    try:
        changed = _write_lock(recipe_path, now, artifacts)
    except OSError as exc:
        raise LockFileError(
            f"could not write the lock file: {exc.strerror or exc}",
            file=str(lock_path(recipe_path)),
            hint="the build itself succeeded; `mopt gc` will not pin it. Use --no-lock to skip the lock file",
        ) from None
    if store is not None:
        store.add_root(lock_path(recipe_path))
    return changed


def _write_lock(recipe_path: Path, now: LockData, artifacts: dict[str, str]) -> bool:
    import fcntl

    from mopt.noop import replace_durably

    p = lock_path(recipe_path)
    with open(p.parent / f".{LOCK_NAME}.flock", "a+") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            data = load_lock_file(p)
        except LockFileError:
            data = {}  # a damaged one is replaced by what this build knows
        if not isinstance(data.get("recipes"), dict):
            data["recipes"] = {}
        data.setdefault("lock_version", 1)
        recipes = data.setdefault("recipes", {})
        old = recipes.get(recipe_path.name, {})
        merged_artifacts = dict(old.get("artifacts", {}))
        merged_artifacts.update(artifacts)
        new = {
            "sources": {**old.get("sources", {}), **now.sources},
            "tools": {**old.get("tools", {}), **now.tools},
            "artifacts": dict(sorted(merged_artifacts.items())),
        }
        if old == new:
            return False
        recipes[recipe_path.name] = new
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        replace_durably(str(p), text.encode(), mode=0o644)  # others' gc reads it: not 0600
        return True


__all__ = ["Engine", "NodeState", "Reporter", "action_logger", "address_path", "close_logger", "procs"]


def noop_stamp_inputs(engine: Engine, states: dict[str, NodeState]) -> dict[str, Any] | None:
    """What a no-op stamp must watch for this successful build (None: no fast path)."""
    files: list[str] = [str(p) for p in engine.recipe.files]
    if engine.project.config_file is not None:
        files.append(str(engine.project.config_file))
    files.append(str(engine.recipe.path.parent / LOCK_NAME))
    # a mopt.toml appearing nearer the recipe would change the settings
    absent = []
    for d in [engine.recipe.path.parent, *engine.recipe.path.parent.parents]:
        if engine.project.config_file is not None and d == engine.project.config_file.parent:
            break
        absent.append(str(d / "mopt.toml"))
    dirs: list[str] = []
    env_extra: list[str] = []
    exist: list[str] = []  # action entries are touched on every hit (LRU): existence only
    ac_dir, want, verified = str(engine.store.ac_dir), engine._want, engine.store.verified
    for st in states.values():
        kind = engine.kind(st.node.kind)
        if not kind.static_fingerprint or st.entry is None or st.key is None:
            return None
        env_values = getattr(kind, "env_values", None)
        if callable(env_values):
            env_extra.extend(env_values(st.node.target.params))
        exist.append(f"{ac_dir}/{st.key}.json")
        files.append(engine.store.blob_str(st.entry.outputs_tree))
        if st.entry.log:
            files.append(engine.store.blob_str(st.entry.log))
        tree = engine.store.blob_str(st.entry.outputs_tree)
        # a vouched node's tree blob is as intact as a hit's just checked (the stamp's stats)
        present = tree in verified or st.node.id in engine.vouched_ids
        entries = engine.store.tree_entries(st.entry.outputs_tree, present=present)
        files.extend(engine.store.blob_str(e.digest) for e in entries)
        if st.node.id in want:
            for address in st.node.addresses:
                base = engine.address_str(address)
                files.extend(f"{base}/{e.path}" for e in entries)
    inputs = [*engine._source_files]
    # A folder's own stat changes when an entry directly in it comes or goes, not when a
    # file in it is edited or one is added further down: watch every file and folder in a
    # declared input folder, and every folder of a model source.
    for path, _digest, _info in engine._sources.values():
        dirs.extend(folder for folder, _sub, _files in os.walk(path, followlinks=True))
    for declared in engine._file_digests:
        if not declared.is_dir():
            inputs.append(str(declared))
            continue
        for folder, _sub, names in os.walk(declared):
            dirs.append(folder)
            inputs.extend(os.path.join(folder, n) for n in names)
    inputs = sorted(set(inputs))
    files.extend(inputs)
    # what each input file held (by the stat cache, so only while its stat is the one it
    # was hashed under): a later `touch` of it is then rehashed by the no-op itself, which
    # holds if the bytes and the mode are unchanged (see noop.check)
    from mopt.digest import mode_of

    digests: dict[str, tuple[str, int]] = {}
    engine._prefetch_dirs(inputs)
    for name in inputs:
        try:
            now = os.stat(name)
        except OSError:
            continue
        d = engine.store.state.lookup(os.path.abspath(name), now)
        if d is not None:
            digests[name] = (d, mode_of(now.st_mode))
    # The recipe files and mopt.toml: filed under the stat they had when read, with the
    # digest of the bytes read (a touch with the same bytes is then rehashed, not a miss;
    # an edit made while this build ran is seen). mopt.lock, just written: the same.
    from mopt import tomlfile
    from mopt.digest import hash_bytes
    from mopt.noop import RACY_NS

    known: dict[str, os.stat_result] = dict(engine.store.verified)
    unsure: list[str] = []
    for name in files[: len(engine.recipe.files) + (engine.project.config_file is not None)]:
        if name not in tomlfile.reads:
            continue  # not read through tomlfile: filed under its stat now, no digest
        read = tomlfile.reads[name]
        if read is None:  # read twice, seen changed between: the stamp is not written
            unsure.append(name)
            continue
        read_st, data, at = read
        if at - read_st.st_ctime_ns < RACY_NS:  # it may have changed again unseen since
            unsure.append(name)
            continue
        known[name] = read_st
        digests[name] = (hash_bytes(data), mode_of(read_st.st_mode))
    lock = str(engine.recipe.path.parent / LOCK_NAME)
    try:
        with open(lock, "rb") as fh:
            lock_st = os.fstat(fh.fileno())
            lock_bytes = fh.read()
        if _stat_id(os.stat(lock)) == _stat_id(lock_st):
            known[lock] = lock_st
            digests[lock] = (hash_bytes(lock_bytes), mode_of(lock_st.st_mode))
    except OSError:
        pass  # none (--no-lock): it must not appear (the stamp lists it absent)
    # per node, what a later full path may take unchecked (`noop.vouch`): its key, tree,
    # build/ folders and its entry as read (the stat of its file then)
    vouch_nodes = {}
    old = engine.vouched or {}
    for i, st in states.items():
        assert st.key is not None and st.entry is not None
        if i in engine.vouched_ids and st.key not in engine.store.touched:
            record = old[i][3]  # its file found with that stat by this build
        else:
            record = engine.store.entry_record(st.key)
            if record is None and st.status == "built":  # stored by this build: read back
                record = engine.store.entry_record_of(st.key, st.entry)
            if record is None:
                continue
        bases = [engine.address_str(a) for a in st.node.addresses] if i in want else []
        vouch_nodes[i] = [st.key, st.entry.outputs_tree, bases, record]
    return {
        "head": files[: len(engine.recipe.files) + (engine.project.config_file is not None) + 1],
        "vouch": {"nodes": vouch_nodes, "build_dir": str(engine.build_dir)},
        "files": files,
        "exist": exist,
        "absent": absent,
        "dirs": dirs,
        "env_extra": env_extra,
        "inputs": inputs,
        "digests": digests,
        "state_db": engine.store.state.db_path,
        "known": known,
        "unsure": unsure,
        "config": None if engine.project.config_file is None else str(engine.project.config_file),
    }


def _stat_id(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remote_for(project: Any, store: Store, offline: bool) -> Any:
    """The remote cache of `[remote]`, or None."""
    settings = project.config.remote
    if not settings.url:
        return None
    try:
        from mopt.remote import RemoteCache
    except ImportError as exc:
        raise MoptError(
            f"[remote] url is set but the remote cache needs fsspec ({exc.name} is missing)",
            file=str(project.config_file),
            table="remote",
            key="url",
            hint="pip install 'mopt[remote]' (and s3fs for s3://)",
        ) from None
    try:
        return RemoteCache.from_settings(settings, store, offline=offline)
    except ImportError as exc:
        raise MoptError(
            f"cannot open the remote cache: {exc}",
            file=str(project.config_file),
            table="remote",
            key="url",
            hint="install the fsspec backend for this URL (s3fs for s3://, gcsfs for gs://)",
        ) from None


def plan_status(session: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    """`mopt plan`'s status column (read-only: a plan never changes the store)."""
    engine = Engine(session, read_only=True)
    try:
        _plan_vouched(engine)
        return engine.plan(ids)
    finally:
        engine.store.close()


def _plan_vouched(engine: Engine) -> None:
    """Give `engine` what the stale no-op stamp of this recipe's last build vouches for
    (`noop.vouch`), if this process checked one (`mopt plan` asks for its plan file first):
    plan checks no build/ file, so only the store's blobs must be unchanged."""
    from mopt import noop

    seen = noop.last_seen
    if seen is None or seen["stamp"].get("result", {}).get("recipe") != str(engine.recipe.path):
        return
    v = noop.vouch(
        seen["path"], seen["ident"], store_dir=str(engine.store.root), build_dir=str(engine.build_dir), plan=True
    )
    if v is not None:
        engine.vouched = v["nodes"]
        engine.vouched_digests = vouched_input_digests(v)


def vouched_input_digests(vouched: dict[str, Any]) -> dict[str, str]:
    """Of `noop.vouch`'s answer: path → digest of each input file the stale stamp recorded
    a digest of and showed unchanged (its stat now is the one the stamp was written under,
    when the stat cache had that digest under it), for `Engine.vouched_digests`."""
    stamp, changed = vouched["stamp"], vouched["changed"]
    inputs = set(stamp.get("inputs", ()))
    return {p: d for p, (d, _mode) in stamp.get("digests", {}).items() if p in inputs and p not in changed}


def vouched_stamp_updates(
    engine: Engine, states: dict[str, NodeState], vouched: dict[str, Any]
) -> dict[str, tuple[list[int], Any]] | None:
    """When every node of this build was vouched for by its stale stamp (`noop.vouch`) and
    nothing but the recipe, settings or lock files changed (their new stat and digest:
    path → (stat, (digest, mode) or None)), what `noop.write` would record differs from
    that stamp only in those files and the result (`noop.patch`). None when anything else
    may differ (the full write then runs): another node, a changed module or input, the
    environment, a folder, a file gone, a racy read."""
    stamp = vouched["stamp"]
    if vouched["others"] or engine.vouched_n != len(states) or list(states) != stamp["result"]["ids"]:
        return None
    head = [str(p) for p in engine.recipe.files]
    if engine.project.config_file is not None:
        head.append(str(engine.project.config_file))
    head.append(str(engine.recipe.path.parent / LOCK_NAME))
    if [p for p, _st in stamp.get("head", [])] != list(dict.fromkeys(head)):
        return None
    changed: dict[str, Any] = vouched["changed"]
    if any(p not in head for p in changed):
        return None
    # the modules this process loaded: all of them watched by the stamp already
    mods = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and not f.startswith(sys.base_prefix + os.sep):
            mods.add(os.path.abspath(f))
    from mopt.noop import indices

    if len(indices(stamp["groups"], sorted(mods))) != len(mods):
        return None
    from mopt import tomlfile
    from mopt.digest import mode_of
    from mopt.noop import RACY_NS

    # each head file's stat and digest as `noop_stamp_inputs` files them (the recipe and
    # settings as read; mopt.lock as it is now, after this build wrote it or not)
    now = time.time_ns()
    recorded = dict((p, want) for p, want in stamp["head"])
    digests = stamp.get("digests", {})
    updates: dict[str, tuple[list[int], Any]] = {}
    for name in recorded:
        digest: Any = None
        if name == head[-1]:
            try:
                with open(name, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    data = fh.read()
                if _stat_id(os.stat(name)) != _stat_id(st):
                    return None  # replaced meanwhile (the full write files it with no digest)
            except FileNotFoundError:
                if recorded[name] is None:
                    continue  # none, as then (--no-lock)
                return None
            except OSError:
                return None
            digest = (hash_bytes(data), mode_of(st.st_mode))
        elif name in tomlfile.reads:
            read = tomlfile.reads[name]
            if read is None:
                return None  # seen changed while read: the full write writes no stamp
            st, data, at = read
            if at - st.st_ctime_ns < RACY_NS:
                return None
            digest = (hash_bytes(data), mode_of(st.st_mode))
        else:
            return None  # not read through tomlfile: left to the full write
        if now - st.st_ctime_ns < RACY_NS:
            return None
        stat_now = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        if stat_now == recorded[name] and tuple(digests.get(name, ())) == digest:
            continue
        if name not in changed and stat_now != recorded[name]:
            return None  # changed after the stamp was checked: left to the full write
        updates[name] = (stat_now, digest)
    if set(changed) - set(updates):
        return None  # a changed file not recorded anew (gone, or not read)
    return updates


def noop_paths(stamp: dict[str, Any]) -> list[str]:
    from mopt.noop import _paths

    return _paths(stamp["groups"])


def vouched_nodes_now(engine: Engine, vouched: dict[str, Any]) -> dict[str, Any] | None:
    """For `noop.patch(nodes=...)`: the stale stamp's vouch nodes with the entry record of
    each node whose entry file this build touched (gc's "last used": a new stat, which the
    old record would not match next time), a node dropped if its entry is not known so
    (then the full path checks it next time); None if no entry was touched (the vouch file
    stands as it is)."""
    touched = engine.store.touched
    if not touched:
        return None
    nodes: dict[str, Any] = {}
    for i, v in vouched["nodes"].items():
        if v[0] in touched:
            record = engine.store.entry_record(v[0])
            if record is None:
                continue
            v = [v[0], v[1], v[2], record]
        nodes[i] = v
    return nodes


def vouched_expect(engine: Engine, vouched: dict[str, Any]) -> dict[str, Any]:
    """For `noop.write(expect=...)` after a build where some nodes were vouched for: each
    blob and build/ file of the stale stamp that it showed unchanged and this build did
    not check again, with the stat it showed (the one it was last found intact under).
    Only ever stricter than a stat taken now: a file changed since is a miss next time.
    The build/ files of nodes not vouched for are left out (they may be rebuilt)."""
    from mopt.noop import _recorded

    stamp = vouched["stamp"]
    paths = noop_paths(stamp)
    stats = _recorded(stamp["stats"]) or []
    if len(stats) != len(paths):
        return {}
    cas = os.path.join(os.path.abspath(engine.store.root), "cas") + os.sep
    built = str(engine.build_dir).rstrip(os.sep) + os.sep
    others = {
        engine.address_str(a) for i, node in engine.graph.nodes.items() if i not in engine.vouched_ids for a in node.addresses
    }
    changed, verified = vouched["changed"], engine.store.verified
    n = len(built)

    def base(p: str) -> str:  # the build/<model>/<section>/<target> folder of a build/ file
        return built + "/".join(p[n:].split("/", 3)[:3])

    return {
        p: rec
        for p, rec in zip(paths, stats)
        if (p.startswith(cas) or (p.startswith(built) and base(p) not in others))
        and p not in changed
        and p not in verified
    }
