"""The body of a Ray task: run one action on a worker, through the remote cache.

Runs in a Ray worker process. It opens the worker's own local store (`worker_store`, a
path on the worker machine), reads the action's inputs from the remote cache by digest
(each blob re-hashed on arrival), runs the kind (`mopt_ray.action.run_action`), pushes the
outputs (blobs first, entry last) and returns the action entry as JSON. A worker killed
mid-action leaves only a scratch folder under the worker store's tmp/ (swept later) and,
at most, some content-addressed blobs on the remote: never an entry.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from mopt_ray.action import ActionResult, ActionSpec, run_action


def execute(spec_json: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the action `spec_json` (an `ActionSpec`) with the worker settings `cfg`.

    `cfg`: `worker_store` (path, `~` expanded here), `remote` (`RemoteCache.connection()`),
    `disable_plugins` (names). Returns `ActionResult.to_json()`.
    """
    from mopt.plugins import get_registry
    from mopt.remote import RemoteCache, RemoteError
    from mopt.store import Store, StoreError

    spec = ActionSpec.model_validate_json(spec_json)
    host = socket.gethostname()
    store = Store(Path(os.path.expanduser(cfg["worker_store"])))
    try:
        conn = cfg["remote"]
        remote = RemoteCache(conn["url"], store, push=True, options=conn.get("options") or {})
        # Built meanwhile by someone else (another driver, an earlier attempt)?
        entry = remote.fetch_entry(spec.key, verify=True)
        if entry is not None:
            return ActionResult("cached", entry=entry, host=host).to_json()
        registry = get_registry(cfg.get("disable_plugins") or ())
        try:
            result = run_action(
                spec,
                store,
                registry,
                fetch_tree=remote.fetch_tree,
                fetch_blob=remote.fetch_blob,
            )
        except (RemoteError, StoreError) as exc:
            return ActionResult("failed", reason=f"fetching inputs on {host}: {exc}", host=host).to_json()
        if result.entry is not None and result.status in ("built", "cached"):
            try:
                remote.push(spec.key, result.entry)
            except (RemoteError, StoreError) as exc:
                return ActionResult(
                    "failed", reason=f"built on {host}, but pushing the outputs failed: {exc}", host=host
                ).to_json()
        return result.to_json()
    finally:
        store.close()
