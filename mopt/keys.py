"""Action keys: BLAKE3 of the canonical JSON of everything that can change an output.

Parts: kind + kind version, plugin + version, resolved params, input content digests (and
the model source's digest for kinds that read it, and declared input files), the kind's
tool fingerprint, output-relevant platform properties, and a salt. Not paths, not times,
not environment noise.
"""

from __future__ import annotations

import json
from typing import Any

from mopt.digest import canonical_json, hash_bytes

KEY_FORMAT = 1

#: canonical_json's encoder, built once (json.dumps with options builds one per call)
_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


class CanonicalEncoder:
    """`canonical_json` of a flat dict of parts, byte for byte, reusing the encoding of the
    values many nodes share (a kind's params, fingerprint, hardware; 10,000 nodes have a
    handful of distinct ones) and of repeated strings.

    JSON with sorted keys and no whitespace is compositional: a dict's encoding is its
    sorted keys' encodings joined with each value's own. A shared value is remembered by
    identity and keeps the value alive (so its id is not reused); the values passed in are
    read-only by contract (`Node.params_json`, `Engine.fingerprint`)."""

    def __init__(self, shared: frozenset[str] | set[str] = frozenset()) -> None:
        self.shared = frozenset(shared)
        self._by_id: dict[int, tuple[Any, bytes]] = {}
        self._strings: dict[str, bytes] = {}
        self._keys: dict[str, bytes] = {}

    def encode(self, parts: dict[str, Any]) -> bytes:
        out = []
        keys, strings, by_id, shared = self._keys, self._strings, self._by_id, self.shared
        for k in sorted(parts):
            kb = keys.get(k)
            if kb is None:
                if type(k) is not str:
                    return canonical_json(parts)  # what canonical_json would say of it
                kb = keys[k] = _ENCODE(k).encode("utf-8") + b":"
            v = parts[k]
            t = type(v)
            if t is str:  # the value() cases inline: this loop runs ~10 times per node
                b = strings.get(v)
                if b is None:
                    b = strings[v] = _ENCODE(v).encode("utf-8")
            elif (t is dict or t is list) and not v:
                b = b"{}" if t is dict else b"[]"
            elif k in shared:
                b = self.value(v, True)
            else:
                b = _ENCODE(v).encode("utf-8")
            out.append(kb + b)
        return b"{" + b",".join(out) + b"}"

    def value(self, v: Any, shared: bool = False) -> bytes:
        t = type(v)
        if t is str:
            b = self._strings.get(v)
            if b is None:
                b = self._strings[v] = _ENCODE(v).encode("utf-8")
            return b
        if shared and (t is dict or t is list) and v:
            hit = self._by_id.get(id(v))
            if hit is not None and hit[0] is v:
                return hit[1]
            b = _ENCODE(v).encode("utf-8")
            self._by_id[id(v)] = (v, b)
            return b
        return _ENCODE(v).encode("utf-8")


#: the parts of an action key (and of a node's identity) that nodes share as objects
SHARED_PARTS = frozenset({"params", "fingerprint", "hardware", "model", "platform", "source"})


def action_key(parts: dict[str, Any], encoder: CanonicalEncoder | None = None) -> str:
    """The key of an action from its parts (`encoder`: the same bytes, faster over many)."""
    if encoder is None:
        return hash_bytes(canonical_json({"format": KEY_FORMAT, **parts}))
    return hash_bytes(encoder.encode({"format": KEY_FORMAT, **parts}))


def diff_parts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why a key changed, as readable lines: `param max_batch_size: 64 → 128`."""
    reasons: list[str] = []
    if old.get("kind_version") != new.get("kind_version"):
        reasons.append(f"kind {new.get('kind')} version {old.get('kind_version')} → {new.get('kind_version')}")
    if old.get("plugin_version") != new.get("plugin_version"):
        reasons.append(
            f"plugin {new.get('plugin')} {old.get('plugin_version')} → {new.get('plugin_version')}"
        )
    for path, a, b in _leaf_diff(old.get("params", {}), new.get("params", {})):
        reasons.append(f"param {path}: {_fmt(a)} → {_fmt(b)}")
    for slot in sorted(set(old.get("inputs", {})) | set(new.get("inputs", {}))):
        if old.get("inputs", {}).get(slot) != new.get("inputs", {}).get(slot):
            reasons.append(f"input {slot!r} changed")
    if old.get("source") != new.get("source"):
        reasons.append("model source changed")
    for name in sorted(set(old.get("files", {})) | set(new.get("files", {}))):
        a, b = old.get("files", {}).get(name), new.get("files", {}).get(name)
        if a != b:
            reasons.append(f"file {name} {'added' if a is None else 'removed' if b is None else 'changed'}")
    for path, a, b in _leaf_diff(old.get("fingerprint", {}), new.get("fingerprint", {})):
        reasons.append(f"tool {path} {_fmt(a)} → {_fmt(b)}")
    for path, a, b in _leaf_diff(old.get("platform", {}), new.get("platform", {})):
        reasons.append(f"platform {path}: {_fmt(a)} → {_fmt(b)}")
    for path, _a, _b in _leaf_diff(old.get("env", {}), new.get("env", {})):
        reasons.append(f"env {path} changed")
    if old.get("salt") != new.get("salt"):
        reasons.append("salt changed")
    if old.get("format") not in (None, new.get("format", KEY_FORMAT)):
        reasons.append("key format changed")
    return reasons


_MISSING = object()


def _leaf_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out.extend(_leaf_diff(a.get(k, _MISSING), b.get(k, _MISSING), f"{prefix}{k}."))
        return out
    if a != b:
        return [(prefix.rstrip("."), a, b)]
    return []


def _fmt(v: Any) -> str:
    if v is _MISSING:
        return "(unset)"
    return canonical_json(v).decode()
