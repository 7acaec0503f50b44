"""Builds through the real CLI: caching, invalidation, sharing, failures, concurrency, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_mopt

RECIPE = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }

[defaults]
targets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]

[toy.cpu]
hardware = "cpu"

[toy.gpu]
hardware = "toy-gpu"
"""


def build(project: Path, *args: str, env: dict[str, str] | None = None, recipe: str = "r.toml") -> dict:
    proc = run_mopt("build", recipe, "--json", "--no-check", *args, cwd=project, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    data["returncode"] = proc.returncode
    data["stderr"] = proc.stderr
    return data


def ran(data: dict) -> set[str]:
    return {n["id"] for n in data["nodes"] if n["status"] == "built"}


@pytest.fixture
def toy(project: Path) -> Path:
    (project / "r.toml").write_text(RECIPE)
    return project


def test_second_build_runs_nothing(toy: Path) -> None:
    first = build(toy)
    assert first["returncode"] == 0
    assert first["counts"] == {"built": 7}  # weights/export/check[export] shared by both sections
    second = build(toy)
    assert second["counts"] == {"cached": 7}
    engine = toy / "build" / "toy" / "gpu" / "toy-engine" / "engine.plan"
    assert "hw=toy-gpu fp16 b32 O3" in engine.read_text()
    assert not os.access(engine, os.W_OK) or os.geteuid() == 0
    assert engine.stat().st_mode & 0o222 == 0  # read-only


def test_identical_node_in_two_sections_is_built_once(toy: Path) -> None:
    data = build(toy)
    weights = [n for n in data["nodes"] if n["kind"] == "toy-weights"]
    assert len(weights) == 1
    # both sections' folders hold it
    for hw in ("cpu", "gpu"):
        assert (toy / "build" / "toy" / hw / "toy-weights" / "weights.bin").is_file()


def test_changed_param_rebuilds_only_dependents(toy: Path) -> None:
    build(toy)
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.gpu.toy-engine]\nmax_batch_size = 64\n")
    plan = json.loads(run_mopt("plan", "r.toml", "--json", cwd=toy).stdout)
    status = {n["id"]: n["status"]["summary"] for n in plan["nodes"]}
    assert status["toy.gpu:toy-engine"] == "param max_batch_size: 32 → 64"
    assert status["toy.cpu:toy-engine"] == "up to date"
    assert status["toy.gpu:toy-check[toy-engine]"].startswith("will run: input toy-engine")
    data = build(toy)
    assert ran(data) == {"toy.gpu:toy-engine", "toy.gpu:toy-check[toy-engine]"}


def test_tool_version_change_is_explained_and_rebuilds(toy: Path) -> None:
    build(toy)
    env = {"MOPT_FIXTURE_TOOL_VERSION": "2.0"}
    plan = json.loads(run_mopt("plan", "r.toml", "--json", cwd=toy, env=env).stdout)
    status = {n["id"]: n["status"]["summary"] for n in plan["nodes"]}
    assert status["toy.cpu:toy-engine"] == 'tool toy-compiler "1.0" → "2.0"'
    # the engines rerun; their bytes did not change, so the checks downstream stay cached
    assert ran(build(toy, env=env)) == {"toy.cpu:toy-engine", "toy.gpu:toy-engine"}


def test_touch_without_change_reruns_nothing(toy: Path) -> None:
    build(toy)
    time.sleep(0.05)
    os.utime(toy / "toy-model" / "weights.bin")
    assert build(toy)["counts"] == {"cached": 7}


def test_changed_input_file_reruns_its_consumers(toy: Path) -> None:
    (toy / "data.txt").write_text("a\nb\n")
    with open(toy / "r.toml", "a") as fh:
        fh.write('[toy.cpu.toy-check]\ndata = "data.txt"\n')
    build(toy)
    (toy / "data.txt").write_text("a\nb\nc\n")
    data = build(toy)
    assert ran(data) == {"toy.cpu:toy-check[toy-engine]", "toy.cpu:toy-check[toy-export]"}
    report = json.loads((toy / "build/toy/cpu/toy-check[toy-export]/report.json").read_text())
    assert report["data_lines"] == 3


def _blob(store: Path, digest: str) -> Path:
    return store / "cas" / digest[:2] / digest


def test_deleted_blob_is_a_miss_and_rebuilt(toy: Path) -> None:
    data = build(toy)
    node = next(n for n in data["nodes"] if n["id"] == "toy.cpu:toy-export")
    manifest = json.loads(_blob(toy / ".mopt", node["outputs"]).read_text())
    digest = manifest["entries"][0][3]
    _blob(toy / ".mopt", digest).unlink()
    again = build(toy)
    assert "toy.cpu:toy-export" in ran(again)
    assert _blob(toy / ".mopt", digest).is_file()


def test_corrupted_blob_is_detected_and_rebuilt(toy: Path) -> None:
    data = build(toy)
    build(toy)  # the blobs' stats are now in the stat cache
    node = next(n for n in data["nodes"] if n["id"] == "toy.cpu:toy-export")
    manifest = json.loads(_blob(toy / ".mopt", node["outputs"]).read_text())
    blob = _blob(toy / ".mopt", manifest["entries"][0][3])
    os.chmod(blob, 0o644)
    blob.write_text("opset=17\nfrom=tampered\n")
    again = build(toy)
    assert "toy.cpu:toy-export" in ran(again)
    text = (toy / "build/toy/cpu/toy-export/model.txt").read_text()
    assert "tampered" not in text


def test_failing_action_is_not_cached_and_leaves_no_output(toy: Path) -> None:
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.cpu.toy-export]\nfail = true\n")
    data = build(toy, "--keep-going")
    assert data["returncode"] == 1
    status = {n["id"]: n for n in data["nodes"]}
    failed = status["toy.cpu:toy-export"]
    assert failed["status"] == "failed"
    assert "toy export failed on purpose" in failed["reason"]
    assert "toy export failed on purpose" in Path(failed["log"]).read_text()
    assert status["toy.cpu:toy-engine"]["status"] == "blocked"
    assert not (toy / "build/toy/cpu/toy-export").exists()
    assert not list((toy / ".mopt" / "ac").glob(f"{failed['key']}*"))
    # the other section is independent and was built (--keep-going)
    assert status["toy.gpu:toy-export"]["status"] == "built"
    # and the failure is not replayed from a cache: it runs again
    assert build(toy)["returncode"] == 1
    proc = run_mopt("build", "r.toml", "--no-check", cwd=toy)
    assert proc.returncode == 1
    assert "FAILED toy.cpu:toy-export: RuntimeError: toy export failed on purpose" in proc.stderr
    assert "full log:" in proc.stderr


def test_unbuildable_target_is_reported_not_attempted(toy: Path) -> None:
    text = (toy / "r.toml").read_text().replace(
        '[toy.gpu]\nhardware = "toy-gpu"\n',
        '[toy.gpu]\nhardware = "toy-gpu"\ntargets = ["toy-weights", "toy-export", "toy-gpu-only"]\n',
    )
    (toy / "r.toml").write_text(text)
    data = build(toy)
    assert data["returncode"] == 1
    node = next(n for n in data["nodes"] if n["id"] == "toy.gpu:toy-gpu-only")
    assert node["status"] == "unbuildable"
    assert node["reason"].startswith("unbuildable here:")
    assert "GPU" in node["reason"] or "gpu" in node["reason"]


def test_two_concurrent_builds_run_each_action_once(toy: Path) -> None:
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.cpu.toy-export]\nsleep = 1.5\n")
    counter = toy / ".mopt" / "cache" / "counter.txt"  # writable in the sandbox (the project is not)
    env = dict(os.environ, MOPT_FIXTURE_COUNTER=str(counter))
    cmd = [sys.executable, "-m", "mopt", "build", "r.toml", "--no-check", "--json", "toy.cpu"]
    procs = [subprocess.Popen(cmd, cwd=toy, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert counter.read_text().splitlines() == ["toy-export"]
    statuses = sorted(
        next(n["status"] for n in json.loads(o)["nodes"] if n["id"] == "toy.cpu:toy-export") for o, _ in outs
    )
    assert statuses == ["built", "cached"]


def test_sigkill_mid_action_recovers_on_next_build(toy: Path) -> None:
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.cpu.toy-export]\nsleep = 30\n")
    counter = toy / ".mopt" / "cache" / "counter.txt"  # writable in the sandbox (the project is not)
    env = dict(os.environ, MOPT_FIXTURE_COUNTER=str(counter))
    p = subprocess.Popen([sys.executable, "-m", "mopt", "build", "r.toml", "--no-check", "toy.cpu"],
                         cwd=toy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not counter.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert counter.exists(), "the action never started"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (toy / "build/toy/cpu/toy-export").exists()
    # a partial output never lands under a final name; the next build just runs it again
    (toy / "r.toml").write_text((toy / "r.toml").read_text().replace("sleep = 30", "sleep = 0"))
    data = build(toy, "toy.cpu")
    assert data["returncode"] == 0
    assert (toy / "build/toy/cpu/toy-export/model.txt").read_text().startswith("opset=17")


def test_frozen_fails_when_source_changed(toy: Path) -> None:
    build(toy)
    assert build(toy, "--frozen")["returncode"] == 0
    (toy / "toy-model" / "weights.bin").write_text("new weights")
    proc = run_mopt("build", "r.toml", "--frozen", "--no-check", cwd=toy)
    assert proc.returncode == 2
    assert "--frozen: source of model 'toy' changed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_frozen_without_lock_file_fails(toy: Path) -> None:
    proc = run_mopt("build", "r.toml", "--frozen", "--no-check", cwd=toy)
    assert proc.returncode == 2
    assert "no entry for r.toml" in proc.stderr


def test_offline_missing_hf_source_fails_clearly(toy: Path, tmp_path: Path) -> None:
    (toy / "r.toml").write_text(RECIPE.replace('{ path = "toy-model" }', '{ hf = "org/none", revision = "abc" }'))
    proc = run_mopt("build", "r.toml", "--offline", "--no-check", cwd=toy,
                    env={"HF_HUB_CACHE": str(tmp_path / "empty-hf-cache")})
    assert proc.returncode == 2
    assert "is not in the local Hugging Face cache" in proc.stderr
    assert "downloading is off (--offline, or a plan)" in proc.stderr


def test_command_kind_key_covers_argv_files_and_env(project: Path) -> None:
    (project / "in.txt").write_text("hello\n")
    (project / "c.toml").write_text(
        RECIPE.split("[defaults]")[0]
        + '[toy.cpu]\ntargets = ["a", "b"]\n'
        '[toy.cpu.a]\nkind = "command"\nargv = ["sh", "-c", "cat {file} > {out}/a.txt; echo $GREETING >> {out}/a.txt"]\n'
        'files = ["in.txt"]\nenv = ["GREETING"]\n'
        '[toy.cpu.b]\nkind = "command"\ninput = "a"\nargv = ["sh", "-c", "wc -l < {in}/a.txt > {out}/n"]\n'
    )
    first = build(project, recipe="c.toml", env={"GREETING": "hi"})
    assert first["counts"] == {"built": 2}
    assert (project / "build/toy/cpu/a/a.txt").read_text() == "hello\nhi\n"
    assert (project / "build/toy/cpu/b/n").read_text().strip() == "2"
    assert build(project, recipe="c.toml", env={"GREETING": "hi", "OTHER": "x"})["counts"] == {"cached": 2}
    # an allow-listed variable is in a's key; b reruns because a's output changed
    assert ran(build(project, recipe="c.toml", env={"GREETING": "hey"})) == {"toy.cpu:a", "toy.cpu:b"}
    assert (project / "build/toy/cpu/a/a.txt").read_text() == "hello\nhey\n"
    (project / "in.txt").write_text("hello\nworld\n")
    assert ran(build(project, recipe="c.toml", env={"GREETING": "hey"})) == {"toy.cpu:a", "toy.cpu:b"}
    assert (project / "build/toy/cpu/b/n").read_text().strip() == "3"


def test_gc_keeps_what_lock_files_reference(toy: Path) -> None:
    build(toy)
    (toy / "r.toml").write_text(RECIPE.replace('hardware = "toy-gpu"', 'hardware = "toy-gpu"\n[toy.gpu.toy-engine]\nopt_level = 5'))
    build(toy)  # the old gpu engine entry is now unreferenced by the lock file? (artifacts map is per address)
    proc = run_mopt("gc", "--max-size", "0", "--json", cwd=toy)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["kept_by_lock_files"] >= 7
    # everything the current lock file references is still a hit
    assert build(toy)["counts"] == {"cached": 7}


def test_show_and_ls_and_explain(toy: Path) -> None:
    build(toy)
    show = json.loads(run_mopt("show", "r.toml", "toy.gpu:toy-engine", "--json", cwd=toy).stdout)
    assert [f["path"] for f in show["files"]] == ["engine.plan"]
    assert show["provenance"]["fingerprint"] == {"toy-compiler": "1.0"}
    assert show["provenance"]["reproducible"] is False
    ls = json.loads(run_mopt("ls", "r.toml", "--json", cwd=toy).stdout)
    assert len(ls["artifacts"]) == 7 and all(a["bytes"] > 0 for a in ls["artifacts"])
    ex = json.loads(run_mopt("explain", "r.toml", "toy.cpu:toy-engine", "--json", cwd=toy).stdout)
    assert set(ex["parts"]) >= {"kind", "kind_version", "plugin", "plugin_version", "params", "inputs",
                                 "fingerprint", "platform", "salt", "hardware"}
    assert ex["key"] == show["key"] or ex["id"] != show["id"]


def test_sigint_mid_action_stops_cleanly_and_next_build_recovers(toy: Path) -> None:
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.cpu.toy-export]\nsleep = 30\n")
    counter = toy / ".mopt" / "cache" / "counter.txt"  # writable in the sandbox (the project is not)
    env = dict(os.environ, MOPT_FIXTURE_COUNTER=str(counter))
    # Ctrl-C as a terminal sends it: a test run started in the background (`cmd &` in a script,
    # where SIGINT is ignored and the ignoring is inherited, so Python installs no handler)
    # must not turn this into a test of that shell's choice
    p = subprocess.Popen([sys.executable, "-m", "mopt", "build", "r.toml", "--no-check", "toy.cpu"],
                         cwd=toy, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 60
    while not counter.exists() and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 130
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not (toy / "build/toy/cpu/toy-export").exists()
    (toy / "r.toml").write_text((toy / "r.toml").read_text().replace("sleep = 30", "sleep = 0"))
    assert build(toy, "toy.cpu")["returncode"] == 0


def test_selected_target_is_materialized_but_not_its_dependencies(toy: Path) -> None:
    data = build(toy, "toy.gpu:toy-engine")
    assert data["counts"] == {"built": 3}
    assert (toy / "build/toy/gpu/toy-engine/engine.plan").is_file()
    assert not (toy / "build/toy/gpu/toy-export").exists()


def test_an_exclusive_kind_runs_alone(project: Path, tmp_path: Path) -> None:
    # three slow exports and a benchmark-like exclusive kind per export, with 2 jobs: the
    # exports run two at a time, and nothing overlaps an exclusive action
    (project / "r.toml").write_text(RECIPE.replace(
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]',
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-timed"]\n'
        '[defaults.toy-export]\nsleep = 0.4\n',
    ).replace("[toy.gpu]\nhardware = \"toy-gpu\"\n", '[toy.cpu.sweep]\n"toy-export.opset" = [15, 16, 17]\n'))
    times = project / ".mopt" / "cache" / "times.txt"  # writable in the sandbox (the project is not)
    data = build(project, "-j", "2", env={**os.environ, "MOPT_FIXTURE_TIMES": str(times)})
    assert data["returncode"] == 0, data["stderr"]
    spans = [(float(a), float(b), label) for a, b, label in (ln.split(" ", 2) for ln in times.read_text().splitlines())]
    timed = [s for s in spans if s[2].startswith("toy-timed")]
    exports = [s for s in spans if s[2].startswith("toy-export")]
    assert len(timed) == 3 and len(exports) == 3
    for a, b, label in timed:
        for c, d, other in spans:
            if other != label:
                assert d <= a or c >= b, f"{other} ran during exclusive {label}"
    # and the non-exclusive exports did share the two slots
    assert any(a < d and c < b for (a, b, x) in exports for (c, d, y) in exports if x != y)


def test_a_gathering_node_runs_on_what_got_built(project: Path) -> None:
    # toy-gpu-only cannot build here: toy-gather still runs, on the rest, and says so; its
    # key holds the missing input's status, so it is cached until that input builds
    (project / "r.toml").write_text(RECIPE.replace(
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]',
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-engine", "toy-gpu-only", "toy-check", "toy-gather"]',
    ).replace("[toy.gpu]\nhardware = \"toy-gpu\"\n", ""))
    data = build(project, "--keep-going")
    states = {n["id"]: n for n in data["nodes"]}
    assert states["toy.cpu:toy-gpu-only"]["status"] == "unbuildable"
    assert states["toy.cpu:toy-gather"]["status"] == "built"
    assert data["returncode"] == 1  # the unbuildable target still fails the build
    got = json.loads((project / "build/toy/cpu/toy-gather/gathered.json").read_text())
    assert [a["label"] for a in got["got"]["models"]] == ["toy-engine", "toy-export"]
    assert [a["label"] for a in got["got"]["checks"]] == ["toy-check[toy-engine]", "toy-check[toy-export]"]
    assert got["got"]["checks"][0]["from"] == {"model": ["toy-engine"], "reference": ["toy-weights"]}
    assert got["missing"]["models"][0]["label"] == "toy-gpu-only"
    assert got["missing"]["models"][0]["status"] == "unbuildable"
    assert got["missing"]["models"][0]["reason"].startswith("unbuildable here:")
    assert set(got["missing"]) == {"models"}
    # plan predicts the same: toy-gather is up to date, not "will run"
    plan = json.loads(run_mopt("plan", "r.toml", "--json", cwd=project).stdout)
    status = {n["id"]: n["status"]["state"] for n in plan["nodes"]}
    assert status["toy.cpu:toy-gpu-only"] == "unbuildable"
    assert status["toy.cpu:toy-gather"] == "up-to-date"
    again = build(project, "--keep-going")
    assert {n["id"]: n["status"] for n in again["nodes"]}["toy.cpu:toy-gather"] == "cached"


def test_a_gathering_node_runs_again_when_a_missing_input_builds(project: Path) -> None:
    recipe = RECIPE.replace(
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-engine", "toy-check"]',
        '[defaults]\ntargets = ["toy-weights", "toy-export", "toy-engine", "toy-check", "toy-gather"]',
    ).replace("[toy.gpu]\nhardware = \"toy-gpu\"\n", "")
    (project / "r.toml").write_text(recipe + "[toy.cpu.toy-export]\nfail = true\n")
    first = build(project, "--keep-going")
    assert {n["id"]: n["status"] for n in first["nodes"]}["toy.cpu:toy-gather"] == "built"
    got = json.loads((project / "build/toy/cpu/toy-gather/gathered.json").read_text())
    assert got["got"] == {"checks": [], "models": []}
    assert {m["label"]: m["status"] for m in got["missing"]["models"]} == {
        "toy-export": "failed", "toy-engine": "blocked"
    }
    (project / "r.toml").write_text(recipe)
    second = build(project, "--keep-going")
    assert second["returncode"] == 0
    assert {n["id"]: n["status"] for n in second["nodes"]}["toy.cpu:toy-gather"] == "built"
    got = json.loads((project / "build/toy/cpu/toy-gather/gathered.json").read_text())
    assert got["missing"] == {} and len(got["got"]["models"]) == 2


def test_default_jobs_follow_the_cpus_this_process_may_use() -> None:
    # taskset / a container's cpuset / a batch allotment: on 1 allotted CPU of a bigger host,
    # the default -j is 1, not the host's count (os.cpu_count ignores the affinity mask)
    import subprocess
    import sys

    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from mopt.build import usable_cpus; print(usable_cpus(), os.cpu_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1"
    from mopt.build import usable_cpus

    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_plan_says_why_against_the_last_build_of_the_node(toy: Path) -> None:
    """plan diffs a node's key parts with those of its last build: its key per the build log
    of these selectors, else per mopt.lock (another selection's build), and the parts that
    key's action entry recorded."""
    build(toy)
    with open(toy / "r.toml", "a") as fh:
        fh.write("[toy.gpu.toy-engine]\nmax_batch_size = 64\n")
    for args in ((), ("toy.gpu:toy-engine",)):  # the second: no build of these selectors yet
        plan = json.loads(run_mopt("plan", "r.toml", *args, "--json", cwd=toy).stdout)
        status = {n["id"]: n["status"]["summary"] for n in plan["nodes"]}
        assert status["toy.gpu:toy-engine"] == "param max_batch_size: 32 → 64"


def test_a_failure_whose_log_cannot_be_written_is_still_a_clean_failure(tmp_path: Path) -> None:
    """An action whose inputs cannot be laid out on a full disk: appending mopt's own
    "FAILED" lines to its log fails too (ENOSPC). The build reports the action's error and
    exits 1, no traceback (a clean-clone CI run once met this in the full-disk fault test)."""
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[defaults]\ntargets = ["a"]\n[defaults.a]\nkind = "command"\n'
        'argv = ["sh", "-c", "echo out > {out}/a"]\n[models.m]\n[m.cpu]\n'
    )
    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    code = (
        "import builtins, errno, os, sys\n"
        "import mopt.build\n"
        "def full(path, mode='r', *a, **k):\n"
        "    if 'a' in mode and str(path).endswith('.txt'):\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))\n"
        "    return builtins.open(path, mode, *a, **k)\n"
        "mopt.build.open = full  # the engine's own writes to a log (the action's run elsewhere)\n"
        "def no_room(self, st, in_dir):\n"
        "    raise OSError(errno.ENOSPC, 'no space left while materializing the inputs')\n"
        "mopt.build.Engine._inputs = no_room\n"
        "sys.argv = ['mopt', 'build', 'r.toml', '--no-check']\n"
        "from mopt.__main__ import main\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "FAILED m.cpu:a" in proc.stderr and "no space left while materializing" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr.split("  | ")[0], proc.stderr


def test_progress_lines_reach_stderr_with_json_but_not_with_quiet(tmp_path: Path) -> None:
    """A long action's progress lines (`BuildContext.progress`, "progress: " in its log) are
    printed under --json too (the report is stdout's; a 12-minute serving search must not be
    silent), and not with -q."""
    (tmp_path / "r.toml").write_text(
        'schema = 1\n[defaults]\ntargets = ["a"]\n[defaults.a]\nkind = "command"\n'
        'argv = ["sh", "-c", "echo \'progress: halfway there\'; echo done > {out}/x"]\n[models.m]\n[m.cpu]\n'
    )
    first = run_mopt("build", "r.toml", "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "m.cpu:a: halfway there" in first.stderr and json.loads(first.stdout)["counts"] == {"built": 1}
    (tmp_path / "r.toml").write_text((tmp_path / "r.toml").read_text().replace("halfway", "almost"))
    quiet = run_mopt("build", "r.toml", "--json", "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and "almost there" not in quiet.stderr
