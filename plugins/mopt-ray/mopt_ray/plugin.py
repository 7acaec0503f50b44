"""The `ray` executor: `[executor] kind = "ray"` in mopt.toml.

Registration imports nothing heavy; Ray is imported when a build starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from mopt.api import Core, Executor, ExecutorSession, MoptError, Params, hookimpl


class RayExecutor(Executor):
    """Runs cache misses as Ray tasks on workers that offer the target's hardware."""

    name = "ray"
    description = "a Ray cluster; hardware profiles as custom resources, artifacts via the remote cache"

    class Settings(Params):
        kind: str = "ray"
        address: str = Field(
            default="auto",
            description='"auto" (the running cluster), "ray://host:10001", or "local" (start one here)',
        )
        max_retries: int = Field(
            default=3, ge=0, description="retries of an action whose worker or node died"
        )
        worker_store: str = Field(
            default="~/.cache/mopt/ray-worker-store",
            description="the local store on each worker machine (a path there; ~ expanded there)",
        )
        namespace: str | None = Field(default=None, description="Ray namespace")
        portable_kinds: list[str] = Field(
            default=[], description="per-hardware kinds that may run on any node (need no GPU to run)"
        )
        runtime_env: dict[str, Any] = Field(default={}, description="Ray runtime_env for the tasks")

    def build(self, session: ExecutorSession, *, settings: Any = None) -> dict[str, Any]:
        """Build the session's actions on the cluster; return `session.states()`.

        `settings` defaults to the `Settings` defaults. The session must have a writable
        remote cache: workers exchange artifacts through it."""
        from mopt_ray.scheduler import RayBuild

        if settings is None:
            settings = self.Settings()
        elif isinstance(settings, dict):
            settings = self.Settings.model_validate(settings)
        if session.remote_connection() is None:
            raise MoptError(
                "the ray executor needs a remote cache: workers read inputs and write outputs there",
                table="remote",
                key="url",
                hint='set [remote] url = "s3://bucket/prefix" (or another URL every worker can reach)',
            )
        if not session.remote_writable():
            raise MoptError(
                "the ray executor writes to the remote cache, but [remote] push = false",
                table="remote",
                key="push",
                hint="set push = true (workers and the driver upload artifacts there)",
            )
        connect(settings, session)
        return RayBuild(session, settings).run()


def connect(settings: Any, session: ExecutorSession) -> None:
    """Connect to the cluster named by `settings.address` unless already connected.

    `address = "local"` starts a one-node cluster here, offering the `mopt:<profile>`
    resources of this machine's GPUs (as `mopt worker --print-resources` prints them).
    """
    import ray

    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"namespace": settings.namespace, "log_to_driver": False}
    if settings.address == "local":
        from mopt_ray.placement import local_resources

        kw["address"] = "local"
        kw["resources"] = local_resources(session.registry, session)[0]
    else:
        kw["address"] = settings.address
    try:
        ray.init(**kw)
    except ConnectionError as exc:
        raise MoptError(
            f"cannot connect to the Ray cluster at {settings.address!r}: {exc}",
            table="executor",
            key="address",
            hint='start one with `ray start --head`, or set address = "ray://host:10001" or "local"',
        ) from None


@hookimpl
def mopt_register_executors(register: Callable[[Any], None]) -> None:
    """The `ray` executor."""
    register(RayExecutor)


@hookimpl
def mopt_register_commands(cli: Any, core: Core) -> None:
    """`mopt worker`: what this machine offers a mopt Ray cluster."""
    from mopt_ray.cli import register

    register(cli, core)
