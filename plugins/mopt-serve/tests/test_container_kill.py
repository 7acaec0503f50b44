"""`kill_children_of_init`: the `docker exec` that kills the server is itself killed (exit 137)
when the container's init exits with its child; with the PIDs printed that is a kill done,
not a failure (seen in CI with tini: exit 137, output "6")."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from mopt_serve.container import KILL_CHILDREN_OF_INIT, kill_children_of_init


@dataclass
class _Result:
    exit_code: int
    output: bytes


class _Container:
    def __init__(self, exit_code: int, output: bytes) -> None:
        self.result = _Result(exit_code, output)
        self.argv: list[str] = []

    def exec_run(self, argv: list[str]) -> _Result:
        self.argv = argv
        return self.result


def test_exit_137_with_the_pids_printed_is_a_kill() -> None:
    c = _Container(137, b"6\n")
    assert kill_children_of_init(c) == ["6"]
    assert c.argv == ["python3", "-c", KILL_CHILDREN_OF_INIT]
    assert kill_children_of_init(_Container(0, b"7 9\n")) == ["7", "9"]


@pytest.mark.parametrize(("code", "out"), [(137, b""), (1, b"6\n"), (126, b"OCI runtime exec failed")])
def test_nothing_killed_or_another_exit_is_an_error(code: int, out: bytes) -> None:
    with pytest.raises(RuntimeError, match=rf"could not kill the server inside the container \(exit {code}\)"):
        kill_children_of_init(_Container(code, out))
