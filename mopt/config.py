"""Project settings from `mopt.toml` (found next to the recipe or in a parent folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mopt import tomlfile
from mopt.errors import MoptError, did_you_mean

CONFIG_NAME = "mopt.toml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreSettings(_Strict):
    path: str = Field(default=".mopt", description="store folder, relative to mopt.toml")
    build_dir: str = Field(default="build", description="where artifacts are materialized")


class RemoteSettings(_Strict):
    url: str | None = Field(default=None, description="fsspec URL: s3://bucket/prefix, file://...")
    push: bool = True
    options: dict[str, Any] = Field(
        default={}, description="fsspec storage options (e.g. endpoint_url); never credentials: use the usual env/config"
    )


class PluginSettings(_Strict):
    disable: list[str] = Field(default=[], description="plugin names not to load")


class ProjectConfig(_Strict):
    store: StoreSettings = StoreSettings()
    remote: RemoteSettings = RemoteSettings()
    executor: dict[str, Any] = Field(default={"kind": "local"}, description="[executor] kind = ...")
    plugins: PluginSettings = PluginSettings()


@dataclass
class Project:
    """Where the project lives and its settings."""

    root: Path
    config: ProjectConfig
    config_file: Path | None

    @property
    def store_dir(self) -> Path:
        return (self.root / self.config.store.path).resolve()

    @property
    def build_dir(self) -> Path:
        return (self.root / self.config.store.build_dir).resolve()


def load_project(start: Path) -> Project:
    """Settings from the nearest mopt.toml at or above `start` (defaults, rooted at `start`,
    when none)."""
    start = start.resolve()
    cfg = next((d / CONFIG_NAME for d in [start, *start.parents] if (d / CONFIG_NAME).is_file()), None)
    if cfg is None:
        return Project(start, ProjectConfig(), None)
    data, text = tomlfile.load(cfg)
    try:
        conf = ProjectConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        table = ".".join(loc[:-1])
        key = loc[-1] if loc else None
        hint = None
        if err["type"] == "extra_forbidden":
            fields: Any = ProjectConfig
            for p in loc[:-1]:
                fields = fields.model_fields[p].annotation
            hint = did_you_mean(loc[-1], getattr(fields, "model_fields", {}), "keys")
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise MoptError(
            msg,
            file=str(cfg),
            table=table,
            key=key,
            line=tomlfile.find_line(text, loc[:-1], key),
            hint=hint,
        ) from None
    return Project(cfg.parent, conf, cfg)
