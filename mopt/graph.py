"""The build graph: sections × targets → a DAG of nodes, shared where identical.

A node's identity is a digest of what defines it (kind and version, the plugin, the
validated params, its inputs' identities, the model source for kinds that read it, the
hardware profile for kinds whose output depends on it). Two sections that define the same
node get one node with two addresses. Action keys (which use content digests of the built
inputs instead of identities) are computed by `mopt.keys` when the graph runs.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mopt.api import HardwareProfile, Input, TargetKind
from mopt.digest import hash_bytes
from mopt.errors import MoptError, did_you_mean
from mopt.keys import Layout, member
from mopt.plugins import Registry
from mopt.recipe import Model, Recipe, Section, Target


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
    addresses: list[str] = field(default_factory=list)
    #: slots that take whatever of their inputs got built (`Input.partial`)
    partial_slots: tuple[str, ...] = ()
    #: `target.params` as JSON, dumped once (params are frozen); treat it as read-only
    params_dump: Any = None

    def params_json(self) -> Any:
        if self.params_dump is None:
            self.params_dump = self.target.params.model_dump(mode="json")
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

    def kind_of(self, node: Node) -> TargetKind:
        return self.registry.targets[node.kind]()

    def dependents(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for n in self.nodes.values():
            for i in n.input_ids():
                out[i].append(n.id)
        return out

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

    def match(self, selectors: list[str]) -> list[str]:
        """Node ids matched by the selectors themselves (all nodes when there are none)."""
        if not selectors:
            return list(self.nodes)
        picked: set[str] = set()
        for sel in selectors:
            sec_pat, _, tgt_pat = sel.partition(":")
            sec_pat = sec_pat or "*"
            tgt_pat = tgt_pat or "*"
            hit = False
            for node in self.nodes.values():
                for addr in node.addresses:
                    sec, _, label = addr.partition(":")
                    if fnmatch.fnmatchcase(sec, sec_pat) and (
                        fnmatch.fnmatchcase(label, tgt_pat)
                        or fnmatch.fnmatchcase(node.target.name, tgt_pat)
                    ):
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


def _candidates(slot: Input, section: Section, me: Target, registry: Registry) -> list[str]:
    """Target names in `section` that can feed `slot`, most preferred first: by the slot's
    kinds when it names kinds, else by its formats; section order within one preference."""
    def produces(t: Target) -> str:
        return registry.targets[t.kind].produces

    usable = [t for t in section.targets if t.name != me.name and slot.accepts(t.kind, produces(t))]
    if slot.kinds:
        tiers = [[t for t in usable if t.kind == k] for k in slot.kinds]
    else:
        tiers = [[t for t in usable if produces(t) == f] for f in slot.formats]
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
                slot = next((s for s in cls.consumes if s.accepts(kind, fmt)), None)
                if slot is None:
                    accepted = "; ".join(
                        s.describe() if len(cls.consumes) == 1 else f"{s.name}: {s.describe()}"
                        for s in cls.consumes
                    )
                    raise MoptError(
                        f"input {inp!r} is a {kind!r}" + (f" (format {fmt!r})" if fmt else "")
                        + f", which kind {t.kind!r} does not take",
                        file=where.file if where else None,
                        table=where.table if where else None,
                        key="input",
                        line=where.line if where else None,
                        hint=f"it takes: {accepted or 'no inputs'}",
                    )
                slots[slot.name].append(inp)
        for slot in cls.consumes:
            if slots[slot.name]:
                continue
            if "*" in slot.kinds:
                continue  # wildcard slots are only ever explicit
            cands = _candidates(slot, section, t, registry)
            if not cands:
                if slot.required:
                    first_kind = _producer_of(registry, slot)
                    raise MoptError(
                        f"target {name!r} ({t.kind}) needs an input of {slot.describe()}, "
                        "and the section has none",
                        file=section.where.file,
                        table=section.id,
                        key="targets",
                        line=section.where.line,
                        hint=f"add {first_kind!r} to targets" if first_kind else "add a target that makes one",
                    )
                continue
            if len(cands) > 1 and not (slot.fanout or slot.gather):
                raise MoptError(
                    f"target {name!r} could take its {slot.name!r} input from "
                    f"{' or '.join(repr(c) for c in cands)}",
                    file=where.file if where else None,
                    table=where.table if where else section.id,
                    key="input",
                    line=where.line if where else None,
                    hint=f'say which: input = "{cands[0]}"',
                )
            slots[slot.name] = cands
        wiring[name] = slots
    _check_cycles(section, wiring)
    return wiring


def _producer_of(registry: Registry, slot: Input) -> str | None:
    """A kind that can fill `slot`, for hints (the first named kind, else the first
    registered kind producing its preferred format)."""
    if slot.kinds:
        return slot.kinds[0]
    for fmt in slot.formats:
        for name, cls in registry.targets.items():
            if cls.produces == fmt:
                return name
    return None


def _check_cycles(section: Section, wiring: dict[str, dict[str, list[str]]]) -> None:
    state: dict[str, int] = {}
    path: list[str] = []

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
                    raise MoptError(
                        f"dependency cycle: {' → '.join(cyc)}",
                        file=where.file,
                        table=where.table,
                        key="input",
                        line=where.line,
                        hint="an `input` points back at a target that depends on this one",
                    )
                if state.get(d) is None:
                    visit(d)
        path.pop()
        state[n] = 2

    for n in wiring:
        if n not in state:
            visit(n)


def _topo_names(wiring: dict[str, dict[str, list[str]]]) -> list[str]:
    done: list[str] = []
    seen: set[str] = set()

    def visit(n: str) -> None:
        if n in seen:
            return
        seen.add(n)
        for deps in wiring[n].values():
            for d in deps:
                visit(d)
        done.append(n)

    for n in wiring:
        visit(n)
    return done


def build_graph(recipe: Recipe, registry: Registry) -> Graph:
    """Expand the recipe's sections into the graph of nodes."""
    nodes: dict[str, Node] = {}
    by_identity: dict[str, Node] = {}
    kinds: dict[str, TargetKind] = {}  # one instance per kind, not one per target
    hw_json: dict[int, Any] = {}  # id(profile) → its JSON
    memo = _NodeMemo()
    #: per shape: for each target name in topological order, its slots and the (slot, mode)
    #: of those that have inputs
    wirings: dict[Any, list[tuple[str, dict[str, list[str]], tuple[tuple[str, str], ...]]]] = {}
    slot_modes: dict[tuple[str, str], str] = {}  # (kind, slot) → gather | fanout | one
    for section in recipe.sections:
        sid = section.id
        hw = registry.hardware[section.hardware]
        model = recipe.models[section.model]
        # sections of one shape (target names, kinds, inputs) wire alike: 10,000 sections
        # under one [defaults] have one shape; the first of a shape raises any wiring error
        shape = tuple((t.name, t.kind, None if t.inputs is None else tuple(t.inputs)) for t in section.targets)
        plan = wirings.get(shape)
        if plan is None:
            wiring = _wire(section, registry)
            kind_of = {t.name: t.kind for t in reversed(section.targets)}  # the first of a name
            plan = wirings[shape] = [
                (
                    name,
                    wiring[name],
                    tuple(
                        (s, slot_modes.get((kind_of[name], s)) or _slot_mode(registry, kind_of[name], s, slot_modes))
                        for s in wiring[name]
                        if wiring[name][s]
                    ),
                )
                for name in _topo_names(wiring)
            ]
        variants: dict[str, list[Target]] = {}
        for t in section.targets:
            kind = kinds.get(t.kind)
            if kind is None:
                kind = kinds[t.kind] = registry.targets[t.kind]()
            t.params = kind.bind(t.params, model=section.model, hardware=section.key, section=sid)
            variants.setdefault(t.name, []).append(t)
        built: dict[str, list[Node]] = {}  # target name → its nodes in this section
        for name, slots, modes in plan:
            choices: list[list[tuple[str, list[Node]]]] = [
                [(s, [n for inp in slots[s] for n in built[inp]])]
                if mode == "gather"
                else [(s, [n]) for inp in slots[s] for n in built[inp]]
                if mode == "fanout"
                else [(s, [n]) for n in built[slots[s][0]]]
                for s, mode in modes
            ]
            multi = [len(c) > 1 for c in choices]
            here: list[Node] = []
            built[name] = here
            for t in variants[name]:
                for combo in itertools.product(*choices) if choices else [()]:
                    inputs: dict[str, list[str]] = {s: [] for s in slots}
                    suffix = []
                    for (slot, inodes), is_multi in zip(combo, multi):
                        inputs[slot] += [n.id for n in inodes]
                        if is_multi:
                            suffix.append(inodes[0].label)
                    label = t.label + (f"[{','.join(suffix)}]" if suffix else "")
                    identity = memo.identity(registry, model, hw, t, inputs, nodes, hw_json)
                    existing = by_identity.get(identity)
                    if existing is not None:
                        addr = f"{sid}:{label}"
                        if addr not in existing.addresses:
                            existing.addresses.append(addr)
                        here.append(existing)
                        continue
                    node = memo.node(registry, section, sid, model, hw, t, inputs, label, identity)
                    by_identity[identity] = node
                    nodes[node.id] = node
                    here.append(node)
    return Graph(recipe, registry, nodes)


def _slot(registry: Registry, kind: str, slot: str) -> Input:
    return next(s for s in registry.targets[kind].consumes if s.name == slot)


def _slot_mode(registry: Registry, kind: str, slot: str, memo: dict[tuple[str, str], str]) -> str:
    """How a slot of `kind` takes its inputs: all at once (gather), one node each (fanout), or one."""
    s = _slot(registry, kind, slot)
    mode = memo[(kind, slot)] = "gather" if s.gather else "fanout" if s.fanout else "one"
    return mode


class _NodeMemo:
    """What `build_graph` computes once for the many nodes that share it: a params object's
    JSON dump (bound params are frozen and shared where a section's values are), a model's
    family/task, a kind's plugin, and each of these as the canonical JSON member it is in a
    node's definition (`keys.member`). Each is held with its object, so an id seen here is
    never another object's; every one of them is frozen (pydantic `frozen=True` models, the
    registry's classes), so a member encoded once is the member encoded now."""

    def __init__(self) -> None:
        self.dumps: dict[int, tuple[Any, Any, str]] = {}
        self.models: dict[int, tuple[Model, dict[str, Any], str, str]] = {}
        self.kinds: dict[str, tuple[Any, Any, tuple[str, ...], Layout]] = {}
        self.hardware: dict[int, tuple[HardwareProfile, str]] = {}

    def dump(self, params: Any) -> Any:
        return self._dump(params)[1]

    def _dump(self, params: Any) -> tuple[Any, Any, str]:
        hit = self.dumps.get(id(params))
        if hit is None or hit[0] is not params:
            dumped = params.model_dump(mode="json")
            hit = self.dumps[id(params)] = (params, dumped, member("params", dumped))
        return hit

    def model(self, model: Model) -> dict[str, Any]:
        return self._model(model)[1]

    def _model(self, model: Model) -> tuple[Model, dict[str, Any], str, str]:
        hit = self.models.get(id(model))
        if hit is None or hit[0] is not model:
            fam = {"family": model.spec.family, "task": model.spec.task}
            source = model.spec.source
            hit = self.models[id(model)] = (model, fam, member("model", fam), member("source", source))
        return hit

    def kind(self, registry: Registry, kind: str) -> tuple[Any, Any, tuple[str, ...]]:
        return self._kind(registry, kind)[:3]

    def _kind(self, registry: Registry, kind: str) -> tuple[Any, Any, tuple[str, ...], Layout]:
        hit = self.kinds.get(kind)
        if hit is None:
            cls = registry.targets[kind]
            partial = tuple(s.name for s in cls.consumes if s.gather and s.partial)
            plugin = registry.plugin_of("targets", kind)
            fixed = {
                "kind": kind,
                "kind_version": cls.version,
                "plugin": plugin.name,
                "plugin_version": plugin.version,
            }
            holes = ("params", "model", "inputs") + (("source",) if cls.uses_source else ()) + (
                ("hardware",) if cls.per_hardware else ()
            )
            layout = Layout({k: member(k, v) for k, v in fixed.items()}, holes)
            hit = self.kinds[kind] = (cls, plugin, partial, layout)
        return hit

    def hw(self, hw: HardwareProfile, hw_json: dict[int, Any]) -> str:
        hit = self.hardware.get(id(hw))
        if hit is None or hit[0] is not hw:
            if id(hw) not in hw_json:
                hw_json[id(hw)] = hw.model_dump(mode="json")
            hit = self.hardware[id(hw)] = (hw, member("hardware", hw_json[id(hw)]))
        return hit[1]

    def identity(
        self,
        registry: Registry,
        model: Model,
        hw: HardwareProfile,
        t: Target,
        inputs: dict[str, list[str]],
        nodes: dict[str, Node],
        hw_json: dict[int, Any],
    ) -> str:
        """The digest of the canonical JSON of the node's definition: {kind, kind_version,
        plugin, plugin_version, params, inputs (their identities), model (family, task),
        source (kinds that read it), hardware (per-hardware kinds)}, written from members
        encoded once per kind, params object, model and profile (`keys.Layout`)."""
        cls, _, _, layout = self._kind(registry, t.kind)
        hit = self.dumps.get(id(t.params))
        if hit is None or hit[0] is not t.params:
            hit = self._dump(t.params)
        m = self.models.get(id(model))
        if m is None or m[0] is not model:
            m = self._model(model)
        ins = member("inputs", {s: [nodes[i].identity for i in ids] for s, ids in sorted(inputs.items())})
        if cls.uses_source:
            if cls.per_hardware:
                return hash_bytes(layout.join(hit[2], m[2], ins, m[3], self.hw(hw, hw_json)))
            return hash_bytes(layout.join(hit[2], m[2], ins, m[3]))
        if cls.per_hardware:
            return hash_bytes(layout.join(hit[2], m[2], ins, self.hw(hw, hw_json)))
        return hash_bytes(layout.join(hit[2], m[2], ins))

    def node(
        self,
        registry: Registry,
        section: Section,
        sid: str,
        model: Model,
        hw: HardwareProfile,
        t: Target,
        inputs: dict[str, list[str]],
        label: str,
        identity: str,
    ) -> Node:
        cls, plugin, partial, _ = self._kind(registry, t.kind)
        node_id = f"{sid}:{label}"
        return Node(
            id=node_id,
            identity=identity,
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
            addresses=[node_id],
            partial_slots=partial,
            params_dump=self._dump(t.params)[1],
        )


def _make_node(
    registry: Registry,
    section: Section,
    model: Model,
    hw: HardwareProfile,
    t: Target,
    inputs: dict[str, list[str]],
    label: str,
    nodes: dict[str, Node],
    hw_json: dict[int, Any] | None = None,
    memo: _NodeMemo | None = None,
) -> Node:
    """The node of target `t` (see `_NodeMemo.identity` for what its identity covers)."""
    memo = memo or _NodeMemo()
    identity = memo.identity(registry, model, hw, t, inputs, nodes, {} if hw_json is None else hw_json)
    return memo.node(registry, section, section.id, model, hw, t, inputs, label, identity)


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
