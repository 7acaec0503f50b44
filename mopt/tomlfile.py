"""Reading TOML files with errors that point at the file, line and column, and finding
where a table or key was written (for errors raised after parsing)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from mopt.errors import MoptError
from mopt.filehash import open_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_AT_EOF = re.compile(r"\s*\(at end of document\)\s*$")


#: every file `load` read in this process: path → (its stat, taken on the open file, the
#: bytes read, when: time.time_ns()), or None if two reads saw different stats. The build
#: log's head records the stat the bytes had, so an edit made while a build ran is seen.
reads: dict[str, tuple[os.stat_result, bytes, int] | None] = {}


def _read(path: Path) -> str:
    # never a blocking open: a fifo in the recipe's or mopt.toml's place is "not a regular file"
    with open(open_regular(path, follow=True), "rb") as fh:
        at = time.time_ns()  # a file changed less than a moment before may change again unseen
        st = os.fstat(fh.fileno())
        data = fh.read()
    key = str(path)
    if key not in reads:
        reads[key] = (st, data, at)
    elif (seen := reads[key]) is not None and _id(seen[0]) != _id(st):
        reads[key] = None
    text = data.decode("utf-8")
    if "\r" in text:  # as read_text's universal newlines read it
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _id(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def load(path: Path, display: str | None = None) -> tuple[dict[str, Any], str]:
    """Parse a TOML file; syntax errors become a `MoptError` with line and column."""
    shown = display or str(path)
    try:
        text = _read(path)
    except FileNotFoundError:
        raise MoptError("file not found", file=shown, hint="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MoptError(f"cannot read file: {exc}", file=shown) from None
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise MoptError(
            f"nested deeper than Python can parse (over {MAX_DEPTH} levels)", file=shown
        ) from None
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _AT.search(msg)
        if m:
            line, col = int(m.group(1)), int(m.group(2))
            body = msg[: m.start()]
            raise MoptError(
                f"TOML syntax error at column {col}: {body[0].lower() + body[1:]}",
                file=shown,
                line=line,
            ) from None
        body = _AT_EOF.sub("", msg)
        raise MoptError(f"TOML syntax error at end of file: {body}", file=shown) from None
    where = _too_deep(data)
    if where is not None:
        raise MoptError(
            f"nested more than {MAX_DEPTH} levels deep (tables and arrays)",
            file=shown,
            table=".".join(where[:8]) + (" ..." if len(where) > 8 else ""),
            hint="no recipe or config needs that; flatten it",
        )
    return data, text


#: tables and arrays nested deeper than this are refused: no recipe needs it, and merging,
#: hashing and JSON-encoding such values would recurse without bound
MAX_DEPTH = 32


def _too_deep(value: Any) -> list[str] | None:
    """The path to the first value nested deeper than MAX_DEPTH, else None (iterative)."""
    stack: list[tuple[Any, int, list[str]]] = [(value, 0, [])]
    while stack:
        v, d, p = stack.pop()
        if d > MAX_DEPTH:
            return p
        if isinstance(v, dict):
            stack.extend((sub, d + 1, [*p, str(k)]) for k, sub in v.items())
        elif isinstance(v, list):
            stack.extend((sub, d + 1, [*p, str(i)]) for i, sub in enumerate(v))
    return None


def split_key(dotted: str) -> list[str]:
    """Split a TOML dotted key, honouring quotes (`a."b.c".d` → [a, b.c, d])."""
    parts: list[str] = []
    cur = ""
    quote: str | None = None
    for ch in dotted.strip():
        if quote:
            if ch == quote:
                quote = None
            else:
                cur += ch
        elif ch in "\"'":
            quote = ch
        elif ch == ".":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


_HEADER = re.compile(r"^\s*\[\[?([^\]]+)\]\]?\s*(#.*)?$")


def find_line(text: str, table: list[str], key: str | None = None) -> int | None:
    """Best-effort line number (1-based) where `key` of `table` is written."""
    lines = text.splitlines()
    headers: list[tuple[int, list[str]]] = []
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m:
            headers.append((i, split_key(m.group(1))))
    headers.append((len(lines), []))

    def region(path: list[str]) -> tuple[int, int] | None:
        for idx, (i, h) in enumerate(headers[:-1]):
            if h == path:
                return i, headers[idx + 1][0]
        return None

    def key_in(start: int, end: int, name: str) -> int | None:
        pat = re.compile(r"(^|[\s{,.\[])(\"|')?" + re.escape(name) + r"(\"|')?\s*(=|\.)")
        for i in range(start, end):
            if pat.search(lines[i].split("#", 1)[0]):
                return i + 1
        return None

    if key is not None:
        sub = region(table + split_key(key))
        if sub is not None:  # the key is itself a table with a header
            return sub[0] + 1
    if key is None and table and region(table) is None:
        # a table only implied by deeper headers ([toi.cpu] implies [toi])
        for i, h in headers[:-1]:
            if h[: len(table)] == table:
                return i + 1
    # the table has its own header: look for the key below it
    for depth in range(len(table), -1, -1):
        head = table[:depth]
        reg = region(head) if head else (0, headers[0][0])
        if reg is None:
            continue
        start, end = reg
        # walk down the remaining path (dotted keys / inline tables) inside the region
        rest = table[depth:] + ([key] if key else [])
        found = start + 1 if head else None
        pos = start + 1 if head else 0
        for name in rest:
            hit = key_in(pos, end, name)
            if hit is None:
                break
            found, pos = hit, hit - 1
        return found
    return None
