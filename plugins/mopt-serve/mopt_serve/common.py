"""What the serving kinds share: reading a model's config.json, the tensor-parallel rules, and
writing configs and launch scripts that name no absolute path. (Memory is `mopt check`'s own
estimator's job: each kind declares its `memory_model`, or its runtime's `kv_pool()`.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from mopt.api import CheckContext, Finding, HardwareProfile

#: the default distribution gates: mopt_ml.genmetrics.DEFAULT_GATES (mean KL and its p99, nats;
#: their sources in docs/recipes.md); a test keeps the two equal
DEFAULT_KL_GATES = {"max_kl": 0.05, "max_kl_p99": 0.5}

#: the checkpoints a quantizer, a serving config or a check starts from (and is compared with):
#: the source's weights, or a model pre-trained from them
CHECKPOINT_KINDS = ("pretrain", "weights")
#: which of several accepted models a serving config takes: the quantized one first
PREFER_MODEL = ("modelopt-ptq", *CHECKPOINT_KINDS)

#: model_types that are encoders (no KV cache, no causal-LM checkpoint export)
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert", "new")


def read_model_config(folder: Path) -> dict[str, Any]:
    """`config.json` of an HF-format folder ({} when there is none)."""
    p = folder / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def is_encoder(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in ENCODERS


def parallel_findings(ctx: CheckContext, tp: int, pp: int, *, tp_key: str, engine: str) -> list[Finding]:
    """TP shards must divide the attention heads; KV heads divide evenly or are replicated
    (tp a multiple of them); TP × PP GPUs must exist on the profile."""
    hw, cfg = ctx.hardware, ctx.model_config
    out: list[Finding] = []

    def add(sev: str, code: str, msg: str, fix: str = "", key: str | None = tp_key) -> None:
        out.append(Finding(sev, code, msg, fix, ctx.section, ctx.target, key))

    if hw.is_gpu and tp * pp > hw.gpu_count:
        add(
            "error",
            "not-enough-gpus",
            f"{engine}: tensor × pipeline parallel = {tp} × {pp} = {tp * pp} GPUs, profile {hw.name!r} has {hw.gpu_count}",
            f"{tp_key} = {max(1, hw.gpu_count // max(pp, 1))}",
        )
    if not cfg:
        if tp > 1:
            add(
                "info",
                "no-model-config",
                "no config.json for this model: head divisibility not checked",
                "give the model a local source or `config = ...` in [models.<name>]",
                None,
            )
        return out
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    if isinstance(heads, int) and heads % tp != 0:
        add(
            "error",
            "tp-heads",
            f"{engine}: tensor parallel size {tp} does not divide the model's {heads} attention heads",
            f"{tp_key} = one of {[d for d in range(1, heads + 1) if heads % d == 0 and d <= max(hw.gpu_count, 1)]}",
        )
    if isinstance(kv, int) and kv % tp != 0:
        if tp % kv == 0:
            add(
                "warning",
                "tp-kv-replicated",
                f"{engine}: tensor parallel size {tp} exceeds the model's {kv} KV heads; each is replicated "
                f"{tp // kv}× (more KV cache per token)",
            )
        else:
            add(
                "error",
                "tp-kv-heads",
                f"{engine}: tensor parallel size {tp} does not divide the model's {kv} KV heads",
                f"{tp_key} = a divisor of {kv}",
            )
    return out


def cc_str(hw: HardwareProfile) -> str:
    cc = hw.compute_capability
    return f"{cc[0]}.{cc[1]}" if cc else "none"


def dump_yaml(data: dict[str, Any]) -> str:
    """Block-style YAML in insertion order (stable bytes for the same params)."""
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def shell_script(
    comment: list[str], argv: list[str], needs_model: bool = True, env: dict[str, str] | None = None
) -> str:
    """A POSIX launch script: `$MODEL_DIR` stands for the model folder, `$HERE` for the
    artifact's own folder, so the artifact names no absolute path of the machine that built it."""
    lines = ["#!/bin/sh", *(f"# {c}" for c in comment), "set -eu", 'HERE=$(cd "$(dirname "$0")" && pwd)']
    if needs_model:
        lines.append('MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to the model folder (see the comment above)}"')
    lines += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    quoted = [sh_arg(a) for a in argv]
    lines.append("exec " + " ".join(quoted) + ' "$@"')
    return "\n".join(lines) + "\n"


def sh_arg(a: str) -> str:
    """Quote one argument for sh; `{model}` / `{here}` inside it become "$MODEL_DIR" / "$HERE"."""
    if "{model}" not in a and "{here}" not in a:
        return shlex.quote(a)
    esc = a.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
    return '"' + esc.replace("{model}", "$MODEL_DIR").replace("{here}", "$HERE") + '"'


def write_text(path: Path, text: str, executable: bool = False) -> None:
    path.write_text(text)
    if executable:
        path.chmod(0o755)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def version_tuple(v: str) -> tuple[int, ...]:
    """(1, 2) from "1.2.0rc3"; () when it does not start with a number."""
    out = []
    for part in v.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)
