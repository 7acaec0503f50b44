"""TensorRT timing caches kept outside the action's output, shared by every engine build.

A timing cache is valid for one GPU model, TensorRT version, CUDA version and hardware-
compatibility level, so its file name is derived from exactly those; it is independent of
the engine's params, and every build of this machine reads it and merges what it learnt
back (under an fcntl lock, so parallel builds do not lose each other's entries).

Where it lives: `BuildContext.cache_dir` when the core provides one (proposed), else
`$MOPT_CACHE_DIR`, else the action's scratch folder (not persisted; the log says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUBDIR = "tensorrt-timing"


def cache_root(ctx: Any) -> tuple[Path, bool]:
    """(folder for timing caches, whether it persists beyond this action)."""
    core = getattr(ctx, "cache_dir", None)
    if core:
        return Path(core) / SUBDIR, True
    env = os.environ.get("MOPT_CACHE_DIR")
    if env:
        return Path(env) / SUBDIR, True
    return Path(ctx.tmp) / SUBDIR, False


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-").lower()


def cache_file_name(facts: dict[str, str], hardware_compatibility: str) -> str:
    """`trt-10.13.3.9_cuda-12.9_nvidia-h200_sm90_hwc-none.cache` from the build facts."""
    cc = facts.get("compute_capability", "unknown").replace(".", "")
    return (
        f"trt-{_slug(facts.get('tensorrt', 'unknown'))}_cuda-{_slug(facts.get('cuda', 'unknown'))}_"
        f"{_slug(facts.get('gpu', 'unknown'))}_sm{cc}_hwc-{_slug(hardware_compatibility)}.cache"
    )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on `<path>.lock` for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def read(path: Path) -> bytes:
    """The cache's bytes, or b"" when there is none yet."""
    with locked(path):
        return path.read_bytes() if path.is_file() else b""


def merge_and_write(path: Path, config: Any, log: Any) -> int:
    """Merge the builder config's timing cache into the file at `path` (atomically);
    returns the number of bytes written."""
    ours = config.get_timing_cache()
    with locked(path):
        if path.is_file():
            on_disk = config.create_timing_cache(path.read_bytes())
            # entries another build wrote since we read the file are kept
            if not on_disk.combine(ours, False):
                log("timing cache on disk did not match this build; replacing it")
                on_disk = ours
            blob = bytes(memoryview(on_disk.serialize()))
        else:
            blob = bytes(memoryview(ours.serialize()))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(blob)
