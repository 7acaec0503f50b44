"""Faults of execution, through the real CLI: actions that crash, exit, segfault, change their
inputs, write into the project, leak state, or outlive a killed mopt (issue 13, items 2, 8, 9).

Each test builds in `proj/` next to an `outside/` folder and asserts the exit code, that no
traceback was printed, that nothing outside the project and its store changed, and that the
store checker (tests/storecheck.py, which does not import mopt) passes afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TOY_MODEL, run_mopt
from tests.storecheck import check_store

HAS_BWRAP = shutil.which("bwrap") is not None and subprocess.run(
    ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "true"], capture_output=True
).returncode == 0
SANDBOXES = ["none", pytest.param("bwrap", marks=pytest.mark.skipif(not HAS_BWRAP, reason="no usable bwrap"))]

HEAD = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[toy.cpu]
hardware = "cpu"
"""


class Proj:
    """A project folder (with its store) beside an `outside/` folder that must stay as it is."""

    def __init__(self, root: Path, sandbox: str) -> None:
        self.dir = root / "proj"
        self.outside = root / "outside"
        self.root = root
        shutil.copytree(TOY_MODEL, self.dir / "toy-model")
        (self.dir / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n\n[executor]\nsandbox = "{sandbox}"\n')
        self.outside.mkdir()
        (self.outside / "keep.txt").write_text("untouched\n")
        self.before = self._outside_state()

    def _outside_state(self) -> dict[str, object]:
        return {
            "root": sorted(os.listdir(self.root)),
            "outside": {p.name: p.read_bytes() for p in self.outside.iterdir()},
        }

    def recipe(self, body: str) -> None:
        (self.dir / "r.toml").write_text(HEAD + body)

    def build(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_mopt("build", "r.toml", "--no-check", *args, cwd=self.dir, env=env, timeout=600)

    def build_json(self, *args: str) -> tuple[int, dict, str]:
        proc = self.build("--json", *args)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.returncode, json.loads(proc.stdout), proc.stderr

    def check(self) -> None:
        """Nothing outside changed, and the store is sound."""
        assert self._outside_state() == self.before
        assert check_store(self.dir / ".mopt", self.dir / "build") == []

    @property
    def cache(self) -> Path:
        """A folder actions may write to in every sandbox mode (the command kind's cache dir)."""
        return self.dir / ".mopt" / "cache" / "command"


def node(data: dict, node_id: str) -> dict:
    return next(n for n in data["nodes"] if n["id"] == node_id)


@pytest.fixture(params=SANDBOXES)
def proj(request: pytest.FixtureRequest, tmp_path: Path) -> Proj:
    return Proj(tmp_path, request.param)


# ---------------------------------------------------------------------- crashes (item 9)


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("segfault", "killed by SIGSEGV"),
        ("exit", "exited with code 3"),
        ("kill", "killed by SIGKILL"),
        ("sys-exit", "sys.exit(4)"),
    ],
)
def test_a_crashing_action_fails_alone_with_its_log(proj: Proj, how: str, why: str) -> None:
    proj.recipe(f"""\
targets = ["toy-weights", "toy-export", "bad", "after"]

[toy.cpu.bad]
kind = "toy-misbehave"
input = "toy-weights"
how = "{how}"

[toy.cpu.after]
kind = "toy-misbehave"
input = "toy-export"
""")
    code, data, _err = proj.build_json("-k")
    assert code == 1
    bad = node(data, "toy.cpu:bad")
    assert bad["status"] == "failed" and why in bad["reason"], bad
    log = Path(bad["log"]).read_text()
    assert "misbehaving: " + how in log  # the action's own lines are in its log
    if how == "segfault":
        assert "Segmentation fault" in log  # faulthandler's trace of the crash
    # the other actions ran, in a replaced worker where one died
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {
        "toy.cpu:toy-weights", "toy.cpu:toy-export", "toy.cpu:after"}
    proj.check()
    # and the failure was not cached: it runs (and fails) again
    code, data, _ = proj.build_json("-k")
    assert code == 1 and node(data, "toy.cpu:bad")["status"] == "failed"
    proj.check()


def test_two_onnx_exports_at_the_default_jobs(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("mopt_ml")
    p = Proj(tmp_path, "auto")
    (p.dir / "r.toml").write_text("""\
schema = 1

[models.b1]
family = "bert"
task = "embedding"
source = { synthetic = "bert", seed = 1 }

[models.b2]
family = "bert"
task = "embedding"
source = { synthetic = "bert", seed = 2 }

[defaults]
targets = ["weights", "onnx"]

[b1.cpu]
hardware = "cpu"

[b2.cpu]
hardware = "cpu"
""")
    jobs = ["-j", "2"] if (os.cpu_count() or 1) < 2 else []  # two exports at once, as on any multi-core box
    code, data, err = p.build_json(*jobs)
    assert code == 0, err
    assert data["counts"] == {"built": 4}
    for m in ("b1", "b2"):
        assert (p.dir / "build" / m / "cpu" / "onnx" / "model.onnx").stat().st_size > 0
    p.check()


# ---------------------------------------------------------------------- state does not leak


def test_env_cwd_and_torch_threads_do_not_leak_into_the_next_action(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    p = Proj(tmp_path, "auto")
    p.recipe("""\
targets = ["toy-weights", "leak", "probe"]

[toy.cpu.leak]
kind = "toy-misbehave"
input = "toy-weights"
how = "leak"
torch = true

[toy.cpu.probe]
kind = "toy-misbehave"
input = "leak"
how = "probe"
torch = true
""")
    default_threads = torch.get_num_threads()  # this process never changed it
    # -j 1: one worker, so the probe runs in the very process the leak ran in
    code, _data, err = p.build_json("-j", "1")
    assert code == 0, err
    seen = json.loads((p.dir / "build" / "toy" / "cpu" / "probe" / "seen.json").read_text())
    leaked = json.loads((p.dir / "build" / "toy" / "cpu" / "leak" / "seen.json").read_text())
    assert leaked["leak"] == "leaked"  # it did change them, in its own run
    assert seen["leak"] is None
    assert seen["cwd"] != leaked["cwd"]
    assert seen["torch_threads"] == default_threads
    p.check()


# ---------------------------------------------------------------------- inputs (item 2)


def test_an_action_that_changes_its_input_fails_and_the_blob_is_rebuilt(tmp_path: Path) -> None:
    # without a sandbox the write succeeds (root ignores the read-only mode); the stat
    # check after the action catches it
    p = Proj(tmp_path, "none")
    p.recipe("""\
targets = ["toy-weights", "toy-export", "evil", "sibling"]

[toy.cpu.evil]
kind = "toy-misbehave"
input = "toy-export"
how = "write-input"

[toy.cpu.sibling]
kind = "toy-engine"
input = "toy-export"
""")
    code, data, _ = p.build_json("-k", "-j", "1", "toy.cpu:toy-export")
    assert code == 0
    export = p.dir / "build" / "toy" / "cpu" / "toy-export" / "model.txt"
    original = export.read_bytes()
    code, data, _ = p.build_json("-k", "-j", "1")
    assert code == 1
    evil = node(data, "toy.cpu:evil")
    assert evil["status"] == "failed"
    assert "kind 'toy-misbehave' changed its input toy.cpu:toy-export: model.txt" in evil["reason"]
    # inputs below the store's copy threshold are private copies, so the write hit the copy
    # and the blob is intact: nothing to remove (a large, hard-linked input would be removed)
    assert "damaged blob(s) removed" not in evil["reason"]
    # the next build finds the upstream intact and every consumer sees the original bytes
    p.recipe("""\
targets = ["toy-weights", "toy-export", "sibling"]

[toy.cpu.sibling]
kind = "toy-engine"
input = "toy-export"
""")
    code, data, err = p.build_json("-j", "1")
    assert code == 0, err
    assert node(data, "toy.cpu:toy-export")["status"] == "cached"
    assert export.read_bytes() == original
    assert (p.dir / "build" / "toy" / "cpu" / "sibling" / "engine.plan").read_text().startswith(original.decode())
    p.check()


@pytest.mark.skipif(not HAS_BWRAP, reason="no usable bwrap")
def test_in_the_sandbox_inputs_and_the_project_are_read_only(tmp_path: Path) -> None:
    p = Proj(tmp_path, "bwrap")
    p.recipe("""\
targets = ["toy-weights", "toy-export", "evil", "escape"]

[toy.cpu.evil]
kind = "toy-misbehave"
input = "toy-export"
how = "write-input"

[toy.cpu.escape]
kind = "toy-misbehave"
how = "write-project"
""")
    code, data, _ = p.build_json("-k")
    assert code == 1
    assert "Read-only file system" in node(data, "toy.cpu:evil")["reason"]
    assert "Read-only file system" in node(data, "toy.cpu:escape")["reason"]
    assert not (p.dir / "escaped.txt").exists()
    assert node(data, "toy.cpu:toy-export")["status"] == "built", [(n["id"], n["status"], n.get("reason")) for n in data["nodes"]]
    p.check()


def _fan_out(p: Proj, round_: int, extra: str = "") -> None:
    """`up` writes 50 MB (hard-linked into each consumer's inputs, being over the store's
    copy threshold), read by 16 consumers (each its own action); `round_` gives it new bytes (a new key, new blob)."""
    up = f"head -c 50000000 /dev/zero > {{out}}/w; echo {round_} >> {{out}}/w"
    cons = "".join(
        f'\n[toy.cpu.c{i}]\nkind = "command"\ninput = "up"\n'
        f'argv = ["sh", "-c", "echo c{i} > {{out}}/n; wc -c < {{in}}/w >> {{out}}/n"]\n'
        for i in range(16)
    )
    names = ["up", *(f"c{i}" for i in range(16)), *(["evil"] if extra else [])]
    p.recipe(f'targets = {json.dumps(names)}\n\n[toy.cpu.up]\nkind = "command"\n'
             f"argv = {json.dumps(['sh', '-c', up])}\n{cons}{extra}")


def test_sixteen_parallel_consumers_of_one_blob_pass_the_input_check(proj: Proj) -> None:
    # Siblings hard-link the same blob into their inputs and unlink it when they end: each
    # link or unlink moves the shared inode's ctime, while the others' checks rehash it.
    # The race is timing-bound (2 cores: 0 to 12 of 16 consumers failed per build), so
    # several builds, each from new bytes.
    for round_ in range(5):
        _fan_out(proj, round_)
        code, data, err = proj.build_json("-k", "-j", "16")
        failed = [(n["id"], n.get("reason")) for n in data["nodes"] if n["status"] == "failed"]
        assert code == 0 and not failed, (round_, failed, err)
        for i in range(16):
            assert (proj.dir / "build" / "toy" / "cpu" / f"c{i}" / "n").read_text().split() == [f"c{i}", "50000002"]
    proj.check()


def test_a_consumer_that_rewrites_a_shared_input_in_place_is_caught(tmp_path: Path) -> None:
    # same size, mtime put back: only the ctime tells, and then the bytes
    p = Proj(tmp_path, "none")
    tamper = ("touch -r {in}/w {out}/t && chmod u+w {in}/w && printf X | dd of={in}/w conv=notrunc"
              " 2>/dev/null && chmod a-w {in}/w && touch -r {out}/t {in}/w")
    _fan_out(p, 0, f'\n[toy.cpu.evil]\nkind = "command"\ninput = "up"\nargv = {json.dumps(["sh", "-c", tamper])}\n')
    code, data, err = p.build_json("-k", "-j", "16", "toy.cpu:up", "toy.cpu:evil")
    assert code == 1, err
    reason = node(data, "toy.cpu:evil")["reason"]
    assert "kind 'command' changed its input toy.cpu:up: w" in reason
    assert "1 damaged blob(s) removed" in reason
    # the blob is gone: the next build runs `up` again and every consumer reads its bytes
    _fan_out(p, 0)
    code, data, err = p.build_json("-j", "16")
    assert code == 0, err
    assert node(data, "toy.cpu:up")["status"] == "built"
    assert (p.dir / "build" / "toy" / "cpu" / "c0" / "n").read_text().split() == ["c0", "50000002"]
    p.check()


@pytest.mark.skipif(not HAS_BWRAP, reason="no usable bwrap")
def test_a_kind_without_network_cannot_connect(tmp_path: Path) -> None:
    p = Proj(tmp_path, "bwrap")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        p.recipe(f"""\
targets = ["online", "offline"]

[toy.cpu.online]
kind = "toy-misbehave"
how = "connect"
port = {port}

[toy.cpu.offline]
kind = "toy-no-network"
how = "connect"
port = {port}
""")
        code, data, _ = p.build_json("-k")
    assert code == 1
    assert node(data, "toy.cpu:online")["status"] == "built"
    off = node(data, "toy.cpu:offline")
    assert off["status"] == "failed" and ("refused" in off["reason"] or "unreachable" in off["reason"]), off
    p.check()


def test_an_unknown_sandbox_setting_is_exit_2(tmp_path: Path) -> None:
    p = Proj(tmp_path, "docker")
    p.recipe('targets = ["toy-weights"]\n')
    proc = p.build()
    assert proc.returncode == 2
    assert "sandbox" in proc.stderr and "mopt.toml" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- signals and orphans (item 8)


def _wait_for(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _slow_command(p: Proj, seconds: int) -> Path:
    """One command action that logs `start`, sleeps, then logs `late` (it must never get there)."""
    log = p.cache / "log.txt"
    argv = ["sh", "-c", f"echo start >> {log}; sleep {seconds}; echo late >> {log}; echo x > {{out}}/f"]
    p.recipe(f'targets = ["slow"]\n\n[toy.cpu.slow]\nkind = "command"\nargv = {json.dumps(argv)}\n')
    return log


@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGHUP, 129, "SIGHUP")])
def test_sigterm_and_sighup_stop_the_running_actions(proj: Proj, sig: int, code: int, word: str) -> None:
    log = _slow_command(proj, 3)
    mopt = subprocess.Popen(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--no-check"],
        cwd=proj.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for(log, "start")
    mopt.send_signal(sig)
    _out, err = mopt.communicate(timeout=60)
    assert mopt.returncode == code, err
    assert f"({word}): running actions stopped" in err and "Traceback" not in err
    time.sleep(4)  # the action would have written `late` by now
    assert log.read_text() == "start\n"
    # nothing half-done was stored, and a rebuild runs the action from scratch
    proj.check()
    assert not (proj.dir / "build" / "toy" / "cpu" / "slow").exists()


def test_a_killed_builds_orphan_keeps_the_lock_until_it_is_gone(proj: Proj) -> None:
    # the action forks a subshell that outlives its parent (tokens: $$ is 3 in every sandbox): after kill -9 of mopt, a
    # waiting build must not run the action beside it (in the sandbox the orphan is
    # killed with the sandbox's pid namespace; without, it keeps the lock until it ends)
    log = proj.cache / "log.txt"
    script = (
        f"T=$(date +%s%N); echo start $T >> {log}; ( sleep 3; echo orphan-end $T >> {log} ) ; "
        f"echo end $T >> {log}; echo x > {{out}}/f"
    )
    proj.recipe(
        f'targets = ["slow"]\n\n[toy.cpu.slow]\nkind = "command"\nargv = {json.dumps(["sh", "-c", script])}\n'
    )
    first = subprocess.Popen(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--no-check"],
        cwd=proj.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for(log, "start")
    first.kill()
    first.communicate(timeout=30)
    second = proj.build()
    assert second.returncode == 0, second.stderr
    assert "Traceback" not in second.stderr
    time.sleep(3.5)  # let any orphan finish
    lines = [ln.split() for ln in log.read_text().splitlines()]
    starts = [t for what, t in lines if what == "start"]
    assert len(starts) == 2
    a, b = starts
    events = [(what, t) for what, t in lines]
    if ("orphan-end", a) in events:  # the orphan lived on: it ended before the second run began
        assert events.index(("orphan-end", a)) < events.index(("start", b)), events
    assert ("end", a) not in events  # the killed build's shell itself died at once
    proj.check()


# ---------------------------------------------------------------------- the fork server (zygote)


@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize("zygote", ["1", "0"])
def test_workers_are_forked_from_a_zygote_that_preloaded_the_kinds_modules(
    tmp_path: Path, sandbox: str, zygote: str
) -> None:
    # toy-misbehave declares preload = ("wave",), which nothing else imports: a forked worker
    # has it before run() starts; an exec'd one (MOPT_ZYGOTE=0) does not
    p = Proj(tmp_path, sandbox)
    p.recipe('targets = ["probe"]\n\n[toy.cpu.probe]\nkind = "toy-misbehave"\nhow = "probe"\n')
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = p.build("--json", env={**env, "MOPT_ZYGOTE": zygote})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((p.dir / "build" / "toy" / "cpu" / "probe" / "seen.json").read_text())
    assert seen["preloaded"] is (zygote == "1")
    assert ("--zygote" in seen["parent"]) is (zygote == "1"), seen
    # the zygote imported with OpenMP's passive wait policy; the action's environment is
    # mopt's, without it
    assert seen["parent_omp_wait_policy"] == ("PASSIVE" if zygote == "1" else None), seen
    assert seen["omp_wait_policy"] is None, seen
    p.check()
    # the same build again, all hits (the build log is gone): the zygote that was started
    # ahead is stopped without having forked a worker, and nothing is left running
    for log in (p.dir / ".mopt" / "log").iterdir():
        log.unlink()
    proc = p.build("--json", env={**env, "MOPT_ZYGOTE": zygote})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["counts"] == {"cached": 1}, data["counts"]
    assert data["io"]["noop_miss"] == "no log", data["io"]  # it went through the engine
    p.check()


def test_a_users_omp_wait_policy_is_kept(tmp_path: Path) -> None:
    p = Proj(tmp_path, "none")
    p.recipe('targets = ["probe"]\n\n[toy.cpu.probe]\nkind = "toy-misbehave"\nhow = "probe"\n')
    proc = p.build("--json", env={**os.environ, "MOPT_ZYGOTE": "1", "OMP_WAIT_POLICY": "ACTIVE"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((p.dir / "build" / "toy" / "cpu" / "probe" / "seen.json").read_text())
    assert seen["parent_omp_wait_policy"] == "ACTIVE", seen
    assert seen["omp_wait_policy"] == "ACTIVE", seen
    p.check()


@pytest.mark.skipif(not HAS_BWRAP, reason="no usable bwrap")
def test_in_the_sandbox_an_action_cannot_write_beside_its_own_folders(tmp_path: Path) -> None:
    # the folder above a worker's scratch holds the other workers' scratch (forked workers
    # share their zygote's sandbox; Landlock fences each in) or is read-only (exec'd ones)
    p = Proj(tmp_path, "bwrap")
    argv = ["sh", "-c", "touch {out}/../../../beside && echo x > {out}/f"]
    p.recipe(f'targets = ["beside"]\n\n[toy.cpu.beside]\nkind = "command"\nargv = {json.dumps(argv)}\n')
    code, data, _ = p.build_json()
    assert code == 1
    log = Path(node(data, "toy.cpu:beside")["log"]).read_text()
    assert "Permission denied" in log or "Read-only file system" in log, log
    assert not list((p.dir / ".mopt").rglob("beside"))
    p.check()
