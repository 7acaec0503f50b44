"""Parallel consumers of one large input: the input check after an action (`InputWatch`)
must blame an action only for what it did to its inputs, never for what its siblings do to
the blob they all share.

A large output (>= HARDLINK_MIN_BYTES) is hard-linked into every consumer's `in/` folder, so
the consumers share one inode: each sibling's link (its inputs laid out, or a kind linking its
input elsewhere) and unlink (its scratch folder removed) moves that inode's ctime while another
consumer runs. The check then rehashes the file, and the bytes decide. Before 0608dc7 it
rehashed through the stat cache, which files a digest only under a stat that held still
while it read and raised after three tries; the watch counted that as a change. On that code
the build test below failed in 6 of 6 builds ("kind 'command' changed its input toy.cpu:up:
w", the message the H200 build gave for `vllm` beside four `vllm-tuned` and `fp8`), and so
did the first test's scene. A real change must still be caught.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import mopt.runner
from mopt.filehash import hash_file
from mopt.runner import InputWatch
from mopt.store import HARDLINK_MIN_BYTES
from tests.conftest import TOY_MODEL, run_mopt


def _ctime(path: Path) -> int:
    return os.stat(path).st_ctime_ns


def _sibling_links(blob: Path, tag: str) -> None:
    """What siblings do to a shared blob: link it into their inputs and unlink it again,
    until its ctime has moved (the kernel's clock for it ticks every few ms)."""
    before = _ctime(blob)
    for i in range(10_000):
        link = blob.with_name(f"{blob.name}.{tag}{i}")
        os.link(blob, link)
        os.unlink(link)
        if _ctime(blob) != before:
            return
    raise AssertionError("the blob's ctime never moved")


@pytest.fixture
def shared(tmp_path: Path) -> tuple[Path, Path, str]:
    """(blob, its hard link in an action's in/ folder, digest): a read-only 20 MiB blob."""
    blob = tmp_path / "cas" / "blob"
    blob.parent.mkdir()
    blob.write_bytes(os.urandom(20 << 20))
    blob.chmod(0o444)
    in_dir = tmp_path / "in"
    (in_dir / "model-0").mkdir(parents=True)
    link = in_dir / "model-0" / "model.safetensors"
    os.link(blob, link)
    return blob, in_dir, hash_file(blob)


def test_siblings_linking_the_blob_during_the_rehash_are_not_a_change(
    shared: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blob, in_dir, digest = shared
    path = str(in_dir / "model-0" / "model.safetensors")
    watch = InputWatch.take([in_dir], {path: digest})
    _sibling_links(blob, "a")  # a sibling laid out its inputs while the action ran
    real = mopt.runner.hash_file
    rehashed: list[str] = []

    def hash_while_siblings_link(p: str) -> str:
        # ... and siblings keep linking and unlinking while the check reads the file
        _sibling_links(blob, "b")
        digest_now = real(p)
        _sibling_links(blob, "c")
        rehashed.append(p)
        return digest_now

    monkeypatch.setattr(mopt.runner, "hash_file", hash_while_siblings_link)
    assert watch.changes([in_dir]) == []
    assert rehashed == [path]  # the ctime did move: the bytes were what decided


def test_a_real_change_is_still_caught_while_siblings_link_the_blob(shared: tuple[Path, Path, str]) -> None:
    blob, in_dir, digest = shared
    path = in_dir / "model-0" / "model.safetensors"
    watch = InputWatch.take([in_dir], {str(path): digest})
    _sibling_links(blob, "a")
    # rewritten in place, same size, mtime put back: only the ctime and the bytes tell
    st = os.stat(path)
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.write(b"X")
    path.chmod(0o444)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _sibling_links(blob, "b")
    assert watch.changes([in_dir]) == [(str(path), digest)]


def test_a_replaced_input_is_caught(shared: tuple[Path, Path, str]) -> None:
    _blob, in_dir, digest = shared
    path = in_dir / "model-0" / "model.safetensors"
    watch = InputWatch.take([in_dir], {str(path): digest})
    new = in_dir / "model-0" / ".new"
    new.write_bytes(b"other bytes")
    os.replace(new, path)
    assert watch.changes([in_dir]) == [(str(path), digest)]


HEAD = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[toy.cpu]
hardware = "cpu"
"""


def _recipe(project: Path, round_: int) -> list[str]:
    """`up` writes a file over the hard-link threshold. Its consumers: one reads it a while,
    one links it into its own folder again and again for 3 s (as serve-search links its
    model into the store's cache), and six quick ones only read a small file beside it (as
    `vllm` reads config.json), so every quick one's check runs while the shared inode's ctime
    keeps moving."""
    size = HARDLINK_MIN_BYTES + 1_000_000
    up = f"head -c {size} /dev/urandom > {{out}}/w; echo {round_} > {{out}}/config.json"
    body = f'\n[toy.cpu.up]\nkind = "command"\nargv = {json.dumps(["sh", "-c", up])}\n'
    consumers = {
        "slow": "for i in 1 2 3; do cat {in}/w > /dev/null; done; sleep 1; echo slow > {out}/o",
        "linker": "end=$(($(date +%s) + 3)); while [ $(date +%s) -lt $end ]; do ln {in}/w l && rm l; done;"
        " echo linked > {out}/o",
    }
    for i in range(6):
        consumers[f"quick{i}"] = (
            f"sleep 0.{i}; cat {{in}}/config.json > {{out}}/o; wc -c < {{in}}/w >> {{out}}/o"
        )
    for name, sh in consumers.items():
        body += f'\n[toy.cpu.{name}]\nkind = "command"\ninput = "up"\nargv = {json.dumps(["sh", "-c", sh])}\n'
    names = ["up", *consumers]
    (project / "r.toml").write_text(HEAD + f"targets = {json.dumps(names)}\n" + body)
    return names


def test_quick_and_slow_consumers_of_one_large_output_build_in_parallel(tmp_path: Path) -> None:
    shutil.copytree(TOY_MODEL, tmp_path / "toy-model")
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n\n[executor]\nsandbox = "none"\n')
    size = HARDLINK_MIN_BYTES + 1_000_000
    for round_ in range(3):  # new bytes each time: a new blob, every consumer runs
        names = _recipe(tmp_path, round_)
        proc = run_mopt("build", "r.toml", "--no-check", "--json", "-k", "-j", "8", cwd=tmp_path, timeout=300)
        data = json.loads(proc.stdout)
        failed = [(n["id"], n.get("reason")) for n in data["nodes"] if n["status"] != "built"]
        assert proc.returncode == 0 and not failed, (round_, failed, proc.stderr[-2000:])
        assert len(data["nodes"]) == len(names)
        for i in range(6):
            out = (tmp_path / "build" / "toy" / "cpu" / f"quick{i}" / "o").read_text().split()
            assert out == [str(round_), str(size)]


def test_a_blob_whose_stat_keeps_moving_is_judged_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Store.intact_stat` on a blob siblings keep linking: the stat cache gives up ("kept
    changing"), and the blob is rehashed, not condemned and removed; damaged bytes still are."""
    from mopt.store import Store

    store = Store(tmp_path / "store")
    digest = store.put_bytes(b"x" * 4096)

    def gives_up(path: str, st: object) -> str:
        raise OSError(f"{path} kept changing while being hashed")

    monkeypatch.setattr(store.state, "digest_of", gives_up)
    assert store.intact_stat(digest) is not None
    assert Path(store.blob_str(digest)).is_file()
    blob = Path(store.blob_str(digest))
    blob.chmod(0o644)
    blob.write_bytes(b"y" * 4096)
    assert store.intact_stat(digest) is None and not blob.exists()
