"""A server started in two halves: its Python imports first, its `main` on a word.

On the H200 (2026-12-05, `tests/data/h200-2026-12-05`), ~55 of each vLLM start's 87-131 s
passed before the engine touched the GPU: ~21 s until `vllm serve` logged its first line, then
18-47 s resolving the model's architecture in the API process. serve-search starts its configs
one after another, so the next config's imports can run while the current one compiles and
serves: `Prestarted.spawn` starts this module (`python -m mopt_serve.prestart`), which imports
what `vllm serve` imports before it allocates on a GPU (never `torch.cuda`), says so in the
server's log and waits on stdin; `go()` makes it run the entry point as `python -m` would,
with the same argv. `pause()` / `resume()` stop its process group (SIGSTOP / SIGCONT) while
another server is measured, so a timed step shares the machine with nothing of it.

Launcher line: `python -m mopt_serve.prestart [--preload M,M] [--arch A] -m MODULE -- ARGS`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VLLM_MAIN = "vllm.entrypoints.cli.main"
# what `vllm serve` imports before the engine allocates on a GPU (vLLM 0.26): its CLI, the
# OpenAI API server, the engine core and the model registry; none initializes CUDA
VLLM_PRELOAD = (
    "torch",
    "transformers",
    VLLM_MAIN,
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.model_executor.models.registry",
)
READY = "mopt-prestart: imported"


def vllm_launcher(argv: list[str], model_dir: Path) -> list[str] | None:
    """`argv` (a `vllm serve` line: the console script, or this Python's `-m
    vllm.entrypoints.cli.main`) as a prestart line; None for any other command."""
    if argv[:1] == ["vllm"]:
        rest = argv[1:]
    elif argv[1:3] == ["-m", VLLM_MAIN]:
        rest = argv[3:]
    else:
        return None
    arch = []
    with contextlib.suppress(OSError, ValueError, LookupError, TypeError):
        arch = ["--arch", str(json.loads((model_dir / "config.json").read_text())["architectures"][0])]
    return [
        sys.executable,
        "-m",
        __name__,
        "--preload",
        ",".join(VLLM_PRELOAD),
        *arch,
        "-m",
        VLLM_MAIN,
        "--",
        *rest,
    ]


class Prestarted:
    """A launcher process waiting for `go()`, in a process group of its own."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc, self.log_path, self.paused = proc, log_path, False

    @classmethod
    def spawn(
        cls, argv: list[str], log_path: Path, env: dict[str, str] | None, preexec: Any = None
    ) -> Prestarted:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, env=env, preexec_fn=preexec,
            )  # fmt: skip
        return cls(proc, log_path)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        if self.proc.poll() is None and not self.paused:
            self._signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def go(self) -> subprocess.Popen[bytes]:
        """Run the entry point now (the imports may still be under way: it runs after them)."""
        self.resume()
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        return self.proc

    def cancel(self) -> None:
        """Stop it without running anything (its imports, if any are left, with it)."""
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def _preload(modules: list[str], arch: str | None) -> list[str]:
    done = []
    for m in modules:
        try:
            importlib.import_module(m)
            done.append(m)
        except Exception as e:  # a module that moved between vLLM versions: the start is only slower
            print(f"mopt-prestart: could not import {m}: {type(e).__name__}: {e}", flush=True)
    if arch:
        try:  # the architecture's module, as vLLM's registry names it (a private table: guarded)
            from vllm.model_executor.models.registry import _VLLM_MODELS  # type: ignore[import-not-found]

            m = "vllm.model_executor.models." + _VLLM_MODELS[arch][0]
            importlib.import_module(m)
            done.append(m)
        except Exception as e:
            print(
                f"mopt-prestart: could not import the module of {arch}: {type(e).__name__}: {e}", flush=True
            )
    return done


def main(argv: list[str] | None = None) -> int:
    import argparse
    import runpy

    ap = argparse.ArgumentParser(prog="python -m mopt_serve.prestart")
    ap.add_argument("--preload", default="")
    ap.add_argument("--arch", default=None)
    ap.add_argument("-m", dest="module", required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    t0 = time.monotonic()
    done = _preload([m for m in a.preload.split(",") if m], a.arch)
    cuda = sys.modules.get("torch")
    if cuda is not None and getattr(cuda, "cuda", None) is not None and cuda.cuda.is_initialized():
        print("mopt-prestart: warning: an import initialized CUDA", flush=True)
    print(f"{READY} {len(done)} modules in {time.monotonic() - t0:.1f} s; waiting for go", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 0  # the search ended first: nothing runs
    t = time.monotonic()
    devnull = os.open(os.devnull, os.O_RDONLY)  # the servers' children must not hold the pipe
    os.dup2(devnull, 0)
    os.close(devnull)
    print(f"mopt-prestart: go after {t - t0:.1f} s", flush=True)
    sys.argv = [a.module, *rest]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
