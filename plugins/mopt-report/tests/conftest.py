"""The core's fixtures (tests/conftest.py): a project with the toy model and its own store;
the report is tested on the fixture plugin's toy kinds, through the real CLI."""

from __future__ import annotations

from tests.conftest import project  # noqa: F401
