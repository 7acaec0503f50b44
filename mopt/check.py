"""`mopt check`: a recipe against its hardware profiles, before any build, in well under a second.

Generic rules read the params a kind marks with a `mopt.api.Role` (precision, sequence length,
batch size, memory fraction, tensor-parallel size, ...): a param's name means nothing here,
so a storage-only `dtype` is never read as a compute precision, and a kind written later is
checked by marking its fields. Each kind's own `check()` adds its specific findings. The
model's shape comes from its family's `dims()` over its config.json (`[models.X] config`,
the local `path` / `package` / cached `hf` checkpoint, or a synthetic source's `config` over
the family's `synthetic_defaults`).

Memory is sized by a kind's runtime `kv_pool()` (the core knows no runtime), else by its
`memory_model` ("engine", "none"; inferred from the roles when absent): docs/plugins.md.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mopt.api import (
    CheckContext,
    Finding,
    HardwareProfile,
    KvPool,
    Role,
    SourceContext,
    TargetKind,
    param_roles,
)
from mopt.errors import PluginError
from mopt.estimate import (
    BYTES,
    GIB,
    ConfigError,
    MemoryEstimate,
    ModelDims,
    Workload,
    activation_dtype,
    estimate,
    gib,
    largest_fitting,
    normalize_precision,
)
from mopt.family import TEXT_GENERATION, model_dims
from mopt.graph import Graph, Node
from mopt.recipe import Model, Recipe, Section

#: the lowest compute capability with hardware support for each precision
MIN_CC: dict[str, str] = {
    "fp32": "0.0", "fp16": "5.3", "int8": "6.1", "int4": "7.5", "bf16": "8.0", "fp8": "8.9", "nvfp4": "10.0"
}  # fmt: skip
#: roles that describe a memory workload (a kind with none of them gets no estimate)
MEMORY_ROLES = frozenset(
    {
        Role.batch_size,
        Role.seq_len,
        Role.num_tokens,
        Role.memory_fraction,
        Role.kv_cache_fraction,
        Role.workspace_gb,
        Role.kv_block_tokens,
    }
)
#: role → [(param name, value)] of one target's params, in field order
RoleValues = dict[Role, list[tuple[str, Any]]]


def role_values(kind: type[TargetKind], params: dict[str, Any]) -> RoleValues:
    """The params of `kind` that carry a role, by role (unmarked params are not there)."""
    out: RoleValues = {}
    for name, role in param_roles(kind.Params).items():
        if name in params:
            out.setdefault(role, []).append((name, params[name]))
    return out


def _first(rv: RoleValues, *roles: Role) -> tuple[str | None, Any]:
    for role in roles:
        for k, v in rv.get(role, ()):
            if v is not None:
                return k, v
    return None, None


#: the sequence length assumed for an engine whose params set none
ENGINE_DEFAULT_SEQ = 512
#: vocabulary assumed for a synthetic model whose tokenizer is not built yet
SYNTHETIC_VOCAB_GUESS = 32000


@dataclass
class NodeEstimate:
    """The estimator's breakdown for one target (or a section's baseline) on its profile."""

    section: str
    target: str
    hardware: str
    estimate: MemoryEstimate
    basis: str  # which params it came from
    largest: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "target": self.target,
            "hardware": self.hardware,
            "basis": self.basis,
            "largest_fitting": self.largest,
            **self.estimate.to_json(),
        }


@dataclass
class CheckReport:
    """Findings, the memory estimates behind them, and where each model's config came from."""

    findings: list[Finding]
    estimates: list[NodeEstimate]
    configs: dict[str, str]
    sections: list[str]
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for f in self.findings if f.severity == s) for s in ("error", "warning", "info")}

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.errors,
            "counts": self.counts,
            "findings": [finding_json(f) for f in self.findings],
            "estimates": [e.to_json() for e in self.estimates],
            "model_configs": self.configs,
            "sections": self.sections,
            "seconds": round(self.seconds, 4),
        }


def finding_json(f: Finding) -> dict[str, Any]:
    return {k: getattr(f, k) for k in ("severity", "code", "section", "target", "key", "message", "fix")}


# --------------------------------------------------------------------------- model configs


@dataclass
class _ModelInfo:
    config: dict[str, Any] | None
    origin: str  # where the config came from, or why there is none
    dims: ModelDims | None = None
    problem: Finding | None = None  # an error about the config itself (bad JSON)


def load_model_config(model: Model, recipe: Recipe, registry: Any) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json as a dict and where it came from, or (None, why not).

    Never downloads: `hf` sources are read from the local cache only."""
    if model.config_path is not None:
        return _read_json(model.config_path)
    kind, params = model.source_kind, model.source_params
    if kind in ("path", "package", "hf") and kind in registry.sources:
        ctx = SourceContext(
            project_dir=recipe.project_dir,
            cache_dir=recipe.project_dir / ".mopt" / "sources",
            offline=True,
            family=None,
            model_name=model.name,
        )
        try:
            folder = registry.sources[kind]().resolve(params, ctx)
        except Exception as exc:  # a missing checkpoint is not a check failure
            return None, f"{kind} source not available locally ({_short(exc)})"
        cfg = Path(folder) / "config.json"
        if not cfg.is_file():
            return None, f"no config.json in {folder}"
        return _read_json(cfg)
    overrides = getattr(params, "config", None)
    if isinstance(overrides, dict) or "synthetic" in kind:
        # a synthetic source: the family's small defaults under the recipe's overrides. Only
        # the plain dict is read (no plugin code runs: families build configs with transformers)
        named = getattr(params, kind, None)
        fam = registry.families.get(named) if isinstance(named, str) else None
        fam = fam or registry.families.get(model.spec.family)
        value = getattr(fam, "synthetic_defaults", None)
        defaults: dict[str, Any] = value if isinstance(value, dict) else {}
        merged = {**defaults, **(overrides if isinstance(overrides, dict) else {})}
        if not merged:
            return None, f"{kind} source gives no config"
        origin = f"{kind} source config" + (" over the family's synthetic defaults" if defaults else "")
        if "vocab_size" not in merged:
            # the synthetic tokenizer's vocabulary is only known once built; it is small
            merged["vocab_size"] = SYNTHETIC_VOCAB_GUESS
            origin += f"; vocab_size assumed {SYNTHETIC_VOCAB_GUESS}"
        return merged, origin
    return None, f"{kind} source: config.json is only known after fetching"


def _read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _BadConfig(f"{path}: {_short(exc)}") from None
    if not isinstance(data, dict):
        raise _BadConfig(f"{path}: not a JSON object")
    return data, str(path)


class _BadConfig(Exception):
    pass


def _short(exc: BaseException) -> str:
    s = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return s if len(s) < 200 else s[:197] + "..."


def _model_info(model: Model, recipe: Recipe, registry: Any) -> _ModelInfo:
    try:
        cfg, origin = load_model_config(model, recipe, registry)
    except _BadConfig as exc:
        f = Finding(
            severity="error",
            code="model-config-invalid",
            message=f"config.json of model {model.name!r} cannot be read: {exc}",
            fix=f"point [models.{model.name}] config at a valid Hugging Face config.json",
            section=f"models.{model.name}",
            key="config",
        )
        return _ModelInfo(None, str(exc), None, f)
    if cfg is None:
        return _ModelInfo(None, origin)
    try:
        dims = model_dims(cfg, registry.families.get(model.spec.family))
    except ConfigError as exc:
        return _ModelInfo(cfg, f"{origin} (lacks {', '.join(exc.missing)})")
    except Exception as exc:  # a bug of the family's plugin, not a config to add (MOPT_TRACEBACK=1: where)
        plugin = registry.plugin_of("families", model.spec.family).name
        raise PluginError(f"plugin {plugin!r} failed in family {model.spec.family!r} dims() on {origin}: "
                          f"{type(exc).__name__}: {_short(exc)}", hint="fix the plugin (or that config.json), "
                          f"or disable it with MOPT_DISABLE_PLUGINS={plugin}") from exc
    return _ModelInfo(cfg, origin, dims)


# --------------------------------------------------------------------------- the rules


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _cc(hw: HardwareProfile) -> str:
    return ".".join(map(str, hw.compute_capability)) if hw.compute_capability else "-"


def _profiles_with(registry: Any, precision: str) -> list[str]:
    return [p.name for p in registry.hardware.values() if p.is_gpu and precision in p.precisions]


def _needs_gpu(reqs: list[str]) -> list[str]:
    return [r for r in reqs if r in ("gpu", "hardware") or r.startswith("cuda")]


class _Checker:
    def __init__(self, graph: Graph) -> None:
        self.registry = graph.registry
        self.recipe = graph.recipe
        self.findings: list[Finding] = []
        self.estimates: list[NodeEstimate] = []
        self.models: dict[str, _ModelInfo] = {}
        self.at = ("", "")  # (section, target) the findings being added are about

    def model(self, name: str) -> _ModelInfo:
        if name not in self.models:
            info = _model_info(self.recipe.models[name], self.recipe, self.registry)
            self.models[name] = info
            if info.problem is not None:
                self.findings.append(info.problem)
        return self.models[name]

    def add(self, severity: str, code: str, key: str | None, message: str, fix: str) -> None:
        """A finding on the target being checked (`at`: its section and label)."""
        self.findings.append(Finding(severity, code, message, fix, *self.at, key))

    # ----------------------------------------------------------------- per node

    def check_node(self, node: Node, section: Section, label: str) -> bool:
        """Run every rule on one target of one section; True when it had a memory workload."""
        hw = self.registry.hardware[section.hardware]
        cls: type[TargetKind] = self.registry.targets[node.kind]
        kind = cls()
        params = role_values(cls, node.params_json())
        sec = section.id
        self.at = (sec, label)
        info = self.model(section.model)
        dims = info.dims
        task = self._task(section)

        try:
            reqs = list(kind.requirements(node.target.params, hw))
        except Exception:
            reqs = list(cls.requires)
        gpu_reqs = _needs_gpu(reqs)
        on_cpu_profile = not hw.is_gpu
        generic_from = len(self.findings)
        if on_cpu_profile and gpu_reqs:
            gpus = [p.name for p in self.registry.hardware.values() if p.is_gpu]
            self.add(
                "error",
                "kind-needs-gpu",
                "hardware",
                f"target kind {node.kind!r} requires {', '.join(gpu_reqs)}, but profile {hw.name!r} "
                "has no GPU",
                f"remove {node.target.name!r} from this section's targets, or set hardware to a GPU "
                f"profile ({', '.join(gpus[:5])}{', ...' if len(gpus) > 5 else ''}; `mopt hardware`)",
            )

        had_workload = False
        if not (on_cpu_profile and gpu_reqs):  # the params of a target that cannot run say nothing
            self._precision(params, hw)
            self._fractions(params)
            self._tokens_per_block(params)
            if not on_cpu_profile:
                self._parallel(params, hw, dims, section.model)
            if dims is not None:
                self._seq_lengths(params, dims, section.model, info.origin)
            if hw.is_gpu and hw.memory_gb and dims is not None:
                had_workload = self._memory(kind, params, hw, dims, task)

        ctx = CheckContext(
            hardware=hw,
            model_config=info.config,
            family=self._family(section.model),
            section=sec,
            target=label,
            task=task,
        )
        try:
            extra = kind.check(node.target.params, ctx)
        except Exception as exc:  # a plugin's bug: its traceback with MOPT_TRACEBACK=1
            if os.environ.get("MOPT_TRACEBACK"):
                traceback.print_exc()
            plugin = self.registry.plugin_of("targets", node.kind).name
            self.add(
                "warning",
                "kind-check-failed",
                None,
                f"kind {node.kind!r} (plugin {plugin!r}) crashed in check(): {type(exc).__name__}: {_short(exc)}",
                f"report it to the plugin's authors; disable with MOPT_DISABLE_PLUGINS={plugin}",
            )
            extra = []
        own = [
            Finding(f.severity, f.code, f.message, f.fix, f.section or sec, f.target or label, f.key)
            for f in extra or []
        ]
        if own:
            # the kind knows its params best: its finding on a key (or with a code) replaces the
            # generic rule's, so a kind that checks e.g. tp_size itself is not reported twice
            keys = {f.key for f in own if f.key}
            codes = {f.code for f in own}
            if on_cpu_profile and gpu_reqs and any(f.severity == "error" for f in own):
                codes.add("kind-needs-gpu")  # the kind said itself why it cannot run here
            generic = self.findings[generic_from:]
            del self.findings[generic_from:]
            self.findings += [f for f in generic if f.key not in keys and f.code not in codes]
            self.findings += own
        return had_workload

    def _task(self, section: Section) -> str:
        return self.recipe.models[section.model].spec.task

    def _family(self, model: str) -> Any:
        cls = self.registry.families.get(self.recipe.models[model].spec.family)
        try:
            return cls() if cls is not None else None
        except Exception:
            return None

    def _precision(self, params: RoleValues, hw: HardwareProfile) -> None:
        for key, value in params.get(Role.precision, ()):
            p = normalize_precision(value)
            if p is None or p in hw.precisions:
                continue
            if not hw.is_gpu:
                self.add(
                    "warning",
                    "precision-unsupported",
                    key,
                    f"{key} = {value!r}: profile {hw.name!r} is a CPU profile without native {p} "
                    f"(it has {', '.join(hw.precisions)}); CPU kernels for {p} are missing or slow",
                    f'use {key} = "fp32" (or int8 quantization) for CPU targets',
                )
                continue
            others = [n for n in _profiles_with(self.registry, p) if n != hw.name]
            alt = "fp16 or bf16" if "bf16" in hw.precisions else "fp16"
            if p == "int4":
                alt = "int8"
            self.add(
                "error",
                "precision-unsupported",
                key,
                f"{key} = {value!r} needs compute capability ≥ {MIN_CC[p]}; "
                f"{hw.name} ({hw.gpu_name}) has {_cc(hw)} (supports {', '.join(hw.precisions)})",
                f"use {alt} on {hw.name}, or build for a profile with {p}: {', '.join(others[:6])}",
            )
        qkey, q = _first(params, Role.quantization)
        qp = normalize_precision(q)
        if hw.is_gpu and qkey and qp is not None and qp not in hw.precisions:
            if qp == "fp8":
                self.add(
                    "warning",
                    "precision-unsupported",
                    qkey,
                    f"{qkey} = {q!r} on {hw.name} (CC {_cc(hw)}): FP8 compute needs CC ≥ 8.9; on this "
                    "GPU it runs weight-only (W8A16) at best: memory saved, no FP8 math",
                    "keep it for the memory saving, or use int8 (W8A8) for faster math on this GPU",
                )
            else:
                self.add(
                    "error",
                    "precision-unsupported",
                    qkey,
                    f"{qkey} = {q!r} ({qp}) needs compute capability ≥ {MIN_CC[qp]}; "
                    f"{hw.name} has {_cc(hw)}",
                    f"use awq / gptq (int4) or fp8 on {hw.name}, or a profile with {qp}: "
                    + ", ".join(_profiles_with(self.registry, qp)[:6]),
                )
        kvkey, kv = _first(params, Role.kv_cache_precision)
        kp = normalize_precision(kv)
        if hw.is_gpu and kvkey and kp is not None and kp not in hw.precisions:
            self.add(
                "warning" if kp == "fp8" else "error",
                "precision-unsupported",
                kvkey,
                f"{kvkey} = {kv!r} on {hw.name} (CC {_cc(hw)}): no hardware {kp} "
                f"(needs CC ≥ {MIN_CC[kp]}); only some attention backends can "
                "store the cache in it and compute in fp16",
                f'use {kvkey} = "auto" on this GPU, or check that your runtime version '
                "supports an fp8 KV cache on it",
            )

    def _fractions(self, params: RoleValues) -> None:
        for key, value in [*params.get(Role.memory_fraction, ()), *params.get(Role.kv_cache_fraction, ())]:
            v = _num(value)
            if v is not None and not 0 < v <= 1:
                self.add(
                    "error",
                    "fraction-out-of-range",
                    key,
                    f"{key} = {v:g} is a fraction of GPU memory and must be in (0, 1]",
                    f"set {key} between 0.5 and 0.95 (0.9 is the usual default)",
                )

    def _tokens_per_block(self, params: RoleValues) -> None:
        key, value = _first(params, Role.kv_block_tokens)
        v = _int(value)
        if key is None or v is None or (v > 0 and v & (v - 1) == 0):
            return
        lower = 1 << (max(v, 1).bit_length() - 1)
        upper = lower * 2
        self.add(
            "error",
            "tokens-per-block-not-pow2",
            key,
            f"{key} = {v} is not a power of two (a paged KV cache's block size must be one)",
            f"use {key} = {lower} or {upper} (32 and 64 are common)" if v > 0 else f"use {key} = 32 or 64",
        )

    def _parallel(self, params: RoleValues, hw: HardwareProfile, dims: ModelDims | None, model: str) -> None:
        tp_key, tp_v = _first(params, Role.tensor_parallel)
        pp_key, pp_v = _first(params, Role.pipeline_parallel)
        tp, pp = _int(tp_v) or 1, _int(pp_v) or 1
        if tp_key is None and pp_key is None:
            return
        if tp < 1 or pp < 1:
            bad = tp_key if tp < 1 else pp_key
            self.add("error", "tp-invalid", bad, f"{bad} must be ≥ 1", f"set {bad} = 1")
            return
        if tp * pp > hw.gpu_count:
            key = tp_key if tp > 1 else pp_key
            self.add(
                "error",
                "tp-over-gpus",
                key,
                " × ".join(f"{k} = {v}" for k, v in ((tp_key, tp), (pp_key, pp)) if k)
                + f" needs {tp * pp} GPUs; profile {hw.name!r} has {hw.gpu_count}",
                f"set {key} so that TP × PP ≤ {hw.gpu_count}, or use a profile with {tp * pp} GPUs "
                "(a hardware plugin can register one with gpu_count)",
            )
        if dims is None or tp == 1:
            return
        valid = [t for t in range(1, max(dims.heads, 1) + 1) if not _tp_problems(dims, t)]
        fix_tp = f"use {tp_key} in {{{', '.join(map(str, valid[:8]))}}} for {model}"
        for code, why in _tp_problems(dims, tp, model):
            self.add("error", code, tp_key, f"{tp_key} = {tp} {why}", fix_tp)

    def _seq_lengths(self, params: RoleValues, dims: ModelDims, model: str, origin: str) -> None:
        limit = dims.max_sequence
        if limit is None:
            return
        for key, value, written in _seq_values(params):
            if value <= limit:
                continue
            if dims.encoder:
                why = "absolute position embeddings: inputs must be truncated to it"
            elif dims.rope_factor:
                why = f"RoPE scaling factor {dims.rope_factor:g} already applied"
            else:
                why = "longer inputs need RoPE scaling (rope_scaling in config.json, e.g. YaRN)"
            self.add(
                "error",
                "seq-over-max-position",
                key,
                (
                    f"{key} = {value}"
                    if written == str(value)
                    else f"{key} has a shape {written} of sequence length {value},"
                )
                + f" over {model}'s max_position_embeddings {limit} ({origin})",
                f"keep {key} ≤ {limit}; {why}",
            )

    # ----------------------------------------------------------------- memory

    def _memory(
        self, kind: TargetKind, params: RoleValues, hw: HardwareProfile, dims: ModelDims, task: str
    ) -> bool:
        pool = kind.kv_pool(hw, task)
        spec = workload_for(params, dims, hw, pool if pool is not None else kind.memory_model)
        if spec is None:
            return False
        w, keys = spec
        if pool is not None:
            w = replace(w, runtime=kind.name)
        elif task == TEXT_GENERATION:
            # a generation engine keeps every sequence's KV cache: batch × seq of it must fit
            w = replace(w, kv_cache=True)
        assert hw.memory_gb is not None
        cap = hw.memory_gb
        e = estimate(dims, w, cap)
        ne = NodeEstimate(*self.at, hw.name, e, _basis(w, keys))
        self.estimates.append(ne)
        if pool is None:
            bkey, skey = keys.get("batch"), keys.get("seq")
            max_b = largest_fitting(dims, w, cap, "batch", max(w.batch, 1) * 64 + 1024)
            max_s = largest_fitting(dims, w, cap, "seq_len", max(dims.max_sequence or 0, w.seq_len))
            ne.largest = {bkey or "batch": max_b, skey or "seq_len": max_s}
            if e.fits:
                return True
            opts = []
            if max_b is not None and max_b < w.batch:
                opts.append(f"{bkey or 'max_batch_size'} ≤ {max_b} at {skey or 'seq'} {w.seq_len}")
            if max_s is not None and max_s < w.seq_len:
                opts.append(f"{skey or 'max_seq_len'} ≤ {max_s} at batch {w.batch}")
            opts += _smaller_precisions(dims, w, hw, keys.get("precision"))
            if not opts:
                opts.append("the weights alone do not fit: quantize (int8/fp8/int4) or use a larger GPU")
            self.add(
                "error",
                "memory-over-capacity",
                bkey or skey,
                f"estimated {gib(e.total)} > {hw.memory_gb:g} GiB of {hw.name}: {_breakdown(e)}",
                "largest that fits: " + "; or ".join(opts),
            )
            return True
        # a serving runtime's KV-cache pool
        skey = keys.get("seq") or pool.seq_key
        bkey = keys.get("batch") or pool.seqs_key
        fkey = keys.get("fraction") or pool.fraction_key
        kv_tokens = e.kv_tokens_available or 0
        max_seqs = kv_tokens // max(w.seq_len, 1)
        max_len = largest_fitting(
            dims,
            w,
            cap,
            "seq_len",
            w.seq_len,
            fits=lambda x: (x.kv_tokens_available or 0) >= x.workload.seq_len,
        )
        ne.largest = {bkey: max_seqs, skey: max_len}
        where = _pool_text(e, hw)
        if not e.model_fits:
            need = e.fixed / (cap * GIB)
            fixes = []
            if w.memory_fraction is not None and need < 0.97:
                fixes.append(f"raise {fkey} to {min(0.97, need + 0.03):.2f}")
            fixes += _smaller_precisions(dims, w, hw, keys.get("precision"))
            if hw.gpu_count > w.tp:
                fixes.append(f"shard with tensor_parallel_size up to {hw.gpu_count}")
            fixes.append(f"lower {pool.tokens_key}")
            self.add(
                "error",
                "memory-over-capacity",
                keys.get("fraction") or keys.get("precision") or fkey,
                f"the model does not fit in {where} of {hw.name}: {_breakdown(e, kv=False)} = {gib(e.fixed)}, "
                "before any KV cache",
                "; or ".join(fixes),
            )
            return True
        kv_need_one = e.kv_per_token * w.seq_len
        if kv_tokens < w.seq_len:
            fixes = []
            if max_len:
                fixes.append(f"{skey} ≤ {max_len}")
            if w.memory_fraction is not None:
                frac = (e.fixed + kv_need_one) / (cap * GIB)
                if frac <= 0.97:
                    fixes.append(f"{fkey} = {frac + 0.01:.2f}")
            if w.kv_dtype is None and "fp8" in hw.precisions:
                fixes.append('kv_cache_dtype = "fp8"')
            self.add(
                "error",
                "kv-cache-too-small",
                skey,
                f"the KV cache left in {where} of {hw.name} holds {kv_tokens:,} tokens "
                f"({gib(e.kv_available or 0)} at {e.kv_per_token / 1024:.0f} KiB/token), fewer than one "
                f"{skey} = {w.seq_len:,} sequence ({gib(kv_need_one)}); the runtime refuses to start. "
                f"The rest: {_breakdown(e, kv=False)}",
                "set " + ", or ".join(fixes) if fixes else "use a larger GPU",
            )
            return True
        if not e.fits:
            short = kv_tokens // max(w.batch, 1)
            fixes = [f"{bkey} ≤ {max_seqs} for full-length sequences"]
            if short >= 1:
                fixes.append(f"{skey} ≤ {short:,} for {w.batch} concurrent sequences")
            if w.kv_dtype is None and "fp8" in hw.precisions:
                fixes.append('kv_cache_dtype = "fp8" (halves the KV cache)')
            self.add(
                "warning",
                "kv-cache-short",
                bkey,
                kv_fit_text(e, hw, bkey, skey, max_seqs, short, where)
                + f"; sequences beyond that queue. Besides the KV cache: {_breakdown(e, kv=False)}",
                "; or ".join(fixes),
            )
        return True

    def baseline(self, section: Section) -> None:
        """The model's own estimate for a section none of whose targets sets batch / sequence
        limits: 16-bit on a GPU profile (with what fits), fp32 on a CPU one (no capacity)."""
        hw = self.registry.hardware[section.hardware]
        dims = self.model(section.model).dims
        if dims is None:
            return
        if self._task(section) == TEXT_GENERATION:
            self._generation_baseline(section, hw, dims)
            return
        seq = min(ENGINE_DEFAULT_SEQ, dims.max_sequence or ENGINE_DEFAULT_SEQ)
        if not hw.is_gpu or not hw.memory_gb:
            w = Workload(precision="fp32", batch=1, seq_len=seq, device="cpu")
            basis = f"fp32 on CPU, batch 1 × {seq} tokens (no target sets limits)"
            self.estimates.append(NodeEstimate(section.id, "(model)", hw.name, estimate(dims, w), basis))
            return
        prec = _sixteen_bit(dims, hw)
        w = Workload(precision=prec, batch=1, seq_len=seq, shared_memory=hw.shared_memory)
        e = estimate(dims, w, hw.memory_gb)
        ne = NodeEstimate(
            section.id, "(model)", hw.name, e, f"{prec}, batch 1 × {seq} tokens (no target sets limits)"
        )
        ne.largest = {
            "batch": largest_fitting(dims, w, hw.memory_gb, "batch", 1 << 20),
            "seq_len": largest_fitting(dims, w, hw.memory_gb, "seq_len", dims.max_sequence or 1 << 20),
        }
        self.estimates.append(ne)

    def _generation_baseline(self, section: Section, hw: HardwareProfile, dims: ModelDims) -> None:
        """A text-generation section none of whose targets sets serving limits: on a GPU,
        what serving it with a runtime's every default would ask for (the runtime of the
        first kind by name whose `kv_pool` says `baseline`: mopt-serve's vllm) and the
        largest settings that fit, as an info finding; on CPU, or with no such kind, the KV
        cache of one full-context sequence (fp32 on CPU)."""
        seq = dims.max_sequence or 2048
        found = self._baseline_pool(hw)
        if not hw.is_gpu or not hw.memory_gb or found is None:
            cpu = not hw.is_gpu or not hw.memory_gb
            prec = "fp32" if cpu else (dims.config_dtype if dims.config_dtype in hw.precisions else "fp16")
            tokens = min(seq, found[1].max_tokens) if found is not None else seq
            w = Workload(
                precision=prec, batch=1, seq_len=seq, num_tokens=tokens, kv_cache=True,
                device="cpu" if cpu else "gpu", shared_memory=hw.shared_memory,
            )  # fmt: skip
            where = "on CPU" if cpu else "(no serving kind gives its runtime's defaults)"
            basis = f"text-generation, {prec} {where}, KV cache for 1 × {seq:,} tokens (the model's context)"
            e = estimate(dims, w, None if cpu else hw.memory_gb)
            self.estimates.append(NodeEstimate(section.id, "(model)", hw.name, e, basis))
            return
        kind_name, pool = found
        spec = workload_for({}, dims, hw, pool)
        assert spec is not None
        w, keys = spec
        w = replace(w, runtime=kind_name)
        e = estimate(dims, w, hw.memory_gb)
        kv_tokens = e.kv_tokens_available or 0
        max_seqs = kv_tokens // max(w.seq_len, 1)
        short = kv_tokens // max(w.batch, 1)
        ne = NodeEstimate(section.id, "(model)", hw.name, e, "text-generation, " + _basis(w, keys))
        ne.largest = {pool.seqs_key: max_seqs, pool.seq_key: min(kv_tokens, seq) or None}
        self.estimates.append(ne)
        pool_text = _pool_text(e, hw)
        if not e.model_fits:
            msg = (
                f"{hw.name} {hw.memory_gb:g} GiB: the model does not fit in {pool_text}: {_breakdown(e, kv=False)}"
            )
            fix = "; or ".join(_smaller_precisions(dims, w, hw, None) or ["use a larger GPU"])
        else:
            msg = kv_fit_text(e, hw, pool.seqs_key, pool.seq_key, max_seqs, short, pool_text) + (
                f" (the defaults of kind {kind_name!r}; no target of this section sets them)"
            )
            fix = (
                f"serve with {pool.seq_key} ≤ {min(kv_tokens, seq):,} and {pool.seqs_key} ≤ {max(max_seqs, 1)} "
                f"at that length, or shorter contexts for more sequences"
                if kv_tokens
                else "quantize the weights or use a larger GPU"
            )
        self.at = (section.id, "")
        self.add("info", "kv-cache-fit", None, msg, fix)

    def _baseline_pool(self, hw: HardwareProfile) -> tuple[str, KvPool] | None:
        """(kind name, its pool) of the first kind by name whose `kv_pool` is a `baseline`."""
        for name in sorted(self.registry.targets):
            cls = self.registry.targets[name]
            if cls.kv_pool is TargetKind.kv_pool:
                continue
            try:
                pool = cls().kv_pool(hw, TEXT_GENERATION)
            except Exception:  # a plugin's bug: that kind gives no baseline
                continue
            if pool is not None and pool.baseline:
                return name, pool
        return None


def _pool_text(e: MemoryEstimate, hw: HardwareProfile) -> str:
    """What a runtime's KV cache is carved from: `0.92 × 8 GiB = 7.36 GiB`."""
    w, cap = e.workload, hw.memory_gb or 0.0
    if w.memory_fraction is not None:
        return f"{w.memory_fraction:g} × {cap:g} GiB = {gib(e.budget or 0)}"
    if w.kv_fraction is not None:  # TensorRT-LLM: a fraction of what the model leaves free
        return f"{w.kv_fraction:g} × the {gib(max(0.0, cap * GIB - e.fixed))} the model leaves of {cap:g} GiB"
    return f"{cap:g} GiB"


def kv_fit_text(
    e: MemoryEstimate, hw: HardwareProfile, bkey: str, skey: str, max_seqs: int, short: int, pool: str
) -> str:
    """`rtx4060-laptop 8 GiB: max_model_len 32,768 × max_num_seqs 8 needs 28.00 GiB of KV
    cache (112 KiB/token, bf16); 4.95 GiB is left in 0.92 × 8 GiB = 7.36 GiB: fits
    max_num_seqs ≤ 1 at 32,768 or max_model_len ≤ 5,533 at 8`."""
    w = e.workload
    kv_dtype = w.kv_dtype or activation_dtype(w.precision)
    fits = [f"{bkey} ≤ {max_seqs} at {w.seq_len:,}"] if max_seqs >= 1 else []
    if short >= 1:
        fits.append(f"{skey} ≤ {min(short, w.seq_len):,} at {w.batch}")
    return (
        f"{hw.name} {hw.memory_gb:g} GiB: {skey} {w.seq_len:,} × {bkey} {w.batch} needs {gib(e.kv_cache)} of KV "
        f"cache ({e.kv_per_token / 1024:g} KiB/token, {kv_dtype}); {gib(e.kv_available or 0)} is left in {pool}"
        + (f": fits {' or '.join(fits)}" if fits else ": not one full-length sequence fits")
    )


def _tp_problems(dims: ModelDims, tp: int, model: str = "") -> list[tuple[str, str]]:
    """(code, what) for each part of `model` that tensor-parallel size `tp` cannot split evenly."""
    out = []
    if dims.heads % tp:
        out.append(("tp-heads", f"does not divide the {dims.heads} attention heads of {model}"))
    if dims.kv_heads % tp and tp % dims.kv_heads:
        out.append(
            (
                "tp-kv-heads",
                f"and the {dims.kv_heads} KV heads of {model}: neither divides the other, so KV heads "
                "can be neither split nor replicated evenly",
            )
        )
    if dims.intermediate % tp:
        out.append(("tp-intermediate", f"does not divide the MLP width {dims.intermediate} of {model}"))
    return out


def _seq_values(params: RoleValues) -> list[tuple[str, int, str]]:
    """(dotted key, sequence length, how it was written) for every `seq_len` param and
    every [batch, seq] shape in a `shapes` param (lists of shapes, tables of them per input,
    'NxM' strings)."""
    out: list[tuple[str, int, str]] = []
    for k, v in params.get(Role.seq_len, ()):
        if _int(v) is not None:
            out.append((k, v, str(v)))
    for k, v in params.get(Role.shapes, ()):
        out += _shape_seqs(v, k)
    return out


def _shape_seqs(v: Any, key: str) -> list[tuple[str, int, str]]:
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in _shape_seqs(x, f"{key}.{k}")]
    if isinstance(v, str):
        return [(key, int(m.group(2)), m.group(0)) for m in re.finditer(r"(\d+)x(\d+)(x\d+)*", v)]
    if isinstance(v, list):
        if len(v) >= 2 and all(_int(x) is not None for x in v):
            return [(key, v[1], json.dumps(v))]
        return [s for x in v for s in _shape_seqs(x, key)]
    return []


def _basis(w: Workload, keys: dict[str, str]) -> str:
    parts = [w.runtime, w.precision]
    parts.append(f"{keys.get('batch', 'batch')} {w.batch} × {keys.get('seq', 'seq')} {w.seq_len:,}")
    if w.num_tokens is not None:
        parts.append(f"{w.num_tokens:,} tokens/pass")
    if w.tp > 1 or w.pp > 1:
        parts.append(f"TP {w.tp} PP {w.pp}")
    if w.memory_fraction is not None:
        parts.append(f"utilization {w.memory_fraction:g}")
    if w.kv_fraction is not None:
        parts.append(f"KV fraction {w.kv_fraction:g}")
    assumed = keys.get("assumed")
    if assumed:
        parts.append(f"assumed {assumed}")
    return ", ".join(parts)


def _breakdown(e: MemoryEstimate, kv: bool = True) -> str:
    parts = [f"weights {gib(e.weights)}"]
    if e.workload.kv_cache and kv:
        parts.append(f"KV cache {gib(e.kv_cache)}")
    parts.append(f"activations {gib(e.activations)}")
    if e.workspace:
        parts.append(f"workspace {gib(e.workspace)}")
    if e.runtime:
        parts.append(f"runtime {gib(e.runtime)}")
    w = e.workload
    return " + ".join(parts) + f" (batch {w.batch} × {w.seq_len:,} tokens, {w.precision})"


def _smaller_precisions(dims: ModelDims, w: Workload, hw: HardwareProfile, key: str | None) -> list[str]:
    out = []
    assert hw.memory_gb is not None
    for p in ("fp8", "int8", "int4"):
        if p not in hw.precisions or BYTES[p] >= BYTES[w.precision]:
            continue
        e = estimate(dims, replace(w, precision=p), hw.memory_gb)
        if e.fits or (w.kv_cache and e.model_fits and not estimate(dims, w, hw.memory_gb).model_fits):
            out.append(f"{key or 'precision'} = {p!r} ({gib(e.total if not w.kv_cache else e.fixed)})")
            break
    return out


def _sixteen_bit(dims: ModelDims, hw: HardwareProfile) -> str:
    """The precision a GPU target runs at when no param sets one: the config's 16-bit dtype
    where the GPU has it, else fp16."""
    prec = dims.config_dtype if dims.config_dtype in ("fp16", "bf16") else "fp16"
    return prec if prec in hw.precisions else "fp16"


#: roles of a KV-cache pool: a kind that marks them is sized only through its `kv_pool()`
POOL_ROLES = frozenset({Role.memory_fraction, Role.kv_cache_fraction, Role.kv_block_tokens})


def workload_for(
    params: RoleValues, dims: ModelDims, hw: HardwareProfile, model: str | KvPool | None = None
) -> tuple[Workload, dict[str, str]] | None:
    """The workload a target's role-marked params (`role_values`) describe, and which param
    gave each number (`batch`, `seq`, `precision`, `fraction` → param name; `assumed` →
    defaults used). `model` is how the kind is sized (`memory_model`): a serving runtime's
    `KvPool`, whose defaults fill what the params leave out, "engine", "none", or None
    ("engine" when batch / sequence / token / workspace roles are marked and no pool's).
    None when the params say nothing about memory."""
    present = {r for r, kvs in params.items() if any(v is not None for _, v in kvs)}
    pool = model if isinstance(model, KvPool) else None
    if pool is None:
        if model is None and not present & POOL_ROLES and present & {
            Role.batch_size, Role.seq_len, Role.num_tokens, Role.workspace_gb
        }:  # fmt: skip
            model = "engine"
        if model != "engine":
            return None
    keys: dict[str, str] = {}
    assumed: list[str] = []

    pkey, pval = _first(params, Role.precision)
    prec = normalize_precision(pval) or _sixteen_bit(dims, hw)
    if pkey:
        keys["precision"] = pkey
    qkey, qval = _first(params, Role.quantization)
    q = normalize_precision(qval)
    if q is not None and qkey and BYTES[q] < BYTES[prec]:
        prec = q
        keys["precision"] = qkey
    kv_dtype = normalize_precision(_first(params, Role.kv_cache_precision)[1])

    _, tp_v = _first(params, Role.tensor_parallel)
    _, pp_v = _first(params, Role.pipeline_parallel)
    tp, pp = max(1, _int(tp_v) or 1), max(1, _int(pp_v) or 1)
    max_pos = dims.max_sequence or 2048

    def pick(role: Role, default: int, what: str) -> tuple[int, str | None]:
        for n, value in params.get(role, ()):
            v = _int(value)
            if v is not None and v > 0:
                return v, n
        assumed.append(f"{what} {default:,}")
        return default, None

    nt = _int(_first(params, Role.num_tokens)[1])
    if pool is not None:
        batch, bk = pick(Role.batch_size, pool.max_seqs, pool.seqs_key)
        seq, sk = pick(Role.seq_len, max_pos, pool.seq_key)
        if nt:
            tokens = nt
        elif pool.whole_sequence:
            tokens = min(max(seq, pool.max_tokens), batch * seq)
        else:  # chunked prefill: one pass takes at most max_tokens
            tokens = min(pool.max_tokens, batch * seq)
        of_gpu = pool.share_of == "gpu"
        fk, fv = _first(params, Role.memory_fraction if of_gpu else Role.kv_cache_fraction)
        frac_v = _num(fv)
        if frac_v is None or fk is None:
            assumed.append(f"{pool.fraction_key} {pool.fraction:g}")
        else:
            keys["fraction"] = fk
        frac = frac_v if frac_v is not None and 0 < frac_v <= 1 else pool.fraction
        sizing: dict[str, Any] = {
            "num_tokens": tokens,
            "kv_cache": True,
            "memory_fraction": frac if of_gpu else None,
            "kv_fraction": None if of_gpu else frac,
            "runtime": "kv-pool",
        }
    else:
        batch, bk = pick(Role.batch_size, 1, "batch")
        seq, sk = pick(Role.seq_len, min(ENGINE_DEFAULT_SEQ, max_pos), "seq")
        sizing = {"workspace_gb": _num(_first(params, Role.workspace_gb)[1]) or 0.0, "runtime": "engine"}
    # kv_dtype matters to an engine too: a generation engine keeps a KV cache
    w = Workload(precision=prec, kv_dtype=kv_dtype, batch=batch, seq_len=seq, tp=tp, pp=pp,
                 shared_memory=hw.shared_memory, **sizing)
    if bk:
        keys["batch"] = bk
    if sk:
        keys["seq"] = sk
    if assumed:
        keys["assumed"] = ", ".join(assumed)
    return w, keys


# --------------------------------------------------------------------------- entry points


def run_checks(graph: Graph, ids: list[str] | None = None) -> CheckReport:
    """Check the selected nodes (all when `ids` is None) on every section they belong to."""
    t0 = time.perf_counter()
    ids = list(graph.nodes) if ids is None else ids
    graph.declared_files(ids)
    c = _Checker(graph)
    by_id = {s.id: s for s in graph.recipe.sections}
    # a node shared by several sections (same definition) is checked in each of them
    touched = {a.partition(":")[0] for i in ids for a in graph.nodes[i].addresses}
    selected_sections = [s.id for s in graph.recipe.sections if s.id in touched]
    wanted = set(selected_sections)
    with_workload: set[str] = set()
    relevant: set[str] = set()
    for i in ids:
        node = graph.nodes[i]
        for addr in node.addresses:
            sec_id, _, label = addr.partition(":")
            if sec_id not in wanted:
                continue
            section = by_id[sec_id]
            rv = role_values(graph.registry.targets[node.kind], node.params_json())
            if (MEMORY_ROLES | {Role.tensor_parallel, Role.shapes}) & set(rv):
                relevant.add(sec_id)
            if c.check_node(node, section, label):
                with_workload.add(sec_id)
    for sec_id in selected_sections:
        section = by_id[sec_id]
        hw = graph.registry.hardware[section.hardware]
        info = c.model(section.model)
        if info.dims is None and hw.is_gpu and sec_id in relevant:
            c.at = (sec_id, "")
            c.add(
                "info",
                "model-config-unknown",
                "config",
                f"memory, sequence-length and tensor-parallel rules skipped for model {section.model!r}: "
                f"{info.origin}",
                f'add config = "<path to its config.json>" under [models.{section.model}]',
            )
        if sec_id not in with_workload:
            c.baseline(section)
    configs = {name: info.origin for name, info in c.models.items()}
    return CheckReport(c.findings, c.estimates, configs, selected_sections, time.perf_counter() - t0)

