"""`mopt worker --print-resources`: the `ray start --resources` JSON for this machine
(added to the `mopt` command line by the plugin's `mopt_register_commands`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from mopt.api import Core


def register(app: click.Group, core: Core) -> None:
    """Add `mopt worker` to the CLI."""

    @app.command("worker", context_settings={"help_option_names": ["-h", "--help"]})
    @click.option(
        "--print-resources",
        is_flag=True,
        help="print only the JSON for `ray start --resources` (one mopt:<profile> per matching GPU group)",
    )
    @click.option("--address", default="<head>:6379", help="the head node's address, for the printed command")
    def worker(print_resources: bool, address: str) -> None:
        """What this machine offers a mopt Ray cluster, and how to join it.

        GPUs matching a hardware profile become the custom resource mopt:<profile>; CPU
        profiles need none (every Ray node runs CPU and hardware-independent actions)."""
        from mopt_ray.placement import local_resources

        res, notes = local_resources(core.registry(), core)
        text = json.dumps(_ints(res), sort_keys=True)
        if print_resources:
            for n in notes:
                sys.stderr.write(f"{n}\n")
            sys.stdout.write(text + "\n")
            return
        for n in notes:
            sys.stdout.write(f"{n}\n")
        sys.stdout.write(f"resources: {text}\n")
        sys.stdout.write(f"join the cluster with:\n  ray start --address={address} --resources='{text}'\n")


def _ints(res: dict[str, float]) -> dict[str, Any]:
    return {k: int(v) if float(v).is_integer() else v for k, v in res.items()}
