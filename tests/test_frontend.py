"""The front end every command pays: declared files resolved as `Path.resolve` does, and the
cyclic collector back on after a session loads."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from mopt.builtin.targets import CommandKind
from mopt.gcpause import paused_gc


def test_command_files_resolve_exactly_as_path_resolve(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "proj").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    (tmp_path / "real" / "f").write_text("x")
    os.symlink(tmp_path / "real" / "f", tmp_path / "real" / "g")
    kind = CommandKind()
    names = ["../link/f", "../link/g", "../real/f", "../link/nope", "../link/..", "x", "../link/./f",
             str(tmp_path / "link" / "g")]  # fmt: skip
    params = kind.Params(argv=["true"], files=names)
    want = [(tmp_path / "proj" / n).resolve() for n in names]
    assert kind.input_files(params, tmp_path / "proj") == want
    assert kind.input_files(params, tmp_path / "proj") == want  # again, from its folder memo


def test_paused_gc_turns_the_collector_back_on_even_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_gc(freeze=True):
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()
    gc.unfreeze()


def test_command_bind_fills_names_per_section_and_shares_params_without_them() -> None:
    kind = CommandKind()
    named = kind.Params(argv=["sh", "-c", "cp {file} {out}/{model}"], files=["w/{model}-{hardware}.bin"])
    plain = kind.Params(argv=["sh", "-c", "sha1sum {in}/out > {out}/out"], files=["w/x.bin"])
    for model in ("a", "b", "a"):  # the same params object, bound for several sections
        got = kind.bind(named, model=model, hardware="cpu", section=f"{model}.cpu")
        assert got.argv == ["sh", "-c", f"cp {{file}} {{out}}/{model}"]
        assert got.files == [f"w/{model}-cpu.bin"]
        assert kind.bind(plain, model=model, hardware="cpu", section=f"{model}.cpu") is plain


def test_canonical_bytes_equal_canonical_json() -> None:
    from mopt.digest import canonical_json
    from mopt.keys import canonical_bytes

    values = [
        {"b": [1, 2.5, None, True], "a": {"z": "é✓", "y": {"x": []}}, "c": ""},
        {"params": {"argv": ["sh", "-c", "sha1sum {in}/out > {out}/out"], "env": [], "shell": False}},
        [0, -1, 1e300, "\u0000\n\""],
    ]
    for v in values:
        assert canonical_bytes(v) == canonical_json(v)
    for bad in (float("nan"), {"x": float("inf")}):
        with pytest.raises(ValueError):
            canonical_bytes(bad)
