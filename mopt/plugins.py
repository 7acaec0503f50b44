"""Plugin discovery and the registry of everything plugins register.

The core registers its own kinds, hardware profiles, sources and executors through the same
hooks as third parties (pytest's model). Entry points are loaded lazily, on first use.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import BaseModel

from mopt import hookspecs
from mopt.api import (
    RESERVED_TARGET_KEYS,
    Executor,
    Family,
    HardwareProfile,
    Input,
    Source,
    TargetKind,
)
from mopt.errors import PluginError

ENTRY_POINT_GROUP = "mopt"

#: the core's own plugins, registered exactly like third-party ones
BUILTIN_PLUGINS = (
    "mopt.builtin.hardware",
    "mopt.builtin.families",
    "mopt.builtin.sources",
    "mopt.builtin.targets",
    "mopt.builtin.executors",
)

CATEGORIES = ("targets", "families", "hardware", "sources", "executors")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass
class PluginInfo:
    """One loaded plugin: its name, distribution and what it registered."""

    name: str
    version: str
    dist: str | None
    builtin: bool
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Registry:
    """Everything registered, by category and name, with the plugin that sent it."""

    targets: dict[str, type[TargetKind]] = field(default_factory=dict)
    families: dict[str, type[Family]] = field(default_factory=dict)
    hardware: dict[str, HardwareProfile] = field(default_factory=dict)
    sources: dict[str, type[Source]] = field(default_factory=dict)
    executors: dict[str, type[Executor]] = field(default_factory=dict)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    disabled: list[str] = field(default_factory=list)

    def plugin_of(self, category: str, name: str) -> PluginInfo:
        """The plugin that registered `name` in `category`."""
        return self.plugins[self.origin[(category, name)]]

    def kind(self, name: str) -> type[TargetKind]:
        return self.targets[name]


def disabled_from_env() -> list[str]:
    """Plugin names listed in MOPT_DISABLE_PLUGINS (comma separated)."""
    raw = os.environ.get("MOPT_DISABLE_PLUGINS", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def make_plugin_manager(disable: Iterable[str] = ()) -> pluggy.PluginManager:
    """A plugin manager with the built-ins and installed entry points, minus `disable`."""
    pm = pluggy.PluginManager("mopt")
    pm.add_hookspecs(hookspecs)
    blocked = set(disable)
    for name in blocked:
        pm.set_blocked(name)
    for modname in BUILTIN_PLUGINS:
        if modname in blocked:
            continue
        pm.register(importlib.import_module(modname), name=modname)
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in blocked or pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not look like a mopt crash
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}",
                hint=f"fix or uninstall it, or disable it with MOPT_DISABLE_PLUGINS={ep.name}",
            ) from exc
        pm.register(plugin, name=ep.name)
        dist = getattr(ep, "dist", None)
        if dist is not None:
            pm._mopt_dists = getattr(pm, "_mopt_dists", {})  # type: ignore[attr-defined]
            pm._mopt_dists[ep.name] = (dist.name, dist.version)  # type: ignore[attr-defined]
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"plugin {exc.plugin!r} implements an unknown hook: {exc}",
            hint="hooks are listed in mopt/hookspecs.py",
        ) from exc
    return pm


def _version_of(pm: pluggy.PluginManager, name: str) -> tuple[str | None, str]:
    dists: dict[str, tuple[str, str]] = getattr(pm, "_mopt_dists", {})
    if name in dists:
        return dists[name]
    if name.startswith("mopt."):
        from mopt import __version__

        return "mopt", __version__
    return None, "0"


def build_registry(pm: pluggy.PluginManager, disabled: Iterable[str] = ()) -> Registry:
    """Call every registration hook, plugin by plugin, validating each registration."""
    reg = Registry(disabled=list(disabled))
    for name, plugin in pm.list_name_plugin():
        if name is None or plugin is None:  # blocked (disabled) names stay listed with None
            continue
        dist, version = _version_of(pm, name)
        reg.plugins[name] = PluginInfo(
            name=name,
            version=version,
            dist=dist,
            builtin=name.startswith("mopt.builtin"),
            registered={c: [] for c in CATEGORIES},
        )
    for category in CATEGORIES:
        hook = getattr(pm.hook, f"mopt_register_{category}")
        for impl in hook.get_hookimpls():  # registration order: the core first
            plugin_name = impl.plugin_name
            impl.function(register=_registrar(reg, category, plugin_name))
    return reg


def _registrar(reg: Registry, category: str, plugin: str) -> Callable[[Any], None]:
    validators: dict[str, Callable[[Any, str], str]] = {
        "targets": _check_kind,
        "families": _check_family,
        "hardware": _check_hardware,
        "sources": _check_source,
        "executors": _check_executor,
    }

    def register(obj: Any) -> None:
        name = validators[category](obj, plugin)
        table: dict[str, Any] = getattr(reg, category)
        if name in table:
            other = reg.origin[(category, name)]
            raise PluginError(
                f"plugin {plugin!r} registers {category[:-1] if category != 'hardware' else 'hardware profile'} "
                f"{name!r}, already registered by plugin {other!r}",
                hint=f"rename one, or disable one with MOPT_DISABLE_PLUGINS={plugin}",
            )
        table[name] = obj
        reg.origin[(category, name)] = plugin
        reg.plugins[plugin].registered[category].append(name)

    return register


def _bad(plugin: str, what: str, hint: str | None = None) -> PluginError:
    return PluginError(f"plugin {plugin!r}: {what}", hint=hint)


def _check_name(name: Any, plugin: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise _bad(
            plugin,
            f"{what} name {name!r} is invalid",
            "names are lower-case letters, digits, '-' and '_', starting with a letter",
        )
    return name


def _check_params_model(model: Any, plugin: str, owner: str, attr: str) -> None:
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise _bad(plugin, f"{owner}.{attr} must be a pydantic BaseModel subclass, got {model!r}")
    if model.model_config.get("extra") != "forbid":
        raise _bad(
            plugin,
            f"{owner}.{attr} must forbid unknown keys",
            "subclass mopt.api.Params, or set model_config = ConfigDict(extra='forbid')",
        )


def _check_kind(obj: Any, plugin: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, TargetKind)):
        raise _bad(plugin, f"registered target {obj!r} is not a mopt.api.TargetKind subclass")
    name = _check_name(getattr(obj, "name", None), plugin, "target kind")
    _check_params_model(obj.Params, plugin, obj.__name__, "Params")
    clash = RESERVED_TARGET_KEYS & set(obj.Params.model_fields)
    if clash:
        raise _bad(plugin, f"{obj.__name__}.Params uses reserved key(s) {sorted(clash)}")
    if not isinstance(obj.version, str) or not obj.version:
        raise _bad(plugin, f"{obj.__name__}.version must be a non-empty string")
    for slot in obj.consumes:
        if not isinstance(slot, Input):
            raise _bad(plugin, f"{obj.__name__}.consumes must hold mopt.api.Input, got {slot!r}")
        if slot.partial and not slot.gather:
            raise _bad(plugin, f"{obj.__name__}.consumes: slot {slot.name!r} is partial without gather")
        if slot.gather and slot.fanout:
            raise _bad(plugin, f"{obj.__name__}.consumes: slot {slot.name!r} cannot both gather and fan out")
    if "run" not in {k for c in obj.__mro__[:-1] if c is not TargetKind for k in vars(c)}:
        raise _bad(plugin, f"target kind {name!r} ({obj.__name__}) does not implement run()")
    return name


def _check_family(obj: Any, plugin: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, Family)):
        raise _bad(plugin, f"registered family {obj!r} is not a mopt.api.Family subclass")
    if obj.pooling not in ("last-token", "mean", "cls"):
        raise _bad(plugin, f"family {obj.__name__}.pooling must be last-token, mean or cls")
    return _check_name(getattr(obj, "name", None), plugin, "family")


def _check_hardware(obj: Any, plugin: str) -> str:
    if not isinstance(obj, HardwareProfile):
        raise _bad(plugin, f"registered hardware {obj!r} is not a mopt.api.HardwareProfile")
    if obj.is_gpu and (obj.compute_capability is None or obj.memory_gb is None):
        raise _bad(plugin, f"GPU profile {obj.name!r} needs compute_capability and memory_gb")
    return _check_name(obj.name, plugin, "hardware profile")


def _check_source(obj: Any, plugin: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, Source)):
        raise _bad(plugin, f"registered source {obj!r} is not a mopt.api.Source subclass")
    name = _check_name(getattr(obj, "name", None), plugin, "source")
    _check_params_model(getattr(obj, "Params", None), plugin, obj.__name__, "Params")
    if name not in obj.Params.model_fields:
        raise _bad(plugin, f"source {name!r}: {obj.__name__}.Params needs a field named {name!r}")
    return name


def _check_executor(obj: Any, plugin: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, Executor)):
        raise _bad(plugin, f"registered executor {obj!r} is not a mopt.api.Executor subclass")
    _check_params_model(obj.Settings, plugin, obj.__name__, "Settings")
    return _check_name(getattr(obj, "name", None), plugin, "executor")


_REGISTRY: dict[tuple[str, ...], Registry] = {}


def get_registry(disable: Iterable[str] = ()) -> Registry:
    """The registry for this process, loaded on first use (idempotent per disable list)."""
    blocked = tuple(sorted(set(disable) | set(disabled_from_env())))
    if blocked not in _REGISTRY:
        _REGISTRY[blocked] = build_registry(make_plugin_manager(blocked), blocked)
    return _REGISTRY[blocked]


def reset_registry() -> None:
    """Forget loaded plugins (tests)."""
    _REGISTRY.clear()
