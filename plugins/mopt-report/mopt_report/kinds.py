"""`mopt kinds [KIND]`: the target kinds of the registry (plugin, what each takes and makes)
and a kind's params (type, default, description), read from each kind's class and its
`Params` model; `--markdown` is the reference docs/kinds.md is generated as."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import PydanticUndefined

HEAD = """# Target kinds

Every target kind of mopt and its first-party plugins: what it takes, what it makes, and each
param with its type, default and description. Generated from the registry by
`mopt kinds --markdown --first-party > docs/kinds.md` (a test fails when this file is out of
date); `mopt kinds [KIND]` prints the same for whatever is installed, third-party kinds too.
Params go in a target's table (`[model.hardware.target]`), a section, or `[defaults]`:
[recipes.md](recipes.md#reference).
"""


def _type(t: Any) -> str:
    """`list[str]`, `int | None`, `Literal['fp16', 'fp32']`: an annotation as it reads in code."""
    plain = isinstance(t, type) and not getattr(t, "__args__", None)
    return (t.__name__ if plain else str(t)).replace("typing.", "").replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "" if value is PydanticUndefined else json.dumps(value, default=str)


def kind_info(registry: Any, name: str) -> dict[str, Any]:
    """One kind as `mopt kinds --json` lists it."""
    cls = registry.targets[name]
    plugin = registry.plugin_of("targets", name)
    return {
        "name": name,
        "plugin": plugin.name,
        "distribution": plugin.dist or "mopt",
        "first_party": plugin.builtin or plugin.first_party,
        "description": cls.description,
        "takes": [
            {
                "slot": i.name,
                "what": i.describe(),
                "required": i.required,
                "fanout": i.fanout,
                "gather": i.gather,
            }
            for i in cls.consumes
        ],
        "produces": cls.produces,
        "params": [
            {
                "name": n,
                "type": _type(f.annotation),
                "default": _default(f),
                "description": f.description or "",
            }
            for n, f in cls.Params.model_fields.items()
        ],
    }


def takes(info: dict[str, Any]) -> str:
    """`model: format onnx (one node each); reference: kind weights`."""
    how = {"fanout": " (one node each)", "gather": " (all of them)"}
    return "; ".join(
        f"{t['slot']}: {t['what']}{''.join(v for k, v in how.items() if t[k])}{'' if t['required'] else ', optional'}"
        for t in info["takes"]
    )


def markdown(infos: list[dict[str, Any]]) -> str:
    """The reference page: an index, then each kind with its params."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = [HEAD, "| kind | plugin | takes | produces | what it makes |", "|---|---|---|---|---|"]
    out += [
        f"| [{i['name']}](#{i['name']}) | {i['distribution']} | {cell(takes(i)) or '-'} | {i['produces'] or '-'} "
        f"| {cell(i['description'])} |"
        for i in infos
    ]
    for i in infos:
        out += ["", f"## {i['name']}", "", f"{i['description'] or '(no description)'}. Plugin `{i['plugin']}` "
                f"({i['distribution']}); takes {takes(i) or 'nothing'}; produces {i['produces'] or 'nothing'}.", ""]  # fmt: skip
        if not i["params"]:
            out.append("No params.")
            continue
        out += ["| param | type | default | description |", "|---|---|---|---|"]
        out += [
            f"| `{p['name']}` | {cell(p['type'])} | {cell(p['default'])} | {cell(p['description'])} |"
            for p in i["params"]
        ]
    return "\n".join(out) + "\n"
