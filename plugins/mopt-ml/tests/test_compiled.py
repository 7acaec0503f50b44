"""The torch-compile consumer: bucket choice, and a clear error where no GPU exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopt_ml.compiled import pick_bucket


def test_pick_bucket_prefers_the_largest_batch_that_holds_the_length() -> None:
    meta = {"buckets": [{"batch": 1, "seq": 128}, {"batch": 32, "seq": 128}, {"batch": 32, "seq": 512}]}
    assert pick_bucket(meta, 100) == (32, 128)
    assert pick_bucket(meta, 300) == (32, 512)
    assert pick_bucket(meta, 4096) == (32, 512)  # nothing holds it: the longest, texts truncated


def test_running_an_artifact_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("mopt_torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from mopt_ml.compiled import load

    with pytest.raises(RuntimeError, match="runs on the CUDA GPU it was compiled for"):
        load(tmp_path, tmp_path)
