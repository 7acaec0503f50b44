"""Action keys: BLAKE3 of the canonical JSON of everything that can change an output.

Parts: kind + kind version, plugin + version, resolved params, input content digests (and
the model source's digest, or its declared identity, for kinds that read it, and declared
input files), the kind's tool fingerprint, output-relevant platform properties, and a salt.
Not paths, not times, not environment noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json import encoder as std_encoder
from typing import Any

from mopt.digest import canonical_json, hash_bytes

KEY_FORMAT = 1

#: `canonical_json`'s encoder, built once (`json.dumps` with options builds one per call)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _c_encode() -> Callable[[Any], str]:
    """`_ENCODER.encode` without building its C encoder on every call (json/encoder.py,
    `iterencode(o, _one_shot=True)`): ~3.8 µs of each of the 20,000 encodings (node
    identities, action keys) of `mopt plan` at 10,000 nodes, ~75 ms. No marker
    table (`check_circular`): a value that contains itself raises RecursionError, not
    ValueError, and keys' parts are JSON data read from TOML and digests."""
    make = getattr(std_encoder, "c_make_encoder", None)
    if make is None:  # a Python without the C accelerator
        return _ENCODER.encode
    c = make(None, _ENCODER.default, std_encoder.encode_basestring, None, ":", ",", True, False, False)
    return lambda obj: "".join(c(obj, 0))


_ENCODE = _c_encode()


def canonical_bytes(obj: Any) -> bytes:
    """`canonical_json(obj)`, byte for byte."""
    return _ENCODE(obj).encode("utf-8")


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
