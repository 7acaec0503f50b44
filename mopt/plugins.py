"""Plugin discovery and the registry of everything plugins register.

The core registers its own kinds, hardware profiles, sources and executors through the same
hooks as third parties (pytest's model). Entry points are loaded lazily, on first use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata as md
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import BaseModel

from mopt import hookspecs
from mopt.api import FORMATS, Executor, Family, HardwareProfile, Input, Source, TargetKind
from mopt.errors import PluginError, closest, did_you_mean
from mopt.family import DEFAULT_CONFIG_KEYS

#: the plugin distributions this project ships (plugins/*): first-party. The `mopt-` prefix
#: says nothing (third parties use it too, as pytest-* and datasette-* plugins do); a name
#: here is registered before every other plugin and never blamed for a clash.
FIRST_PARTY_DISTRIBUTIONS = frozenset(
    {
        "mopt-deploy",
        "mopt-image",
        "mopt-ml",
        "mopt-openvino",
        "mopt-ray",
        "mopt-report",
        "mopt-serve",
        "mopt-tensorrt",
        "mopt-torch",
    }
)


def _normalized(dist_name: str) -> str:
    """A distribution name as PEP 503 compares them (`Mopt_ML` is `mopt-ml`)."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def is_first_party(dist_name: str | None) -> bool:
    """Whether the distribution `dist_name` is one of mopt's own (FIRST_PARTY_DISTRIBUTIONS)."""
    return dist_name is not None and _normalized(dist_name) in FIRST_PARTY_DISTRIBUTIONS


@functools.cache
def _entry_points() -> list[md.EntryPoint]:
    """The `mopt` entry points in registration order: mopt's own plugin distributions
    (FIRST_PARTY_DISTRIBUTIONS) first, then the others, each by name; so a third party that
    registers a name mopt's plugins already have is the one blamed, however pip ordered them
    and whatever its distribution is called. Read once a process (each scan of the installed
    distributions costs ~7 ms)."""

    def third_party(ep: md.EntryPoint) -> bool:
        dist = getattr(ep, "dist", None)
        return not is_first_party(dist.name if dist is not None else None)

    eps = list(md.entry_points(group="mopt"))
    return sorted(eps, key=lambda ep: (third_party(ep), ep.name))


#: the core's own plugins, registered exactly like third-party ones
BUILTIN_PLUGINS = (
    "mopt.builtin.hardware",
    "mopt.builtin.families",
    "mopt.builtin.sources",
    "mopt.builtin.targets",
    "mopt.builtin.executors",
)

CATEGORIES = ("targets", "families", "hardware", "sources", "executors", "doctor_checks")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass
class PluginInfo:
    """One loaded plugin: its name, distribution and what it registered."""

    name: str
    version: str
    dist: str | None
    builtin: bool
    registered: dict[str, list[str]] = field(default_factory=dict)
    #: the core's own (`builtin`) or a distribution of FIRST_PARTY_DISTRIBUTIONS
    first_party: bool = False


@dataclass
class Registry:
    """Everything registered, by category and name, with the plugin that sent it."""

    targets: dict[str, type[TargetKind]] = field(default_factory=dict)
    families: dict[str, type[Family]] = field(default_factory=dict)
    hardware: dict[str, HardwareProfile] = field(default_factory=dict)
    sources: dict[str, type[Source]] = field(default_factory=dict)
    executors: dict[str, type[Executor]] = field(default_factory=dict)
    doctor_checks: dict[str, Callable[[Any], list[dict[str, str]]]] = field(default_factory=dict)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    disabled: list[str] = field(default_factory=list)
    #: disabled plugin name → what disabled it ("MOPT_DISABLE_PLUGINS" or "[plugins] disable")
    disabled_by: dict[str, str] = field(default_factory=dict)
    #: problems that do not stop mopt (undecorated hook functions, unknown disabled names)
    warnings: list[str] = field(default_factory=list)

    def plugin_of(self, category: str, name: str) -> PluginInfo:
        """The plugin that registered `name` in `category`."""
        return self.plugins[self.origin[(category, name)]]

    def disabled_provider(self, category: str, name: str) -> str | None:
        """The disabled plugin that would register `name` in `category`, or None. Only asked
        when a recipe names something unknown (an error): the disabled plugins are then
        imported and their hooks called with a throwaway `register`."""
        return _offers_of(self.disabled).get((category, name)) if self.disabled else None


#: a category's name in messages
SINGULAR = {
    "targets": "target kind",
    "families": "model family",
    "hardware": "hardware profile",
    "sources": "source",
    "executors": "executor",
    "doctor_checks": "doctor check",
}


def disabled_from_env() -> list[str]:
    """Plugin names listed in MOPT_DISABLE_PLUGINS (comma separated)."""
    raw = os.environ.get("MOPT_DISABLE_PLUGINS", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def make_plugin_manager(disable: Iterable[str] = (), only: Iterable[str] | None = None) -> pluggy.PluginManager:
    """A plugin manager with the built-ins and installed entry points, minus `disable` (and,
    with `only`, the entry points not named there)."""
    pm = pluggy.PluginManager("mopt")
    pm.add_hookspecs(hookspecs)
    blocked = set(disable)
    for modname in BUILTIN_PLUGINS:
        if modname in blocked:
            continue
        pm.register(importlib.import_module(modname), name=modname)
    for ep in _entry_points():
        if ep.name in blocked or pm.get_plugin(ep.name) is not None or (only is not None and ep.name not in only):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not look like a mopt crash
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to import: {_one_line(exc)}",
                hint=f"fix or uninstall it, or disable it with MOPT_DISABLE_PLUGINS={ep.name}",
            ) from exc
        check_hook_names(plugin, ep.name)
        pm.register(plugin, name=ep.name)
    return pm


HOOK_NAMES = tuple(sorted(n for n in dir(hookspecs) if n.startswith("mopt_")))


def check_hook_names(plugin: Any, name: str) -> list[str]:
    """Refuse a plugin whose @hookimpl function names no hook (with the closest hook name;
    pluggy's own check_pending says it with the module's repr twice and no hint). Returns
    warnings for hook-like functions without @hookimpl: mopt never calls them, which is never
    what their author meant."""
    warnings = []
    for attr in dir(plugin):
        fn = getattr(plugin, attr, None)
        if not callable(fn):
            continue
        if getattr(fn, "mopt_impl", None) is None:
            if attr.startswith("mopt_register_") or attr in HOOK_NAMES:
                warnings.append(
                    f"plugin {name!r}: function {attr} is not decorated with @hookimpl, so mopt never "
                    "calls it (from mopt.api import hookimpl)"
                )
        elif attr not in HOOK_NAMES:
            best = closest(attr, HOOK_NAMES)
            raise PluginError(
                f"plugin {name!r} implements an unknown hook {attr!r}",
                hint=(f"did you mean {best!r}? " if best else "")
                + "the hooks are listed in mopt/hookspecs.py",
            )
    return warnings


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (pydantic errors: the first error's message)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        e = exc.errors()[0]
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        text = f"invalid {exc.title}: {loc + ': ' if loc else ''}{msg}"
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _version_of(name: str) -> tuple[str | None, str]:
    """(distribution, version) of a loaded plugin; (None, "0") for one registered by hand."""
    if name.startswith("mopt."):
        from mopt import __version__

        return "mopt", __version__
    ep = next((ep for ep in _entry_points() if ep.name == name), None)
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else (None, "0")


def build_registry(pm: pluggy.PluginManager, disabled: Iterable[str] = ()) -> Registry:
    """Call every registration hook, plugin by plugin, validating each registration."""
    reg = Registry(disabled=list(disabled))
    for name, plugin in pm.list_name_plugin():
        reg.warnings += check_hook_names(plugin, name)
        dist, version = _version_of(name)
        reg.plugins[name] = PluginInfo(
            name=name,
            version=version,
            dist=dist,
            builtin=name.startswith("mopt.builtin"),
            registered={c: [] for c in CATEGORIES},
            first_party=name.startswith("mopt.builtin") or is_first_party(dist),
        )
    for category in CATEGORIES:
        hook = getattr(pm.hook, f"mopt_register_{category}")
        for impl in hook.get_hookimpls():  # registration order: the core first
            _call(impl, f"mopt_register_{category}", register=_registrar(reg, category, impl.plugin_name))
    return reg


def _call(impl: pluggy.HookImpl, hook: str, **args: Any) -> None:
    """Call one plugin's hook with the arguments it names; its own bug is one line naming it."""
    try:
        impl.function(**{a: args[a] for a in impl.argnames})
    except PluginError:
        raise
    except Exception as exc:  # not a traceback
        raise PluginError(
            f"plugin {impl.plugin_name!r} failed in hook {hook}: {_one_line(exc)}",
            hint=f"fix the plugin, or disable it with MOPT_DISABLE_PLUGINS={impl.plugin_name}",
        ) from exc


def register_commands(cli: Any, core: Any, disable: Iterable[str] = ()) -> None:
    """Call every plugin's `mopt_register_commands(cli, core)`, in registration order; the
    plugins in `disable` or MOPT_DISABLE_PLUGINS add none. A plugin may not replace a
    command that is already there (the core's own are all there before)."""
    pm = make_plugin_manager(sorted(set(disable) | set(disabled_from_env())))
    for impl in pm.hook.mopt_register_commands.get_hookimpls():
        before = dict(cli.commands)
        _call(impl, "mopt_register_commands", cli=cli, core=core)
        replaced = sorted(n for n, c in before.items() if cli.commands.get(n) is not c)
        if replaced:
            raise PluginError(
                f"plugin {impl.plugin_name!r} replaces the command {replaced[0]!r}",
                hint=f"rename its command, or disable it with MOPT_DISABLE_PLUGINS={impl.plugin_name}",
            )


def _offers_of(names: Iterable[str]) -> dict[tuple[str, str], str]:
    """(category, name) → plugin, for what the plugins `names` would register."""
    wanted = set(names)
    loaders: list[tuple[str, Callable[[], Any]]] = [
        (m, functools.partial(importlib.import_module, m)) for m in BUILTIN_PLUGINS
    ]
    loaders += [(ep.name, ep.load) for ep in _entry_points()]
    offers: dict[tuple[str, str], str] = {}
    for plugin_name, load in loaders:
        if plugin_name not in wanted:
            continue
        try:
            plugin = load()
        except Exception:  # a plugin that fails to load offers nothing
            continue
        for category in CATEGORIES:
            found: list[Any] = []
            with contextlib.suppress(Exception):  # nor does a hook that fails
                getattr(plugin, f"mopt_register_{category}")(register=found.append)
            for obj in found:
                if isinstance(getattr(obj, "name", None), str):
                    offers.setdefault((category, obj.name), plugin_name)
    return offers


def _registrar(reg: Registry, category: str, plugin: str) -> Callable[[Any], None]:
    validators: dict[str, Callable[[Any, str], str]] = {
        "targets": _check_kind,
        "families": _check_family,
        "hardware": _check_hardware,
        "sources": _check_source,
        "executors": _check_executor,
        "doctor_checks": _check_doctor,
    }

    def register(obj: Any) -> None:
        name = validators[category](obj, plugin)
        table: dict[str, Any] = getattr(reg, category)
        if name in table:
            other = reg.origin[(category, name)]
            raise _clash(reg, category, name, plugin, other)
        table[name] = obj
        reg.origin[(category, name)] = plugin
        reg.plugins[plugin].registered[category].append(name)

    return register


def _clash(reg: Registry, category: str, name: str, plugin: str, other: str) -> PluginError:
    """Two plugins register `name`: the third-party one is blamed, and its fix given (never
    "disable" a first-party plugin: that takes all its kinds away); of two third parties, the
    later. First-party plugins register first, so the later one is the third party's anyway
    unless a plugin was registered by hand."""
    first = reg.plugins.get(plugin)
    if first is not None and first.first_party and not reg.plugins[other].first_party:
        return PluginError(
            f"plugin {_described(reg, other)} registers {SINGULAR[category]} {name!r}, which "
            f"plugin {_described(reg, plugin)} (mopt's own) registers too",
            hint=f"rename it in {other!r}, or disable {other!r} with MOPT_DISABLE_PLUGINS={other}",
        )
    return PluginError(
        f"plugin {_described(reg, plugin)} registers {SINGULAR[category]} {name!r}, already "
        f"registered by plugin {_described(reg, other)}",
        hint=f"rename it in {plugin!r}, or disable {plugin!r} with MOPT_DISABLE_PLUGINS={plugin}",
    )


def _described(reg: Registry, plugin: str) -> str:
    """`'ml' (mopt-ml 0.2.0)`: the plugin and its distribution."""
    info = reg.plugins.get(plugin)
    if info is None or info.dist is None:
        return repr(plugin)
    return f"{plugin!r} ({info.dist} {info.version})"


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
    clash = {"kind", "input"} & set(obj.Params.model_fields)  # what every target table may hold
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
    for fmt in (obj.produces, *(f for slot in obj.consumes for f in slot.formats)):
        if fmt and fmt not in FORMATS:  # a misspelled format would feed nothing, silently
            raise _bad(plugin, f"target kind {name!r} names an unknown artifact format {fmt!r}",
                       "a new one is added to mopt.api.FORMATS first; " + did_you_mean(fmt, FORMATS, "formats"))
    return name


def _check_family(obj: Any, plugin: str) -> str:
    if not (inspect.isclass(obj) and issubclass(obj, Family)):
        raise _bad(plugin, f"registered family {obj!r} is not a mopt.api.Family subclass")
    if obj.pooling not in ("last-token", "mean", "cls"):
        raise _bad(plugin, f"family {obj.__name__}.pooling must be last-token, mean or cls")
    for dim in obj.config_keys:
        if dim not in DEFAULT_CONFIG_KEYS:
            raise _bad(plugin, f"family {obj.__name__}.config_keys names {dim!r}, which is no dimension mopt reads",
                       did_you_mean(dim, DEFAULT_CONFIG_KEYS, "dimensions"))
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


def _check_doctor(obj: Any, plugin: str) -> str:
    if not callable(obj):
        raise _bad(plugin, f"registered doctor check {obj!r} is not a function of the machine")
    return _check_name(getattr(obj, "__name__", "").replace("_", "-"), plugin, "doctor check")


_REGISTRY: dict[Any, Registry] = {}


def get_registry(disable: Iterable[str] = (), only: Iterable[str] | None = None) -> Registry:
    """The registry for this process, loaded on first use (idempotent per disable list).
    `disable` is the project's `[plugins] disable`; MOPT_DISABLE_PLUGINS adds to it. With
    `only`, just the built-ins and those plugins are loaded (the ones a recipe's last build
    used, per its build log: see `mopt.cli.Session`). Warnings (undecorated hooks, disabled
    names that are no plugin) go to stderr once."""
    from_env = disabled_from_env()
    blocked = tuple(sorted(set(disable) | set(from_env)))
    some = None if only is None else frozenset(only)
    if (blocked, None) in _REGISTRY:  # every plugin: it serves every caller
        return _REGISTRY[(blocked, None)]
    if (blocked, some) not in _REGISTRY:
        reg = _REGISTRY[(blocked, some)] = build_registry(make_plugin_manager(blocked, some), blocked)
        known = [*BUILTIN_PLUGINS, *(ep.name for ep in _entry_points())]
        for name in blocked:
            source = reg.disabled_by[name] = "MOPT_DISABLE_PLUGINS" if name in from_env else "[plugins] disable"
            if name not in known:
                reg.warnings.append(
                    f"{source} names {name!r}, which is no installed plugin ("
                    + did_you_mean(name, known, "plugins")
                    + ")"
                )
        for w in reg.warnings:
            sys.stderr.write(f"warning: {w}\n")
    return _REGISTRY[(blocked, some)]
