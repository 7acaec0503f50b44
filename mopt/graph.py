"""The build graph: sections × targets → a DAG of nodes, shared where identical.

A node's identity is a digest of what defines it (kind and version, the plugin, the
validated params, its inputs' identities, the model source for kinds that read it, the
hardware profile for kinds whose output depends on it). Two sections that define the same
node get one node with two addresses. Action keys (which use content digests of the built
inputs instead of identities) are computed by `mopt.keys` when the graph runs.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopt import tomlfile
from mopt.api import HardwareProfile, Input, TargetKind
from mopt.digest import hash_bytes
from mopt.errors import MoptError, did_you_mean
from mopt.keys import canonical_bytes
from mopt.plugins import Registry
from mopt.recipe import Model, Recipe, Section, Target, _display


@dataclass
class Node:
    """One action of the graph."""

    id: str
    identity: str
    kind: str
    kind_version: str
    plugin: str
    plugin_version: str
    target: Target
    section: Section
    model: Model
    hardware: HardwareProfile
    inputs: dict[str, list[str]]
    label: str
    #: `target.params` as JSON, dumped once per params object (frozen); read-only
    params_dump: Any
    addresses: list[str] = field(default_factory=list)
    #: slots that take whatever of their inputs got built (`Input.partial`)
    partial_slots: tuple[str, ...] = ()

    def params_json(self) -> Any:
        return self.params_dump

    def input_ids(self) -> list[str]:
        return [i for ids in self.inputs.values() for i in ids]

    def needs(self, dep: str) -> bool:
        """Whether this node cannot run without `dep` (False: a `partial` slot's input)."""
        return not any(dep in self.inputs.get(s, ()) for s in self.partial_slots)


@dataclass
class Graph:
    recipe: Recipe
    registry: Registry
    nodes: dict[str, Node]  # in topological order

    def input_labels(self, node: Node) -> dict[str, list[str]]:
        """Slot → labels of the nodes `node` consumes."""
        return {s: [self.nodes[d].label for d in ids] for s, ids in node.inputs.items()}

    def closure(self, ids: Iterable[str]) -> list[str]:
        """`ids` and everything they depend on, in topological order."""
        want: set[str] = set()
        stack = list(ids)
        while stack:
            i = stack.pop()
            if i in want:
                continue
            want.add(i)
            stack.extend(self.nodes[i].input_ids())
        return [i for i in self.nodes if i in want]

    def select(self, selectors: list[str]) -> list[str]:
        """Node ids matched by `model.hardware:target` selectors (globs), with their deps."""
        if not selectors:  # every node: the closure of all of them is all of them, in order
            return list(self.nodes)
        return self.closure(self.match(selectors))

    def require_files(self, node: Node, files: list[Path]) -> list[Path]:
        """`files` (`node`'s declared input files) if each exists, else a one-line error at the
        line of the param naming the first missing one: `check` and `plan` find it, not the
        action reading it once its inputs are built."""
        for f in files:
            if not os.path.exists(f):
                key = next((k for k, v in node.params_json().items() for x in (v if isinstance(v, list) else [v])
                            if isinstance(x, str) and x and str(f).endswith(os.path.normpath(x).lstrip("./"))), None)  # fmt: skip
                hint = "fix the path, relative to the recipe's folder, or create the file"
                raise MoptError(f"input file {f} does not exist", **self._written_at(node, key), hint=hint)
        return files

    def declared_files(self, ids: list[str]) -> None:
        """`require_files` of every node of `ids` (`mopt check`)."""
        kinds: dict[str, TargetKind] = {}
        for n in map(self.nodes.__getitem__, ids):
            k = kinds.get(n.kind) or kinds.setdefault(n.kind, checked_files(self.registry.targets[n.kind]()))
            self.require_files(n, k.input_files(n.target.params, self.recipe.project_dir))

    def _written_at(self, node: Node, key: str | None) -> dict[str, Any]:
        """Where `key` of `node`'s target is set (the highest layer setting it), else its table."""
        sec, t, w = node.section, node.target.name, node.target.where
        for path in reversed(self.recipe.files) if key else ():
            data, text = tomlfile.load(path, _display(path))
            for table in ([sec.model, sec.key, t], [sec.model, sec.key], ["defaults", t], ["defaults", node.kind], ["defaults"]):  # fmt: skip
                body = functools.reduce(lambda d, k: d.get(k, {}) if isinstance(d, dict) else {}, table, data)
                if isinstance(body, dict) and key in body:
                    return {"file": _display(path), "table": ".".join(table), "key": key, "line": tomlfile.find_line(text, table, key)}  # fmt: skip
        return {"file": w.file, "table": w.table, "key": key, "line": w.line}

    def match(self, selectors: list[str]) -> list[str]:
        """Node ids matched by the selectors themselves (all nodes when there are none)."""
        if not selectors:
            return list(self.nodes)
        picked: set[str] = set()
        addrs: list[tuple[Node, str, str]] = [
            (node, addr.partition(":")[0], addr.partition(":")[2])
            for node in self.nodes.values()
            for addr in node.addresses
        ]
        for sel in selectors:
            sec_pat, _, tgt_pat = sel.partition(":")
            sec_ok = name_matcher(sec_pat or "*", {sec for _, sec, _ in addrs})
            tgt_ok = name_matcher(
                tgt_pat or "*", {x for node, sec, label in addrs if sec_ok(sec) for x in (label, node.target.name)}
            )
            hit = False
            for node, sec, label in addrs:
                if sec_ok(sec) and (tgt_ok(label) or tgt_ok(node.target.name)):
                    picked.add(node.id)
                    hit = True
            if not hit:
                sections = sorted({s.id for s in self.recipe.sections})
                targets = sorted({n.target.name for n in self.nodes.values()})
                hint = (
                    did_you_mean(sec_pat, sections, "sections")
                    if not any(fnmatch.fnmatchcase(s, sec_pat) for s in sections)
                    else did_you_mean(tgt_pat, targets, "targets")
                )
                raise MoptError(
                    f"selector {sel!r} matches no target",
                    hint=hint + "; selectors look like model.hardware:target, globs allowed",
                )
        return [i for i in self.nodes if i in picked]


def checked_files(kind: TargetKind) -> TargetKind:
    """`kind`, its `input_files` failing with a one-line error naming the file.

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
    return kind


def name_matcher(pattern: str, names: Iterable[str]) -> Callable[[str], bool]:
    """A test for one part of a selector: `pattern` taken exactly when it is one of `names`,
    else as a glob. The ids mopt prints can be typed back: `bench[int8]` and `validate[onnx]`
    hold `[...]`, a glob character class that would not match them."""
    if pattern in set(names):
        return pattern.__eq__
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def _candidates(slot: Input, section: Section, me: Target, registry: Registry) -> list[str]:
    """Target names in `section` that can feed `slot`, most preferred first: by the slot's
    kinds when it names kinds, else by its preferred kinds and then its formats; section
    order within one preference."""
    produces = {t.name: registry.targets[t.kind].produces for t in section.targets}
    usable = [t for t in section.targets if t.name != me.name and slot.accepts(t.kind, produces[t.name])]
    if slot.kinds:
        tiers = [[t for t in usable if t.kind == k] for k in slot.kinds]
    else:
        tiers = [[t for t in usable if t.kind == k] for k in slot.prefer]
        tiers += [[t for t in usable if produces[t.name] == f] for f in slot.formats]
    names: list[str] = []
    for tier in tiers:
        for t in tier:
            if t.name not in names:
                names.append(t.name)
        if names and not (slot.fanout or slot.gather):
            break
    return names


def _wire(section: Section, registry: Registry) -> dict[str, dict[str, list[str]]]:
    """For each target name: slot → input target names."""
    first: dict[str, Target] = {}
    for t in section.targets:
        first.setdefault(t.name, t)
    wiring: dict[str, dict[str, list[str]]] = {}
    for name, t in first.items():
        cls = registry.targets[t.kind]
        slots: dict[str, list[str]] = {s.name: [] for s in cls.consumes}
        where = t.input_where or t.where
        if t.inputs is not None:
            for inp in t.inputs:
                kind = first[inp].kind
                fmt = registry.targets[kind].produces
                fits = [s for s in cls.consumes if s.accepts(kind, fmt)]
                # the first slot that takes it and still has room: `input = ["vllm-fp8", "fp8",
                # "weights"]` fills serve, model, reference in that order
                slot = next((s for s in fits if s.gather or s.fanout or not slots[s.name]), None)
                if fits and slot is None:
                    raise where.error(
                        f"input {inp!r} ({kind}) has no slot left: kind {t.kind!r} takes one "
                        + " and one ".join(f"{s.name!r}" for s in fits)
                        + f" input, already {', '.join(repr(slots[s.name][0]) for s in fits)}",
                        "input",
                        "name each input once; drop the extra one",
                    )
                if slot is None:
                    accepted = "; ".join(
                        s.describe() if len(cls.consumes) == 1 else f"{s.name}: {s.describe()}"
                        for s in cls.consumes
                    )
                    raise where.error(
                        f"input {inp!r} is a {kind!r}"
                        + (f" (format {fmt!r})" if fmt else "")
                        + f", which kind {t.kind!r} does not take",
                        "input",
                        f"it takes: {accepted or 'no inputs'}",
                    )
                slots[slot.name].append(inp)
        for slot in cls.consumes:
            if slots[slot.name] or "*" in slot.kinds:
                continue  # filled by `input`; wildcard slots are only ever explicit
            cands = _candidates(slot, section, t, registry)
            if not cands:
                if slot.required:
                    first_kind = _producer_of(registry, slot)
                    raise section.where.error(
                        f"target {name!r} ({t.kind}) needs an input of {slot.describe()}, "
                        "and the section has none",
                        "targets",
                        f"add {first_kind!r} to targets" if first_kind else "add a target that makes one",
                    )
                continue
            if len(cands) > 1 and not (slot.fanout or slot.gather):
                raise where.error(
                    f"target {name!r} could take its {slot.name!r} input from "
                    f"{' or '.join(repr(c) for c in cands)}",
                    "input",
                    f'say which: input = "{cands[0]}"',
                )
            slots[slot.name] = cands
        wiring[name] = slots
    return wiring


def _producer_of(registry: Registry, slot: Input) -> str | None:
    """A kind that can fill `slot`, for hints (the first named kind, else the first
    registered kind producing its preferred format)."""
    if slot.kinds or slot.prefer:
        return (slot.kinds or slot.prefer)[0]
    for fmt in slot.formats:
        for name, cls in registry.targets.items():
            if cls.produces == fmt:
                return name
    return None


def _order(section: Section, wiring: dict[str, dict[str, list[str]]]) -> list[str]:
    """The section's target names, each after its inputs; a cycle is an error."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []
    done: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for deps in wiring[n].values():
            for d in deps:
                if state.get(d) == 1:
                    cyc = path[path.index(d) :] + [d]
                    where = (
                        next((t.input_where or t.where for t in section.targets if t.name == d), None)
                        or section.where
                    )
                    raise where.error(
                        f"dependency cycle: {' → '.join(cyc)}",
                        "input",
                        "an `input` points back at a target that depends on this one",
                    )
                if state.get(d) is None:
                    visit(d)
        path.pop()
        state[n] = 2
        done.append(n)

    for n in wiring:
        if n not in state:
            visit(n)
    return done


def build_graph(recipe: Recipe, registry: Registry) -> Graph:
    """Expand the recipe's sections into the graph of nodes."""
    nodes: dict[str, Node] = {}
    by_identity: dict[str, Node] = {}
    kinds: dict[str, TargetKind] = {}  # one instance per kind, not one per target
    # params objects are shared by the sections whose values are equal: dump each once
    dumps: dict[int, tuple[Any, Any]] = {}
    for section in recipe.sections:
        sid = section.id
        hw = registry.hardware[section.hardware]
        model = recipe.models[section.model]
        wiring = _wire(section, registry)
        variants: dict[str, list[Target]] = {}
        for t in section.targets:
            kind = kinds.get(t.kind)
            if kind is None:
                kind = kinds[t.kind] = registry.targets[t.kind]()
            t.params = kind.bind(t.params, model=section.model, hardware=section.key, section=sid)
            variants.setdefault(t.name, []).append(t)
        built: dict[str, list[Node]] = {}  # target name → its nodes in this section
        for name in _order(section, wiring):
            slots = wiring[name]
            cls = registry.targets[variants[name][0].kind]
            # per filled slot, the ways to fill it: all inputs at once (gather), one node
            # per input (fanout), or one node of the one input target
            choices: list[list[tuple[str, list[Node]]]] = [
                [(s.name, [n for inp in slots[s.name] for n in built[inp]])]
                if s.gather
                else [(s.name, [n]) for inp in slots[s.name] for n in built[inp]]
                if s.fanout
                else [(s.name, [n]) for n in built[slots[s.name][0]]]
                for s in cls.consumes
                if slots[s.name]
            ]
            multi = [len(c) > 1 for c in choices]
            here: list[Node] = []
            built[name] = here
            for t in variants[name]:
                for combo in itertools.product(*choices):
                    inputs: dict[str, list[str]] = {s: [] for s in slots}
                    suffix = []
                    for (slot, inodes), is_multi in zip(combo, multi):
                        inputs[slot] += [n.id for n in inodes]
                        if is_multi:
                            suffix.append(inodes[0].label)
                    label = t.label + (f"[{','.join(suffix)}]" if suffix else "")
                    hit = dumps.get(id(t.params))
                    if hit is None or hit[0] is not t.params:
                        hit = dumps[id(t.params)] = (t.params, t.params.model_dump(mode="json"))
                    node = _node(registry, section, model, hw, t, inputs, label, hit[1], nodes)
                    existing = by_identity.get(node.identity)
                    if existing is None:
                        by_identity[node.identity] = nodes[node.id] = existing = node
                    elif node.id not in existing.addresses:
                        existing.addresses.append(node.id)
                    here.append(existing)
    return Graph(recipe, registry, nodes)


def _node(
    registry: Registry,
    section: Section,
    model: Model,
    hw: HardwareProfile,
    t: Target,
    inputs: dict[str, list[str]],
    label: str,
    params: Any,
    nodes: dict[str, Node],
) -> Node:
    """The node of target `t`; its identity is the digest of the canonical JSON of what
    defines it: kind and plugin with their versions, params, its inputs' identities, the
    model's family and task, the source (kinds that read it), the hardware profile
    (per-hardware kinds)."""
    cls = registry.targets[t.kind]
    plugin = registry.plugin_of("targets", t.kind)
    definition: dict[str, Any] = {
        "kind": t.kind,
        "kind_version": cls.version,
        "plugin": plugin.name,
        "plugin_version": plugin.version,
        "params": params,
        "inputs": {s: [nodes[i].identity for i in ids] for s, ids in sorted(inputs.items())},
        "model": {"family": model.spec.family, "task": model.spec.task},
    }
    if cls.uses_source:
        definition["source"] = model.spec.source
    if cls.per_hardware:
        definition["hardware"] = hw.model_dump(mode="json")
    node_id = f"{section.id}:{label}"
    return Node(
        id=node_id,
        identity=hash_bytes(canonical_bytes(definition)),
        kind=t.kind,
        kind_version=cls.version,
        plugin=plugin.name,
        plugin_version=plugin.version,
        target=t,
        section=section,
        model=model,
        hardware=hw,
        inputs=inputs,
        label=label,
        params_dump=params,
        addresses=[node_id],
        partial_slots=tuple(s.name for s in cls.consumes if s.gather and s.partial),
    )


# --------------------------------------------------------------------------- rendering


def to_dot(graph: Graph, ids: list[str]) -> str:
    """Graphviz dot: one cluster per section, shared nodes drawn once."""
    lines = ["digraph mopt {", "  rankdir=LR;", '  node [shape=box, fontname="monospace"];']
    by_section: dict[str, list[Node]] = {}
    for i in ids:
        n = graph.nodes[i]
        by_section.setdefault(n.section.id, []).append(n)
    for k, (sec, ns) in enumerate(by_section.items()):
        lines.append(f'  subgraph cluster_{k} {{ label="{sec}";')
        for n in ns:
            extra = f"\\n(+{len(n.addresses) - 1} shared)" if len(n.addresses) > 1 else ""
            lines.append(f'    "{n.id}" [label="{n.label}\\n{n.kind}{extra}"];')
        lines.append("  }")
    for i in ids:
        for d in graph.nodes[i].input_ids():
            lines.append(f'  "{d}" -> "{i}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(graph: Graph, ids: list[str]) -> str:
    """Mermaid flowchart of the selected nodes."""
    num = {i: f"n{k}" for k, i in enumerate(ids)}
    lines = ["flowchart LR"]
    for i in ids:
        n = graph.nodes[i]
        text = f"{n.id}<br/>{n.kind}".replace('"', "'")
        lines.append(f'  {num[i]}["{text}"]')
    for i in ids:
        for d in graph.nodes[i].input_ids():
            lines.append(f"  {num[d]} --> {num[i]}")
    return "\n".join(lines) + "\n"
