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
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopt import buildlog
from mopt.api import LOCK_NAME, PROGRESS, Artifact, Missing, SourceContext, SourceError, TargetKind
from mopt.digest import canonical_json, hash_bytes
from mopt.errors import MoptError
from mopt.filehash import FileStat, file_stat, open_regular
from mopt.graph import Node, checked_files
from mopt.keys import action_key, diff_parts
from mopt.runner import InputWatch, ProcessRunner
from mopt.schedule import (
    NodeState,
    Reporter,
    built_inputs,
    code_digest,
    log_failure,
    missing_inputs,
    node_spawn,
    readiness,
    store_built,
)
from mopt.store import ActionEntry, Store, StoreError


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


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


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


class SourceMismatch(MoptError):
    """A declared source's folder does not hold the bytes mopt.lock recorded for the same
    declaration (a generator that is not deterministic, files edited in place)."""


#: the prefix of a source's key part taken from its declaration (`Source.identity`), never
#: a content digest (64 hex digits)
DECLARED = "declared:"


class Engine:
    """Keys, plans and builds the nodes of a session's graph."""

    def __init__(
        self,
        session: Any,
        *,
        offline: bool = False,
        salt: str = "",
        read_only: bool = False,
        selectors: list[str] | tuple[str, ...] = (),
        use_log: bool = True,
    ) -> None:
        """`selectors` and `offline` name the build log (`mopt.buildlog`) this build reads and
        writes; `use_log=False` (`--no-log`) reads none: every hit is checked in the store."""
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
        self._prefetched_dirs: set[str] = set()
        self._node_files: dict[str, list[Path]] = {}
        #: section id → (model, section name): the folders of build/<model>/<section>/<target>
        self._section_names = {sec.id: (sec.model, sec.key) for sec in self.recipe.sections}
        self.planning = False  # plan never downloads a source
        #: the runner `prestart` started, until `build` takes it
        self._early_runner: ProcessRunner | None = None
        self.remote = _remote_for(self.project, self.store, offline)
        if offline:  # libraries that honour these never touch the network
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
        self.log_path = buildlog.log_path(
            str(self.store.root), buildlog.ident_of(str(self.recipe.path), selectors, offline)
        )
        self.ident = buildlog.ident_of(str(self.recipe.path), selectors, offline)
        #: the last build's log (None: none, or unreadable): its keys are plan's "why"
        self.log: buildlog.Log | None = None
        got = buildlog.load(self.log_path, self.ident, str(self.store.root))
        if not isinstance(got, str):
            self.log = got
        #: why the log's word is not taken for hits ("" when it is)
        self.log_miss = "--no-log" if not use_log else got if isinstance(got, str) else ""
        #: node id → what the log records of it, for the nodes this build took from it
        self._from_log: dict[str, list[Any]] = {}
        #: node id → the stat of its entry file after this build touched it (gc's last use)
        self._touched: dict[str, Any] = {}
        #: what the user should know but that failed nothing (a lock file not written)
        self.warnings: list[str] = []
        #: nodes `mopt build --rebuild` runs again though up to date; kind → why its hits are stale
        self.rebuild: set[str] = set()
        self.stale: dict[str, str] = {}

    # ------------------------------------------------------------------ key parts

    def kind(self, name: str) -> TargetKind:
        if name not in self._kinds:
            self._kinds[name] = checked_files(self.registry.targets[name]())
        return self._kinds[name]

    def fingerprint(self, kind: str) -> dict[str, str]:
        if kind not in self._fingerprints:
            self._fingerprints[kind] = dict(self.kind(kind).fingerprint())
        return self._fingerprints[kind]

    def source_key(self, model_name: str) -> str:
        """The model source's part of action keys: `declared:<BLAKE3 of its declared identity>`
        for a source whose bytes follow from its declaration (`Source.identity`: nothing is
        resolved, made or hashed), else the content digest of its folder."""
        declared = self._declared(model_name)
        return declared[0] if declared is not None else self.source(model_name)[1]

    def source(self, model_name: str) -> tuple[Path, str, dict[str, Any]]:
        """(folder, content digest, lock info) of a model's source checkpoint, made or
        fetched if need be; a declared source's digest must be the one mopt.lock recorded
        for the same declaration (SourceMismatch)."""
        if model_name in self._sources:
            return self._sources[model_name]
        # actions materialize declared sources from the executor's threads: one at a time
        with self.__dict__.setdefault("_source_lock", threading.Lock()):
            if model_name in self._source_errors:
                raise self._source_errors[model_name]
            if model_name not in self._sources:
                self._sources[model_name] = self._materialize_source(model_name)
        return self._sources[model_name]

    def _materialize_source(self, model_name: str) -> tuple[Path, str, dict[str, Any]]:
        declared = self._declared(model_name)
        model, src, ctx = self._source_resolver(model_name)
        try:
            path = Path(src.resolve(model.source_params, ctx))
        except SourceError as exc:
            raise self._source_failed(model, SourceUnavailable, " ".join(str(exc).split())) from None
        except (OSError, ValueError) as exc:  # e.g. a NUL in a path, a loop of links
            raise self._source_failed(model, MoptError, f"cannot resolve the source: {' '.join(str(exc).split())}") from None
        try:
            digest = self._source_digest(path)
        except MoptError as exc:
            raise self._source_failed(model, MoptError, exc.message, exc.hint) from None
        except OSError as exc:
            raise self._source_failed(model, MoptError, f"cannot read the source {path}: {exc}") from None
        what = src.describe(model.source_params)
        if declared is None:
            return path, digest, {"source": what, **src.lock_info(model.source_params, path)}
        recorded = self._recorded_digest(model_name, declared[0])
        if recorded is not None and recorded != digest:
            raise self._source_failed(
                model,
                SourceMismatch,
                f"its folder {path} hashes to {digest[:12]}, but {LOCK_NAME} recorded {recorded[:12]} for "
                "this same declaration (a generator that is not deterministic, or files changed since)",
                f"delete that folder to have it made again, or reinstall the package; to accept the new "
                f"files, delete sources.{model_name} of {self.recipe.path.name} in {lock_path(self.recipe.path)}",
            )
        return path, digest, {"source": what, "identity": declared[0], "declared": declared[1], "digest": digest}

    def _declared(self, model_name: str) -> tuple[str, Any] | None:
        """(key part, identity) of a source that declares its identity, else None."""
        memo: dict[str, tuple[str, Any] | None] = self.__dict__.setdefault("_declared_ids", {})
        if model_name in memo:
            return memo[model_name]
        if model_name in self._source_errors:
            raise self._source_errors[model_name]
        model, src, ctx = self._source_resolver(model_name)
        try:
            value = src.identity(model.source_params, ctx)
            found = None
            if value is not None:
                found = DECLARED + hash_bytes(canonical_json({"source": model.source_kind, "identity": value})), value
        except SourceError as exc:
            raise self._source_failed(model, SourceUnavailable, " ".join(str(exc).split())) from None
        except (TypeError, ValueError) as exc:  # not JSON
            raise self._source_failed(
                model, MoptError, f"source {model.source_kind!r} declared an identity that is not JSON data: {exc}"
            ) from None
        memo[model_name] = found
        return found

    def _source_resolver(self, model_name: str) -> tuple[Any, Any, SourceContext]:
        """(model, its source resolver, the context it gets)."""
        model = self.recipe.models[model_name]
        if model.spec.source is None:
            raise MoptError(
                "model has no `source`, and a target of it reads the checkpoint",
                file=model.where.file,
                table=model.where.table,
                key="source",
                hint='add e.g. source = { path = "models/x" }',
            )
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
        return model, self.registry.sources[model.source_kind](), ctx

    def _source_failed(self, model: Any, cls: type[MoptError], message: str, hint: str | None = None) -> MoptError:
        """The error of a source that cannot be had, remembered (a later ask fails alike)."""
        err = cls(message, file=model.where.file, table=model.where.table, key="source", hint=hint)
        self._source_errors[model.name] = err
        return err

    def _recorded_digest(self, model_name: str, identity: str) -> str | None:
        """The content digest mopt.lock recorded for this model's source under `identity`."""
        with suppress(LockFileError):  # a damaged lock file records nothing (the build replaces it)
            entry = read_lock(self.recipe.path).get("sources", {}).get(model_name)
            if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("digest"), str):
                return str(entry["digest"])
        return None

    def source_lock(self, model_name: str) -> dict[str, Any]:
        """The model source's entry of mopt.lock: its folder's digest and lock info, or its
        declared identity and (once an action has read the folder) the folder's digest."""
        declared = self._declared(model_name)
        if declared is None or model_name in self._sources:
            _path, digest, info = self.source(model_name)
            return {"digest": digest, **info}
        model, src, _ctx = self._source_resolver(model_name)
        entry = {"source": src.describe(model.source_params), "identity": declared[0], "declared": declared[1]}
        recorded = self._recorded_digest(model_name, declared[0])
        return entry if recorded is None else {**entry, "digest": recorded}

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

    def keyed(
        self, node: Node, inputs: dict[str, list[str]], missing: dict[str, list[Missing]] | None = None
    ) -> tuple[dict[str, Any], str]:
        """`(parts, action_key(parts))` of the node."""
        kind = self.kind(node.kind)
        parts: dict[str, Any] = {
            "kind": node.kind,
            "kind_version": node.kind_version,
            "plugin": node.plugin,
            "plugin_version": node.plugin_version,
            "params": node.params_json(),
            "inputs": inputs,
            "model": {"family": node.model.spec.family, "task": node.model.spec.task},
            "fingerprint": self.fingerprint(node.kind),
            "platform": kind.platform(node.hardware),
            "salt": self.salt,
        }
        if kind.uses_source:
            parts["source"] = self.source_key(node.model.name)
        gathers = [slot.name for slot in kind.consumes if slot.gather]
        if gathers:  # a gathering kind names what it took: its output may say so
            gone = {(s, m.label) for s, ms in (missing or {}).items() for m in ms}
            labels = self.graph.nodes
            parts["input_labels"] = {
                s: [labels[d].label for d in node.inputs.get(s, []) if (s, labels[d].label) not in gone]
                for s in gathers
            }
        if missing:
            parts["missing"] = {s: [[m.label, m.status] for m in ms] for s, ms in sorted(missing.items())}
        files = self.node_files(node)
        if files:  # named relative to the project (else absolute): keys do not hold paths
            parts["files"] = {_relative(f, self.recipe.project_dir): self.file_digest(f) for f in files}
        if kind.per_hardware:
            parts["hardware"] = node.hardware.model_dump(mode="json")
        env_values = getattr(kind, "env_values", None)
        if callable(env_values):
            parts["env"] = env_values(node.target.params)
        return parts, action_key(parts)

    def code_changed(self, node: Node, meta: dict[str, Any]) -> None:
        """Warn, once per kind, when the code of `node`'s kind is not the code that made the
        entry `meta` is of while its version is (the same key: its output is reused)."""
        made_by = meta.get("code")
        if made_by and node.kind not in self.stale and made_by != code_digest(self.registry.targets[node.kind].__module__):
            self.stale[node.kind] = w = (
                f"kind {node.kind!r} (plugin {node.plugin!r}) changed since it built {node.id}, but its version "
                f"{node.kind_version!r} did not: that output is reused (bump the kind's version if its outputs "
                f"change; `mopt build --rebuild {node.id}` rebuilds it)")  # fmt: skip
            logging.getLogger("mopt").warning("warning: %s", w)

    # ------------------------------------------------------------------ the last build

    def last_parts(self, node_id: str) -> dict[str, Any] | None:
        """The key parts of `node_id`'s last build (what `plan` diffs against): its key per
        the build log, else per mopt.lock, and the parts its action entry recorded."""
        rec = self.log.nodes.get(node_id) if self.log is not None else None
        key = rec[0] if rec is not None else self._locked_keys().get(node_id)
        if not isinstance(key, str):
            return None
        try:
            entry = self.store.ac_entry(key, check_blobs=False)
        except ValueError:  # not a key (a damaged lock file)
            return None
        parts = entry.meta.get("parts") if entry is not None else None
        return parts if isinstance(parts, dict) else None

    def _locked_keys(self) -> dict[str, Any]:
        keys = self.__dict__.get("_lock_keys")
        if keys is None:
            try:
                keys = read_lock(self.recipe.path).get("artifacts", {})
            except LockFileError:
                keys = {}
            self._lock_keys = keys if isinstance(keys, dict) else {}
        return self._lock_keys

    # ------------------------------------------------------------------ plan

    def plan(self, ids: list[str], materialize: set[str] | None = None) -> dict[str, dict[str, Any]]:
        """Per node: up to date / new / why it will run, without running anything. A node of
        `materialize` (default: all) whose build/ folder does not hold its artifact (another
        recipe's target of the same name laid out there, a hand edit) says so."""
        self.planning = True
        want = set(ids) if materialize is None else materialize
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
            rec = self._logged(node, key)
            if rec is not None:
                tree: str | None = rec[1]["outputs_tree"]
                meta = rec[1]["meta"]
            else:
                entry = self.hit(key, fetch=False)
                tree, meta = (None, {}) if entry is None else (entry.outputs_tree, entry.meta)
            if tree is not None:
                self.code_changed(node, meta)
                outputs[i] = tree
                result[i] = {"state": "up-to-date", "summary": "up to date", "key": key}
                if i in want and not self._laid_out(node, tree, rec):
                    where = ", ".join(str(self.address_path(a)) for a in node.addresses)
                    result[i]["summary"] = f"up to date; {where} holds other bytes: mopt build lays it out again"
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
                                   reporter=reporter or Reporter(), materialize=self._want)
            result: dict[str, NodeState] = ex_cls().build(session, settings=settings) or session.states()
            self.store.state.flush()
            return result
        from mopt.machine import gpu_count

        reporter = reporter or Reporter()
        jobs = jobs or usable_cpus()
        self.store.cleanup_tmp()
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
                # one shared gc lock over the pass (its hits materialize), not one per hit
                # (held again inside, it is granted at once), and one stat-cache transaction
                with self.store.in_use(), self.store.state.batch():
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
                            entry = None if i in self.rebuild else self.hit(st.key, node=node)
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
            reporter.stop()
        return states

    def run(
        self,
        ids: list[str],
        *,
        wanted: list[str],
        jobs: int | None = None,
        keep_going: bool = False,
        reporter: Reporter | None = None,
        frozen: bool = False,
        lock: bool = True,
    ) -> dict[str, NodeState]:
        """`mopt build`: check --frozen, build `ids` (laying out `wanted` under build/), then
        update mopt.lock (unless `frozen` or not `lock`) and write the build log."""
        # the action runner's zygotes import torch & co. while the sources are resolved
        self.prestart(ids, jobs)
        try:
            lock_now = current_lock(self, ids)
            if frozen and (diffs := frozen_diff(self.recipe.path, lock_now)):
                raise MoptError(
                    "--frozen: " + "; ".join(diffs),
                    file=str(lock_path(self.recipe.path)),
                    hint="rebuild without --frozen to update the lock file",
                )
        except BaseException:
            self.stop_prestarted()
            raise
        try:
            states = self.build(ids, jobs=jobs, keep_going=keep_going, reporter=reporter, materialize=set(wanted))
            # off again (the first action run turned it on): the lock and the log are made of
            # ~100,000 objects at 10,000 nodes that all stay alive
            import gc

            gc.disable()
            artifacts = {i: st.key for i, st in states.items() if st.status in ("built", "cached") and st.key}
            if not frozen and lock:
                try:
                    # taken again: it now holds the digests of the declared sources the build read
                    write_lock(self.recipe.path, current_lock(self, ids), artifacts, store=self.store)
                except LockFileError as exc:
                    self.warnings.append(str(exc))
            elif lock_path(self.recipe.path).exists():
                self.store.add_root(lock_path(self.recipe.path))
            self.write_log(states)
        finally:
            self.store.close()
        return states

    def write_log(self, states: dict[str, NodeState]) -> None:
        """Record this build in its log (`mopt.buildlog`): what it read and what each node it
        built or found stands on. Never fails the build: a log not written costs the next
        build its fast path only."""
        if self.read_only:
            return
        try:
            self._write_log(states)
        except (OSError, ValueError) as exc:
            buildlog.forget(self.log_path)
            why = getattr(exc, "strerror", None) or exc  # (a full disk: where, the bytes needed)
            logging.getLogger("mopt").warning("mopt: the build log %s was not written: %s", self.log_path, why)

    def _write_log(self, states: dict[str, NodeState]) -> None:
        w = buildlog.Writer()
        off = [] if all(st.status in ("built", "cached") for st in states.values()) else ["the build did not succeed"]
        if self.fast_path_off(states):
            off.append(self.fast_path_off(states))
        plugin_files: list[int] = []  # the loaded modules and sys.path folders: the plugin set
        absent = self._log_head(w, off, plugin_files)
        self._log_inputs(w, off, plugin_files)
        env_names = self._log_nodes(w, states)
        w.save(
            self.log_path,
            ident=self.ident,
            store=str(self.store.root),
            env=buildlog.environment(env_names),
            env_names=env_names,
            absent=absent,
            noop="; ".join(off),
            # the plugins this build used: the next one loads only these while the plugin set
            # holds (not after a load that warned: those warnings are a full load's)
            plugins=None if self.registry.warnings or off else self._plugins_used(states),
            plugin_files=plugin_files,
            result={
                "recipe": str(self.recipe.path),
                "ids": list(states),
                # what `mopt build --json` lists of each node on a no-op
                "nodes": [
                    [st.node.kind, st.key, st.entry.outputs_tree, round(st.entry.duration_s, 3)]
                    if st.entry is not None
                    else None
                    for st in states.values()
                ],
                "selected": self.selected(states),
                "build_dir": str(self.build_dir),
                # what `mopt plan` prints of each node when the log holds (its table)
                "plan": marshal.dumps(
                    [[st.node.id, len(st.node.addresses), st.node.kind, st.node.input_ids(), st.node.section.id]
                     for st in states.values()]
                ),
                "warnings": [*self.registry.warnings, *self.stale.values()],
            },
        )

    def _plugins_used(self, states: dict[str, NodeState]) -> list[str]:
        """The plugins (not built in) that registered what these nodes use."""
        reg, used = self.registry, set()
        for st in states.values():
            n = st.node
            used.add(("targets", n.kind))
            used.add(("hardware", n.hardware.name))
            used.add(("families", n.model.spec.family))
            if n.model.spec.source is not None:
                used.add(("sources", n.model.source_kind))
        used.add(("executors", self.project.config.executor.get("kind", "local")))
        return sorted({reg.origin[u] for u in used if u in reg.origin} - {p for p in reg.origin.values() if p.startswith("mopt.builtin")})

    def _log_head(self, w: buildlog.Writer, off: list[str], plugin_files: list[int]) -> list[str]:
        """Record the recipe files and settings as they were read, the lock file as it is now
        and the code that ran (every loaded module: one changed since this process loaded it
        is not what ran); the files that must not appear (a mopt.toml nearer the recipe, the
        lock file when there is none)."""
        import mopt
        from mopt import tomlfile
        from mopt.digest import hash_bytes, mode_of

        def watch(path: str, fs: FileStat, digest: tuple[str, int], taken: int | None = None) -> None:
            if w.file(path, fs, digest, touchable=True, taken=taken) is None:
                off.append(f"{path} changed while the build read it")

        head = [str(p) for p in self.recipe.files]
        if self.project.config_file is not None:
            head.append(str(self.project.config_file))
        for name in dict.fromkeys(head):
            read = tomlfile.reads.get(name)
            if read is None:  # read twice with two stats, or not read through tomlfile
                off.append(f"{name} changed while the build read it")
                continue
            rst, data, at = read
            watch(name, file_stat(rst), (hash_bytes(data), mode_of(rst.st_mode)), at)
        absent = []
        lock = str(lock_path(self.recipe.path))
        try:
            with open(open_regular(lock, follow=True), "rb") as fh:
                lst = os.fstat(fh.fileno())
                watch(lock, file_stat(lst), (hash_bytes(fh.read()), mode_of(lst.st_mode)))
        except FileNotFoundError:
            absent.append(lock)
        except OSError:  # a fifo or a folder in its place: never a blocking open
            off.append(f"{lock} is not a readable regular file")
        for d in [self.recipe.path.parent, *self.recipe.path.parent.parents]:
            if self.project.config_file is not None and d == self.project.config_file.parent:
                break
            absent.append(str(d / "mopt.toml"))
        old = self.log if not self.log_miss else None
        for mod in buildlog.loaded_modules():
            try:
                mst = os.stat(mod)
            except OSError:
                continue
            if mst.st_ctime_ns >= mopt.STARTED_NS:
                off.append(f"{mod} changed while the build ran")
                continue
            k = old.index.get(mod) if old is not None else None
            if old is not None and k is not None and old.stats[k] == file_stat(mst) and k in old.digests and k not in old.racy:
                digest = old.digests[k]  # as the last build read it
            else:
                try:
                    with open(mod, "rb") as fh:
                        mst = os.fstat(fh.fileno())
                        digest = (hash_bytes(fh.read()), mode_of(mst.st_mode))
                except OSError:
                    continue
            watch(mod, file_stat(mst), digest)
            if mod in w.index:
                plugin_files.append(w.index[mod])
        return absent

    def _log_inputs(self, w: buildlog.Writer, off: list[str], plugin_files: list[int]) -> None:
        """Record what the build read besides the recipe: the declared input files and folders
        (every file and folder in them: a folder's own stat changes when an entry directly in
        it comes or goes), the model sources it made or read, and the folders of sys.path (a
        plugin installed or removed changes their listing)."""
        from mopt.digest import hash_bytes, mode_of

        files = list(self._source_files)
        on_path = buildlog.path_dirs()
        folders = list(on_path)
        for path, _digest, _info in self._sources.values():
            folders.extend(f for f, _sub, _files in os.walk(path, followlinks=True))
        for declared in self._file_digests:
            if not declared.is_dir():
                files.append(str(declared))
                continue
            for folder, _sub, names in os.walk(declared):
                folders.append(folder)
                files.extend(os.path.join(folder, n) for n in names)
        self._prefetch_dirs(files)
        for name in sorted(set(files)):
            try:
                ist = os.stat(name)
            except OSError:
                off.append(f"{name} is gone")
                continue
            d = self.store.state.lookup(os.path.abspath(name), ist)
            # with its digest, a touch of it with the same bytes is no change; the stat cache
            # may have no digest of a file written just before it was read: its stat then
            i = w.file(name, file_stat(ist), None if d is None else (d, mode_of(ist.st_mode)), touchable=d is not None)
            if i is None:
                off.append(f"{name} changed while the build read it")
        for folder in sorted(set(folders)):
            try:
                fst = os.stat(folder)
                listing = "\0".join(sorted(os.listdir(folder)))
            except OSError:
                continue
            digest = (hash_bytes(listing.encode("utf-8", "surrogateescape")), 0)
            i = w.file(folder, file_stat(fst), digest, touchable=True)
            if i is None:
                off.append(f"{folder} changed while the build read it")
            elif folder in on_path:
                plugin_files.append(i)

    def _log_nodes(self, w: buildlog.Writer, states: dict[str, NodeState]) -> list[str]:
        """Record each node this build built or found: its key, its entry, its entry file and
        blobs, and its build/ files and folders (as the old log recorded them where this build
        took the node from it and found them holding). A node that failed keeps its last
        record (plan's "why"). Returns the kinds' environment variable names."""
        env_names: set[str] = set()
        old = self.log
        for i, st in states.items():
            env_values = getattr(self.kind(st.node.kind), "env_values", None)
            if callable(env_values):
                env_names.update(env_values(st.node.target.params))
            rec = self._from_log.get(i)
            if st.status not in ("built", "cached") or st.entry is None or st.key is None:
                last = old.nodes.get(i) if old is not None else None
                store_files = _carry(w, old, last[2]) if old is not None and last is not None else None
                if last is not None and store_files is not None:
                    w.nodes[i] = [last[0], last[1], store_files, [], []]
                continue
            if rec is not None and old is not None:
                store_files = _carry(w, old, rec[2])
                if i in self._touched and store_files:  # its entry file: a new stat, the same bytes
                    w.stats[store_files[0]] = self._touched[i]
                fields = rec[1]
            else:
                store_files = self._store_files(w, st.key, st.entry)
                fields = st.entry.model_dump(mode="json")
                fields["meta"] = {k: v for k, v in fields["meta"].items() if k != "parts"}
            if store_files is None:
                continue
            bases = [self.address_str(a) for a in st.node.addresses] if i in self._want else []
            build_files = None
            if bases and rec is not None and old is not None and rec[4] == bases:
                build_files = _carry(w, old, rec[3])
            if bases and build_files is None:
                build_files = self._build_files(w, st.entry.outputs_tree, bases)
            if build_files is None:  # not laid out, or not recorded: laid out again next time
                build_files, bases = [], []
            w.nodes[i] = [st.key, fields, store_files, build_files, bases]
        return sorted(env_names)

    def _store_files(self, w: buildlog.Writer, key: str, entry: ActionEntry) -> list[int] | None:
        """Record the entry file and blobs of a node this build built or checked in the store."""
        from mopt.digest import MODE_FILE

        seen = self.store.entry_files.get(key)
        if seen is None:
            return None
        out = [w.file(self.store.ac_str(key), seen[0], (seen[1], MODE_FILE), touchable=True)]
        digests = [entry.outputs_tree, *(e.digest for e in self.store.tree_entries(entry.outputs_tree, present=True))]
        if entry.log:
            digests.append(entry.log)
        for d in digests:
            path = self.store.blob_str(d)
            known = self.store.verified.get(path)
            out.append(w.file(path, None if known is None else file_stat(known), (d, MODE_FILE)))
        return None if None in out else out  # type: ignore[return-value]

    def _build_files(self, w: buildlog.Writer, tree: str, bases: list[str]) -> list[int] | None:
        """Record the build/ folders `bases` laid out from `tree`: every file and folder."""
        from mopt.digest import hash_bytes

        entries = self.store.tree_entries(tree, present=True)
        children: dict[str, set[str]] = {"": set()}
        for e in entries:
            parts = e.path.split("/")
            for k in range(len(parts)):
                children.setdefault("/".join(parts[:k]), set()).add(parts[k])
        out: list[int | None] = []
        for base in bases:
            for e in entries:
                out.append(w.file(f"{base}/{e.path}", None, (e.digest, e.mode)))
            for rel, names in children.items():
                listing = hash_bytes("\0".join(sorted(names)).encode("utf-8", "surrogateescape"))
                out.append(w.file(f"{base}/{rel}" if rel else base, None, (listing, 0)))
        return None if None in out else out  # type: ignore[return-value]

    def selected(self, states: dict[str, NodeState]) -> list[str]:
        """One line per built node whose result names a `winner` (a select-like kind)."""
        lines = []
        for st in states.values():
            res = (st.entry.meta.get("result") or {}) if st.entry is not None else {}
            if st.status in ("built", "cached") and res.get("winner"):
                lines.append(
                    f"selected {st.node.section.id}: {res['winner']} ({res.get('objective', 'objective')}; "
                    f"{res.get('eligible', '?')} of {res.get('variants', '?')} variants passed) → "
                    f"{self.address_path(st.node.id)}"
                )
                lines += [str(x) for x in res.get("explain") or []]  # the kind's ranking and why
        return lines

    def fast_path_off(self, states: dict[str, NodeState]) -> str:
        """Which kinds of this build turn the no-op off (their fingerprint may read machine
        state), as one line; "" when none does."""
        off: dict[str, str] = {}
        for st in states.values():
            if not self.kind(st.node.kind).static_fingerprint:
                off.setdefault(st.node.kind, self.registry.plugin_of("targets", st.node.kind).name)
        if not off:
            return ""
        names = ", ".join(f"{k!r} (plugin {p!r})" for k, p in sorted(off.items()))
        return (
            f"{'kind' if len(off) == 1 else 'kinds'} {names} may read machine state in fingerprint() "
            "(static_fingerprint = False); a kind whose fingerprint is package versions says "
            "fingerprint_packages = (...)"
        )

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

    def _prestarted_runner(self, ids: list[str], workers: int) -> ProcessRunner | None:
        """The local runner with its zygotes importing the modules of `ids`' kinds, or None
        when no kind of them declares `preload` (the runner then starts at the first miss)."""
        kinds = {k for i in ids if (k := self.registry.targets.get(self.graph.nodes[i].kind)) is not None}
        if not any(k.preload for k in kinds):
            return None
        runner = self._local_runner(workers)
        runner.prestart((k.sandbox, k.network, tuple(k.preload)) for k in kinds)
        return runner

    def _local_runner(self, workers: int) -> ProcessRunner:
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
        of many large files, rehashing them is the whole cost of a build."""
        paths: set[Path] = set()
        for i in ids:
            paths.update(self.node_files(self.graph.nodes[i]))
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
                if stat_.S_ISREG(st.st_mode):
                    # an unchanged file is in the log or a stat-cache row (prefetched above)
                    known = None if self.log is None or self.log_miss else self.log.digest_of(str(p), file_stat(st))
                    if known is None:
                        known = self.store.state.lookup(os.path.abspath(p), st)
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
        files = self._node_files.get(node.id)
        if files is None:
            files = self.kind(node.kind).input_files(node.target.params, self.recipe.project_dir)
            files = self._node_files[node.id] = self.graph.require_files(node, files)
        return files

    def _prefetch_dirs(self, paths: Any) -> None:
        """The stat records under the folders of `paths` in one query per folder."""
        for d in sorted({os.path.dirname(os.path.abspath(p)) for p in paths} - self._prefetched_dirs):
            self._prefetched_dirs.add(d)
            self.store.state.prefetch(d)

    def hit(
        self, key: str, *, node: Node | None = None, fetch: bool = True, remote: bool = True
    ) -> ActionEntry | None:
        """The cache entry for `key` if it and every blob it names are intact.

        Two ways: the build log records `node` under this key and its entry file and blobs
        are as it recorded them (`_logged`); else the store's entry, whose blobs are checked
        through the stat cache (an untouched blob costs a stat; one whose stat changed is
        rehashed, and one whose bytes no longer match its digest is removed: a miss, the
        action reruns). On a local miss the remote cache (if any, and `remote`) is asked: with
        `fetch`, its blobs are downloaded, re-hashed and recorded locally; without, only the
        entry is read (plan: no bytes).
        """
        rec = self._logged(node, key) if node is not None else None
        if rec is not None:
            logged = ActionEntry.model_construct(**rec[1])
            if not self.read_only:
                self.store.use(key)
                touched = self.store.touch_if_due(key, self.log.now[rec[2][0]])  # type: ignore[union-attr]
                if touched is not None:
                    self._touched[node.id] = touched  # type: ignore[union-attr]
            self._from_log[node.id] = rec  # type: ignore[union-attr]
            return logged
        entry = self.store.ac_entry(key, check_blobs=False)
        if entry is None:
            if self.remote is None or not remote:
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
        if self.store.intact_stat(entry.outputs_tree, repair=repair) is None:
            return None
        try:
            members = [e.digest for e in self.store.tree_entries(entry.outputs_tree, present=True)]
        except StoreError as exc:
            logging.getLogger("mopt").warning("%s%s", exc, "; removing it and rebuilding" if repair else "")
            if repair:
                self.store.discard_blob(entry.outputs_tree)
            return None
        if entry.log:
            members.append(entry.log)
        with self.store.state.batch():
            for d in members:
                if self.store.intact_stat(d, repair=repair) is None:
                    return None
        return entry

    def _logged(self, node: Node, key: str) -> list[Any] | None:
        """The build log's record of `node` if its last build built or found it under `key`
        and its entry file and blobs are as that build recorded them, else None."""
        log = self.log
        if log is None or self.log_miss:
            return None
        rec = log.node(node.id, key)
        return rec if rec is not None and log.node_holds(rec, build=False) else None

    def _laid_out(self, node: Node, tree: str, rec: list[Any] | None) -> bool:
        """Whether every build/ folder of `node` holds the tree `tree`: as the log recorded
        them (`rec`), else checked file by file (read-only)."""
        bases = [self.address_str(a) for a in node.addresses]
        if rec is not None and rec[4] == bases and self.log is not None and self.log.first_change(rec[3]) is None:
            return True
        return all(self.store.holds(tree, b) for b in bases)

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

    def _finish_hit(self, st: NodeState, entry: ActionEntry, outputs: dict[str, str]) -> None:
        st.status = "cached"
        st.entry = entry
        self.code_changed(st.node, entry.meta)
        self._meta[entry.outputs_tree] = dict(entry.meta.get("result") or {})
        outputs[st.node.id] = entry.outputs_tree
        rec = self._from_log.get(st.node.id)
        if rec is not None and st.node.id in self._want:
            bases = [self.address_str(a) for a in st.node.addresses]
            if rec[4] != bases or self.log is None or self.log.first_change(rec[3]) is not None:
                self._from_log[st.node.id] = rec[:3] + [[], []]  # laid out again below: recorded anew
                self._materialize(st.node, entry.outputs_tree, blobs_checked=True)
        else:
            self._materialize(st.node, entry.outputs_tree, blobs_checked=True)

    def address_path(self, address: str) -> Path:
        """build/<model>/<section>/<target> of `address` in this recipe."""
        return address_path(self.build_dir, address, self._section_names)

    def address_str(self, address: str) -> str:
        """`address_path` as an absolute path string."""
        return os.path.abspath(self.address_path(address))

    def _materialize(self, node: Node, tree: str, *, blobs_checked: bool = False) -> None:
        if node.id not in getattr(self, "_want", {node.id}):
            return
        with self.store.in_use():
            for address in node.addresses:
                # materialize checks every file by stat (or by inode for large, linked ones)
                # and rebuilds the folder if one was edited or removed: a repair of this
                # target's folder only, never of the blob another target's file shares
                self.store.materialize(tree, self.address_str(address), blobs_checked=blobs_checked)

    def _execute(self, st: NodeState, reporter: Reporter) -> NodeState:
        """Run one action under its lock (another process may have built it meanwhile).

        The kind runs in a worker process (`self.runner`); this thread prepares its inputs,
        checks afterwards that it did not change them, and stores what it wrote.
        """
        node = st.node
        assert st.key is not None and st.parts is not None
        key = st.key
        with self.store.lock(key, on_wait=lambda: reporter.waiting(st)) as lock_fd, ExitStack() as stack:
            entry = None if node.id in self.rebuild else self.hit(key)
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
                spawn = node_spawn(
                    st,
                    inputs,
                    self.registry,
                    source=str(source) if source is not None else None,
                    project_dir=str(self.recipe.project_dir),
                    offline=self.offline,
                    cache_dir=str(self._cache_dir(node.kind)),
                    network=bool(getattr(kind, "network", True)),
                    sandboxed=bool(getattr(kind, "sandbox", True)),
                    preload=tuple(getattr(kind, "preload", ())),
                )
                res = stack.enter_context(self.runner.exec(spawn, on_line=lambda line: _set_last(st, line, reporter),
                                                           lock_fd=lock_fd))
                log_path = res.log
                changed = watch.changes(watched)
                if changed:
                    raise InputChanged(self._input_damage(node.kind, changed, in_dir, names))
                if not res.ok:
                    st.duration = res.duration
                    st.status = "failed"
                    st.reason = res.error
                    st.log_path = self.store.keep_failed_log(key, log_path)
                    return st
                entry = store_built(self.store, spawn, res, st.parts, kind, recipe=str(self.recipe.path))
                st.entry = entry
                self._meta[entry.outputs_tree] = res.meta
                if self.remote is not None and self.remote.push_enabled:
                    try:
                        self.remote.push(key, entry)
                    except Exception as exc:  # the build succeeded; only sharing failed
                        logging.getLogger("mopt").warning(f"mopt: remote cache not updated: {exc}")
                st.status = "built"
                st.duration = res.duration
                self._materialize(node, entry.outputs_tree)
            except BaseException as exc:  # a failing action must not take the build down
                st.duration = time.time() - t0
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                # mopt's own errors (a source that cannot be had) are a line for the user, not a traceback
                clean = isinstance(exc, InputChanged | MoptError)
                log_failure(log_path, str(exc) if clean else exc)
                st.status = "failed"
                st.reason = str(exc) if clean else f"{type(exc).__name__}: {exc}"
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


def _resume_gc() -> None:
    """The collector on again if `mopt build` turned it off while it keyed the graph and took
    hits (cli_build), with what is alive now out of its sight (`gc.freeze`: the recipe, the
    graph, the keyed nodes and their entries, alive until the process ends): else each full
    collection after it walks those ~1M objects again, ~0.3 s each at 10,000 nodes."""
    import gc

    if not gc.isenabled():
        gc.freeze()
        gc.enable()


class InputChanged(Exception):
    """An action changed a file it was given to read."""


def _set_last(st: NodeState, line: str, reporter: Reporter) -> None:
    if line.startswith(PROGRESS):
        line = line[len(PROGRESS) :]
        reporter.progress(st, line)
    st.last_line = line[-200:]


def _carry(w: buildlog.Writer, old: buildlog.Log, indices: list[int]) -> list[int] | None:
    """Record again, as the old log recorded them, the files at `indices` of `old` that this
    build found holding (a node it took from the log); None if one cannot be."""
    out = []
    for k in indices:
        st = old.learnt.get(k, old.stats[k])  # a touched file found holding: its new stat
        # a file recorded within the racy window stays so until a build checks its digest
        racy = k in old.racy and not old.verdict.get(k)
        i = w.file(old.paths[k], st, old.digests.get(k), touchable=k in old.touchable, taken=st[4] if racy else None)
        if i is None:
            return None
        out.append(i)
    return out


# ---------------------------------------------------------------------- lock file


@dataclass
class LockData:
    sources: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)


def lock_path(recipe_path: Path) -> Path:
    return recipe_path.parent / LOCK_NAME


def current_lock(engine: Engine, ids: list[str]) -> LockData:
    """Sources and tool versions this build uses (taken again after the build, it holds the
    digests of the declared sources its actions read)."""
    data = LockData()
    for i in ids:
        node = engine.graph.nodes[i]
        kind = engine.kind(node.kind)
        if kind.uses_source and node.model.name not in data.sources:
            data.sources[node.model.name] = engine.source_lock(node.model.name)
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
    from mopt.filehash import NotRegularFileError, read_regular

    try:
        # never a blocking open: a fifo in its place (or reached through a gc root) is an error
        text = read_regular(p, follow=True).decode("utf-8")
    except FileNotFoundError:
        return {}
    except NotRegularFileError:
        raise LockFileError(
            "the lock file is not a regular file", file=str(p), hint="remove it and rebuild"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LockFileError(f"cannot read the lock file: {exc}", file=str(p)) from None
    return parse_lock(text, str(p))


def parse_lock(text: str, where: str) -> dict[str, Any]:
    """A lock file's text, parsed and checked (`where`: its name in errors, e.g. a path or
    `REV:path`); LockFileError if it is not what mopt writes."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LockFileError(f"lock file is not valid JSON: {exc}", file=where, hint="delete it and rebuild") from None
    recipes = data.get("recipes", {}) if isinstance(data, dict) else None
    if not isinstance(recipes, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("artifacts", {}), dict) for e in recipes.values()
    ):
        raise LockFileError(
            "lock file is not a mopt lock file (no `recipes` table of artifacts)",
            file=where,
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
        pin = "identity" if "identity" in cur else "digest"  # a declared source: its declaration
        if old is None:
            diffs.append(f"source of model {name!r} is not in the lock file")
        elif old.get(pin) != cur[pin]:
            was, new = old.get("declared"), cur.get("declared")
            if isinstance(was, dict) and isinstance(new, dict):  # what of the declaration changed
                changed = sorted(k for k in set(was) | set(new) if was.get(k) != new.get(k))
                what = ", ".join(f"{k} {json.dumps(was.get(k))} → {json.dumps(new.get(k))}" for k in changed)
            else:
                what = " → ".join(str(d).removeprefix(DECLARED)[:12] for d in (old.get(pin, old.get("digest")), cur[pin]))
            diffs.append(f"source of model {name!r} changed ({what})")
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

    from mopt.filehash import replace_durably

    p = lock_path(recipe_path)
    # O_NOFOLLOW | O_NONBLOCK: a link in its place is refused (ELOOP, a one-line LockFileError)
    # rather than created or written through; a fifo cannot block the open
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with open(os.open(p.parent / f".{LOCK_NAME}.flock", flags, 0o644), "a+") as lk:
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


__all__ = ["Engine", "NodeState", "Reporter", "address_path"]


def _remote_for(project: Any, store: Store, offline: bool) -> Any:
    """The remote cache of `[remote]`, or None."""
    settings = project.config.remote
    if not settings.url:
        return None
    try:
        from mopt.remote import RemoteCache

        return RemoteCache.from_settings(settings, store, offline=offline)
    except ImportError as exc:  # fsspec itself, or the backend of the URL's protocol
        raise MoptError(
            f"cannot open the remote cache: {exc}",
            file=str(project.config_file),
            table="remote",
            key="url",
            hint="pip install 'mopt[remote]' (fsspec), and the backend for this URL: s3fs for s3://, gcsfs for gs://",
        ) from None


def plan_status(
    session: Any, ids: list[str], *, wanted: list[str] | None = None, selectors: Any = (), use_log: bool = True
) -> dict[str, dict[str, Any]]:
    """`mopt plan`'s status column (read-only: a plan never changes the store)."""
    engine = Engine(session, read_only=True, selectors=selectors, use_log=use_log)
    try:
        return engine.plan(ids, None if wanted is None else set(wanted))
    finally:
        engine.store.close()
