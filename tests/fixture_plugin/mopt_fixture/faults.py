"""Kinds that misbehave on purpose, for the isolation tests (tests/faults/test_exec.py):
a plugin of their own (entry point `fixture-faults`), so the toy plugin's list stays as is."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from mopt.api import BuildContext, Input, Params, TargetKind, hookimpl


class ToyMisbehave(TargetKind):
    """An action that misbehaves on purpose (tests of isolation): `how` is one of
    segfault, exit (os._exit), kill (SIGKILL, as the OOM killer does), sys-exit,
    write-input, write-project, leak (set an env variable and, with `torch`, torch's
    threads), probe (write what it sees of those into its output), connect (to
    127.0.0.1:`port`), ok."""

    name = "toy-misbehave"
    consumes = (Input("model", kinds=("toy-weights", "toy-export", "toy-misbehave"), required=False),)

    class Params(Params):
        how: str = "ok"
        torch: bool = False
        port: int = 0

    #: a module nothing else of mopt imports: whether it is there when run() starts tells
    #: that the worker was forked from a zygote that preloaded it
    preload = ("wave",)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import sys

        preloaded = "wave" in sys.modules
        how = ctx.params.how
        ctx.log(f"misbehaving: {how}")
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
        elif how == "exit":
            os._exit(3)
        elif how == "kill":
            os.kill(os.getpid(), 9)
        elif how == "sys-exit":
            raise SystemExit(4)
        elif how == "write-input":
            art = next(a for arts in ctx.inputs.values() for a in arts)
            victim = sorted(p for p in art.path.rglob("*") if p.is_file())[0]
            with open(victim, "a") as fh:
                fh.write("tampered\n")
        elif how == "write-project":
            (ctx.project_dir / "escaped.txt").write_text("written by an action\n")
        elif how == "leak":
            os.environ["MOPT_FIXTURE_LEAK"] = "leaked"
            os.chdir(ctx.tmp)
            if ctx.params.torch:
                import torch

                torch.set_num_threads(1)
        elif how == "connect":
            import socket

            with socket.create_connection(("127.0.0.1", ctx.params.port), timeout=5) as s:
                s.sendall(b"hello")
        seen: dict[str, Any] = {"leak": os.environ.get("MOPT_FIXTURE_LEAK"), "cwd": os.getcwd(),
                                "preloaded": preloaded}
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            seen["parent"] = fh.read().replace(b"\0", b" ").decode()
        seen["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
        with open(f"/proc/{os.getppid()}/environ", "rb") as fh:
            parent_env = dict(e.split(b"=", 1) for e in fh.read().split(b"\0") if b"=" in e)
        seen["parent_omp_wait_policy"] = (parent_env.get(b"OMP_WAIT_POLICY") or b"").decode() or None
        if ctx.params.torch and how == "probe":
            import torch

            seen["torch_threads"] = torch.get_num_threads()
        (ctx.out / "seen.json").write_text(json.dumps(seen, sort_keys=True))
        return seen


class ToyNoNetwork(ToyMisbehave):
    """`toy-misbehave` for a kind that declares it needs no network."""

    name = "toy-no-network"
    network = False



@hookimpl
def mopt_register_targets(register: Callable[[Any], None]) -> None:
    """The misbehaving kinds."""
    register(ToyMisbehave)
    register(ToyNoNetwork)
