"""Fixtures of the image tests: a real tiny base image (helpers live in image_helpers)."""

from __future__ import annotations

import pytest
from mopt_image.testing import BaseImage, fake_server, find_static_busybox, make_busybox_base


@pytest.fixture(scope="session")
def base_image(tmp_path_factory: pytest.TempPathFactory) -> BaseImage:
    """A FROM-scratch busybox image with stand-ins for vllm, trtllm-serve and tritonserver."""
    if find_static_busybox() is None:
        pytest.skip("no static busybox (apt-get install busybox-static)")
    extra = {f"usr/local/bin/{n}": (fake_server(n), 0o755) for n in ("vllm", "trtllm-serve", "tritonserver")}
    return make_busybox_base(tmp_path_factory.mktemp("base") / "busybox.oci.tar", extra=extra)
