"""The ids mopt prints can be typed back as selectors: a fanout label (`toy-check[...]`,
`bench[int8]`) holds `[...]`, a glob character class, and a sweep label holds `@`; an exact
id or label is matched before the selector is taken as a glob."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_mopt
from tests.test_graph import _setup

CHECK = "toy.gpu:toy-check[toy-engine@max_batch_size=64,opt_level=3]"
ENGINE = "toy.gpu:toy-engine@max_batch_size=64,opt_level=3"


def _ids(project: Path, *selectors: str) -> list[str]:
    proc = run_mopt("plan", "r.toml", "--json", *selectors, cwd=project)
    assert proc.returncode == 0, proc.stderr
    return [n["id"] for n in json.loads(proc.stdout)["nodes"]]


def test_printed_ids_with_brackets_and_sweep_labels_select_their_node(project: Path) -> None:
    _setup(project)
    assert CHECK in _ids(project)  # mopt prints it
    ids = _ids(project, CHECK)
    assert ids[-1] == CHECK and ENGINE in ids  # the node, with its inputs
    assert not any(i.startswith("toy.gpu:toy-check") for i in ids[:-1])
    assert _ids(project, ENGINE)[-1] == ENGINE
    # the label alone, under a section glob
    assert _ids(project, "*.gpu:toy-check[toy-engine@max_batch_size=64,opt_level=3]")[-1] == CHECK
    # a glob is still a glob
    assert sum(i.startswith("toy.gpu:toy-check") for i in _ids(project, "toy.gpu:toy-check*")) == 5
    assert sum(i.startswith("toy.gpu:toy-check") for i in _ids(project, "toy.gpu:toy-check")) == 5


def test_explain_takes_a_printed_fanout_id(project: Path) -> None:
    _setup(project)
    for node in (CHECK, ENGINE):
        proc = run_mopt("explain", "r.toml", node, "--json", cwd=project)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["id"] == node
