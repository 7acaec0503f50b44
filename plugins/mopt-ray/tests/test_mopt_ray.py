"""The Ray executor on a real local Ray cluster (2 CPUs, one `mopt:rtx4060-laptop` unit),
with real remote caches: S3 (moto's server on loopback) and file://."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("mopt_fixture")

from mopt_ray.plugin import RayExecutor  # noqa: E402

from mopt.build import Engine  # noqa: E402
from mopt.cli import Session  # noqa: E402
from mopt.executor import BuildSession  # noqa: E402
from mopt.remote import RemoteCache  # noqa: E402

TOY_MODEL = Path(__file__).resolve().parents[3] / "tests" / "data" / "toy-model"
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAMOPTRAYTEST00001",
    "AWS_SECRET_ACCESS_KEY": "mopt-ray-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}

RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[defaults]
targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]

[toy.laptop]
hardware = "rtx4060-laptop"

[toy.gpu]
hardware = "toy-gpu"
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A local Ray cluster whose only custom resource is one `mopt:rtx4060-laptop`.

    Workers inherit the environment at init: fake AWS credentials, and a counter file the
    fixture's toy-export appends to each time it really runs.
    """
    base = tmp_path_factory.mktemp("ray")
    counter = base / "runs.txt"
    counter.touch()
    saved = {k: os.environ.get(k) for k in [*FAKE_ENV, "MOPT_FIXTURE_COUNTER", "MOPT_FIXTURE_TOOL_VERSION"]}
    os.environ.update(FAKE_ENV)
    os.environ["MOPT_FIXTURE_COUNTER"] = str(counter)
    os.environ.pop("MOPT_FIXTURE_TOOL_VERSION", None)
    ray.init(
        address="local",  # a new cluster, never one that happens to run on this machine
        num_cpus=2,
        resources={"mopt:rtx4060-laptop": 1},
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"mopt-test-{uuid.uuid4().hex[:6]}",
    )
    try:
        yield {"counter": counter, "base": base}
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def s3_endpoint(cluster: Any) -> Any:
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_project(root: Path, recipe: str = RECIPE) -> Path:
    root.mkdir(parents=True)
    shutil.copytree(TOY_MODEL, root / "toy-model")
    (root / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (root / "r.toml").write_text(recipe)
    return root / "r.toml"


def ray_build(
    recipe: Path,
    remote_url: str,
    options: dict[str, Any],
    worker_store: Path,
    selectors: list[str] | None = None,
    **settings: Any,
) -> tuple[dict[str, Any], Engine, RemoteCache]:
    session = Session(recipe)
    engine = Engine(session)
    remote = RemoteCache(remote_url, engine.store, options=options)
    ids = session.graph.select(selectors or [])
    states = RayExecutor().build(
        BuildSession(engine, ids, remote=remote),
        settings=RayExecutor.Settings(worker_store=str(worker_store), **settings),
    )
    return states, engine, remote


def by_label(states: dict[str, Any]) -> dict[str, Any]:
    """'laptop:toy-engine' → state (the section and label of each node's first address)."""
    out = {}
    for st in states.values():
        for a in st.node.addresses:
            sec, _, label = a.partition(":")
            out[f"{sec.split('.', 1)[1]}:{label}"] = st
    return out


def runs(cluster: Any) -> list[str]:
    return cluster["counter"].read_text().splitlines()


def local_build(project: Path, *selectors: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MOPT_DISABLE_PLUGINS"}
    proc = subprocess.run(
        [sys.executable, "-m", "mopt", "build", "r.toml", "--json", "--no-check", *selectors],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_misses_run_on_matching_workers_and_land_in_the_s3_cache(
    cluster: Any, s3_endpoint: str, tmp_path: Path
) -> None:
    import s3fs

    bucket = "mopt-ray-" + uuid.uuid4().hex[:8]
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True).mkdir(bucket)
    url = f"s3://{bucket}/cache"
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    before = len(runs(cluster))

    recipe_a = make_project(tmp_path / "a")
    states, _engine, remote = ray_build(recipe_a, url, options, tmp_path / "worker-store")
    s = by_label(states)
    statuses = {k: v.status for k, v in s.items()}
    # the laptop section's engine ran on the worker offering mopt:rtx4060-laptop
    assert statuses["laptop:toy-engine"] == "built", s["laptop:toy-engine"].reason
    assert statuses["laptop:toy-weights"] == statuses["laptop:toy-export"] == "built"
    # no worker offers mopt:toy-gpu: reported unbuildable with the reason, not left pending
    assert statuses["gpu:toy-engine"] == "unbuildable"
    assert "no Ray worker offers mopt:toy-gpu" in s["gpu:toy-engine"].reason
    assert statuses["gpu:toy-check[toy-engine]"] == "blocked"
    built = [st for st in states.values() if st.status == "built"]
    assert len(built) == 5  # weights, export, check[export] (shared), laptop engine + its check
    assert all(st.entry.meta["executor"] == "ray" for st in built)
    assert len(runs(cluster)) == before + 1  # toy-export ran once
    plan = recipe_a.parent / "build" / "toy" / "laptop" / "toy-engine" / "engine.plan"
    assert "hw=rtx4060-laptop fp16 b32 O3" in plan.read_text()

    # results landed in the remote cache, with their blobs, and in the worker's store
    on_remote = set(remote.list_keys())
    assert {st.key for st in built} <= on_remote
    for st in built:
        assert remote.fetch_entry(st.key, verify=True) is not None
    assert any((tmp_path / "worker-store" / "ac").iterdir())

    # the driver's store holds what it materialized: a local build of that section is all hits
    local = local_build(recipe_a.parent, "toy.laptop")
    assert local["counts"] == {"cached": 5}

    # a fresh machine-like project (its own store), same remote: all hits from the remote,
    # nothing runs on the workers, the artifacts are downloaded and verified
    recipe_b = make_project(tmp_path / "b")
    states_b, _engine_b, remote_b = ray_build(
        recipe_b, url, options, tmp_path / "worker-store", ["toy.laptop"]
    )
    assert {st.status for st in states_b.values()} == {"cached"}
    assert len(runs(cluster)) == before + 1
    assert remote_b.stats.rejected_blobs == 0 and remote_b.stats.downloaded_blobs > 0
    plan_b = recipe_b.parent / "build" / "toy" / "laptop" / "toy-engine" / "engine.plan"
    assert plan_b.read_text() == plan.read_text()
    assert local_build(recipe_b.parent, "toy.laptop")["counts"] == {"cached": 5}


def test_worker_with_other_tool_versions_refuses(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver keys toy-engine with toy-compiler 9.9; the workers have 1.0: refusing is
    right, storing it under the driver's key would mislabel the artifact."""
    monkeypatch.setenv("MOPT_FIXTURE_TOOL_VERSION", "9.9")
    url = f"file://{tmp_path / 'remote'}"
    states, _engine, remote = ray_build(
        make_project(tmp_path / "c"), url, {}, tmp_path / "worker-store", ["toy.laptop"]
    )
    s = by_label(states)
    eng = s["laptop:toy-engine"]
    assert eng.status == "failed"
    assert "toy-compiler '9.9' → '1.0'" in eng.reason
    assert s["laptop:toy-export"].status == "built"
    assert eng.key not in remote.list_keys()


SLOW = """\
schema = 1

[models.toy]
family = "toyfam"

[toy.cpu]
hardware = "cpu"
targets = ["slow"]

[toy.cpu.slow]
kind = "command"
shell = true
argv = ["if [ -e {mark} ]; then echo ok > {{out}}/result.txt; else touch {mark}; echo $$ > {pid}; exec sleep 120; fi"]
"""


def _kill_worker_when_running(pidfile: Path, build: threading.Thread, result: dict[str, Any]) -> None:
    """Wait for the action's process; SIGKILL the Ray worker running it, then the process."""
    deadline = time.time() + 60
    while not (pidfile.exists() and pidfile.read_text().strip()):
        if not build.is_alive():
            states = result.get("out", ({},))[0]
            raise AssertionError(f"the build ended first: {[(s.status, s.reason) for s in states.values()]}")
        assert time.time() < deadline, "the action never started"
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    cmdline = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "ray" in cmdline.lower() or "default_worker" in cmdline, cmdline
    os.kill(ppid, signal.SIGKILL)  # the worker: Ray sees a lost task
    os.kill(pid, signal.SIGKILL)  # the action's own process (its own session) dies with it


@pytest.mark.parametrize("retries", [1, 0])
def test_worker_loss_is_retried_and_leaves_nothing_under_a_final_name(
    cluster: Any, tmp_path: Path, retries: int
) -> None:
    mark, pid = tmp_path / "mark", tmp_path / "pid"
    recipe = make_project(tmp_path / "p", SLOW.format(mark=mark, pid=pid))
    url = f"file://{tmp_path / 'remote'}"
    worker_store = tmp_path / "worker-store"
    result: dict[str, Any] = {}

    def go() -> None:
        result["out"] = ray_build(recipe, url, {}, worker_store, max_retries=retries)

    t = threading.Thread(target=go)
    t.start()
    _kill_worker_when_running(pid, t, result)
    t.join(120)
    assert not t.is_alive()
    states, _engine, remote = result["out"]
    (st,) = states.values()
    remote_root = tmp_path / "remote"
    if retries:
        assert st.status == "built", st.reason
        assert (recipe.parent / "build" / "toy" / "cpu" / "slow" / "result.txt").read_text() == "ok\n"
        assert remote.list_keys() == [st.key]
    else:
        assert st.status == "failed"
        assert "lost on the Ray cluster after 0 retries" in st.reason
        # nothing under a final name: no entry on the remote or in the worker's store
        assert remote.fetch_entry(st.key) is None and remote.list_keys() == []
        assert not (worker_store / "ac" / f"{st.key}.json").exists()
    for leftover in (remote_root / "tmp").glob("*") if (remote_root / "tmp").exists() else []:
        raise AssertionError(f"unfinished upload left behind: {leftover}")


def test_a_gathering_node_runs_on_ray_with_what_got_built(cluster: Any, tmp_path: Path) -> None:
    # no worker offers mopt:toy-gpu: the engine is unbuildable, its check blocked; toy-gather
    # (gather + partial) still runs on a worker, on the export and its check
    recipe = RECIPE.replace(
        'targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]',
        'targets = ["toy-weights", "toy-export", "toy-engine", "toy-check", "toy-gather"]',
    )
    url = f"file://{tmp_path / 'remote'}"
    states, _engine, _remote = ray_build(
        make_project(tmp_path / "g", recipe), url, {}, tmp_path / "worker-store", ["toy.gpu"]
    )
    s = by_label(states)
    assert s["gpu:toy-engine"].status == "unbuildable"
    assert s["gpu:toy-gather"].status == "built", s["gpu:toy-gather"].reason
    assert s["gpu:toy-gather"].entry.meta["executor"] == "ray"
    got = json.loads((tmp_path / "g" / "build/toy/gpu/toy-gather/gathered.json").read_text())
    assert [a["label"] for a in got["got"]["models"]] == ["toy-export"]
    assert [a["label"] for a in got["got"]["checks"]] == ["toy-check[toy-export]"]
    assert {m["label"]: m["status"] for m in got["missing"]["models"]} == {"toy-engine": "unbuildable"}
    assert {m["label"]: m["status"] for m in got["missing"]["checks"]} == {"toy-check[toy-engine]": "blocked"}
