"""The build context: the Dockerfile and copies of the input artifacts, laid out so that two
builds of the same inputs see the same bytes, modes and times (sorted, 0644/0755, mtime 0)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopt.api import MODE_EXEC, MODE_FILE, TreeEntry, hash_tree, iter_files, mode_of
from mopt_image.templates import ServeSpec

#: the time every file and folder of the context carries (SOURCE_DATE_EPOCH=0)
EPOCH = 0


@dataclass(frozen=True)
class BuildContextInfo:
    path: Path
    digest: str  # BLAKE3 tree digest, as mopt digests any folder
    entries: tuple[TreeEntry, ...]

    def manifest(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "files": [[e.path, oct(e.mode), e.size, e.digest] for e in self.entries],
        }


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy the regular files of `src` (mopt artifacts hold nothing else) under `dest`.

    Copies, never hard links: the inputs are read-only store files, and the context's
    modes and times are about to be rewritten."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel, abs_, st in iter_files(src):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(abs_, target)
        os.chmod(target, MODE_EXEC if mode_of(st.st_mode) == MODE_EXEC else MODE_FILE)


def _fix_times_and_modes(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            os.utime(p, (EPOCH, EPOCH), follow_symlinks=False)
        for name in dirnames:
            p = os.path.join(dirpath, name)
            os.chmod(p, 0o755)
            os.utime(p, (EPOCH, EPOCH), follow_symlinks=False)
    os.chmod(root, 0o755)
    os.utime(root, (EPOCH, EPOCH))


def assemble(path: Path, spec: ServeSpec, dockerfile: str) -> BuildContextInfo:
    """Write the build context for `spec` into the (new) folder `path`."""
    path.mkdir(parents=True)
    seen: set[str] = set()
    for c in spec.copies:
        if c.context_dir in seen:
            raise ValueError(f"two inputs would be copied to {c.context_dir!r} of the build context")
        seen.add(c.context_dir)
        _copy_tree(c.src, path / c.context_dir)
    df = path / "Dockerfile"
    df.write_text(dockerfile, encoding="utf-8")
    os.chmod(df, MODE_FILE)
    _fix_times_and_modes(path)
    digest, entries = hash_tree(path)
    return BuildContextInfo(path, digest, tuple(entries))
