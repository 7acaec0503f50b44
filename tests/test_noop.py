"""The no-op: an unchanged build only stats what its build log recorded (`mopt.buildlog`); any
change takes the full path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import run_mopt

RECIPE = """\
schema = 1

[defaults]
targets = ["a", "b"]

[defaults.a]
kind = "command"
files = ["in/{model}.txt"]
argv = ["sh", "-c", "cat {file} > {out}/a; echo $GREETING >> {out}/a"]
env = ["GREETING"]

[defaults.b]
kind = "command"
input = "a"
argv = ["sh", "-c", "wc -c < {in}/a > {out}/b"]

[models.m1]
[m1.cpu]

[models.m2]
[m2.cpu]
"""


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    for m in ("m1", "m2"):
        (tmp_path / "in" / f"{m}.txt").write_text(f"hello {m}\n")
    (tmp_path / "r.toml").write_text(RECIPE)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    return tmp_path


def build(p: Path, env: dict[str, str] | None = None) -> dict:
    proc = run_mopt("build", "r.toml", "--json", "--no-check", cwd=p, env={"GREETING": "hi", **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def fast(data: dict) -> bool:
    return bool(data["io"].get("noop"))


def settled(p: Path) -> dict:
    """A build that takes the fast path. On a shared machine a folder of sys.path outside
    the project (site-packages: someone else's `pip install`) may change between two
    builds, which rightly sends the next one down the full path; and a slow machine may
    leave a file inside the racy window when the stamp is written ("stamp next time").
    Then build again, a few times at most, and only for those reasons."""
    data = build(p)
    for _ in range(3):
        why = data["io"].get("noop_miss", "")
        outside = why.startswith("folder changed: ") and not why.startswith(f"folder changed: {p}")
        racy = why.startswith("no stamp: ") and "had just changed" in why
        if fast(data) or not (outside or racy):
            break
        build(p)  # writes a new stamp
        data = build(p)
    return data


def test_a_moved_model_cache_takes_the_full_path(proj: Path, tmp_path: Path) -> None:
    # HF_HOME unset, Hugging Face's cache is under $XDG_CACHE_HOME (or ~/.cache): a source
    # resolved there may resolve elsewhere once it changes, so the no-op must not answer
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    data = build(proj, {"XDG_CACHE_HOME": str(tmp_path / "elsewhere")})
    assert not fast(data)
    assert "environment changed" in data["io"]["noop_miss"]


def test_a_build_typed_twice_is_a_noop_the_second_time(proj: Path) -> None:
    """The build's own writes (outputs, mopt.lock) are recorded within the racy window: the
    next build checks them by digest instead of giving up its fast path."""
    first = build(proj)
    assert first["counts"] == {"built": 4}
    second = build(proj)  # at once
    assert fast(second), second["io"].get("noop_miss")
    assert second["counts"] == {"cached": 4}
    assert {n["id"] for n in second["nodes"]} == {"m1.cpu:a", "m1.cpu:b", "m2.cpu:a", "m2.cpu:b"}
    assert second["nodes"] == [dict(n, status="cached") for n in first["nodes"]]
    time.sleep(0.25)  # past the racy window: what is still checked by digest is learnt now
    third = build(proj)
    assert fast(third), third["io"]
    fourth = build(proj)
    assert fast(fourth) and fourth["io"]["hashed_files"] == 0, fourth["io"]


@pytest.mark.parametrize(
    "change",
    ["edit_input", "edit_recipe", "env", "delete_output", "delete_ac", "new_config"],
)
def test_any_change_takes_the_full_path(proj: Path, change: str) -> None:
    # (a touch of an input, new stat but the same bytes, is settled by the no-op rehashing
    # it: test_touched_input_is_rehashed_not_rebuilt)
    build(proj)
    time.sleep(0.2)
    build(proj)
    first = settled(proj)
    assert fast(first), first["io"]["noop_miss"]
    env = None
    if change == "edit_input":
        (proj / "in" / "m1.txt").write_text("changed\n")
    elif change == "edit_recipe":
        (proj / "r.toml").write_text(RECIPE + "\n# a comment\n")
    elif change == "env":
        env = {"GREETING": "hey"}
    elif change == "delete_output":
        os.chmod(proj / "build/m1/cpu/b", 0o755)
        os.chmod(proj / "build/m1/cpu/b/b", 0o644)
        os.unlink(proj / "build/m1/cpu/b/b")
    elif change == "delete_ac":
        next((proj / ".mopt" / "ac").iterdir()).unlink()
    elif change == "new_config":
        (proj / "mopt.toml").write_text('[store]\npath = ".mopt"\n[plugins]\ndisable = []\n')
    data = build(proj, env)
    assert not fast(data)
    # and the JSON says why
    why = {
        "edit_input": f"changed: {proj / 'in' / 'm1.txt'}",
        "edit_recipe": f"changed: {proj / 'r.toml'}",
        "env": "environment changed",
        "delete_output": "changed: ",  # the hard-linked blob is seen first
        "delete_ac": str(proj / ".mopt" / "ac"),
        "new_config": f"changed: {proj / 'mopt.toml'}",
    }[change]
    assert why in data["io"]["noop_miss"]
    built = {n["id"] for n in data["nodes"] if n["status"] == "built"}
    expected = {
        "edit_input": {"m1.cpu:a", "m1.cpu:b"},
        "edit_recipe": set(),
        "env": {"m1.cpu:a", "m2.cpu:a"},  # b's input bytes changed too, but only in length...
        "delete_output": set(),
        "delete_ac": None,
        "new_config": set(),
    }[change]
    if change == "env":
        assert {"m1.cpu:a", "m2.cpu:a"} <= built
    elif expected is not None:
        assert built == expected
    assert (proj / "build/m1/cpu/b/b").is_file()


def test_touched_input_is_rehashed_not_rebuilt(proj: Path) -> None:
    """A touch (new stat, same bytes) is settled by the no-op itself: it hashes the file,
    finds the stamped digest, and records the new stat, so the next build hashes nothing."""
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    os.utime(proj / "in" / "m1.txt")
    time.sleep(0.3)  # past the racy window: the new stat can be remembered
    data = build(proj)
    assert fast(data), data["io"].get("noop_miss")
    assert data["io"]["hashed_files"] == 1
    assert data["counts"] == {"cached": 4}
    again = build(proj)
    assert fast(again) and again["io"]["hashed_files"] == 0


def test_same_size_and_mtime_but_new_bytes_rebuilds(proj: Path) -> None:
    """An edit that keeps the size and puts the old mtime back changes the ctime: the no-op
    rehashes, sees other bytes and takes the full path, which rebuilds."""
    build(proj)
    time.sleep(0.2)
    build(proj)
    assert fast(settled(proj))
    f = proj / "in" / "m1.txt"
    st = f.stat()
    f.write_text("HELLO m1\n")  # same length
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    time.sleep(0.3)
    data = build(proj)
    assert not fast(data)
    assert data["io"]["noop_miss"] == f"changed: {f}"
    assert {n["id"] for n in data["nodes"] if n["status"] == "built"} == {"m1.cpu:a", "m1.cpu:b"}
    assert (proj / "build/m1/cpu/a/a").read_text().startswith("HELLO m1")


FOLDER_RECIPE = """\
schema = 1

[defaults]
targets = ["a"]

[defaults.a]
kind = "command"
files = ["data"]
argv = ["sh", "-c", "cat {file}/sub/*.txt > {out}/a"]

[models.m1]
[m1.cpu]
"""


@pytest.mark.parametrize("change", ["edit_nested", "add_nested"])
def test_change_inside_an_input_folder_takes_the_full_path(tmp_path: Path, change: str) -> None:
    """A folder's own stat does not change when a file in it is edited or one is added in a
    subfolder: the stamp watches the files and folders inside."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "x.txt").write_text("x\n")
    (tmp_path / "r.toml").write_text(FOLDER_RECIPE)
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    build(tmp_path)
    time.sleep(0.2)
    build(tmp_path)
    assert fast(settled(tmp_path))
    if change == "edit_nested":
        (tmp_path / "data" / "sub" / "x.txt").write_text("edited\n")
    else:
        (tmp_path / "data" / "sub" / "y.txt").write_text("y\n")
    data = build(tmp_path)
    assert not fast(data)
    assert [n["status"] for n in data["nodes"]] == ["built"]
    want = "edited\n" if change == "edit_nested" else "x\ny\n"
    assert (tmp_path / "build/m1/cpu/a/a").read_text() == want


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "fifo", "folder"])
def test_a_damaged_log_is_a_clean_miss(proj: Path, damage: str) -> None:
    build(proj)
    assert fast(settled(proj))
    (log,) = (proj / ".mopt" / "log").glob("*.log")
    data = log.read_bytes()
    if damage == "truncate":
        log.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        k = len(data) - 10
        log.write_bytes(data[:k] + bytes([data[k] ^ 0x20]) + data[k + 1 :])
    elif damage == "garbage":
        log.write_bytes(b"\x00" * len(data))
    elif damage == "fifo":  # never a blocking open
        log.unlink()
        os.mkfifo(log)
    else:
        log.unlink()
        log.mkdir()
    out = build(proj)
    assert not fast(out)
    assert out["io"]["noop_miss"] == "unreadable log", out["io"]
    assert out["counts"] == {"cached": 4}


def test_the_fast_entry_answers_as_the_cli_does(proj: Path) -> None:
    """`python -m mopt build` answers a no-op before click is loaded; `mopt.cli.main` answers
    it after. Both print the same; an option only click knows goes to click."""
    import subprocess
    import sys

    build(proj)
    time.sleep(0.2)
    build(proj)
    first = settled(proj)
    assert fast(first)
    env = {**os.environ, "GREETING": "hi"}
    env.pop("MOPT_DISABLE_PLUGINS", None)
    via_cli = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from mopt.cli import main; sys.argv[0] = 'mopt'; main()",
            "build",
            "r.toml",
            "--json",
            "--no-check",
        ],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert via_cli.returncode == 0, via_cli.stderr
    a, b = json.loads(via_cli.stdout), build(proj)
    assert fast(a) and fast(b)
    a.pop("seconds")
    b.pop("seconds")
    assert a == b
    bad = run_mopt("build", "r.toml", "--jobs", "0", cwd=proj)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    unknown = run_mopt("build", "r.toml", "--no-such-option", cwd=proj)
    assert unknown.returncode == 2 and "no-such-option" in unknown.stderr
