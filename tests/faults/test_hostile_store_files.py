"""Issue #28, section 1: mopt's own files, damaged or hostile, each through the real CLI.

Six families: a fifo (or other non-regular file) where mopt reads one of its metadata files
must not block (every command runs with a timeout, so a regression fails instead of hanging);
a symbolic link in the store's layout is never written through; a file where one of the
store's folders belongs is a one-line error naming it, exit 2, never a traceback; an output
or source file name that is not UTF-8 is refused in one line before anything is stored (names
with newlines are kept, and listed escaped); a SIGTERM during `-j4` stops the running actions
and fails none (no "could not keep the log of failed action" while their scratch goes); a
full disk while mopt writes an action entry, a failed action's log or the build log names the
store and the bytes needed, never `[Errno 28]` with a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_mopt
from tests.faults.test_store import TOY, World, needs_mounts, one_line_error

TIMEOUT = 30
COMMANDS = (
    ("plan", "r.toml"),
    ("ls", "r.toml"),
    ("show", "r.toml", "toy.cpu:toy-export"),
    ("gc",),
    ("build", "r.toml", "--no-check"),
)


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    yield World(tmp_path)


def run(w: World, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = run_mopt(*args, cwd=w.proj, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`mopt {' '.join(args)}` blocked for {TIMEOUT}s")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def built(w: World) -> None:
    proc = run(w, "build", "r.toml", "--no-check")
    assert proc.returncode == 0, proc.stderr


def first(pattern: str, root: Path) -> Path:
    found = sorted(root.glob(pattern))
    assert found, pattern
    return found[0]


def unbuilt(w: World) -> None:
    """Forget what was built (entries, build/, the build log, the lock file) so the next
    build writes to the store again."""
    for p in w.store.glob("ac/*.json"):
        p.unlink()
    shutil.rmtree(w.build_dir)
    shutil.rmtree(w.store / "log", ignore_errors=True)
    (w.proj / "mopt.lock").unlink(missing_ok=True)


# ----------------------------------------------------------------- family 1: a fifo never blocks


@pytest.mark.parametrize(
    "where",
    ["mopt.lock", ".mopt/state.db", ".mopt/ac/*.json", ".mopt/log/*.log", ".mopt/cas/*/*"],
    ids=["lock-file", "state-db", "ac-entry", "build-log", "cas-blob"],
)
def test_fifo_in_place_of_a_metadata_file_never_blocks(w: World, where: str) -> None:
    built(w)
    p = first(where, w.proj)
    p.unlink()
    os.mkfifo(p)
    for cmd in COMMANDS:
        proc = run(w, *cmd)
        assert proc.returncode in (0, 2), f"{cmd}: exit {proc.returncode}\n{proc.stderr}"
        if proc.returncode == 2:  # a miss ("not built") or the path named in one line
            one_line_error(proc.stderr)
    assert w.outside() == w.before


def test_gc_root_leading_to_a_fifo_is_an_error_not_a_hang(w: World) -> None:
    built(w)
    (w.proj / "mopt.lock").unlink()
    os.mkfifo(w.proj / "mopt.lock")
    proc = run(w, "gc")
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc.stderr)
    assert "mopt.lock" in line and "not a regular file" in line, line
    assert len(list(w.store.glob("ac/*.json"))) == 2  # gc did not guess what it pinned


# ------------------------------------------------------- family 2: a link is never written through


@pytest.mark.parametrize(
    ("where", "to_dir"),
    [
        (".mopt/state.db", False),
        (".mopt/state.db-wal", False),
        (".mopt/locks/*.lock", False),
        (".mopt/log", True),
        (".mopt/tmp", True),
        (".mopt/ac", True),
    ],
    ids=["state-db", "state-db-wal", "action-lock", "log-folder", "tmp-folder", "ac-folder"],
)
def test_symlink_in_the_store_is_refused_not_followed(w: World, where: str, to_dir: bool) -> None:
    built(w)
    unbuilt(w)
    found = sorted(w.proj.glob(where))
    p = found[0] if found else w.proj / where
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
    target = w.victim / "sub" if to_dir else w.victim / "v"
    p.symlink_to(target)
    proc = run(w, "build", "r.toml", "--no-check")
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    line = one_line_error(proc.stderr)
    assert str(p) in line and "symbolic link" in line and "remove it" in line, line
    assert not (w.victim / "v").exists()
    assert w.outside() == w.before, "something outside the store was written through the link"


# --------------------------------------------------- family 3: a file where a store folder belongs


@pytest.mark.parametrize(
    "where",
    [".mopt", ".mopt/roots", ".mopt/tmp", ".mopt/cas/*", ".mopt/ac", ".mopt/locks", ".mopt/logs", ".mopt/log"],
    ids=["store", "roots", "tmp", "cas-shard", "ac", "locks", "logs", "log"],
)
def test_file_in_place_of_a_store_folder_is_exit_2(w: World, where: str) -> None:
    built(w)
    unbuilt(w)
    p = first(where, w.proj) if "*" in where else w.proj / where
    shutil.rmtree(p, ignore_errors=True)
    p.write_text("not a folder\n")
    for cmd in (("build", "r.toml", "--no-check"), ("plan", "r.toml"), ("gc",)):
        proc = run(w, *cmd)
        assert proc.returncode == 2, f"{cmd}: exit {proc.returncode}\n{proc.stderr}"
        line = one_line_error(proc.stderr)
        assert str(p) in line and ("not a folder" in line or "not the" in line), line
        assert "remove it" in line and "[store] path" in line, line
    assert p.read_text() == "not a folder\n"
    assert w.outside() == w.before



# ----------------------------------------------------------------- family 4: odd names of outputs


def one_command(w: World, script: str) -> None:
    """The recipe is one `command` target, `odd`, running `sh -c script`."""
    argv = json.dumps(["sh", "-c", script])
    recipe = TOY.replace('["toy-weights", "toy-export"]', '["odd"]')
    (w.proj / "r.toml").write_text(recipe + f'[toy.cpu.odd]\nkind = "command"\nargv = {argv}\n')


def test_an_output_name_that_is_not_utf8_is_refused_in_one_line_and_nothing_is_stored(w: World) -> None:
    one_command(w, "echo ok > {out}/ok.txt; mkdir {out}/z; printf x > \"{out}/z/$(printf 'bad\\377.bin')\"")
    proc = run(w, "build", "r.toml", "--no-check")
    assert proc.returncode == 1, proc.stderr
    failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED ")]
    assert len(failed) == 1 and "toy.cpu:odd" in failed[0], proc.stderr
    assert "z/bad\\xff.bin: not a UTF-8 name" in failed[0] and "rename it" in failed[0], failed[0]
    # refused before any blob was stored: no entry, no blob (ok.txt's neither), no manifest
    assert not list(w.store.glob("ac/*")) and not list(w.store.glob("cas/*/*"))
    w.check(with_build=False)
    # a model source folder holding such a name: exit 2, one line, for plan and build
    (w.proj / "r.toml").write_text(TOY)
    (w.proj / "toy-model" / os.fsdecode(b"bad\xff.txt")).write_text("x")
    for cmd in (("plan", "r.toml"), ("build", "r.toml", "--no-check")):
        proc = run(w, *cmd)
        assert proc.returncode == 2, proc.stderr
        assert "toy-model/bad\\xff.txt: not a UTF-8 name" in one_line_error(proc.stderr)


def test_names_with_newlines_and_control_characters_are_kept_and_listed_escaped(w: World) -> None:
    one_command(w, "for n in 'a\nb' \"$(printf 'esc\\033[31m\\a')\" 'tab\tx'; do echo \"$n\" > \"{out}/$n\"; done")
    built(w)
    laid = w.build_dir / "toy" / "cpu" / "odd"
    assert sorted(p.name for p in laid.iterdir()) == ["a\nb", "esc\x1b[31m\x07", "tab\tx"]
    assert (laid / "a\nb").read_text() == "a\nb\n"
    shown = run(w, "show", "r.toml", "toy.cpu:odd").stdout
    assert "\x1b" not in shown and "\x07" not in shown, shown  # no terminal escapes
    files = [ln.split()[-1] for ln in shown.splitlines() if ln.startswith("  ") and " B  " in ln]
    assert files == ["a\\nb", "esc\\x1b[31m\\x07", "tab\\tx"], shown
    w.check()


# ------------------------------------------ family 5: a signal during -j4 stops actions, fails none


def test_sigterm_during_j4_stops_the_actions_without_keeping_failed_logs(w: World) -> None:
    # four actions that say they run (a file in their output folder), then flood their log
    env = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    for rnd in range(3):  # the race this guards was timing-dependent: a few rounds
        names = [f"s{n}" for n in range(4)]
        recipe = TOY.replace('["toy-weights", "toy-export"]', json.dumps(names))
        for n in names:
            argv = ["sh", "-c", f"touch {{out}}/started-{rnd}; exec yes {n}-line"]
            recipe += f'[toy.cpu.{n}]\nkind = "command"\nargv = {json.dumps(argv)}\n'
        (w.proj / "r.toml").write_text(recipe)
        mopt = subprocess.Popen(
            [sys.executable, "-m", "mopt", "build", "r.toml", "--no-check", "-j4"],
            cwd=w.proj, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.time() + TIMEOUT
            while len(list(w.store.glob(f"tmp/**/out/started-{rnd}"))) < 4:
                assert mopt.poll() is None and time.time() < deadline, "the four actions never ran"
                time.sleep(0.02)
            mopt.send_signal(signal.SIGTERM)
            err = mopt.communicate(timeout=TIMEOUT)[1]
        finally:
            mopt.kill()
        assert mopt.returncode == 143, err
        assert "could not keep" not in err and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("terminated (SIGTERM): running actions stopped;"), err
        # stopped, not failed: no failed action's log, no entry
        assert not list(w.store.glob("logs/*")) and not list(w.store.glob("ac/*"))
    w.check(with_build=False)


# --------------------------------------------- family 6: a full disk while mopt writes its own files

# the real CLI with os.replace failing as on a full disk (ENOSPC) for destinations matching
# $ENOSPC_AT: every file mopt writes whole (entries, failed logs, the build log) is renamed in
ENOSPC = """\
import errno, os, re, sys
real = os.replace
def replace(src, dst, **kw):
    if re.search(os.environ["ENOSPC_AT"], os.fspath(dst)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(src, dst, **kw)
os.replace = replace
from mopt.cli import main
sys.argv[0] = "mopt"
main()
"""


@pytest.mark.parametrize(
    ("at", "script", "code", "what"),
    [
        (r"/ac/[^/]+\.json$", None, 1, "the action entry"),
        (r"/logs/failed-[^/]+\.log$", "echo boom; exit 3", 1, "the log of failed action"),
        (r"/log/[^/]+\.log$", None, 0, ".log ("),
    ],
    ids=["action-entry", "failed-log", "build-log"],
)
def test_a_full_disk_while_writing_mopts_own_files_names_the_store_and_the_bytes(
    w: World, at: str, script: str | None, code: int, what: str
) -> None:
    if script is not None:
        one_command(w, script)
    env = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    proc = subprocess.run(
        [sys.executable, "-c", ENOSPC, "build", "r.toml", "--no-check"],
        cwd=w.proj, env={**env, "ENOSPC_AT": at}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    mopts = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("  | "))  # not the log's
    assert "Traceback" not in mopts and "Errno" not in mopts, proc.stderr
    line = next(ln for ln in mopts.splitlines() if "no space left" in ln)
    assert f"no space left on the disk of the store {w.store}" in line or str(w.store / "log") in line, line
    assert what in line and re.search(r"\(\d+(\.\d)? (B|KiB) needed, .* free\)", line), line
    if script is not None:  # the failed action's own error is still shown, and its log's end
        assert "command exited with status 3" in proc.stderr and "  | boom" in proc.stderr, proc.stderr
    assert not list(w.store.glob("tmp/write-*")) and not list(w.store.glob("log/.tmp-*"))
    w.check(with_build=False)
    if script is None:  # the disk has room again: the build goes on where it stopped
        assert run(w, "build", "r.toml", "--no-check").returncode == 0
        w.check()


@needs_mounts
def test_an_action_on_a_full_store_disk_fails_with_its_own_error(w: World) -> None:
    # the store on a tmpfs with no byte free: the action cannot write its output nor its log;
    # it fails with its own error, the worker does not die ("exited with code 0 (os._exit?)")
    py = sys.executable
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-e", "-c",
         f"mkdir -p {w.store}; mount -t tmpfs -o size=1m tmpfs {w.store}; "
         f"dd if=/dev/zero of={w.store}/fill bs=64k 2>/dev/null || true; cd {w.proj}; "
         f"{py} -m mopt build r.toml --no-check || echo exit=$?"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"},
    )  # fmt: skip
    assert "exit=1" in proc.stdout, proc.stderr
    mopts = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("  | "))
    assert "Traceback" not in mopts, proc.stderr
    failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED toy.cpu:toy-weights")]
    assert len(failed) == 1 and "No space left on device" in failed[0], proc.stderr
    assert re.search(rf"the build log .* no space left on the disk of {re.escape(str(w.store))}/log .* needed", mopts)
