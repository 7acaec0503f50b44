"""`mopt plan` answered from the no-op stamp (Ninja's `-n`, Bazel's cached analysis).

When the stamp a successful `mopt build RECIPE SELECTORS [--offline]` wrote still holds
(`noop`: every file, module, input, blob, build/ file and environment variable it depends on
unchanged), every node of that build is up to date, and `mopt plan RECIPE SELECTORS` would
print the build's graph with "up to date" and the key of each node. The build files that
answer beside its stamp (`<stamp>.plan`: plan's `--json` document for the build's nodes), and
`plan` prints it, or its table, without plugins, pydantic, the recipe or the graph.

The plan file is bound to the one stamp written with it by a random token kept in both (the
stamp can be rewritten by the no-op's learning of touched inputs; the token stays): an old
plan file beside a newer stamp never answers. It is removed before the build writes its
stamp and written after, so a crash between the two leaves none. Anything damaged, missing
or different means the full path, which prints the same thing the slow way.

What else the full path would do differently, and so where this answers nothing:
- a plugin loaded in full prints its warnings: answered only while the store's plugin
  index holds for this installation (the full path then loads only the recipe's plugins),
  and written only by a build whose plugins gave no warning;
- plan resolves model sources offline: an online build's plan file is written only when
  each of its sources resolves offline to the folder the build used;
- the recipe path it prints is the resolved one: compared with the path given now.

This module imports nothing heavy (no pydantic, pluggy or click) until the build writes.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import zlib
from typing import Any

PLAN_VERSION = 1
MAGIC = b"mopt plan stamp 1\n"
MARSHAL_VERSION = 4
UP_TO_DATE = "up to date"


def plan_path(stamp: str) -> str:
    """Where the plan file of the stamp at `stamp` lives (beside it)."""
    return (stamp[: -len(".stamp")] if stamp.endswith(".stamp") else stamp) + ".plan"


TOKEN_LEN = 24


def new_token() -> str:
    return os.urandom(TOKEN_LEN // 2).hex()


def forget(stamp: str) -> None:
    """Remove the plan file of `stamp` (before the build replaces or removes the stamp)."""
    with contextlib.suppress(OSError):
        os.unlink(plan_path(stamp))


# --------------------------------------------------------------------------- written by the build


def write(stamp: str, token: str, session: Any, engine: Any, ids: list[str], keys: dict[str, str]) -> None:
    """File the plan of `ids` (every one a hit under `keys`) beside `stamp`, bound to `token`
    (the same token is in the stamp's result); nothing when plan could print otherwise.
    Never fails the build: the plan file is only a cache."""
    try:
        _write(stamp, token, session, engine, ids, keys)
    except Exception:  # e.g. an id without a key: no plan file, plan takes the full path
        forget(stamp)


def _write(stamp: str, token: str, session: Any, engine: Any, ids: list[str], keys: dict[str, str]) -> None:
    if session.registry.warnings or not _sources_same_offline(engine):
        return
    from mopt.cli import node_json

    # the nodes as plan's --json lists them, kept as values (marshal: builtins only; plan
    # encodes them, or makes its table of them, as the full path does)
    data = {
        "version": PLAN_VERSION,
        "token": token,
        "recipe": str(session.recipe.path),
        "index_dir": str(session.project.store_dir),
        "blocked": list(session.registry.disabled),
        "nodes": [
            node_json(session, i, {"state": "up-to-date", "summary": UP_TO_DATE, "key": keys[i]}) for i in ids
        ],
    }
    from mopt.noop import replace_durably

    try:
        payload = token.encode("ascii") + marshal.dumps(data, MARSHAL_VERSION)
    except ValueError:  # a value marshal cannot hold (a TOML date in a variant): no plan file
        return
    with contextlib.suppress(OSError):  # only a cache: plan takes the full path
        replace_durably(plan_path(stamp), MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload)


def _sources_same_offline(engine: Any) -> bool:
    """Whether every model source the build resolved resolves offline (as plan resolves) to
    the same folder; an `--offline` build's are that already."""
    if engine.offline or not engine._sources:
        return True
    from mopt.api import SourceContext

    reg, recipe = engine.registry, engine.recipe
    for name, (path, _digest, _info) in engine._sources.items():
        model = recipe.models[name]
        fam = reg.families.get(model.spec.family)
        ctx = SourceContext(
            project_dir=model.base_dir,
            cache_dir=engine.store.root / "sources",
            offline=True,
            family=fam() if fam else None,
            model_name=name,
            families=dict(reg.families),
            task=model.spec.task,
        )
        try:
            if reg.sources[model.source_kind]().resolve(model.source_params, ctx) != path:
                return False
        except Exception:
            return False
    return True


# --------------------------------------------------------------------------- read by `mopt plan`


def _read(path: str) -> bytes | None:
    """The plan file's bytes if it is one (its seal is checked by `_load`)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data if data[: len(MAGIC)] == MAGIC and len(data) > len(MAGIC) + 4 + TOKEN_LEN else None


def _token(data: bytes) -> str:
    n = len(MAGIC) + 4
    return data[n : n + TOKEN_LEN].decode("ascii", "replace")


def _load(data: bytes) -> dict[str, Any] | None:
    """The plan the file's bytes `data` hold, if its seal holds and it has the right shape."""
    n = len(MAGIC)
    payload = memoryview(data)[n + 4 :]
    if zlib.crc32(payload) != int.from_bytes(data[n : n + 4], "little"):
        return None  # torn or damaged
    try:
        plan = marshal.loads(payload[TOKEN_LEN:])
    except (EOFError, ValueError, TypeError):
        return None
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION or plan.get("token") != _token(data):
        return None
    want = {"token": str, "recipe": str, "index_dir": str, "blocked": list, "nodes": list}
    if not all(isinstance(plan.get(k), t) for k, t in want.items()):
        return None
    return plan


#: why the last `lookup` found no answer ("" when it did)
last_miss = ""


def lookup(recipe: str, selectors: list[str]) -> dict[str, Any] | None:
    """The plan file that answers `mopt plan recipe selectors` now, or None (the reason is in
    `last_miss`): its stamp (of the build of these selectors, with or without --offline)
    holds, carries the plan file's token, and nothing outside the stamp would change plan's
    output."""
    global last_miss
    from mopt import noop

    last_miss = "no store folder"
    if not os.path.exists(recipe):
        return None
    store_dir = noop.find_store_dir(recipe)
    if store_dir is None:
        return None
    last_miss = "no plan file"
    for offline in (False, True):
        stamp = noop.stamp_path(store_dir, recipe, selectors, offline)
        data = _read(plan_path(stamp))
        if data is None:
            continue
        done = stamp_holds(recipe, selectors, offline)
        if done is None:
            last_miss = f"stamp: {noop.last_miss}"
            continue
        if done.get("plan_token") != _token(data):
            last_miss = "the plan file is not the stamp's"
            continue
        plan = _load(data)
        if plan is None:
            last_miss = "unreadable plan file"
            continue
        from pathlib import Path

        if str(Path(recipe).resolve()) != plan["recipe"]:
            last_miss = "the recipe path resolves elsewhere"
            return None
        from mopt.plugin_index import index_holds

        if not index_holds(plan["index_dir"], tuple(plan["blocked"])):
            last_miss = "the plugin index does not hold"
            return None
        last_miss = ""
        return plan
    return None


def stamp_holds(recipe: str, selectors: list[str], offline: bool) -> dict[str, Any] | None:
    """The stamp's result if it holds, read-only: the no-op's own check with nothing learnt
    or written (a touched file whose bytes are unchanged is rehashed, not recorded)."""
    from mopt import noop

    return noop.stamp_holds(recipe, selectors, offline, learn=False)


def answer(recipe: str, selectors: list[str], as_json: bool) -> bool:
    """Print `mopt plan`'s output from the plan file if one answers (True), else False."""
    try:
        plan = lookup(recipe, selectors)
    except Exception:  # the full path runs and reports whatever this was
        return False
    if plan is None:
        return False
    nodes = plan["nodes"]
    if as_json:
        from mopt.cli import _print_json

        _print_json({"recipe": plan["recipe"], "nodes": nodes})
        return True
    from mopt.cli import plan_table

    try:
        rows = [
            (
                n["id"],
                len(n["addresses"]),
                n["kind"],
                [d for ds in n["inputs"].values() for d in ds],
                UP_TO_DATE,
                n["section"],
            )
            for n in nodes
        ]
    except (KeyError, TypeError, AttributeError):  # not the shape a build writes: the full path
        return False
    plan_table(rows)
    return True
