"""Keys are the digest of the canonical JSON the engine has always hashed, byte for byte (the
encoder `keys` builds once is the standard one), so no key changes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from mopt.digest import canonical_json
from mopt.keys import _ENCODE, action_key, canonical_bytes
from tests.conftest import write_files

# keys that sort in ways a naive join would get wrong: prefixes, case, digits, non-ASCII,
# escapes (the encoder sorts by the key as a str: by code point, before escaping)
AWKWARD_KEYS = ["a", "a_b", "ab", "a.b", "A", "Z", "z", "10", "9", "", " ", "é", "ä", "ß", "日本", "😀",
                '"q', "back\\slash", "tab\t", "nl\n", "\u2028", "\x00nul", "\x7f", "kind", "kind_version"]

AWKWARD_VALUES: list[Any] = [
    0, -1, 10**30, -(10**30), 1.0, -0.0, 0.1, 1e300, 1e-300, 2.5e-8, 123456789.123456789, 1 / 3,
    True, False, None, "", "x", "é\u2028\u2029", '"\\/\b\f\n\r\t', "\x00\x1f\x7f", "😀", "日本語",
    [], {}, [[]], [{}], {"": {}}, [1, "a", None, [True, 2.0]],
]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.random()
    if depth > 3 or pick < 0.45:
        return rng.choice(AWKWARD_VALUES)
    if pick < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(AWKWARD_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _random_object(rng: random.Random) -> dict[str, Any]:
    return {k: _random_value(rng) for k in rng.sample(AWKWARD_KEYS, rng.randrange(1, 12))}


def test_canonical_bytes_of_awkward_objects_are_their_canonical_json() -> None:
    rng = random.Random(18)
    for _ in range(3000):
        obj = _random_object(rng)
        assert canonical_bytes(obj) == canonical_json(obj), obj


def test_the_encoder_is_the_standard_one_byte_for_byte() -> None:
    std = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for v in AWKWARD_VALUES + [{k: i for i, k in enumerate(AWKWARD_KEYS)}, AWKWARD_KEYS]:
        assert _ENCODE(v) == std.encode(v)
    # what it refuses, it refuses as the standard encoder does
    for bad in (math.nan, math.inf, {"a": [-math.inf]}, object(), b"bytes", {1: 2, "a": 3}):
        with pytest.raises((ValueError, TypeError)) as ours:
            _ENCODE(bad)
        with pytest.raises((ValueError, TypeError)) as theirs:
            std.encode(bad)
        assert type(ours.value) is type(theirs.value)


def test_node_identities_and_action_keys_are_the_canonical_ones(project: Path) -> None:
    """Every node's identity is the digest of the canonical JSON of its definition, and
    every key `Engine.keyed` gives is `action_key` of the parts it gives: over kinds that
    read the source, per-hardware kinds, sweeps, shared nodes, gathered and declared files."""
    from mopt.api import Missing
    from mopt.build import Engine
    from mopt.cli import Session
    from mopt.digest import hash_bytes

    write_files(
        project,
        {
            "in/a.txt": "a\n",
            "in/b ü.txt": "b\n",
            "r.toml": """\
                schema = 1

                [models.toy]
                family = "toyfam"
                source = { path = "toy-model" }

                [models."m.2"]
                family = "toyfam"
                source = { path = "toy-model" }

                [defaults]
                targets = ["toy-weights", "toy-export", "toy-engine", "toy-check", "cmd", "toy-gather"]
                toy-engine = { precision = "int8", opt_level = 1 }
                toy-check = { min_score = 0.25 }
                cmd = { kind = "command", files = ["in/a.txt", "in/b ü.txt"], argv = ["cat", "{file}", "é {model}"], env = ["LANG"] }

                [toy.cpu]
                hardware = "cpu"

                [toy.gpu]
                hardware = "toy-gpu"
                opset = 18

                [toy.gpu.sweep]
                "toy-engine.max_batch_size" = [64, 128]
                "toy-engine.opt_level" = [2, 3]

                ["m.2".cpu]
                hardware = "cpu"
            """,
        },
    )
    s = Session(project / "r.toml")
    nodes = s.graph.nodes
    assert len(nodes) > 10
    for n in nodes.values():
        cls = s.registry.targets[n.kind]
        definition: dict[str, Any] = {
            "kind": n.kind,
            "kind_version": cls.version,
            "plugin": n.plugin,
            "plugin_version": n.plugin_version,
            "params": n.target.params.model_dump(mode="json"),
            "inputs": {sl: [nodes[i].identity for i in ids] for sl, ids in sorted(n.inputs.items())},
            "model": {"family": n.model.spec.family, "task": n.model.spec.task},
        }
        if cls.uses_source:
            definition["source"] = n.model.spec.source
        if cls.per_hardware:
            definition["hardware"] = n.hardware.model_dump(mode="json")
        assert n.identity == hash_bytes(canonical_bytes(definition)), n.id
    engine = Engine(s, read_only=True, salt="sälted")
    kinds = set()
    try:
        for n in nodes.values():
            inputs = {sl: [f"{d}-{k}" for k, d in enumerate(ids)] for sl, ids in n.inputs.items()}
            parts, key = engine.keyed(n, inputs)
            assert key == action_key(parts), n.id
            assert parts == engine.keyed(n, inputs)[0]
            kinds.add(n.kind)
            if n.partial_slots:  # a gathering node some of whose inputs will not build
                slot = n.partial_slots[0]
                dep = nodes[n.inputs[slot][0]]
                gone = {slot: [Missing(dep.label, dep.kind, "unbuildable")]}
                parts, key = engine.keyed(n, inputs, gone)
                assert "missing" in parts and "input_labels" in parts
                assert key == action_key(parts), n.id
    finally:
        engine.store.close()
    assert {"toy-weights", "toy-engine", "command", "toy-gather"} <= kinds
