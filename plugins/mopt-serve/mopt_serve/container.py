"""The container launcher of serve-check: run an image mopt built, as a deployment would.

`container_server(archive, ...)` loads the OCI archive of an `image` target into a docker
daemon (the docker SDK; `DOCKER_HOST` says which daemon), runs it the way the deployment
write-ups do — `--network host` on a free port, `--restart on-failure`, `--init` — waits for
`/health`, and yields a `ContainerServer` with the launcher interface of serve-check
(`base_url`, `log_path`, `kill_server()`, `stop()`): every check of `serve_check` runs
against `base_url`. The container (and the image, when this run loaded it) is removed on the
way out, whatever happened.

Why `--init`: docker's restart policy restarts a container when its main process dies, and a
process that is PID 1 of its PID namespace cannot be SIGKILLed from inside it (the kernel
drops signals to an init that has no handler). With `--init` docker's tini is PID 1 and the
server is its child: `kill -9` of the server from inside the container makes tini exit with
128 + 9, and `on-failure` brings the container back. `recover_after_kill` measures that.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from mopt.api import BuildContext, CheckContext, Finding, Input, Params, TargetKind
from mopt_serve.common import CHECKPOINT_KINDS
from mopt_serve.serve_check import check_server
from mopt_serve.server import (
    DEFAULT_TEXTS,
    Outcome,
    cosines,
    embed,
    loadtest_svg,
    read_metrics,
    read_texts_file,
    reference_embeddings,
)

#: a label on every container this module starts (so a leftover is recognisable)
LABEL = "dev.mopt.serve-check"
#: SIGKILL every child of PID 1 (the init) except this script itself: the serving process
#: and whatever it forked. Python is in every serving image (health checks use it too).
KILL_CHILDREN_OF_INIT = (
    "import os, signal\n"
    "me = os.getpid()\n"
    "killed = []\n"
    "for d in os.listdir('/proc'):\n"
    "    if not d.isdigit() or int(d) in (1, me):\n"
    "        continue\n"
    "    try:\n"
    "        stat = open(f'/proc/{d}/stat').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if int(stat.rsplit(')', 1)[1].split()[1]) == 1:\n"
    "        os.kill(int(d), signal.SIGKILL)\n"
    "        killed.append(d)\n"
    "print(' '.join(killed))\n"
)


def kill_children_of_init(container: Any) -> list[str]:
    """SIGKILL the children of the container's PID 1 through `docker exec`; the PIDs killed.

    Where PID 1 exits when its child dies (tini without a restart policy), the kernel kills
    the rest of the container's processes, this exec too, often before it returns: exit 137
    with the PIDs already printed is that, not a failure."""
    r = container.exec_run(["python3", "-c", KILL_CHILDREN_OF_INIT])
    out = r.output.decode(errors="replace").strip() if r.output else ""
    if r.exit_code not in (0, 137) or not out:
        raise RuntimeError(f"could not kill the server inside the container (exit {r.exit_code}): {out[-300:]}")
    return out.split()


class ContainerUnavailable(RuntimeError):
    """No docker daemon (or no docker SDK) here; the message says which and what to do."""


def docker_client(timeout: int = 120) -> Any:
    """A docker SDK client of the daemon `DOCKER_HOST` names (or the default socket)."""
    try:
        import docker  # type: ignore[import-not-found]
    except ImportError:
        raise ContainerUnavailable("running images needs the docker SDK: pip install docker") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ContainerUnavailable(
            f"no docker daemon answers ({first}); start one (dockerd) and set DOCKER_HOST=unix://SOCKET"
        ) from None
    return client


def daemon_unavailable() -> str | None:
    """Why no image can be run here, or None."""
    try:
        docker_client(timeout=10).close()
    except ContainerUnavailable as exc:
        return str(exc)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(base_url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(base_url + path, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@dataclass
class ContainerServer:
    """A running container of a serving image (the launcher interface of serve-check)."""

    client: Any
    container: Any
    image_id: str
    base_url: str
    log_path: Path
    port: int
    health_path: str = "/health"
    startup_s: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        self.container.reload()
        attrs = self.container.attrs
        return {"status": attrs["State"]["Status"], "restart_count": int(attrs.get("RestartCount", 0)),
                "exit_code": attrs["State"].get("ExitCode"), "health": (attrs["State"].get("Health") or {}).get("Status")}

    def alive(self) -> bool:
        """Running, or about to be restarted by its policy (a restart is not a death)."""
        st = self.state()
        return st["status"] in ("running", "restarting", "created")

    def log_tail(self, n: int = 40) -> str:
        self.save_log()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def save_log(self) -> None:
        """The container's output so far (over all its restarts) into `log_path`."""
        with contextlib.suppress(Exception):
            self.log_path.write_bytes(self.container.logs(stdout=True, stderr=True))

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answers 200; RuntimeError if the container gives up first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if _healthy(self.base_url, self.health_path):
                return time.monotonic() - t0
            if not self.alive():
                raise RuntimeError(
                    f"the container exited ({self.state()}) before /health answered; its log ends:\n" + self.log_tail()
                )
            time.sleep(0.1)
        raise RuntimeError(f"the container was not healthy after {timeout:.0f} s; its log ends:\n" + self.log_tail())

    def kill_server(self) -> None:
        """SIGKILL the serving process inside the container (`docker exec … kill -9`)."""
        self.kills.append({"pids_in_container": kill_children_of_init(self.container), "at": time.time()})

    def stop(self) -> None:
        """Remove the container (its log is saved first)."""
        self.save_log()
        with contextlib.suppress(Exception):
            self.container.remove(force=True)


def recover_after_kill(server: ContainerServer, timeout_s: float) -> dict[str, Any]:
    """`kill -9` the server inside the container and measure how long until /health answers
    again (the restart policy must bring it back on its own; nothing here restarts it)."""
    before = server.state()["restart_count"]
    t0 = time.monotonic()
    server.kill_server()
    down_s = None
    while time.monotonic() - t0 < timeout_s:  # first see it go down, so the old server is not timed
        if not _healthy(server.base_url, server.health_path) or server.state()["restart_count"] > before:
            down_s = time.monotonic() - t0
            break
        time.sleep(0.02)
    healthy_s = None
    while down_s is not None and time.monotonic() - t0 < timeout_s:
        if _healthy(server.base_url, server.health_path):
            healthy_s = time.monotonic() - t0
            break
        time.sleep(0.05)
    st = server.state()
    return {
        "killed_pids_in_container": server.kills[-1]["pids_in_container"] if server.kills else [],
        "down_after_s": None if down_s is None else round(down_s, 3),
        "healthy_after_s": None if healthy_s is None else round(healthy_s, 3),
        "restart_count": st["restart_count"] - before,
        "bound_s": timeout_s,
        "recovered": healthy_s is not None and st["restart_count"] > before,
        "state": st,
    }


def archive_image_id(archive: Path) -> str:
    """The image id (config digest) of the one image in an OCI archive (what docker calls it)."""
    import tarfile

    with tarfile.open(archive) as tar:
        def blob(name: str) -> Any:
            f = tar.extractfile(name)
            if f is None:
                raise RuntimeError(f"{archive} has no {name}: not an OCI archive of mopt-image")
            return json.loads(f.read())

        index = blob("index.json")
        manifests = index.get("manifests") or []
        if len(manifests) != 1:
            raise RuntimeError(f"{archive} holds {len(manifests)} images; expected one")
        manifest = blob("blobs/sha256/" + manifests[0]["digest"].split(":", 1)[1])
        return str(manifest["config"]["digest"])


def _load(client: Any, archive: Path, log: Callable[[str], None]) -> tuple[str, bool]:
    """Load the archive into the daemon: (image id, whether this call added it)."""
    config_digest = archive_image_id(archive)
    try:
        client.images.get(config_digest)
        present = True
    except Exception:
        present = False
    if not present:
        t0 = time.monotonic()
        with open(archive, "rb") as f:
            loaded = client.images.load(f)
        ids = [img.id for img in loaded]
        if config_digest not in ids:
            raise RuntimeError(f"docker loaded {ids} from {archive}, expected {config_digest}")
        log(f"docker load {archive.name}: {config_digest[:19]} in {time.monotonic() - t0:.1f} s")
    return config_digest, not present


@contextlib.contextmanager
def container_server(
    archive: Path,
    log_path: Path,
    *,
    port: int | None = None,
    startup_timeout_s: float = 180,
    max_restarts: int = 5,
    health_path: str = "/health",
    port_flag: str = "--port",
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
    client: Any = None,
) -> Iterator[ContainerServer]:
    """Run the image in `archive` with --network host on a free port (`port_flag PORT` is
    appended to its command: the serving commands take the last value), --restart
    on-failure:`max_restarts` and --init; yield it once /health answers; always remove it."""
    own_client = client is None
    client = client or docker_client()
    image_id, added = _load(client, archive, log)
    port = port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    name = f"mopt-serve-{uuid.uuid4().hex[:12]}"
    image = client.images.get(image_id)
    cfg = image.attrs.get("Config") or {}
    kwargs: dict[str, Any] = {}
    if cfg.get("Healthcheck"):  # the image's check probes its default port: probe this one
        code = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}{health_path}', timeout=2)"
        kwargs["healthcheck"] = {"test": ["CMD", "python3", "-c", code], "interval": 1_000_000_000,
                                 "timeout": 3_000_000_000, "retries": 3, "start_period": 60_000_000_000}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"docker run --network host --restart on-failure:{max_restarts} --init {image_id[:19]} … {port_flag} {port}")
    container = client.containers.run(
        image_id, command=[port_flag, str(port)], detach=True, name=name, network_mode="host", init=True,
        restart_policy={"Name": "on-failure", "MaximumRetryCount": max_restarts},
        labels={LABEL: "1"}, environment=env or {}, **kwargs,
    )
    server = ContainerServer(client, container, image_id, base_url, log_path, port, health_path)
    try:
        server.startup_s = server.wait_healthy(startup_timeout_s)
        log(f"container {name} healthy after {server.startup_s:.2f} s on {base_url}")
        yield server
    finally:
        server.stop()
        if added:
            with contextlib.suppress(Exception):
                client.images.remove(image_id, force=True)
        if own_client:
            client.close()


def container_facts(server: ContainerServer) -> dict[str, Any]:
    """What serve.json records about the container run."""
    image = server.client.images.get(server.image_id)
    return {
        "image_id": server.image_id,
        "image_bytes": image.attrs.get("Size"),
        "run": {"network": "host", "restart": "on-failure", "init": True, "port": server.port},
        "daemon": server.client.version().get("Version"),
        "labels": json.loads(json.dumps((image.attrs.get("Config") or {}).get("Labels") or {})),
    }


# --------------------------------------------------------------------------- the kind


def check_container(server: ContainerServer, served: str, texts: list[str], ref: list[list[float]],
                    tokenizer_dir: Path, p: Any, tmp: Path, log: Callable[[str], None]) -> Outcome:
    """The acceptance list of a deployment against a running container: serve-check's checks on
    `base_url` (/v1/models, embeddings vs the reference, /metrics, the bounded load test with
    0 failed requests), then the series /metrics must have, and `kill -9` of the server →
    healthy again within `recovery_bound_s`, answering as before."""
    out = check_server(server, served, texts, ref, tokenizer_dir, p, tmp, log)
    doc = out.doc
    doc["startup_s"] = round(server.startup_s, 2)
    m = read_metrics(server.base_url)
    doc["metrics"]["series"] = len(m)
    doc["metrics"]["kept"] = {k: v for k, v in m.items() if k.startswith("mopt_embed_") and not k.endswith("_created")}
    if not m:
        out.failures.append("/metrics exposes no series")
    elif p.expect_metric and p.expect_metric not in m:
        out.failures.append(f"/metrics has no {p.expect_metric!r} series")
    recoveries = []
    for _ in range(p.kills):
        rec = recover_after_kill(server, p.recovery_bound_s)
        log(f"kill -9 of the server (pid {' '.join(rec['killed_pids_in_container'])} in the container): healthy again "
            f"after {rec['healthy_after_s']} s (bound {p.recovery_bound_s} s), restarts {rec['restart_count']}")
        recoveries.append(rec)
        if not rec["recovered"]:
            out.failures.append(f"not healthy again within {p.recovery_bound_s} s after kill -9 ({rec['state']})")
            break
    doc["recovery"] = recoveries
    if recoveries and recoveries[-1]["recovered"]:  # the restarted server answers the same
        n = min(len(texts), p.batch_size)
        again = embed(server.base_url, served, texts[:n], p.batch_size)
        doc["after_restart_min_cosine"] = min(cosines(again, ref[:n]))
        if not doc["after_restart_min_cosine"] >= doc["min_cosine"] - 1e-6:
            out.failures.append(f"the restarted server answers differently (min cosine "
                                f"{doc['after_restart_min_cosine']:.6f} vs {doc['min_cosine']:.6f} before)")
    return out


class ContainerCheckKind(TargetKind):
    """serve-check against a container: run an `image` target's archive with docker
    (--network host, --restart on-failure, --init), check /health, /v1/models, the
    embeddings against an fp32 reference, /metrics, a bounded load test, and recovery
    after kill -9 of the server; the container is removed in every case."""

    name = "container-check"
    # drives the docker daemon (its socket, --network host): outside the sandbox
    sandbox = False
    version = "1"
    description = "run the image in docker; health, embeddings vs fp32, /metrics, load test, kill -9 recovery"
    consumes = (
        Input("image", kinds=("image",)),
        Input("reference", kinds=CHECKPOINT_KINDS),
    )
    requires = ("python:docker", "python:torch", "python:transformers")
    reproducible = False  # latencies and times
    exclusive: ClassVar[bool] = True  # the load test's numbers: nothing else runs meanwhile

    class Params(Params):
        texts: str | None = Field(default=None, description=".jsonl (`text`) or .txt; null: 16 built-in")
        num_texts: int = Field(default=64, ge=1)
        batch_size: int = Field(default=16, ge=1, description="texts per request of the cosine check")
        max_length: int = Field(default=512, ge=1)
        min_cosine: float = Field(default=0.99, ge=-1, le=1)
        on_fail: Literal["error", "record"] = "error"
        startup_timeout_s: float = Field(default=180, gt=0)
        # the load test: serve-check's closed loop (stdlib threads, keep-alive), on loopback
        concurrency: list[int] = Field(default=[1, 4, 16], min_length=1, description="load-test steps (clients)")
        slo_p99_ms: float = Field(default=100.0, gt=0, description="the knee: highest load with p99 <= this")
        input_len: int = Field(default=64, ge=8, description="tokens per load-test text (mean)")
        input_len_range: float = Field(default=0.5, ge=0, lt=1)
        texts_per_request: int = Field(default=1, ge=1)
        requests_per_client: int = Field(default=24, ge=1)
        min_requests: int = Field(default=60, ge=1)
        max_requests: int = Field(default=400, ge=1)
        warmup_requests: int = Field(default=8, ge=0)
        loadtest_timeout_s: float = Field(default=120, gt=0)
        loadtest_tool: Literal["mopt-loop"] = Field(default="mopt-loop", description="vLLM's bench is not in the image")
        # recovery
        kills: int = Field(default=1, ge=0, description="times the server is kill -9'd (recovery measured each)")
        recovery_bound_s: float = Field(default=30, gt=0, description="healthy again within this after kill -9")
        max_restarts: int = Field(default=5, ge=1, description="--restart on-failure:N")
        expect_metric: str | None = Field(
            default="mopt_embed_requests_total", description="a series /metrics must have (null: any)"
        )

    def input_files(self, params: Any, project_dir: Path) -> list[Path]:
        return [(project_dir / params.texts).resolve()] if params.texts else []

    def fingerprint(self) -> dict[str, str]:
        return {}

    def check(self, params: Any, ctx: CheckContext) -> list[Finding]:
        why = daemon_unavailable()
        if why is None:
            return []
        return [Finding("warning", "no-docker-daemon", f"container-check cannot run the image here: {why}",
                        fix="start dockerd and export DOCKER_HOST=unix://SOCKET (the image still builds)",
                        section=ctx.section, target=ctx.target)]

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        p = ctx.params
        image, ref_art = ctx.input("image"), ctx.input("reference")
        why = daemon_unavailable()
        if why is not None:
            raise RuntimeError(
                f"container-check: {why}. The image ({image.label or image.target}) is built but was not "
                "run or checked"
            )
        info = json.loads((image.path / "image.json").read_text())
        texts = list(DEFAULT_TEXTS)
        if p.texts:
            texts = read_texts_file((ctx.project_dir / p.texts).resolve(), p.num_texts)
        texts = (texts * (p.num_texts // len(texts) + 1))[: p.num_texts]
        ctx.log(f"reference: fp32 PyTorch on {ref_art.target!r}, {len(texts)} texts")
        ref = reference_embeddings(ref_art.path, ctx.family, texts, p.max_length)
        served = (info.get("labels") or {}).get("dev.mopt.model") or ctx.model_name
        log_path = ctx.out / "server.log"
        t0 = time.monotonic()
        with container_server(image.path / info["archive"], log_path, startup_timeout_s=p.startup_timeout_s,
                              max_restarts=p.max_restarts, log=ctx.log) as server:
            out = check_container(server, served, texts, ref, ref_art.path, p, ctx.tmp, ctx.log)
            out.doc["container"] = container_facts(server)
        doc = out.doc
        doc.update(format="mopt-container-check/1", image_target=image.label or image.target,
                   image_digest=info["image_digest"], image_builder=info["builder"],
                   wall_s=round(time.monotonic() - t0, 1), passed=not out.failures, failures=out.failures)
        (ctx.out / "serve.json").write_text(json.dumps(doc, indent=2) + "\n")
        kn = doc.get("knee")
        (ctx.out / "loadtest.svg").write_text(
            loadtest_svg([(doc["image_target"], doc["loadtest"], kn)], p.slo_p99_ms,
                         f"{doc['image_target']} in docker: p99 vs throughput"),
            encoding="utf-8",
        )
        for line in summary(doc):
            ctx.log(line)
        if out.failures and p.on_fail == "error":
            raise RuntimeError("container-check failed: " + "; ".join(out.failures))
        rec = (doc.get("recovery") or [{}])[-1]
        return {"passed": not out.failures, "failures": out.failures, "startup_s": doc["startup_s"],
                "min_cosine": doc["min_cosine"], "recovery_s": rec.get("healthy_after_s"),
                "knee_concurrency": kn["concurrency"] if kn else None,
                "peak_requests_per_s": max((s["requests_per_s"] for s in doc["loadtest"]), default=None),
                "image_digest": info["image_digest"], "figures": ["loadtest.svg"]}


def summary(doc: dict[str, Any]) -> list[str]:
    out = [f"image {doc['image_digest'][:19]} ({doc['image_builder']['name']}): healthy after {doc['startup_s']} s; "
           f"min cosine {doc['min_cosine']:.6f} (mean {doc['mean_cosine']:.6f}); /metrics {doc['metrics']['series']} "
           "series",
           "clients  requests  failed  req/s     tokens/s  p50 ms   p90 ms   p99 ms"]
    for s in doc["loadtest"]:
        out.append(f"{s['concurrency']:>7}  {s['completed']:>8}  {s['errors']:>6}  {s['requests_per_s']:>8.1f}  "
                   f"{s['tokens_per_s']:>8.0f}  {s['p50_ms']:>7.1f}  {s['p90_ms']:>7.1f}  {s['p99_ms']:>7.1f}")
    for r in doc.get("recovery") or []:
        out.append(f"kill -9 → healthy again after {r['healthy_after_s']} s (bound {r['bound_s']} s)")
    out.append("PASSED" if doc["passed"] else "FAILED: " + "; ".join(doc["failures"]))
    return out


__all__ = ["ContainerCheckKind", "ContainerServer", "ContainerUnavailable", "container_server", "daemon_unavailable", "recover_after_kill"]
