"""Families and the synthetic source, on real (tiny) transformers models."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_synthetic_qwen3_is_the_real_architecture(synthetic_qwen3: Path) -> None:
    import json

    cfg = json.loads((synthetic_qwen3 / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (64, 2, 4)
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 16)
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digests(synthetic_qwen3))
    assert synthetic_qwen3.name.startswith("synthetic-qwen3-")


def test_synthetic_source_is_byte_identical_for_the_same_spec(synthetic_qwen3: Path, tmp_path: Path) -> None:
    # another process (another hash seed), another cache folder: the same bytes
    code = (
        "import sys; from pathlib import Path\n"
        "from mopt.api import SourceContext\n"
        "from mopt_ml.synthetic import SyntheticSource as S\n"
        "c = Path(sys.argv[1])\n"
        "print(S().resolve(S.Params(synthetic='qwen3', seed=0), SourceContext(c, c, True, None, 'x')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "12345"},
    )
    again = Path(out.stdout.strip().splitlines()[-1])
    assert again != synthetic_qwen3 and again.name == synthetic_qwen3.name
    assert _digests(again) == _digests(synthetic_qwen3)


def test_synthetic_seed_and_config_change_the_model(tmp_path: Path, source_ctx: Any) -> None:
    from safetensors.numpy import load_file

    from mopt_ml.synthetic import SyntheticSource

    s = SyntheticSource()
    a = s.resolve(s.Params(synthetic="bert", seed=1), source_ctx(tmp_path))
    b = s.resolve(s.Params(synthetic="bert", seed=2), source_ctx(tmp_path))
    c = s.resolve(s.Params(synthetic="bert", seed=1, config={"num_hidden_layers": 1}), source_ctx(tmp_path))
    assert len({a, b, c}) == 3
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert not np.array_equal(
        wa["embeddings.word_embeddings.weight"], wb["embeddings.word_embeddings.weight"]
    )
    assert not any(k.startswith("encoder.layer.1.") for k in load_file(str(c / "model.safetensors")))
    # resolving again reuses the folder
    assert s.resolve(s.Params(synthetic="bert", seed=1), source_ctx(tmp_path)) == a


def test_synthetic_unknown_family_is_a_clear_error(tmp_path: Path, source_ctx: Any) -> None:
    from mopt.api import SourceError

    from mopt_ml.synthetic import SyntheticSource

    with pytest.raises(SourceError, match=r"no such family.*bert, qwen3"):
        SyntheticSource().resolve(SyntheticSource.Params(synthetic="llama"), source_ctx(tmp_path))


def test_qwen3_left_and_right_padding_give_the_same_embedding(synthetic_qwen3: Path) -> None:
    from mopt_ml.common import validation_texts
    from mopt_ml.families import Qwen3Family

    fam = Qwen3Family()
    model = fam.load(synthetic_qwen3)
    tok = fam.load_tokenizer(synthetic_qwen3)
    texts = [
        *validation_texts()[:6],
        "Short.",
        "A somewhat longer sentence, to force real padding in the batch.",
    ]
    tok.padding_side = "left"
    left = fam.embed(model, tok, texts)
    tok.padding_side = "right"
    right = fam.embed(model, tok, texts)
    one_by_one = np.concatenate([fam.embed(model, tok, [t]) for t in texts])
    assert np.abs(left - right).max() < 1e-5
    assert np.abs(left - one_by_one).max() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(left, axis=1), 1.0, atol=1e-5)
    # not a constant: different texts, different embeddings
    assert np.abs(left[0] - left[1]).max() > 1e-3


def test_qwen3_pool_takes_the_last_real_token() -> None:
    import torch

    from mopt_ml.families import Qwen3Family

    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert Qwen3Family().pool(hidden, right).tolist() == [hidden[0, 1].tolist(), hidden[1, 3].tolist()]
    assert Qwen3Family().pool(hidden, left).tolist() == [hidden[0, 3].tolist(), hidden[1, 3].tolist()]


def test_bert_pool_is_the_mean_over_the_mask() -> None:
    import torch

    from mopt_ml.families import BertFamily

    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert BertFamily().pool(hidden, mask).tolist() == [[2.0, 3.0]]


def test_family_is_guessed_from_config(synthetic_qwen3: Path, minilm_source: Path) -> None:
    from mopt_ml.families import as_family

    assert as_family(None, synthetic_qwen3).name == "qwen3"
    assert as_family(None, minilm_source).name == "bert"

    class NotAnEmbeddingFamily:
        name = "x"

    with pytest.raises(TypeError, match=r"subclass mopt\.api\.TransformersFamily"):
        as_family(NotAnEmbeddingFamily())


def test_a_family_without_the_heavy_part_is_refused_naming_what_it_lacks() -> None:
    from mopt.api import Family

    from mopt_ml.families import as_family

    class OnlyShape(Family):
        name = "only-shape"

    with pytest.raises(TypeError) as exc:
        as_family(OnlyShape)
    assert str(exc.value) == (
        "family 'only-shape' does not implement load, load_tokenizer, pool, export_spec of the "
        "mopt.api.Family contract and embed, embed_batch (TransformersFamily's helpers), which "
        "mopt-ml's kinds call; subclass mopt.api.TransformersFamily, which implements them for a "
        "Hugging Face AutoModel architecture"
    )
