"""The remote cache against real stores: a file:// remote and a real S3 protocol server
(moto's ThreadedMotoServer on 127.0.0.1), pushing from one store and pulling into another."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from mopt.digest import hash_bytes, hash_tree
from mopt.remote import (
    RemoteCache,
    RemoteError,
    RemoteIntegrityError,
    redact_url,
)
from mopt.store import ActionEntry, Store

pytest.importorskip("fsspec")

FAKE_KEY_ID = "AKIAMOPTFAKEKEYID0001"
FAKE_SECRET = "mopt-fake-secret-Zq8Xw3"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def moto_endpoint() -> Any:
    """A real S3 protocol server on loopback, with fake credentials in the environment."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
        mp_.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp_.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp_.delenv(var, raising=False)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def _new_bucket(endpoint: str) -> str:
    import s3fs

    bucket = "mopt-" + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.mkdir(bucket)
    return bucket


@pytest.fixture(params=["file", "s3"])
def remote_spec(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """(url, fsspec options) of an empty remote cache."""
    if request.param == "file":
        return f"file://{tmp_path / 'remote'}", {}
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = _new_bucket(endpoint)
    return f"s3://{bucket}/team/cache", {"client_kwargs": {"endpoint_url": endpoint}}


def make_src(root: Path, nonce: str = "", mib: int = 5) -> Path:
    """A folder like a model artifact: a biggish binary, nested files, an executable, an empty file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.bin").write_bytes(bytes(range(256)) * (mib * 4096))
    (root / "config.json").write_text(json.dumps({"hidden": 64, "nonce": nonce}))
    (root / "sub" / "dir").mkdir(parents=True, exist_ok=True)
    (root / "sub" / "dir" / "tokenizer.txt").write_text("a b c\n" * 100)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty.txt").write_bytes(b"")
    return root


KEY = hash_bytes(b"action-1")


def store_action(store: Store, src: Path, key: str = KEY, host: str = "builder-a") -> ActionEntry:
    """What Engine._execute does after a successful run: put_tree, put_log, ac_put."""
    tree, _entries = store.put_tree(src)
    log = store.put_bytes(f"log of {key} on {host}\n".encode())
    return store.ac_put(
        key,
        ActionEntry(key=key, kind="toy", target="m.h:t", outputs_tree=tree, log=log, host=host),
    )


def remote_for(store: Store, spec: tuple[str, dict[str, Any]], **kw: Any) -> RemoteCache:
    url, options = spec
    return RemoteCache(url, store, options=options, **kw)


def overwrite(remote: RemoteCache, rpath: str, data: bytes) -> None:
    """Tamper with a remote object (as a bad disk, a bad actor or a bug would)."""
    if remote.is_local:
        os.chmod(rpath, 0o644)
        Path(rpath).write_bytes(data)
    else:
        remote.fs.pipe_file(rpath, data)


def same_tree(a: Path, b: Path) -> bool:
    return hash_tree(a) == hash_tree(b)


# --------------------------------------------------------------------------- tests


def test_fresh_store_gets_hits_from_the_remote(tmp_path: Path, remote_spec: Any) -> None:
    src = make_src(tmp_path / "src")
    a = Store(tmp_path / "a")
    entry = store_action(a, src)
    ra = remote_for(a, remote_spec)
    rep = ra.push(KEY)
    n_members = len(a.tree_entries(entry.outputs_tree))
    # 6 files, 5 distinct contents (run.sh and tokenizer differ; empty file is one blob) + manifest + log
    assert (
        rep.entry_written
        and rep.uploaded_blobs == len({e.digest for e in a.tree_entries(entry.outputs_tree)}) + 2
    )
    assert rep.uploaded_bytes >= 5 * 1024 * 1024
    assert n_members == 5

    # the second push uploads nothing and leaves the entry alone
    again = remote_for(a, remote_spec).push(KEY)
    assert again.uploaded_blobs == 0 and not again.entry_written and again.present_blobs == rep.uploaded_blobs

    # a second machine: a fresh store, same remote
    b = Store(tmp_path / "b")
    rb = remote_for(b, remote_spec)
    got = rb.fetch_entry(KEY)
    assert got is not None and got.outputs_tree == entry.outputs_tree and got.host == "builder-a"
    # build without the bytes: reading the entry downloaded no blob
    assert not any(b.cas_dir.rglob("*")) and b.ac_entry(KEY) is None
    assert rb.fetch_entry(KEY, verify=True) is not None  # manifest fetched, blobs present remotely

    pulled = rb.pull(KEY)
    assert pulled is not None and b.ac_entry(KEY) == pulled
    assert rb.stats.rejected_blobs == 0
    dest = tmp_path / "out"
    b.materialize(pulled.outputs_tree, dest)
    assert same_tree(src, dest)
    for f in ("model.bin", "config.json", "sub/dir/tokenizer.txt", "run.sh", "empty.txt"):
        assert (dest / f).read_bytes() == (src / f).read_bytes()
    assert os.access(dest / "run.sh", os.X_OK)
    assert b.read_bytes(pulled.log or "") == a.read_bytes(entry.log or "")
    # nothing left in b's temp folder
    assert list(b.tmp_dir.iterdir()) == []


def test_remote_layout_is_the_local_layout(tmp_path: Path, remote_spec: Any) -> None:
    a = Store(tmp_path / "a")
    entry = store_action(a, make_src(tmp_path / "src"))
    ra = remote_for(a, remote_spec)
    ra.push(KEY)
    assert ra.ac_rpath(KEY).endswith(f"/ac/{KEY}.json")
    assert ra.fs.cat_file(ra.ac_rpath(KEY)) == (a.ac_dir / f"{KEY}.json").read_bytes()
    digests = {entry.outputs_tree, entry.log, *(e.digest for e in a.tree_entries(entry.outputs_tree))}
    for d in digests:
        assert d is not None
        assert ra.blob_rpath(d).endswith(f"/cas/{d[:2]}/{d}")
        assert ra.fs.cat_file(ra.blob_rpath(d)) == a.read_bytes(d)
    assert ra.list_keys() == [KEY]
    st = ra.status()
    assert st.reachable and st.ac_entries == 1 and st.blobs == len(digests)
    assert st.blob_bytes == sum(a.blob_path(d).stat().st_size for d in digests if d)
    assert st.tmp_files in (0, None)


def test_tampered_blob_is_rejected_and_the_rebuild_repairs_the_remote(
    tmp_path: Path, remote_spec: Any
) -> None:
    src = make_src(tmp_path / "src")
    a = Store(tmp_path / "a")
    entry = store_action(a, src)
    remote_for(a, remote_spec).push(KEY)

    b = Store(tmp_path / "b")
    rb = remote_for(b, remote_spec)
    victim = next(e for e in b_entries(a, entry) if e.path == "model.bin")
    good = a.read_bytes(victim.digest)
    bad = bytearray(good)
    bad[12345] ^= 0xFF  # one flipped bit, same size
    overwrite(rb, rb.blob_rpath(victim.digest), bytes(bad))

    with pytest.raises(RemoteIntegrityError, match=victim.digest):
        rb.fetch_blob(victim.digest)
    assert not b.has(victim.digest)  # rejected, not stored
    assert list(b.tmp_dir.iterdir()) == []
    # ...and removed from the remote (this cache may write), so every entry naming it is a
    # miss everywhere until a push replaces it
    assert not remote_for(Store(tmp_path / "probe"), remote_spec).has_blob(victim.digest)
    with pytest.raises(RemoteError):
        rb.fetch_tree(entry.outputs_tree)
    assert not b.has(victim.digest)
    # the engine's view: the remote hit is unusable, so the action is a miss
    assert rb.pull(KEY) is None and b.ac_entry(KEY) is None
    assert remote_for(Store(tmp_path / "b2"), remote_spec).fetch_entry(KEY, verify=True) is None
    assert rb.stats.rejected_blobs == 1

    # the engine rebuilds on b (same bytes: a reproducible action) and pushes, from another
    # process (a fresh RemoteCache): the blob is uploaded again
    store_action(b, src, host="builder-b")
    rep = remote_for(b, remote_spec).push(KEY)
    assert rep.uploaded_blobs == 2  # the removed blob, and b's own log (so b's entry is written)
    assert rb.fs.cat_file(rb.blob_rpath(victim.digest)) == good
    c = Store(tmp_path / "c")
    assert remote_for(c, remote_spec).pull(KEY) is not None


def test_read_only_cache_rejects_but_leaves_a_corrupt_blob(tmp_path: Path, remote_spec: Any) -> None:
    a = Store(tmp_path / "a")
    entry = store_action(a, make_src(tmp_path / "src"))
    remote_for(a, remote_spec).push(KEY)
    ro = remote_for(Store(tmp_path / "b"), remote_spec, push=False)
    overwrite(ro, ro.blob_rpath(entry.outputs_tree), b"garbage")
    assert ro.pull(KEY) is None
    assert ro.fs.cat_file(ro.blob_rpath(entry.outputs_tree)) == b"garbage"
    # a writer that knows it is bad replaces it even though it is "present"
    ra = remote_for(a, remote_spec)
    ra._bad.add(entry.outputs_tree)
    assert ra.push(KEY).uploaded_blobs == 1
    assert remote_for(Store(tmp_path / "c"), remote_spec).pull(KEY) is not None


def b_entries(store: Store, entry: ActionEntry) -> list[Any]:
    return store.tree_entries(entry.outputs_tree)


def test_tampered_manifest_entry_or_missing_blob_is_a_miss(tmp_path: Path, remote_spec: Any) -> None:
    src = make_src(tmp_path / "src")
    a = Store(tmp_path / "a")
    entry = store_action(a, src)
    ra = remote_for(a, remote_spec)
    ra.push(KEY)

    # a missing member blob: fetch_entry(verify=True) and pull both say miss
    member = a.tree_entries(entry.outputs_tree)[0].digest
    ra.fs.rm_file(ra.blob_rpath(member))
    b = Store(tmp_path / "b")
    rb = remote_for(b, remote_spec)
    assert rb.fetch_entry(KEY) is not None  # cheap: the entry itself is fine
    assert rb.fetch_entry(KEY, verify=True) is None
    assert rb.pull(KEY) is None and b.ac_entry(KEY) is None
    ra2 = remote_for(a, remote_spec)
    ra2.push(KEY)  # repaired: the missing blob is uploaded again
    assert remote_for(Store(tmp_path / "b2"), remote_spec).pull(KEY) is not None

    # a tampered tree manifest (another valid manifest's bytes under this digest)
    other_tree, _ = a.put_tree(make_src(tmp_path / "other", nonce="x"))
    overwrite(ra, ra.blob_rpath(entry.outputs_tree), a.read_bytes(other_tree))
    c = Store(tmp_path / "c")
    rc = remote_for(c, remote_spec)
    with pytest.raises(RemoteIntegrityError):
        rc.fetch_tree(entry.outputs_tree)
    assert rc.pull(KEY) is None and not c.has(entry.outputs_tree)
    assert not rc.has_blob(entry.outputs_tree)  # removed: the entry is now a miss everywhere

    # a broken or mislabelled entry is a miss, not an error
    overwrite(ra, ra.ac_rpath(KEY), b"{not json")
    assert rc.fetch_entry(KEY) is None
    other_key = hash_bytes(b"other")
    overwrite(
        ra,
        ra.ac_rpath(KEY),
        (a.ac_dir / f"{KEY}.json").read_bytes().replace(KEY.encode(), other_key.encode()),
    )
    assert rc.fetch_entry(KEY) is None
    assert rc.fetch_entry(hash_bytes(b"absent")) is None


def test_entry_is_written_last(tmp_path: Path, remote_spec: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that dies before its entry leaves blobs (harmless) but no entry."""
    a = Store(tmp_path / "a")
    entry = store_action(a, make_src(tmp_path / "src"))
    ra = remote_for(a, remote_spec)

    put = ra._put

    def boom(rpath: str, **kw: Any) -> None:
        if rpath == ra.ac_rpath(KEY):
            raise OSError("connection reset")
        put(rpath, **kw)

    monkeypatch.setattr(ra, "_put", boom)
    with pytest.raises(RemoteError, match="writing entry"):
        ra.push(KEY)
    assert ra.has_blob(entry.outputs_tree)
    assert remote_for(Store(tmp_path / "b"), remote_spec).fetch_entry(KEY) is None


def _push_proc(
    url: str,
    options: dict[str, Any],
    root: str,
    src: str,
    nonce: str,
    host: str,
    barrier: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    store = Store(Path(root))
    make_src(Path(src), nonce=nonce, mib=1)
    store_action(store, Path(src), host=host)
    barrier.wait(timeout=60)
    RemoteCache(url, store, options=options, transfers=4).push(KEY)


@pytest.mark.parametrize("outputs", ["same", "different"])
def test_concurrent_pushes_of_one_action_are_safe(tmp_path: Path, remote_spec: Any, outputs: str) -> None:
    """Five processes push the same action at once (identical outputs, or per-process
    outputs as a non-reproducible engine build gives): afterwards the remote entry is
    whole, names blobs that are all there and intact, and a fresh store pulls it."""
    url, options = remote_spec
    ctx = mp.get_context("spawn")
    n = 5
    barrier = ctx.Barrier(n)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    procs = [
        ctx.Process(
            target=_push_proc,
            args=(
                url,
                options,
                str(tmp_path / f"s{i}"),
                str(tmp_path / f"src{i}"),
                "" if outputs == "same" else f"n{i}",
                f"host-{i}",
                barrier,
                env,
            ),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n

    c = Store(tmp_path / "c")
    rc = RemoteCache(url, c, options=options)
    entry = rc.fetch_entry(KEY, verify=True)
    assert entry is not None and entry.host.startswith("host-")
    assert rc.pull(KEY) is not None
    dest = tmp_path / "out"
    c.materialize(entry.outputs_tree, dest)
    winner = int(entry.host.split("-")[1])
    assert same_tree(dest, tmp_path / f"src{winner}")
    if outputs == "same":
        assert len({hash_tree(tmp_path / f"src{i}")[0] for i in range(n)}) == 1
    if rc.is_local:  # no temp upload left behind, nothing partial under a final name
        assert list((Path(rc.root) / "tmp").iterdir()) == []
        for blob in (Path(rc.root) / "cas").rglob("*"):
            if blob.is_file():
                assert hash_bytes(blob.read_bytes()) == blob.name


def test_credentials_never_logged(
    tmp_path: Path, moto_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mopt")
    bucket = _new_bucket(moto_endpoint)
    options = {"key": FAKE_KEY_ID, "secret": FAKE_SECRET, "client_kwargs": {"endpoint_url": moto_endpoint}}
    a = Store(tmp_path / "a")
    store_action(a, make_src(tmp_path / "src"))
    ra = RemoteCache(f"s3://{bucket}/c", a, options=options)
    ra.push(KEY)
    assert ra.fetch_entry(KEY) is not None
    texts = [repr(ra), str(ra.status().to_json()), ra.fs.cat_file(ra.ac_rpath(KEY)).decode()]

    # a failing remote: errors and warnings name the URL, never the credentials
    gone = RemoteCache(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/c", a, options=options)
    with pytest.raises(RemoteError) as exc_info:
        gone.push(KEY)
    texts.append(str(exc_info.value))
    assert gone.fetch_entry(KEY) is None
    texts.append(str(gone.status().to_json()))
    # (botocore's own DEBUG lines carry the access key id; mopt's records must carry neither)
    texts += [r.getMessage() for r in caplog.records if r.name.startswith("mopt")]
    assert any("no-such-bucket" in t for t in texts)
    for t in texts:
        assert FAKE_SECRET not in t and FAKE_KEY_ID not in t
    assert "***" not in repr(ra)


def test_redact_url() -> None:
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url("sftp://alice:hunter22@host:22/srv/cache") == "sftp://***@host:22/srv/cache"
    assert redact_url("az://c/p?sv=2024&sig=abcdef") == "az://c/p?sv=***&sig=***"
    assert redact_url("file:///tmp/x") == "file:///tmp/x"


def test_scrubs_secret_options_and_url_userinfo(tmp_path: Path) -> None:
    remote = RemoteCache(
        f"file://{tmp_path / 'r'}",
        Store(tmp_path / "a"),
        options={"client_kwargs": {"aws_secret_access_key": "s3kr1t!"}},
    )
    assert remote._scrub("failed with s3kr1t! in it") == "failed with *** in it"


def test_from_settings(tmp_path: Path) -> None:
    from mopt.config import RemoteSettings

    store = Store(tmp_path / "s")
    assert RemoteCache.from_settings(RemoteSettings(), store) is None
    r = RemoteCache.from_settings(RemoteSettings(url=f"file://{tmp_path / 'r'}", push=False), store)
    assert r is not None and not r.push_enabled and r.is_local
    # offline: a network URL is not used; a local one is
    s3 = RemoteSettings(url="s3://bucket/p")
    if shutil.which("true") and _has("s3fs"):
        assert RemoteCache.from_settings(s3, store, offline=True) is None
        s3 = RemoteSettings(url="s3://bucket/p", options={"client_kwargs": {"endpoint_url": "http://x"}})
        r2 = RemoteCache.from_settings(s3, store)
        assert r2 is not None and r2.protocol == "s3" and r2.root == "bucket/p"


def _has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


# --------------------------------------------------------------------------- the CLI


TOY_RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[defaults]
targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]

[toy.gpu]
hardware = "toy-gpu"
"""


def _cli() -> Any:
    """`mopt` in-process (the command is wired into mopt.cli's group)."""
    from click.testing import CliRunner

    from mopt.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args), catch_exceptions=False)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_cli_push_then_pull_into_a_second_project_makes_a_full_hit(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import TOY_MODEL, run_mopt

    if kind == "file":
        url = f"file://{tmp_path / 'remote'}"
        env: dict[str, str] = {}
    else:  # the usual boto configuration: endpoint and credentials from the environment
        endpoint = request.getfixturevalue("moto_endpoint")
        url = f"s3://{_new_bucket(endpoint)}/cache"
        env = {"AWS_ENDPOINT_URL_S3": endpoint}
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    projects = []
    for name in ("a", "b"):
        p = tmp_path / name
        p.mkdir()
        shutil.copytree(TOY_MODEL, p / "toy-model")
        (p / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n\n[remote]\nurl = "{url}"\n')
        (p / "r.toml").write_text(TOY_RECIPE)
        projects.append(p)
    a, b = projects
    # build without pushing (push = false), then share explicitly with `mopt cache push`
    (a / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n\n[remote]\nurl = "{url}"\npush = false\n')
    built = run_mopt("build", "r.toml", "--json", "--no-check", cwd=a, env=env)
    assert built.returncode == 0, built.stderr
    n = len(json.loads(built.stdout)["nodes"])
    (a / "mopt.toml").write_text(f'[store]\npath = ".mopt"\n\n[remote]\nurl = "{url}"\n')

    cli = _cli()
    res = cli("cache", "push", str(a / "r.toml"), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["counts"] == {"pushed": n} and out["uploaded_blobs"] > 0
    res = cli("cache", "push", str(a / "r.toml"), "--json")
    assert json.loads(res.stdout)["counts"] == {"present": n}
    assert json.loads(res.stdout)["uploaded_blobs"] == 0

    # the second machine: its own store, the recipe and lock file from version control
    shutil.copy(a / "mopt.lock", b / "mopt.lock")
    res = cli("cache", "status", str(b / "r.toml"), "--json")
    st = json.loads(res.stdout)
    assert res.exit_code == 0 and st["remote"]["ac_entries"] == n and st["recipe"]["on_remote"] == n
    assert st["local"]["ac_entries"] == 0
    res = cli("cache", "pull", str(b / "r.toml"), "--json")
    assert res.exit_code == 0, res.output
    pulled = json.loads(res.stdout)
    assert pulled["counts"] == {"pulled": n} and pulled["rejected_blobs"] == 0
    again = run_mopt("build", "r.toml", "--json", "--no-check", cwd=b, env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["counts"] == {"cached": n}
    plan = (b / "build" / "toy" / "gpu" / "toy-engine" / "engine.plan").read_text()
    assert plan == (a / "build" / "toy" / "gpu" / "toy-engine" / "engine.plan").read_text()
    text = cli("cache", "status", str(b / "r.toml"))
    assert "only local: 0 action(s); only remote: 0 action(s)" in text.stdout


def test_cli_without_remote_is_bad_input(tmp_path: Path) -> None:
    from mopt.errors import MoptError

    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(TOY_RECIPE)
    cli = _cli()
    with pytest.raises(MoptError, match=r"\[remote\] url: no remote cache configured"):
        cli("cache", "status", str(tmp_path / "r.toml"))
