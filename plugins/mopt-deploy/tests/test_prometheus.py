"""The deployment bundle against a real Prometheus, through the real `mopt` command line:
recipes/cpu-serve.toml's tiny BERT section → ONNX → INT8 → Debian base → the embed image →
`container-check` in docker → `deploy` (and `deploy-fast`, the same with second-scale scrape
and alert intervals). Then the image runs in docker (--network host, --init), Debian's
`prometheus` runs on 127.0.0.1 with the bundle's scrape config (its target's port set to the
container's) and rules; the test queries its HTTP API for the serving series, drives load so
the recording rules have values, kill -9s the server (no restart policy here: the container
stays down), sees MoptTargetDown go pending and firing, starts the container again and sees
the alert clear. Everything is stopped and removed afterwards.

Needs buildah, mmdebstrap, a docker daemon (DOCKER_HOST; .ci/run starts one), Debian's
prometheus (prometheus + promtool; .ci/run installs it), the Debian mirror and PyPI."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import EMBED_BUCKETS, ROOT, ceil
from mopt_image.testing import shared_serving_store

from mopt.tomlfile import tomllib

RECIPE = ROOT / "recipes" / "cpu-serve.toml"
JOB = "tiny-bert"
#: the tiny section, plus the same bundle with second-scale intervals for the live test
EXTRA = """
[tiny-bert.cpu]
hardware = "cpu"
targets = ["weights", "onnx", "int8", "base", "image", "check", "deploy", "deploy-fast"]

[tiny-bert.cpu.deploy-fast]
kind = "deploy"
input = ["check", "image", "weights"]
target_rps = 2000
scrape_interval = "1s"
evaluation_interval = "1s"
rate_window = "5s"
slo_for = "5s"
errors_for = "5s"
down_for = "3s"
"""


def _docker_why_not() -> str | None:
    try:
        from mopt_serve.container import daemon_unavailable
    except ImportError:
        return "mopt-serve is not installed"
    return daemon_unavailable()


def mopt(project: Path, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mopt", *args], cwd=project, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def _bundle(project: Path, target: str, rel: str) -> Any:
    text = (project / "build/tiny-bert/cpu" / target / rel).read_text()
    return json.loads(text) if rel.endswith(".json") else yaml.safe_load(text)


# --------------------------------------------------------------------------- Prometheus


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(what: str, probe: Any, timeout: float, every: float = 0.25) -> Any:
    """Poll `probe()` until it returns a true value; that value (AssertionError naming `what` on timeout)."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            last = probe()
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


class Prom:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, q: str) -> list[dict[str, Any]]:
        d = get_json(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
        assert d["status"] == "success", d
        return list(d["data"]["result"])

    def value(self, q: str) -> float | None:
        res = self.query(q)
        return float(res[0]["value"][1]) if res else None

    def alert(self, name: str) -> str | None:
        """The state of alert `name` ("pending", "firing") or None when it is not active."""
        for a in get_json(f"{self.base}/api/v1/alerts")["data"]["alerts"]:
            if a["labels"].get("alertname") == name:
                return str(a["state"])
        return None


@contextlib.contextmanager
def prometheus(config: Path, workdir: Path, port: int) -> Iterator[Prom]:
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(
            "prometheus ready", lambda: urllib.request.urlopen(base + "/-/ready", timeout=2).status == 200, 30
        )
        yield Prom(base)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@contextlib.contextmanager
def serving_container(archive: Path, port: int) -> Iterator[Any]:
    """The image run as the check ran it (--network host, --init, the port), without a restart
    policy: after kill -9 it stays down until the test starts it again."""
    from mopt_serve.container import archive_image_id, docker_client

    client = docker_client()
    image_id = archive_image_id(archive)
    with open(archive, "rb") as f:
        client.images.load(f)
    container = None
    try:
        container = client.containers.run(
            image_id, command=["--port", str(port)], detach=True, name=f"mopt-deploy-test-{uuid.uuid4().hex[:10]}",
            network_mode="host", init=True, labels={"dev.mopt.deploy-test": "1"},
        )  # fmt: skip
        yield container
    finally:
        if container is not None:
            with contextlib.suppress(Exception):
                container.remove(force=True)
        with contextlib.suppress(Exception):
            client.images.remove(image_id, force=True)
        client.close()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def drive_load(port: int, seconds: float, clients: int = 4) -> tuple[int, int]:
    """Closed-loop POST /v1/embeddings from `clients` threads for `seconds`: (ok, failed)."""
    counts = [0, 0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    body = json.dumps(
        {"model": JOB, "input": ["the deployment bundle is checked by a real prometheus"]}
    ).encode()

    def client() -> None:
        while time.monotonic() < stop:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    ok = r.status == 200
                    r.read()
            except (urllib.error.URLError, OSError):
                ok = False
            with lock:
                counts[0 if ok else 1] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts[0], counts[1]


def free_port() -> int:
    from mopt_serve.container import free_port as fp

    return int(fp())


# --------------------------------------------------------------------------- the test


def check_the_bundle_follows_the_measurement_and_the_recipe(project: Path) -> None:
    serve = _bundle(project, "check", "serve.json")
    image = _bundle(project, "image", "image.json")
    recipe = tomllib.loads(RECIPE.read_text())
    slo = recipe["defaults"]["check"]["slo_p99_ms"]
    target = recipe["tiny-bert"]["cpu"]["deploy"]["target_rps"]
    cap = _bundle(project, "deploy", "capacity.json")
    knee = serve["knee"]
    n, d = knee["completed"], knee["duration_s"]
    assert cap["knee"] == knee["requests_per_s"] and cap["slo_p99_ms"] == slo == serve["slo_p99_ms"]
    assert cap["replicas"] == ceil(target / knee["requests_per_s"])
    assert cap["replicas_safe"] == ceil(target / ((n - 1.959963984540054 * math.sqrt(n)) / d))
    dep = _bundle(project, "deploy", "k8s/deployment.yaml")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == f"mopt/tiny-bert@{image['image_digest']}"
    assert dep["spec"]["replicas"] == cap["replicas_safe"]
    rules = _bundle(project, "deploy", "prometheus/rules.yml")
    p99 = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "MoptLatencyP99OverSLO")
    assert float(p99["expr"].rsplit(">", 1)[1]) == slo / 1000
    rec = _bundle(project, "deploy", "deploy.json")["validation"]
    assert rec["kubernetes-validate"]["version"] and len(rec["kubernetes-validate"]["checked"]) == 4
    assert rec["promtool"]["version"] and rec["promtool"]["checked"]["test rules rules.test.yml"] == "ok"
    print(
        f"\nplan: {cap['sentence']} for {target} req/s (knee {knee['requests_per_s']:.1f} req/s at c="
        f"{knee['concurrency']}); validated by kubernetes-validate {rec['kubernetes-validate']['version']}, "
        f"promtool {rec['promtool']['version']}"
    )


def check_mopt_report_shows_the_plan_beside_the_load_curve(project: Path) -> None:
    r = mopt(project, "report", "serve.toml", "tiny-bert.*", "-o", "page.html", timeout=120)
    assert r.returncode == 0, r.stderr
    page = (project / "page.html").read_text()
    cap = _bundle(project, "deploy", "capacity.json")
    m = re.search(r'<figure><figcaption>deploy</figcaption><div class="fig-row"><img [^>]*>\s*'
                  r'<pre class="notes" data-target="deploy">([^<]*)</pre>', page)  # fmt: skip
    assert m, "no capacity figure with the plan beside it"
    assert cap["sentence"].replace("'", "&#39;") in m[1]


def check_a_real_prometheus_scrapes_records_and_alerts(project: Path, tmp: Path) -> None:
    bundle = project / "build/tiny-bert/cpu/deploy-fast"
    mem_limit = _bundle(project, "deploy-fast", "k8s/deployment.yaml")["spec"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["memory"]  # fmt: skip
    cfg = yaml.safe_load((bundle / "prometheus/prometheus-docker.yml").read_text())
    scrape = cfg["scrape_configs"][0]
    assert scrape["job_name"] == JOB and scrape["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]
    port, prom_port = free_port(), free_port()
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]  # the container's port here
    work = tmp / "prometheus"
    work.mkdir()
    shutil.copy(bundle / "prometheus/rules.yml", work / "rules.yml")
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    times: dict[str, float] = {}
    t0 = time.monotonic()
    with serving_container(project / "build/tiny-bert/cpu/image/image.oci.tar", port) as container, \
            prometheus(work / "prometheus.yml", work, prom_port) as prom:  # fmt: skip
        wait_for("the server's /health", lambda: healthy(port), 60)
        wait_for("up == 1", lambda: prom.value(f'up{{job="{JOB}"}}') == 1, 30)
        times["scraped"] = time.monotonic() - t0
        # the serving series, with the buckets the bundle's rules assume
        les = {s["metric"]["le"] for s in prom.query(f'mopt_embed_request_seconds_bucket{{job="{JOB}"}}')}
        assert les == {format(b, ".12g") if b != int(b) else f"{b:.1f}" for b in EMBED_BUCKETS} | {"+Inf"}, (
            les
        )
        assert prom.value(f'mopt_embed_requests_in_flight{{job="{JOB}"}}') is not None
        ok, failed = drive_load(port, 4.0)
        assert ok > 50 and failed == 0
        rate = wait_for(
            "job:mopt_requests:rate > 0", lambda: prom.value(f'job:mopt_requests:rate{{job="{JOB}"}}'), 20
        )
        p99 = prom.value(f'job:mopt_request_latency_seconds:p99{{job="{JOB}"}}')
        p50 = prom.value(f'job:mopt_request_latency_seconds:p50{{job="{JOB}"}}')
        errors = prom.value(f'job:mopt_request_errors:ratio{{job="{JOB}"}}')
        assert p99 is not None and p50 is not None and 0 < p50 <= p99 <= 10, (p50, p99)
        assert errors == 0
        assert prom.value(f'job:mopt_requests_in_flight:sum{{job="{JOB}"}}') is not None
        assert prom.value(f'job:mopt_replicas_up:count{{job="{JOB}"}}') == 1
        rss = prom.value(f'process_resident_memory_bytes{{job="{JOB}"}}')
        assert rss is not None and rss < int(mem_limit.removesuffix("Mi")) * 2**20, (rss, mem_limit)
        times["recorded"] = time.monotonic() - t0
        # kill -9 the server inside the container: tini exits, nothing restarts it
        from mopt_serve.container import kill_children_of_init

        assert kill_children_of_init(container)  # the PIDs it killed
        killed = time.monotonic()
        wait_for("the container exited", lambda: (container.reload(), container.status)[1] == "exited", 20)
        states = set()

        def firing() -> bool:
            s = prom.alert("MoptTargetDown")
            if s:
                states.add(s)
            return s == "firing"

        wait_for("MoptTargetDown firing", firing, 30, every=0.2)
        times["firing after kill"] = time.monotonic() - killed
        assert "pending" in states, states  # for: 3s, evaluated every second: seen pending first
        container.start()
        restarted = time.monotonic()
        wait_for("the server's /health after the restart", lambda: healthy(port), 60)
        wait_for("MoptTargetDown cleared", lambda: prom.alert("MoptTargetDown") is None, 30)
        assert prom.value(f'up{{job="{JOB}"}}') == 1
        times["cleared after restart"] = time.monotonic() - restarted
    print(
        f"\nreal prometheus: {rate:.0f} req/s recorded, p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; server RSS "
        f"{rss / 2**20:.0f} MiB (limit {mem_limit}); " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
    )


def missing() -> list[str]:
    """What this machine lacks for the test (nothing in CI: .ci/run installs and starts it all)."""
    out = [f"{tool} is not installed (apt-get install {pkg})" for tool, pkg in
           (("buildah", "buildah"), ("mmdebstrap", "mmdebstrap"), ("prometheus", "prometheus"),
            ("promtool", "prometheus")) if shutil.which(tool) is None]  # fmt: skip
    why = _docker_why_not()
    if why is not None:
        out.append(f"no docker daemon: {why} (.ci/run starts one and sets DOCKER_HOST)")
    return out



def test_the_bundle_with_a_real_prometheus(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    lacking = missing()
    if lacking and os.environ.get("CI") == "true":  # CI must run it, never skip it
        pytest.fail("CI lacks what the real-Prometheus test needs: " + "; ".join(lacking))
    if lacking:
        pytest.skip("; ".join(lacking))
    with shared_serving_store(tmp_path_factory) as store:
        _with_prometheus(tmp_path, store)


def _with_prometheus(tmp_path: Path, store: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "mopt.toml").write_text(f'[store]\npath = "{store}"\n')
    text = RECIPE.read_text().replace('[tiny-bert.cpu]\nhardware = "cpu"\n', EXTRA, 1)
    assert "deploy-fast" in text
    (project / "serve.toml").write_text(text)
    t0 = time.monotonic()
    r = mopt(project, "build", "serve.toml", "tiny-bert.*", "-j", "2")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(
        f"\nbuild of tiny-bert.* through deploy (cold unless mopt-image's test built the shared targets "
        f"first): {time.monotonic() - t0:.0f} s"
    )
    check_the_bundle_follows_the_measurement_and_the_recipe(project)
    check_mopt_report_shows_the_plan_beside_the_load_curve(project)
    t1 = time.monotonic()
    check_a_real_prometheus_scrapes_records_and_alerts(project, tmp_path)
    print(f"prometheus part: {time.monotonic() - t1:.0f} s")
