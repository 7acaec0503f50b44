"""Running one action: a `Spawn` (mopt.spawn) in, a `SpawnResult` out (Bazel's SpawnRunner).

`execute_spawn` turns a spawn into a `BuildContext` and runs the kind, always in a process
of its own: a worker of `ProcessRunner`'s warm pool on this machine (with `sandbox=True`
inside bubblewrap: the filesystem read-only but for its scratch folder and the store's
`cache/`, the GPUs bound in, no network for kinds with `network = False`), or the remote
runner (`mopt.executor.run_remote_spawn`) that an executor plugin calls on another machine.
The pool forks its workers from a fork server per sort of worker (a "zygote", `python -m
mopt.runner --zygote`) that has imported the modules the kinds declare
(`TargetKind.preload`), so torch is imported once per build, not once per worker or action
(`MOPT_ZYGOTE=0`: each worker is a new `python -m mopt.runner`).

A worker that crashes, calls `os._exit`, segfaults or is OOM-killed fails that action (its
log and the signal are kept) and is replaced; the environment, the working folder and
torch's thread count are restored after every action, so nothing leaks into the next one.
Workers die with the mopt process that started them (PR_SET_PDEATHSIG; bubblewrap's
--die-with-parent and its own pid namespace), and hold the action's lock descriptor while
they run, so a waiting build never runs an action beside an orphan of a killed one.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from pathlib import Path
from typing import Any

from mopt import procs
from mopt.api import BuildContext, HardwareProfile
from mopt.filehash import hash_file
from mopt.spawn import Spawn, SpawnResult

#: values of `[executor] sandbox`
SANDBOX_MODES = ("auto", "bwrap", "none")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# ---------------------------------------------------------------------- the action logger


class _TailHandler(logging.Handler):
    def __init__(self, cb: Callable[[str], None]) -> None:
        super().__init__()
        self.cb = cb

    def emit(self, record: logging.LogRecord) -> None:
        self.cb(record.getMessage())


def action_logger(key: str, path: Path, on_line: Callable[[str], None] | None = None) -> logging.Logger:
    """A logger of its own for one action: INFO and up into `path` (the action's log),
    every message to `on_line` (the live last line); close it with `close_logger`. Not
    registered with `logging` (no name to find it by): it goes with the action."""
    logger = logging.Logger(f"mopt.action.{key[:16]}", logging.DEBUG)
    fh = logging.FileHandler(path, encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(message)s"))
    fh.setLevel(logging.INFO)
    logger.addHandler(fh)
    if on_line is not None:
        logger.addHandler(_TailHandler(on_line))
    return logger


def close_logger(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        with contextlib.suppress(OSError):  # its last flush on a full disk: the action's error counts
            h.close()


# ---------------------------------------------------------------------- the one action-running function


def execute_spawn(spawn: Spawn, registry: Any, on_line: Callable[[str], None] | None = None) -> SpawnResult:
    """Run `spawn`'s kind in this process, `spawn.env` set meanwhile; never raises for a
    failing kind. Its log goes to `spawn.log`, each line also to `on_line`."""
    out, log = Path(spawn.out), Path(spawn.log)
    logger = action_logger(spawn.key, log, on_line)
    t0 = time.time()
    restore = _Restore()
    try:
        kind_cls = registry.targets.get(spawn.kind)
        if kind_cls is None:
            raise RuntimeError(f"target kind {spawn.kind!r} (plugin {spawn.plugin}) is not installed here")
        kind = kind_cls()
        fam = registry.families.get(spawn.family) if spawn.family else None
        ctx = BuildContext(
            out=out,
            tmp=Path(spawn.tmp),
            params=kind.Params.model_validate(spawn.params),
            inputs=spawn.inputs,
            model_name=spawn.model_name,
            family=fam() if fam else None,
            task=spawn.task,
            source=Path(spawn.source) if spawn.source is not None else None,
            hardware=HardwareProfile.model_validate(spawn.hardware),
            section=spawn.section,
            target=spawn.target,
            project_dir=Path(spawn.project_dir),
            logger=logger,
            offline=spawn.offline,
            cache_dir=Path(spawn.cache_dir) if spawn.cache_dir else None,
            missing=spawn.missing,
        )
        tempfile.tempdir = None  # recomputed from this action's TMPDIR, if it sets one
        where = f" on {spawn.host}" if spawn.host else ""
        logger.info(f"mopt: building {spawn.node_id} ({spawn.kind}) key {spawn.key[:16]}{where}")
        for k, v in spawn.env.items():  # None: unset
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        meta = kind.run(ctx) or {}
        json.dumps(meta)  # metadata must be JSON: fail here, not in the cache
        duration = time.time() - t0
        logger.info(f"mopt: done in {duration:.2f}s")
        return SpawnResult("ok", meta=meta, duration=duration, out=out, log=log)
    except BaseException as exc:  # a failing kind must not take the worker down
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, SystemExit):  # sys.exit() inside a kind fails that action only
            exc = RuntimeError(f"the kind called sys.exit({exc.code!r})")
        logger.error("mopt: FAILED: " + "".join(traceback.format_exception_only(exc)).strip())
        close_logger(logger)
        with contextlib.suppress(OSError), open(log, "a") as fh:  # a full disk: the error is returned
            fh.write(traceback.format_exc())
        return SpawnResult(
            "failed", duration=time.time() - t0, error=f"{type(exc).__name__}: {exc}", out=out, log=log
        )
    finally:
        restore.restore()
        close_logger(logger)


def _default_torch_threads() -> int:
    """The intra-op thread count torch starts with: OMP_NUM_THREADS / MKL_NUM_THREADS if set,
    else one per physical core this process may run on (torch's own rule)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        try:
            n = int(os.environ.get(var, ""))
            if n > 0:
                return n
        except ValueError:
            pass
    cores = set()
    for cpu in os.sched_getaffinity(0):
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


class _Restore:
    """What an action may change in its process, put back afterwards."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        torch = sys.modules.get("torch")
        self.torch_threads = torch.get_num_threads() if torch is not None else None

    def restore(self) -> None:
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        os.umask(self.umask)
        tempfile.tempdir = None
        torch = sys.modules.get("torch")
        if torch is not None:  # imported by this action or an earlier one
            want = self.torch_threads or _default_torch_threads()
            with contextlib.suppress(Exception):
                if torch.get_num_threads() != want:
                    torch.set_num_threads(want)


# ---------------------------------------------------------------------- the runner


def _workdir(parent: Path) -> tuple[Path, Path, Path]:
    d = Path(tempfile.mkdtemp(prefix="a-", dir=parent))
    (d / "out").mkdir()
    (d / "tmp").mkdir()
    return d / "out", d / "tmp", d / "log.txt"


@functools.cache
def bwrap_path() -> str | None:
    """The bubblewrap binary, if installed and able to make a sandbox here (it needs user
    namespaces, or root)."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        probe = subprocess.run(
            [path, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "--", "true"],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if probe.returncode == 0 else None


def resolve_sandbox(mode: str) -> tuple[bool, str]:
    """(whether actions run in bubblewrap, why) for `[executor] sandbox = mode`."""
    if mode == "none":
        return False, 'off ([executor] sandbox = "none")'
    path = bwrap_path()
    if path:
        return True, f"bubblewrap ({path})"
    if mode == "bwrap":
        return False, "bubblewrap is not usable here"
    return False, "bubblewrap not found (apt-get install bubblewrap): actions run unsandboxed"


def _worker_env(zygote: bool) -> dict[str, str]:
    env = {**os.environ, "MOPT_WORKER": "1"}
    if zygote and "OMP_WAIT_POLICY" not in env:
        # OpenMP threads (torch's intra-op pool, MKL) sleep when idle instead of spinning: in
        # worker processes beside each other (and beside other processes on the same cores)
        # the spinning pools made a tiny model's ops ~10x slower (a linear 25 ms instead of
        # 3 ms on a loaded 2-core machine) and burnt the CPU that the other actions needed.
        # For the zygote's imports only: its forked workers inherit the libraries' state but
        # drop the variable (MOPT_ZYGOTE_OMP), so actions see mopt's environment as it is.
        env["OMP_WAIT_POLICY"] = env["MOPT_ZYGOTE_OMP"] = "PASSIVE"
    return env


def _kill_group(pid: int) -> None:
    """SIGKILL process `pid` and its process group."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


class _Child:
    """Our end of a worker or zygote process: its socket, and `cleanup` (its scratch folder).
    `proc`: a `subprocess.Popen`, or a `_ForkedProc` for a worker forked by a zygote."""

    def __init__(self, proc: Any, sock: socket.socket, cleanup: ExitStack) -> None:
        self.proc = proc
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.cleanup = cleanup
        self.alive = True

    def hang_up(self, timeout: float) -> bool:
        """Close our end of its socket (at EOF it exits) and wait for it; False: it still runs."""
        for end in (self.conn, self.sock):
            with contextlib.suppress(OSError):
                end.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill_group(self) -> None:
        """SIGKILL it and its process group, also right after it died: its pid stays
        reserved as the group's id while any member lives (children it left behind)."""
        if not isinstance(self.proc, _ForkedProc):  # a forked one's zygote kills the group as it reaps
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()

    def kill(self) -> None:
        self.kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            # a forked worker's end is reported by its zygote, which may be busy importing
            self.proc.wait(timeout=5 if isinstance(self.proc, _ForkedProc) else 30)
        self.alive = False

    def end(self) -> None:
        self.alive = False
        with contextlib.suppress(Exception):
            self.cleanup.close()


class _Worker(_Child):
    """One warm worker process."""

    def __init__(
        self, proc: Any, sock: socket.socket, scratch: Path, cleanup: ExitStack, *,
        sandboxed: bool, warm: Iterable[str] = (),
    ) -> None:  # fmt: skip
        super().__init__(proc, sock, cleanup)
        self.scratch = scratch
        self.sandboxed = sandboxed
        #: modules imported in it: by its zygote before the fork, and by the kinds it ran
        self.warm = set(warm)

    def close(self) -> None:
        """Ask an idle worker to exit (EOF on its socket), kill it if it does not."""
        if not self.hang_up(2):
            self.kill()
        self.kill_group()  # anything left in its process group
        self.end()

    def run(self, spawn: Spawn, on_line: Callable[[str], None] | None, lock_fd: int | None) -> SpawnResult:
        t0 = time.time()
        try:
            self.conn.send(("run", spawn, lock_fd is not None))
            if lock_fd is not None:
                sendfds(self.sock, [lock_fd])
            while True:
                while not self.conn.poll(0.5):
                    if self.proc.poll() is not None:  # dead, though its socket may live on in a child
                        raise EOFError
                what, value = self.conn.recv()
                if what == "done":
                    res: SpawnResult = value
                    return res
                if on_line is not None:  # a "line"
                    on_line(value)
        except (EOFError, OSError):
            return self._crashed(spawn, time.time() - t0)

    def _crashed(self, spawn: Spawn, duration: float) -> SpawnResult:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()  # its process group too: children that outlived it
        sig = -code if code is not None and code < 0 else None
        if sig is None and code is not None and code > 128 and self.sandboxed:
            sig = code - 128  # bubblewrap reports its child's death by a signal as 128 + signal
        if sig is not None:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            why = f"the action's process was killed by {name}"
            if sig == signal.SIGKILL:
                why += " (out of memory, or killed from outside)"
        elif code is None:
            why = "the action's process stopped answering"
        else:
            why = f"the action's process exited with code {code} (os._exit?) before the action finished"
        with contextlib.suppress(OSError), open(spawn.log, "a") as fh:
            fh.write(f"mopt: FAILED: {why}\n")
        return SpawnResult("crashed", duration=duration, error=why, out=Path(spawn.out), log=Path(spawn.log))


class ProcessRunner:
    """A pool of warm worker processes, optionally each in a bubblewrap sandbox (Bazel's
    SpawnRunner): `exec` is a context manager that yields a spawn's result; the caller
    stores `result.out` / `result.log` before it exits, then the runner removes them.

    Workers are started on first use (a no-op build starts none), reused across actions
    of any kind, and at most `max_workers` live at once. Sandboxed workers differ by
    whether they have the network, so a pool may hold both sorts. Each has a scratch
    folder of its own from `scratch()` (a context manager that yields a new folder).

    Where it can (`_forks`), workers are forked by their sort's zygote (as Android's); a
    worker that lacks a module the next action needs is replaced by a fresh fork
    (milliseconds) rather than made to import it (seconds). Under bubblewrap the zygote
    runs inside the sandbox and each worker it forks fences its own writes in to its
    scratch folder and the store's `cache/` with Landlock, as the workers of one sandbox
    share its mounts.
    """

    def __init__(
        self,
        *,
        max_workers: int,
        scratch: Callable[[], AbstractContextManager[Path]],
        sandbox: bool = False,
        writable: tuple[str, ...] = (),
        disabled_plugins: tuple[str, ...] = (),
    ) -> None:
        self.max_workers = max(1, max_workers)
        self.sandbox = sandbox
        self.writable = tuple(writable)
        self._scratch = scratch
        self.disabled_plugins = tuple(disabled_plugins)
        self._zygotes: dict[str, _Zygote] = {}
        self._idle: list[tuple[str, _Worker]] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self._cond = threading.Condition()
        self._closed = False
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mopt-spawner")
        _RUNNERS.add(self)

    # -- workers

    def _sort(self, spawn_sandboxed: bool, network: bool) -> str:
        """Which sort of worker runs an action: "host" (no sandbox), "net" or "nonet"."""
        if not (self.sandbox and spawn_sandboxed):
            return "host"
        return "net" if network else "nonet"

    def _argv(self, child_fd: int, scratch: Path, sort: str, role: str) -> list[str]:
        ppid = os.getpid() if sort == "host" else 0  # in bubblewrap its parent is bubblewrap's init
        py = [sys.executable, "-m", "mopt.runner", *(["--zygote"] if role == "zygote" else []),
              str(child_fd), str(ppid), *self.disabled_plugins]  # fmt: skip
        if sort == "host":
            return py
        bwrap = bwrap_path()
        assert bwrap is not None
        argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # the GPUs: /dev above is a fresh, minimal one
        for dev in sorted(Path("/dev").glob("nvidia*")) + [Path("/dev/dri")]:
            if dev.exists():
                argv += ["--dev-bind", str(dev), str(dev)]
        for rw in (str(scratch), *self.writable):
            argv += ["--bind", rw, rw]
        if sort == "nonet":
            argv.append("--unshare-net")
        # its own pid namespace: when bubblewrap dies (with mopt: --die-with-parent) every
        # process of the action dies with it, however deep
        argv += ["--unshare-pid", "--die-with-parent", "--new-session", "--chdir", str(scratch), "--"]
        return argv + py

    def _launch(self, sort: str, role: str) -> tuple[subprocess.Popen[bytes], socket.socket, Path, ExitStack]:
        """Start a worker or zygote (`role`) of `sort` in a new scratch folder, its output
        into `<role>.log` there; return it, our end of its socket, the folder, its cleanup."""
        cleanup = ExitStack()
        parent, child = socket.socketpair()
        try:
            scratch = Path(cleanup.enter_context(self._scratch()))
            with open(scratch / f"{role}.log", "ab") as errlog:
                proc = subprocess.Popen(
                    self._argv(child.fileno(), scratch, sort, role),
                    pass_fds=(child.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=errlog,
                    stderr=errlog,
                    start_new_session=True,  # Ctrl-C reaches mopt only; mopt stops them
                    env=_worker_env(zygote=role == "zygote"),
                )
        except BaseException:
            parent.close()
            cleanup.close()
            raise
        finally:
            child.close()
        return proc, parent, scratch, cleanup

    def _zygote(self, sort: str) -> _Zygote:
        """The zygote of `sort`, started if it is not running (on the spawner thread only)."""
        z = self._zygotes.get(sort)
        if z is None or not z.alive:
            z = self._zygotes[sort] = _Zygote(self, sort, *self._launch(sort, "zygote"))
        return z

    def prestart(self, kinds: Iterable[tuple[bool, bool, tuple[str, ...]]]) -> None:
        """Start the zygotes of the actions that may run, now, and have them import those
        actions' modules (`(sandboxed, network, preload)` of each kind) in the background:
        a build calls this before it keys its actions (resolving sources, hashing inputs),
        so the imports overlap that work instead of following the first miss. Kinds that
        preload nothing start nothing here (their zygote starts at their first miss)."""
        wanted: dict[str, dict[str, None]] = {}  # sort → its modules, in order
        for sandboxed, network, preload in kinds:
            sort = self._sort(sandboxed, network)
            if preload and _forks(sort):
                wanted.setdefault(sort, {}).update(dict.fromkeys(preload))

        def start(sort: str, mods: tuple[str, ...]) -> None:
            with self._cond:
                if self._closed:
                    return
            self._zygote(sort).send(("preload", mods))

        for sort, mods in wanted.items():
            self._spawner.submit(start, sort, tuple(mods))

    def _start(self, sort: str, needs: tuple[str, ...]) -> _Worker:
        """A new worker, started on the spawner thread only: one long-lived thread forks every
        worker and zygote, as PR_SET_PDEATHSIG fires when the *thread* that forked a process
        ends, so none may be forked by a short-lived one."""
        if _forks(sort):
            return self._zygote(sort).fork(needs)
        proc, sock, scratch, cleanup = self._launch(sort, "worker")
        return _Worker(proc, sock, scratch, cleanup, sandboxed=sort != "host")

    def _acquire(self, key: str, needs: tuple[str, ...]) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the action runner was shut down")
                # a worker that has the kind's modules warm, the last one released first
                fits = [
                    (w.warm.issuperset(needs), i)
                    for i, (k, w) in enumerate(self._idle)
                    if k == key and w.proc.poll() is None
                ]
                forks = _forks(key)
                if fits:
                    warm, i = max(fits)
                    if warm or not forks:
                        w = self._idle.pop(i)[1]
                        self._busy.add(w)
                        return w
                    # forked workers are cheap: a fresh one from the zygote (which imports
                    # the modules once) beats importing them here, in one worker of several
                    self._idle.pop(i)[1].close()
                total = len(self._idle) + len(self._busy) + self._starting
                if total < self.max_workers:
                    self._starting += 1  # until it is up
                    fut = self._spawner.submit(self._start, key, needs)
                    break
                if self._idle:  # only workers of the other sort are idle: make room
                    _k, old = self._idle.pop(0)
                    old.close()
                    continue
                self._cond.wait()
        try:
            w = fut.result()
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
        with self._cond:
            self._busy.add(w)
        return w

    def _release(self, w: _Worker, key: str) -> None:
        with self._cond:
            self._busy.discard(w)
            keep = w.alive and w.proc.poll() is None and not self._closed
            if keep:
                self._idle.append((key, w))
            self._cond.notify_all()
        if not keep:
            w.close()

    @contextlib.contextmanager
    def exec(
        self, spawn: Spawn, *, on_line: Callable[[str], None] | None = None, lock_fd: int | None = None
    ) -> Iterator[SpawnResult]:
        key = self._sort(spawn.sandboxed, spawn.network)
        w = self._acquire(key, spawn.preload)
        w.warm.update(spawn.preload)
        out, tmp, log = _workdir(w.scratch)
        spawn = replace(spawn, out=str(out), tmp=str(tmp), log=str(log))
        if key != "host":  # /tmp is read-only in there: temp files go to the action's tmp
            spawn = replace(spawn, env={**spawn.env, "TMPDIR": str(tmp)})
        try:
            res = w.run(spawn, on_line, lock_fd)
            if self._closed and not res.ok:  # its worker was killed: the build is being stopped
                raise KeyboardInterrupt("the build was stopped")  # an action stopped, not failed
            # the result's bytes stay in the worker's scratch until stored: the worker
            # (which could write there) is not given another action meanwhile
            yield res
        finally:
            _rmtree(out.parent)
            self._release(w, key)

    def shutdown(self) -> None:
        """Stop the runner's processes (idle ones are asked to exit, busy ones killed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._spawner.shutdown(wait=True)  # no process is started after this
        with self._cond:
            idle = [w for _k, w in self._idle]
            busy = list(self._busy)
            self._idle.clear()
        for w in busy:
            w.kill()
        for w in idle:
            w.close()
        with self._cond:  # their threads may still read their scratch (keep a log, store): it
            self._cond.wait_for(lambda: not self._busy, timeout=10)  # goes with the zygote's
        for z in list(self._zygotes.values()):
            z.close()
        _RUNNERS.discard(self)

    def kill(self) -> None:
        """Kill every worker now (signals: the build is being stopped)."""
        with self._cond:
            self._closed = True
            workers = [w for _k, w in self._idle] + list(self._busy)
        for w in workers:
            with contextlib.suppress(Exception):
                w.kill()
        for z in list(self._zygotes.values()):
            with contextlib.suppress(Exception):
                z.kill()



# ---------------------------------------------------------------------- the zygote (fork server)


def _forks(sort: str) -> bool:
    """Whether workers of `sort` are forked from a zygote here.

    Not with MOPT_ZYGOTE=0; Linux only (fork with the inherited state is what Linux
    offers; elsewhere `fork` after imports such as torch's is unsafe); in a sandbox it
    needs Landlock (Linux 5.13+, `landlock` in the kernel's LSM list), because the workers
    of one sandbox share its mounts and must fence themselves off from each other."""
    if os.environ.get("MOPT_ZYGOTE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    return sort == "host" or landlock_abi() >= 1


class _ForkedProc:
    """A worker forked by a zygote, as `_Worker` sees it (Popen's `pid / poll / wait / kill`):
    its exit status comes from the zygote, which is its parent."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    def poll(self) -> int | None:
        return self.zygote.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        return code

    def kill(self) -> None:
        """SIGKILL the worker's process group: here when its pid is ours to see (a plain
        zygote), else by the zygote (a sandbox's pids are its own)."""
        if self.zygote.sort == "host":
            _kill_group(self.pid)
        self.zygote.send(("kill", self.pid))


class _Zygote(_Child):
    """mopt's side of one fork server: ask it for workers, learn how they ended."""

    def __init__(
        self, runner: ProcessRunner, sort: str, proc: Any, sock: socket.socket, root: Path, cleanup: ExitStack
    ) -> None:
        super().__init__(proc, sock, cleanup)
        self.runner = runner
        self.sort = sort
        self.root = root
        self.send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._status: dict[int, int] = {}
        self._replies: list[Any] = []
        self.forked = 0
        threading.Thread(target=self._read, name=f"mopt-zygote-{sort}", daemon=True).start()

    def send(self, msg: Any, fds: list[int] | None = None) -> None:
        with self.send_lock, contextlib.suppress(OSError):
            self.conn.send(msg)
            if fds:
                sendfds(self.sock, fds)

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._cond:
                if msg[0] == "exit":
                    self._status[msg[1]] = msg[2]
                else:
                    self._replies.append(msg)
                self._cond.notify_all()
        with self._cond:  # the zygote is gone, and with it (PR_SET_PDEATHSIG) its workers
            self.alive = False
            self._cond.notify_all()

    def status(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._status:
                return self._status[pid]
            return None if self.alive else -signal.SIGKILL

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._status or not self.alive, timeout)
        return self.status(pid)

    def fork(self, needs: tuple[str, ...]) -> _Worker:
        """A new worker (called on the runner's spawner thread only)."""
        scratch = Path(tempfile.mkdtemp(prefix="w-", dir=self.root))
        cleanup = ExitStack()
        cleanup.callback(_rmtree, scratch)
        parent, child = socket.socketpair()
        try:
            landlock = self.sort != "host"
            self.send(("fork", str(scratch), tuple(needs), self.runner.writable, landlock), [child.fileno()])
            with self._cond:
                self._cond.wait_for(lambda: self._replies or not self.alive)
                if not self._replies:
                    raise RuntimeError(f"the action runner's fork server died (see {self.root}/zygote.log)")
                reply = self._replies.pop(0)
            if reply[0] != "forked":
                raise RuntimeError(f"the action runner's fork server could not fork a worker: {reply[1]}")
            self.forked += 1
            proc = _ForkedProc(self, reply[1])
            return _Worker(proc, parent, scratch, cleanup, sandboxed=False, warm=reply[2])
        except BaseException:
            parent.close()
            cleanup.close()
            raise
        finally:
            child.close()

    def close(self) -> None:
        """Ask the zygote to end (it kills what it forked); kill it if it does not. One
        that forked nothing is killed at once: it may be in the middle of a long import
        (started ahead by `prestart` for a build that turned out to be all hits)."""
        if not (self.forked and self.hang_up(5)):
            self.kill()
        self.end()

    def kill(self) -> None:
        super().kill()
        self.end()  # the reader thread wakes those who wait for it, at its socket's EOF


_RUNNERS: set[ProcessRunner] = set()


def kill_all() -> None:
    """Kill every worker of every runner of this process (SIGINT / SIGTERM / SIGHUP)."""
    for r in list(_RUNNERS):
        r.kill()


def _rmtree(path: Path) -> None:
    def onerror(func: Any, p: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o755)
            os.chmod(p, 0o755)
            func(p)

    shutil.rmtree(path, onerror=onerror)


# ---------------------------------------------------------------------- inputs must not change


@dataclass
class InputWatch:
    """The stats (inode, size, mtime_ns, ctime_ns) of every file an action reads, taken
    before it runs, to compare with after. `digests`: path → blob digest for files that
    are store blobs (materialized inputs), so a stat change can be told from a benign one
    (another link to the same blob changes its ctime) by rehashing."""

    stats: dict[str, tuple[int, int, int, int]]
    digests: dict[str, str]

    @classmethod
    def take(cls, roots: list[Path], digests: dict[str, str]) -> InputWatch:
        return cls(_stat_tree(roots), digests)

    def changes(self, roots: list[Path]) -> list[tuple[str, str | None]]:
        """(file, its blob digest or None) for every file that changed, appeared or went.
        Not rehashed through the stat cache: it wants a stat that holds still while hashing,
        and siblings linking and unlinking the same blob keep moving its ctime."""
        now = _stat_tree(roots)
        bad: list[tuple[str, str | None]] = []
        for path in sorted(set(self.stats) | set(now)):
            old, new = self.stats.get(path), now.get(path)
            if old == new:
                continue
            digest = self.digests.get(path)
            if old is not None and new is not None and old[:3] == new[:3] and digest is not None:
                try:
                    if hash_file(path) == digest:
                        continue  # only the ctime moved (a new link to the blob): same bytes
                except OSError:
                    pass
            bad.append((path, digest))
        return bad


def _stat_tree(roots: list[Path]) -> dict[str, tuple[int, int, int, int]]:
    out: dict[str, tuple[int, int, int, int]] = {}

    def add(p: str) -> None:
        try:
            st = os.stat(p)
        except OSError:
            return
        out[p] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    for root in roots:
        r = str(root)
        if os.path.isdir(r):
            for dirpath, _dirs, files in os.walk(r, followlinks=True):
                for f in files:
                    add(os.path.join(dirpath, f))
        else:
            add(r)
    return out


# ---------------------------------------------------------------------- the worker process


def _serve(fd: int) -> None:
    """The worker's loop: receive spawns, run them with `execute_spawn`, answer; at EOF end."""
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    send_lock = threading.Lock()  # the kind may log from threads of its own

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("exit",)
        if msg[0] != "run":
            _end_leftovers()
            return
        spawn: Spawn = msg[1]
        lock = recvfds(sock, 1)[0] if msg[2] else None
        procs.ACTION_FDS = (lock,) if lock is not None else ()
        try:
            with _output_to(spawn.log):
                registry = _registry(spawn.disabled_plugins)
                res = execute_spawn(spawn, registry, lambda line: send(("line", line)))
                _reap()
        finally:
            procs.ACTION_FDS = ()
            if lock is not None:
                os.close(lock)
        send(("done", res))


def _children() -> list[int]:
    """This process's child processes (with the subreaper flag: orphans of its children too)."""
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
    return kids


def _reap() -> None:
    """Reap children (and adopted orphans) that have ended. Live ones are left alone between
    actions: a library's warm helper processes (torch.compile's worker pool) must survive."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _end_leftovers() -> None:
    """Kill whatever the actions started and left running, orphans included (the worker
    is their subreaper), and reap it: when a worker ends, nothing it started lives on."""
    for _ in range(100):
        _reap()
        kids = _children()
        if not kids:
            return
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


@contextlib.contextmanager
def _output_to(log: str) -> Iterator[None]:
    """Point fds 1 and 2 at the action's log meanwhile (native libraries' output,
    faulthandler's trace of a segfault)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        for std, fd in zip((1, 2), saved, strict=True):
            os.dup2(fd, std)
            os.close(fd)


@functools.cache
def _registry(disabled: tuple[str, ...]) -> Any:
    """The plugin registry (loaded once per process; a forked worker inherits its zygote's)."""
    from mopt.plugins import get_registry

    return get_registry(disabled)


def _become_worker(ppid: int) -> bool:
    """What every worker does first: die with its parent (thread), adopt its actions'
    orphans, leave Ctrl-C to mopt, trace segfaults into fd 2. False: the parent is already gone."""
    if procs.prctl is not None:
        procs.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        procs.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # an action's orphans become ours to end
    if ppid and os.getppid() != ppid:
        return False  # the parent died before the line above took effect
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # mopt decides when an action stops
    faulthandler.enable()  # a segfault's Python trace goes to fd 2: the action's log
    return True


def worker_main(argv: list[str]) -> int:
    """`python -m mopt.runner [--zygote] FD PPID [DISABLED_PLUGIN...]`: a worker or a zygote
    that talks to mopt over socket FD and dies with PPID (0: no check)."""
    zygote = argv[:1] == ["--zygote"]
    fd, ppid, *disabled = argv[1:] if zygote else argv
    if _become_worker(int(ppid)):
        # the plugins load now, while mopt is still busy elsewhere: the first action then
        # finds a warm worker
        _registry(tuple(disabled))
        (zygote_main if zygote else _serve)(int(fd))
    return 0


# ---------------------------------------------------------------------- Landlock


_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (every arch)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, int(libc.syscall(_SYS_LANDLOCK[0], None, ctypes.c_size_t(0),
                                       ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))))
    except Exception:
        return 0


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_writes(allowed: list[str]) -> None:
    """Forbid this process and everything it starts to create, change, rename or remove
    files anywhere but beneath `allowed` (reading and executing stay as they are).
    Raises OSError when the kernel refuses."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available")
    # WRITE_FILE (bit 1); REMOVE_DIR, REMOVE_FILE, MAKE_CHAR .. MAKE_SYM (4-12), then REFER
    # (13) from ABI 2 on and TRUNCATE (14) from ABI 3 on
    rights = (1 << 1) | sum(1 << b for b in range(4, 12 + min(abi, 3)))
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.c_uint64(rights)  # struct landlock_ruleset_attr's first field, handled_access_fs
    rfd = libc.syscall(_SYS_LANDLOCK[0], ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if rfd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path in allowed:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not there: nothing to allow
            try:
                rule = _PathBeneath(rights, pfd)
                if libc.syscall(_SYS_LANDLOCK[1], ctypes.c_int(rfd), ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(pfd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        if libc.syscall(_SYS_LANDLOCK[2], ctypes.c_int(rfd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(rfd)


# ---------------------------------------------------------------------- the zygote process


def zygote_main(fd: int) -> None:
    """The fork server: serve `preload` / `fork` / `kill` requests on socket `fd` until EOF.

    It never runs an action itself and starts no thread of its own, so a fork copies a
    process that holds no lock of another thread. The modules a request names are
    imported here first (once; an import that fails is left to the action, which then
    meets the error itself). It reports every forked worker's end (`exit`, pid,
    Popen-style return code) and kills that worker's process group then.

    Not `multiprocessing`'s forkserver with `set_forkserver_preload`: that server is one
    per Python process with a preload list fixed before it starts (a second build in the
    same process would get the first's), it is started as a plain interpreter (it cannot
    be put inside bubblewrap, one per sandbox sort), and it imports everything up front;
    this one is per build and sort, runs inside the sandbox, and imports on demand."""
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    zygote_pid = os.getpid()
    tried: list[str] = []  # modules imported here, or that failed to (a fork would fail too)
    workers: set[int] = set()
    chld = {signal.SIGCHLD}

    def send(msg: Any) -> None:
        # no report from the SIGCHLD handler in the middle of another message: a signal
        # blocked here is handled when it is unblocked (pthread_sigmask runs the handler)
        signal.pthread_sigmask(signal.SIG_BLOCK, chld)
        try:
            conn.send(msg)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, chld)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if pid in workers:  # else an adopted orphan
                workers.discard(pid)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)  # what it left behind in its group
                send(("exit", pid, code))

    def on_sigchld(_sig: int, _frame: Any) -> None:
        # a worker's end is reported at once, also while a long import runs here
        with contextlib.suppress(OSError):
            reap()

    def preload(needs: tuple[str, ...]) -> None:
        for mod in needs:
            if mod not in tried:
                tried.append(mod)
                try:
                    __import__(mod)
                except BaseException as exc:  # the action meets it again, in its log
                    print(f"mopt zygote: preloading {mod} failed: {exc!r}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGCHLD, on_sigchld)

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "kill":
                _kill_group(msg[1])
                continue
            if msg[0] == "preload":  # ahead of the first fork: the build is still keying
                preload(msg[1])
                continue
            if msg[0] != "fork":
                break
            _, scratch, needs, writable, landlock = msg
            wfd = recvfds(sock, 1)[0]
            preload(needs)
            sys.stdout.flush()
            sys.stderr.flush()
            # what is imported so far is never collected in a fork: the collector would touch
            # (and so copy) every page of it in each worker
            gc.freeze()
            # a worker's end is reported after its "forked" (that send unblocks the signal)
            signal.pthread_sigmask(signal.SIG_BLOCK, chld)
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(wfd)
                send(("error", f"fork: {exc}"))
                continue
            if pid == 0:  # the worker
                code = 0
                try:
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its children are its own
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, chld)
                    if os.environ.pop("MOPT_ZYGOTE_OMP", None):
                        del os.environ["OMP_WAIT_POLICY"]
                    conn.close()
                    sock.close()
                    os.setsid()  # a process group of its own: killed as one
                    if not _become_worker(zygote_pid):
                        os._exit(0)
                    if landlock:
                        landlock_writes([scratch, *writable, "/dev"])
                        os.chdir(scratch)
                    _serve(wfd)
                except BaseException:
                    code = 70  # first: printing may fail too (a full disk)
                    traceback.print_exc()
                finally:
                    with contextlib.suppress(Exception):
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(code)
            os.close(wfd)
            workers.add(pid)
            send(("forked", pid, tried))
    finally:
        for pid in list(workers):
            _kill_group(pid)
        _end_leftovers()


if __name__ == "__main__":
    # run the module's importable copy: what the worker pickles must name mopt.runner's
    # classes, not __main__'s
    from mopt import runner as _runner

    sys.exit(_runner.worker_main(sys.argv[1:]))
