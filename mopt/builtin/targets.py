"""Built-in target kinds: `command` (Bazel's genrule, DVC's stage)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from mopt import api, procs
from mopt.api import BuildContext, Input, TargetKind, hookimpl

_TOKEN = re.compile(r"\{(out|in|file)(?::([^{}]+))?\}")
_NAMED = re.compile(r"\{(model|hardware|section)(?::[^{}]+)?\}")


class CommandKind(TargetKind):
    """Run a command with declared inputs; it writes its outputs into $MOPT_OUT / {out}.

    Placeholders in `argv`: `{out}` (the output folder), `{in}` (the first input target's
    folder), `{in:NAME}` (input target NAME's folder), `{file}` / `{file:N}` (the first /
    N-th declared file, absolute); in `argv` and `files`: `{model}`, `{hardware}`, `{section}`
    (the section's names), so one `[defaults]` table can serve many sections. The key covers
    the argv, the declared files' and input targets' digests and the values of the env
    variables in `env` (nothing else of the environment reaches the command besides PATH,
    HOME and LANG).
    """

    name = "command"
    version = "1"
    description = "run a command with declared inputs into $MOPT_OUT"
    consumes = (Input("input", kinds=("*",), required=False),)
    produces = "files"

    class Params(api.Params):
        argv: list[str] = Field(min_length=1, description="the command and its arguments")
        files: list[str] = Field(default=[], description="input files, relative to the recipe")
        env: list[str] = Field(default=[], description="env variables passed through (keyed)")
        shell: bool = Field(default=False, description="run argv[0] with sh -c")

        @field_validator("env")
        @classmethod
        def _names(cls, v: list[str]) -> list[str]:
            for name in v:
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    raise ValueError(f"{name!r} is not an environment variable name")
            return v

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return [self._resolved(project_dir / f) for f in params.files]

    def _resolved(self, p: Path) -> Path:
        """`p.resolve()`, its folder resolved once per kind instance (one per engine): 10,000
        nodes' files sit in a few folders, and resolving walks every component's lstat."""
        name = p.name
        if name in ("", ".", "..") or os.path.islink(p):
            return p.resolve()
        dirs: dict[Path, Path] = self.__dict__.setdefault("_resolved_dirs", {})
        parent = dirs.get(p.parent)
        if parent is None:
            parent = dirs[p.parent] = p.parent.resolve()
        return parent / name

    def bind(self, params: Any, *, model: str, hardware: str, section: str) -> Any:
        """Params with {model}, {hardware}, {section} filled in (before keying)."""
        names = {"model": model, "hardware": hardware, "section": section}

        def fill(text: str) -> str:
            return _NAMED.sub(lambda m: names[m.group(1)], text)

        argv = [fill(a) for a in params.argv]
        files = [fill(f) for f in params.files]
        if argv == params.argv and files == params.files:
            return params  # frozen: shared as it is
        return params.model_copy(update={"argv": argv, "files": files})

    def env_values(self, params: Any) -> dict[str, str | None]:
        """The allow-listed env values (part of the key)."""
        return {k: os.environ.get(k) for k in sorted(params.env)}

    def run(self, ctx: BuildContext) -> dict[str, Any] | None:
        files = self.input_files(ctx.params, ctx.project_dir)
        arts = [a for slot in ctx.inputs.values() for a in slot]
        by_name = {a.target: a for a in arts}

        def sub(m: re.Match[str]) -> str:
            what, arg = m.group(1), m.group(2)
            if what == "out":
                return str(ctx.out)
            if what == "in":
                if arg is None:
                    if not arts:
                        raise ValueError("{in} used but the target has no input targets")
                    return str(arts[0].path)
                if arg not in by_name:
                    raise ValueError(f"{{in:{arg}}}: {arg!r} is not an input of this target")
                return str(by_name[arg].path)
            idx = int(arg) if arg else 0
            if idx >= len(files):
                raise ValueError(f"{{file:{idx}}}: only {len(files)} file(s) declared")
            return str(files[idx])

        argv = [_TOKEN.sub(sub, a) for a in ctx.params.argv]
        if ctx.params.shell:
            argv = ["sh", "-c", " ".join(argv)]
        env = {k: v for k in ("PATH", "HOME", "LANG") if (v := os.environ.get(k)) is not None}
        env.update({k: v for k, v in self.env_values(ctx.params).items() if v is not None})
        env["MOPT_OUT"] = str(ctx.out)
        env["MOPT_IN"] = os.pathsep.join(str(a.path) for a in arts)
        env["MOPT_FILES"] = os.pathsep.join(str(f) for f in files)
        ctx.log("$ " + " ".join(argv))
        try:
            rc = procs.run(argv, cwd=ctx.tmp, env=env, on_line=ctx.log)
        except FileNotFoundError:
            raise RuntimeError(f"command not found: {argv[0]!r}") from None
        if rc != 0:
            raise RuntimeError(f"command exited with status {rc}")
        return {"returncode": rc}


@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """The built-in `command` kind."""
    register(CommandKind)
