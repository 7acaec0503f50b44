"""Action keys: BLAKE3 of the canonical JSON of everything that can change an output.

Parts: kind + kind version, plugin + version, resolved params, input content digests (and
the model source's digest, or its declared identity, for kinds that read it, and declared
input files), the kind's tool fingerprint, output-relevant platform properties, and a salt.
Not paths, not times, not environment noise.
"""

from __future__ import annotations

import json
from typing import Any

from mopt.digest import canonical_json, hash_bytes

KEY_FORMAT = 1

#: the encoder `canonical_json` builds on every call (json.dumps with options makes one each
#: time), built once: the same bytes, ~4 µs less per key, 20,000 keys at 10,000 nodes; its
#: C core is made once too (`_c_encode`)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _c_encode() -> Any:
    """`_ENCODER.encode` without its per-call set-up: `JSONEncoder.encode` writes a str
    itself and hands anything else to a C encoder it makes on every call from these very
    settings (json/encoder.py, `iterencode(o, _one_shot=True)`); this makes that encoder
    once. The one difference: no marker table (`check_circular`), which only turns the
    ValueError of a value that contains itself into a RecursionError, and keys' parts are
    JSON data read from TOML and digests. None where the C encoder is not built in."""
    from json import encoder as std

    make = getattr(std, "c_make_encoder", None)
    if make is None:
        return None
    c = make(
        None,
        _ENCODER.default,
        std.encode_basestring,
        None,
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        True,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
    basestring = std.encode_basestring

    def encode(obj: Any) -> str:
        if isinstance(obj, str):
            return str(basestring(obj))
        return "".join(c(obj, 0))

    return encode


_ENCODE = _c_encode() or _ENCODER.encode


def canonical_bytes(obj: Any) -> bytes:
    """`canonical_json(obj)`, byte for byte."""
    return _ENCODE(obj).encode("utf-8")


_HEADS: dict[str, str] = {}  # key → `"key":`, as the encoder writes a member's start


def member(key: str, value: Any) -> str:
    """One `"key":value` member of a canonical JSON object, as `canonical_bytes` writes it
    inside the object (the encoder writes a key as the string it is, then the value as it
    would write it alone: one encoder, one rule for nested and top-level values)."""
    head = _HEADS.get(key)
    if head is None:
        if type(key) is not str:
            raise TypeError(f"keys must be str, not {type(key).__name__}")
        head = _HEADS[key] = _ENCODE(key) + ":"
    if type(value) is dict and not value:  # an empty table (a kind's platform, env): `{}`
        return head + "{}"
    return head + _ENCODE(value)


def from_members(members: dict[str, str]) -> bytes:
    """`canonical_bytes` of the object whose members `members` holds, each written by
    `member` under its own key: `from_members({k: member(k, v) for k, v in d.items()})`
    == `canonical_bytes(d)`, byte for byte. The encoder writes an object as `{`, its members
    sorted by key and joined by `,`, then `}`; so does this. It lets a member shared by
    many objects (a kind's params, a model) be encoded once (tests/test_keys_members.py
    compares the two over nested, unicode, float and sort-order cases)."""
    return ("{" + ",".join([members[k] for k in sorted(members)]) + "}").encode("utf-8")


class Layout:
    """The member order of objects that all have the members `fixed` (already written by
    `member`) and `holes` (written per object): `Layout(fixed, holes).join(*members)` ==
    `from_members({**fixed, **dict(zip(holes, members))})`, the keys sorted once."""

    __slots__ = ("_members", "_pos")

    def __init__(self, fixed: dict[str, str], holes: tuple[str, ...]) -> None:
        if set(fixed) & set(holes) or len(set(holes)) != len(holes):
            raise ValueError("a hole is also a fixed member, or named twice")
        names = sorted([*fixed, *holes])
        self._members = [fixed.get(k, "") for k in names]
        self._pos = tuple(names.index(h) for h in holes)

    def join(self, *members: str) -> bytes:
        if len(members) != len(self._pos):
            raise TypeError(f"{len(self._pos)} member(s) expected, got {len(members)}")
        out = self._members.copy()
        for i, m in zip(self._pos, members):
            out[i] = m
        return ("{" + ",".join(out) + "}").encode("utf-8")


def action_key_from_members(members: dict[str, str]) -> str:
    """`action_key(parts)` from the members of `parts` (see `from_members`)."""
    return hash_bytes(from_members({"format": _FORMAT_MEMBER, **members}))


_FORMAT_MEMBER = member("format", KEY_FORMAT)


def action_key(parts: dict[str, Any]) -> str:
    """The key of an action from its parts."""
    return hash_bytes(canonical_bytes({"format": KEY_FORMAT, **parts}))


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
