"""Recipes: load TOML (with `extends`), merge the layers, validate, expand sweeps.

Resolution order for a target's params, highest first: the target table → the build
section → `[defaults]` → extended files → the kind's own defaults. Tables deep-merge;
scalars and arrays replace. Every error names the file, the table and the key.
"""

from __future__ import annotations

import itertools
import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mopt import tomlfile
from mopt.errors import MoptError, closest, did_you_mean
from mopt.plugins import SINGULAR, Registry

SCHEMA_VERSION = 1
RESERVED_TOP = ("schema", "extends", "models", "defaults")
SECTION_KEYS = ("hardware", "targets", "description", "sweep")
DEFAULTS_KEYS = ("targets",)
#: model, section and target names become folder names (build/<model>/<section>/<target>):
#: one path component each, of characters every filesystem and shell takes as they are
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
#: a variant label (`name@param=value,...`) is also one folder name
_MAX_LABEL_BYTES = 255


def check_name(name: object) -> str | None:
    """Why `name` cannot be a model, section or target name (None if it can)."""
    if not isinstance(name, str) or not name:
        return "a name must be a non-empty string"
    if "\0" in name:
        return f"{name!r} contains a NUL character"
    if _NAME_RE.fullmatch(name) is None:
        return (
            f"{name!r} is not a safe name: it becomes a folder under build/, so use 1-128 letters, "
            "digits, '.', '_' or '-', not starting with '.' (no '/', spaces or '..')"
        )
    return None


# --------------------------------------------------------------------------- results


class ModelSpec(BaseModel):
    """`[models.<name>]`: what the model is and where its checkpoint comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str = Field(default="generic", description="a model-family plugin: qwen3, bert, ...")
    task: str = Field(default="embedding", description="embedding, ...")
    source: dict[str, Any] | None = Field(
        default=None, description="{ hf = ..., revision = ... } | { path = ... } | ... (kinds that read it need it)"
    )
    config: str | None = Field(
        default=None,
        description="a config.json used by `mopt check` when the checkpoint is not local",
    )
    description: str = ""


@dataclass(slots=True)
class Where:
    """Where a value was written; its line is looked up only when an error needs it."""

    file: str
    table: str
    locate: Callable[[], int | None] = field(repr=False)

    @property
    def line(self) -> int | None:
        return self.locate()

    def error(self, message: str, key: str | None = None, hint: str | None = None) -> MoptError:
        return MoptError(message, file=self.file, table=self.table, key=key, line=self.line, hint=hint)


@dataclass
class Model:
    name: str
    spec: ModelSpec
    source_kind: str
    source_params: Any
    config_path: Path | None
    where: Where
    base_dir: Path  # folder of the file that declared the source: relative paths start here


@dataclass
class Target:
    """One target of a section, after merging and validation (one per sweep variant)."""

    name: str
    kind: str
    params: Any
    inputs: list[str] | None
    variant: tuple[tuple[str, Any], ...]
    where: Where
    input_where: Where | None = None

    @property
    def label(self) -> str:
        """`trt-engine` or `trt-engine@max_batch_size=64,opt_level=2`."""
        return _label(self.name, self.variant)


def _label(name: str, variant: tuple[tuple[str, Any], ...]) -> str:
    if not variant:
        return name
    return name + "@" + ",".join(f"{k}={fmt_value(v)}" for k, v in variant)


@dataclass
class Section:
    """A `[<model>.<hardware>]` build section."""

    model: str
    key: str
    hardware: str
    targets: list[Target]
    description: str
    where: Where

    @property
    def id(self) -> str:
        return f"{self.model}.{self.key}"


@dataclass
class Recipe:
    path: Path
    files: list[Path]
    models: dict[str, Model]
    sections: list[Section]

    @property
    def project_dir(self) -> Path:
        return self.path.parent


def fmt_value(v: Any) -> str:
    """A readable, stable rendering of a sweep value for variant ids."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


# --------------------------------------------------------------------------- loading


@dataclass
class _File:
    path: Path
    shown: str
    text: str
    data: dict[str, Any]

    def where(self, table: list[str], key: str | None = None) -> Where:
        return Where(self.shown, ".".join(table), lambda: tomlfile.find_line(self.text, table, key))

    def error(self, msg: str, table: list[str], key: str | None = None, hint: str | None = None) -> MoptError:
        return self.where(table, key).error(msg, key, hint)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _load_chain(path: Path, stack: list[Path], seen: dict[Path, _File], out: list[_File]) -> None:
    """Append `path`'s extended files (depth first), then `path` itself, lowest first."""
    path = path.resolve()
    if path in stack:
        cycle = " → ".join(_display(p) for p in stack[stack.index(path) :] + [path])
        raise MoptError(f"extends cycle: {cycle}", file=_display(stack[-1]), key="extends")
    if path in seen:
        return
    data, text = tomlfile.load(path, _display(path))
    f = _File(path, _display(path), text, data)
    ext = data.get("extends", [])
    if isinstance(ext, str):
        ext = [ext]
    if not isinstance(ext, list) or not all(isinstance(e, str) for e in ext):
        raise f.error("must be a list of file paths", [], "extends")
    for rel in ext:
        target = (path.parent / rel).resolve()
        if not target.is_file():
            raise f.error(
                f"extended file {rel!r} not found (looked at {_display(target)})",
                [],
                "extends",
                hint="paths are relative to the file that declares them",
            )
        _load_chain(target, stack + [path], seen, out)
    seen[path] = f
    out.append(f)


def _is_table(v: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(v, dict)


def load_recipe(path: str | Path, registry: Registry) -> Recipe:
    """Load, merge and validate a recipe; raise `MoptError` on any problem."""
    path = Path(path)
    if not path.exists():
        raise MoptError("recipe not found", file=str(path), hint="give the path to a .toml recipe")
    chain: list[_File] = []
    _load_chain(path, [], {}, chain)
    _check_top_level(chain)
    models = _merge_models(chain, registry)
    sections = _collect_sections(chain, models, registry)
    return Recipe(chain[-1].path, [f.path for f in chain], models, sections)


def _check_top_level(chain: list[_File]) -> None:
    root = chain[-1]
    schema = root.data.get("schema")
    if schema is None:
        raise root.error(f"missing `schema = {SCHEMA_VERSION}`", [], "schema", hint="add it at the top")
    for f in chain:
        s = f.data.get("schema", SCHEMA_VERSION)
        if s != SCHEMA_VERSION or isinstance(s, bool):
            raise f.error(
                f"unsupported schema {s!r}",
                [],
                "schema",
                hint=f"this mopt reads schema = {SCHEMA_VERSION}",
            )
        for key, value in f.data.items():
            if key in RESERVED_TOP:
                if key in ("models", "defaults") and not _is_table(value):
                    raise f.error("must be a table", [], key)
                continue
            if not _is_table(value):
                raise f.error(
                    "unknown top-level key",
                    [],
                    key,
                    hint=did_you_mean(key, RESERVED_TOP, "top-level keys")
                    + "; build sections are tables: [<model>.<hardware>]",
                )


def _merge_models(chain: list[_File], registry: Registry) -> dict[str, Model]:
    merged: dict[str, dict[str, Any]] = {}
    decl: dict[str, _File] = {}
    for f in chain:
        for name, body in f.data.get("models", {}).items():
            if bad := check_name(name):
                raise f.error(bad, ["models"], name, hint="rename the model")
            if name in RESERVED_TOP:
                raise f.error(
                    f"{name!r} is a reserved name and cannot be a model",
                    ["models", name],
                    hint=f"reserved: {', '.join(RESERVED_TOP)}; rename the model",
                )
            if not _is_table(body):
                raise f.error("a model must be a table", ["models"], name)
            merged[name] = _deep_merge(merged.get(name, {}), body)
            decl[name] = f
    models: dict[str, Model] = {}
    for name, body in merged.items():
        f = decl[name]
        table = ["models", name]
        try:
            spec = ModelSpec.model_validate_json(json.dumps(body, default=str), strict=True)
        except ValidationError as exc:
            raise _pydantic_error(exc, f, table, ModelSpec) from None
        if spec.family not in registry.families:
            msg, hint = _unknown(registry, "families", spec.family, "; families come from plugins (`mopt plugins`)")
            raise f.error(msg, table, "family", hint)
        kind, params = _validate_source(spec.source, f, table, registry) if spec.source is not None else ("", None)
        cfg = (f.path.parent / spec.config).resolve() if spec.config else None
        if cfg is not None and not cfg.is_file():
            raise f.error(f"config file {spec.config!r} not found", table, "config")
        src_file = next((g for g in reversed(chain) if "source" in g.data.get("models", {}).get(name, {})), f)
        models[name] = Model(name, spec, kind, params, cfg, f.where(table), src_file.path.parent)
    return models


def _unknown(registry: Registry, category: str, name: Any, tail: str) -> tuple[str, str]:
    """The message and hint for `name`, which no plugin in use registers in `category`:
    how to enable the disabled plugin that does, else the closest names."""
    plugin = registry.disabled_provider(category, name) if isinstance(name, str) else None
    if plugin is not None:
        where = registry.disabled_by.get(plugin, "MOPT_DISABLE_PLUGINS")
        return f"{SINGULAR[category]} {name!r} is disabled by {where} (plugin {plugin!r})", f"remove {plugin!r} from {where} to use it"
    plural = {"targets": "target kinds", "hardware": "profiles"}.get(category, category)
    hint = did_you_mean(str(name), getattr(registry, category), plural) + tail
    return f"unknown {SINGULAR[category]} {name!r}", hint


def _validate_source(src: dict[str, Any], f: _File, table: list[str], registry: Registry) -> tuple[str, Any]:
    names = [k for k in src if k in registry.sources]
    if len(names) != 1:
        given = ", ".join(sorted(src)) or "nothing"
        unknown = [k for k in src if k not in registry.sources]
        hint = "one of: " + ", ".join(f"{{ {n} = ... }}" for n in sorted(registry.sources))
        if not names and unknown:
            best = closest(unknown[0], registry.sources)
            if best:
                hint = f"did you mean {best!r}?"
        raise f.error(
            f"a source names exactly one source kind, got {given}",
            table,
            "source",
            hint=hint,
        )
    kind = names[0]
    cls = registry.sources[kind]
    try:
        return kind, cls.Params.model_validate_json(json.dumps(src, default=str), strict=True)
    except ValidationError as exc:
        raise _pydantic_error(exc, f, table + ["source"], cls.Params) from None


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if _is_table(v) and _is_table(out.get(k)):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


#: where a value was written: the index of its layer and the table below the layer's
Origin = tuple[int, list[str]]


def _merge_traced(
    dst: dict[str, Any], src: dict[str, Any], origins: dict[str, Any], where: Origin, prefix: str = ""
) -> None:
    """Deep-merge `src` into `dst`, recording where each leaf came from."""
    for k, v in src.items():
        dotted = f"{prefix}{k}"
        if _is_table(v) and _is_table(dst.get(k)):
            _merge_traced(dst[k], v, origins, where, dotted + ".")
        else:
            dst[k] = json.loads(json.dumps(v, default=str)) if _is_table(v) else v
            for o in [o for o in origins if o.startswith(dotted + ".")]:
                del origins[o]
            origins[dotted] = where
            if _is_table(v):
                for sub, _ in _flatten(v, dotted + "."):
                    origins[sub] = where


# --------------------------------------------------------------------------- sections


@dataclass
class _Layer:
    file: _File
    table: list[str]
    body: dict[str, Any]

    def where(self, sub: list[str], key: str | None = None) -> Where:
        return self.file.where(self.table + sub, key)


class _Resolved(NamedTuple):
    """A target (one sweep variant) as a section's layers resolve it, wherever they are."""

    name: str
    kind: str
    params: Any
    inputs: list[str] | None
    variant: tuple[tuple[str, Any], ...]
    input_at: Origin | None  # where `input` was written


def _collect_sections(chain: list[_File], models: dict[str, Model], registry: Registry) -> list[Section]:
    order: dict[tuple[str, str], None] = {}  # in the order first declared
    for f in chain:
        for key, body in f.data.items():
            if key in RESERVED_TOP:
                continue
            if bad := check_name(key):
                raise f.error(bad, [], key, hint="a build section is [<model>.<section>]; rename it")
            if key not in models:
                raise f.error(
                    f"unknown model {key!r}",
                    [key],
                    hint=did_you_mean(key, models, "models") + "; declare it under [models]",
                )
            for hw, sec in body.items():
                if not _is_table(sec):
                    raise f.error(
                        "expected build sections [<model>.<hardware>] under a model",
                        [key],
                        hw,
                    )
                if bad := check_name(hw):
                    raise f.error(bad, [key], hw, hint="rename the section")
                order.setdefault((key, hw))
    # Section ids join model and section with a dot, and names may hold dots: two tables
    # must not make one id (["a.b".c] and [a."b.c"]), or they would silently merge.
    ids: dict[str, tuple[str, str]] = {}
    for m, hw in order:
        other = ids.setdefault(f"{m}.{hw}", (m, hw))
        if other != (m, hw):
            f = next(g for g in reversed(chain) if _is_table(g.data.get(m)) and hw in g.data[m])
            raise f.error(
                f"section [{_toml_key(m)}.{_toml_key(hw)}] and [{_toml_key(other[0])}.{_toml_key(other[1])}] "
                f"both have the id {m}.{hw}",
                [m, hw],
                hint="rename one of the models or sections",
            )
    for f in chain:
        for k in f.data.get("defaults", {}):
            if k in SECTION_KEYS and k not in DEFAULTS_KEYS:
                raise f.error(
                    f"{k!r} belongs in a build section, not in [defaults]", ["defaults"], k
                )
    memo: dict[Any, list[_Resolved]] = {}
    return [_section(chain, registry, m, hw, memo) for m, hw in order]


def lookup_key(key: str, layers: list[_Layer]) -> tuple[Any, _Layer | None]:
    """The value of `key` in the highest layer that sets it, and that layer."""
    for lay in reversed(layers):
        if key in lay.body:
            return lay.body[key], lay
    return None, None


def _section(
    chain: list[_File], registry: Registry, model: str, hw: str, memo: dict[Any, list[_Resolved]]
) -> Section:
    layers: list[_Layer] = []  # lowest priority first
    for f in chain:
        if "defaults" in f.data:
            layers.append(_Layer(f, ["defaults"], f.data["defaults"]))
        body = f.data.get(model, {}).get(hw)
        if body is not None:
            layers.append(_Layer(f, [model, hw], body))
    sec_layers = [lay for lay in layers if lay.table[0] != "defaults"]
    decl = sec_layers[-1]

    hardware, hw_layer = lookup_key("hardware", sec_layers)
    if hardware is None:
        hardware, hw_layer = hw, None
    if not isinstance(hardware, str):
        assert hw_layer is not None
        raise hw_layer.file.error("must be a string (a hardware profile name)", hw_layer.table, "hardware")
    if hardware not in registry.hardware:
        lay = hw_layer or decl
        msg, hint = _unknown(registry, "hardware", hardware, "; see `mopt hardware`")
        if hw_layer is None:
            msg += ", taken from the section key as `hardware` is not set"
        raise lay.file.error(msg, lay.table, "hardware" if hw_layer else None, hint)
    description, _ = lookup_key("description", sec_layers)
    # Sections whose layers hold the same values (10,000 sections under one [defaults])
    # resolve to the same targets: merge and validate once, then only the places differ.
    key = _layers_key(layers)
    made = memo.get(key)
    if made is None:
        made = memo[key] = _section_targets(layers, decl, registry)
    out = [
        Target(
            name=r.name,
            kind=r.kind,
            params=r.params,
            inputs=None if r.inputs is None else list(r.inputs),
            variant=r.variant,
            where=decl.where([r.name]),
            input_where=None if r.input_at is None else layers[r.input_at[0]].where(r.input_at[1], "input"),
        )
        for r in made
    ]
    return Section(
        model=model,
        key=hw,
        hardware=hardware,
        targets=out,
        description=description or "",
        where=decl.file.where(decl.table),
    )


def _layers_key(layers: list[_Layer]) -> Any:
    """What a section's targets are made of: each layer's file and values. Equal pickles
    are equal values of equal types in the same key order (a sweep's order names its
    variants; 1 is not 1.0 or true); [defaults] is one object shared by every section."""
    return tuple(
        (id(lay.file), id(lay.body)) if lay.table[0] == "defaults" else (id(lay.file), pickle.dumps(lay.body))
        for lay in layers
    )


def _section_targets(layers: list[_Layer], decl: _Layer, registry: Registry) -> list[_Resolved]:
    """The section's targets, one per sweep variant."""
    targets, t_layer = lookup_key("targets", layers)
    if targets is None:
        raise decl.file.error(
            "no `targets` for this section",
            decl.table,
            hint='add targets = ["weights", "onnx", ...] here or in [defaults]',
        )
    assert t_layer is not None
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise t_layer.file.error("must be a list of target names", t_layer.table, "targets")
    for t in targets:
        if bad := check_name(t):
            raise t_layer.file.error(bad, t_layer.table, "targets", hint="rename the target")
    dup = {t for t in targets if targets.count(t) > 1}
    if dup:
        raise t_layer.file.error(f"target {sorted(dup)[0]!r} is listed twice", t_layer.table, "targets")

    # resolve each target's kind
    kinds: dict[str, str] = {}
    for name in targets:
        kind, k_layer = None, None
        for lay in reversed(layers):
            tbl = lay.body.get(name)
            if _is_table(tbl) and "kind" in tbl:
                kind, k_layer = tbl["kind"], lay
                break
        if kind is None:
            if name not in registry.targets:
                tail = f"; a named target needs a table [{'.'.join(decl.table)}.{name}] with `kind`"
                msg, hint = _unknown(registry, "targets", name, tail)
                raise t_layer.file.error(msg, t_layer.table, "targets", hint)
            kind = name
        elif not isinstance(kind, str) or kind not in registry.targets:
            assert k_layer is not None
            msg, hint = _unknown(registry, "targets", kind, "; see `mopt plugins`")
            raise k_layer.file.error(msg, k_layer.table + [name], "kind", hint)
        kinds[name] = kind

    accepted: set[str] = set()
    for kind in kinds.values():
        accepted |= set(registry.targets[kind].Params.model_fields)

    # every key of every layer must mean something here
    for lay in layers:
        is_def = lay.table[0] == "defaults"
        allowed = DEFAULTS_KEYS if is_def else SECTION_KEYS
        for key, value in lay.body.items():
            if key in allowed:
                continue
            if _is_table(value):
                if is_def:
                    continue  # defaults for targets other sections may use
                if key not in kinds:
                    if key in registry.targets or "kind" in value:
                        hint = f'add "{key}" to `targets`'
                    else:
                        hint = did_you_mean(key, list(kinds) + list(SECTION_KEYS), "targets and keys")
                    raise lay.file.error(
                        f"table {key!r} is not a target of this section", lay.table, key, hint=hint
                    )
                continue
            if key in kinds:
                raise lay.file.error(f"target {key!r} must be a table", lay.table, key)
            if key not in accepted:
                raise lay.file.error(
                    "unknown key",
                    lay.table,
                    key,
                    hint=did_you_mean(key, sorted(accepted | set(allowed)), "keys")
                    + "; a section-level key is a param shared by the section's targets",
                )

    sweep = _sweep_axes(layers, kinds)

    out: list[_Resolved] = []
    for name in targets:
        kind = kinds[name]
        cls = registry.targets[kind]
        fields = set(cls.Params.model_fields)
        params: dict[str, Any] = {}
        origins: dict[str, Origin] = {}
        for li, lay in enumerate(layers):
            shared = {k: v for k, v in lay.body.items() if not _is_table(v) and k in fields}
            _merge_traced(params, shared, origins, (li, []))
            names = [kind] if kind == name else [kind, name]
            if lay.table[0] != "defaults":
                names = [name]
            for n in names:
                tbl = lay.body.get(n)
                if _is_table(tbl):
                    _merge_traced(params, tbl, origins, (li, [n]))
        params.pop("kind", None)
        inputs = params.pop("input", None)
        in_at = origins.pop("input", None)
        in_where = layers[in_at[0]].where(in_at[1], "input") if in_at else None
        origins.pop("kind", None)
        if inputs is not None:
            if isinstance(inputs, str):
                inputs = [inputs]
            if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
                assert in_where is not None
                raise MoptError(
                    "must be a target name or a list of them",
                    file=in_where.file,
                    table=in_where.table,
                    key="input",
                )
            for i in inputs:
                if i not in kinds:
                    assert in_where is not None
                    raise in_where.error(
                        f"input {i!r} is not a target of this section",
                        "input",
                        did_you_mean(i, [t for t in kinds if t != name], "targets"),
                    )
        axes = sweep.get(name, [])
        for combo in itertools.product(*[vals for _, vals, _ in axes]):
            p = json.loads(json.dumps(params, default=str))  # a TOML date: a value the kind validates
            o = dict(origins)
            variant = []
            for (param, _vals, w), value in zip(axes, combo):
                _set_dotted(p, param, value)
                o[param] = w
                variant.append((param, value))
            validated = _validate_params(cls, p, o, layers, decl, name)
            label = _label(name, tuple(variant))
            if "/" in label or "\0" in label or len(label.encode()) > _MAX_LABEL_BYTES:
                raise decl.file.error(
                    f"variant {label[:80]!r} cannot be a folder name (a '/', a NUL or over "
                    f"{_MAX_LABEL_BYTES} bytes): its sweep values become part of build/.../<target>@...",
                    decl.table,
                    "sweep",
                    hint="sweep over values without '/' (or fewer of them)",
                )
            out.append(_Resolved(name, kind, validated, inputs, tuple(variant), in_at))
    return out


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = d.get(p)
        if not _is_table(nxt):
            nxt = d[p] = {}
        d = nxt
    d[parts[-1]] = value


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if _is_table(v):
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _sweep_axes(layers: list[_Layer], kinds: dict[str, str]) -> dict[str, list[tuple[str, list[Any], Any]]]:
    """Per target, its sweep axes: (param, values, (layer index, ["sweep"], "target.param"))."""
    axes: dict[str, dict[str, tuple[list[Any], Any]]] = {}
    for li, lay in enumerate(layers):
        sw = lay.body.get("sweep")
        if sw is None or lay.table[0] == "defaults":
            continue
        table = lay.table + ["sweep"]
        if not _is_table(sw):
            raise lay.file.error("must be a table of \"<target>.<param>\" = [values]", lay.table, "sweep")
        for dotted, values in _flatten(sw):
            # Target names may hold dots ("v1.5.onnx"): take the longest target the key
            # starts with, rather than splitting at the first dot.
            owner = max((t for t in kinds if dotted.startswith(t + ".")), key=len, default=None)
            parts = [owner, dotted[len(owner) + 1 :]] if owner else dotted.split(".", 1)
            if len(parts) != 2 or not parts[1]:
                raise lay.file.error(
                    "a sweep key is \"<target>.<param>\"", table, dotted, hint=f'e.g. "trt-engine.{dotted}"'
                )
            target, param = parts
            if target not in kinds:
                raise lay.file.error(
                    f"sweep over {target!r}, which is not a target of this section",
                    table,
                    dotted,
                    hint=did_you_mean(target, kinds, "targets"),
                )
            if not isinstance(values, list) or not values:
                raise lay.file.error("a sweep axis must be a non-empty list of values", table, dotted)
            axes.setdefault(target, {})[param] = (values, (li, ["sweep"], dotted))
    return {t: [(p, v, w) for p, (v, w) in a.items()] for t, a in axes.items()}


def _validate_params(
    cls: Any, params: dict[str, Any], origins: dict[str, Any], layers: list[_Layer], decl: _Layer, name: str
) -> Any:
    try:
        # strict: "yes" is no bool, "0.3" no float (an int is a float); over JSON, a string is a Path
        return cls.Params.model_validate_json(json.dumps(params, default=str), strict=True)
    except ValidationError as exc:

        def place(loc: list[str]) -> tuple[Where, str]:
            """Where the offending value was written: the layer that set it, else the target."""
            dotted = ".".join(loc)
            origin = next((o for i in range(len(loc), 0, -1) if (o := origins.get(".".join(loc[:i])))), None)
            if origin is None:
                return decl.where([name]), dotted
            if len(origin) == 3:  # a sweep axis: (layer, ["sweep"], "target.param")
                return layers[origin[0]].where(origin[1], origin[2]), f"{name}.{dotted}"
            return layers[origin[0]].where(origin[1] + loc[:-1], loc[-1] if loc else None), dotted

        raise _invalid(exc, cls.Params, place) from None


def _invalid(exc: ValidationError, model: type[BaseModel], place: Any) -> MoptError:
    """pydantic's first error as a `MoptError` at `place(loc)` → (where, key)."""
    errs = exc.errors()
    # unknown keys first: a typo'd key also shows up as a missing one
    err = next((e for e in errs if e["type"] == "extra_forbidden"), errs[0])
    loc = [str(x) for x in err["loc"]]
    where, key = place(loc)
    fields = _fields_at(model, loc[:-1])  # the fields of the table the error is in
    hint: str | None
    if err["type"] == "extra_forbidden":
        msg, hint = "unknown key", None if fields is None else did_you_mean(loc[-1], fields, "keys")
    elif err["type"] == "missing":
        msg, hint = "missing required key", "add it"
    else:
        msg = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {err.get('input')!r}"
        hint = (fields or {}).get(loc[-1]) if loc else None  # the field's description
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})"
    return where.error(msg, key or None, hint or None)


def _pydantic_error(exc: ValidationError, f: _File, table: list[str], model: type[BaseModel]) -> MoptError:
    return _invalid(exc, model, lambda loc: (f.where(table, loc[0] if loc else None), ".".join(loc)))


def _fields_at(model: type[BaseModel], path: list[str]) -> dict[str, str] | None:
    cur: Any = model
    for p in path:
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or p not in cur.model_fields:
            return None
        cur = cur.model_fields[p].annotation
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return {k: (f.description or "") for k, f in cur.model_fields.items()}
    return None


# --------------------------------------------------------------------------- schema


def json_schema(registry: Registry) -> dict[str, Any]:
    """A JSON Schema of the recipe format (for editors), from the registered models."""
    kind = {"type": "string", "enum": sorted(registry.targets)}
    kinds = {}
    for name, cls in sorted(registry.targets.items()):
        s = cls.Params.model_json_schema()
        props = dict(s.get("properties", {}))
        props["kind"] = kind
        props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
        s["properties"] = props
        s["additionalProperties"] = False
        if cls.description:
            s["description"] = cls.description
        kinds[name] = s
    named_target = {"type": "object", "properties": {"kind": kind}, "required": ["kind"]}
    sources = [cls.Params.model_json_schema() for _, cls in sorted(registry.sources.items())]
    model_schema = ModelSpec.model_json_schema()
    model_schema["properties"]["family"]["enum"] = sorted(registry.families)
    model_schema["properties"]["source"] = {"anyOf": sources}
    section: dict[str, Any] = {
        "type": "object",
        "properties": {
            "hardware": {"type": "string", "enum": sorted(registry.hardware)},
            "targets": {"type": "array", "items": {"type": "string"}},
            "description": {"type": "string"},
            "sweep": {
                "type": "object",
                "description": '"<target>.<param>" = [values]: one node per combination',
                "additionalProperties": {"type": "array", "minItems": 1},
            },
            **kinds,
        },
        "additionalProperties": {"anyOf": [named_target, {"not": {"type": "object"}}]},
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "mopt recipe",
        "type": "object",
        "properties": {
            "schema": {"const": SCHEMA_VERSION},
            "extends": {"type": "array", "items": {"type": "string"}},
            "models": {"type": "object", "additionalProperties": model_schema},
            "defaults": {
                "type": "object",
                "properties": {"targets": section["properties"]["targets"], **kinds},
            },
        },
        "required": ["schema"],
        "additionalProperties": {
            "type": "object",
            "description": "[<model>.<hardware>] build sections",
            "additionalProperties": section,
        },
    }
