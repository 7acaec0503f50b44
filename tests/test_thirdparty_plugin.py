"""A third party's plugin, end to end: tests/thirdparty_plugin (the `acme-distil-plugin`
distribution, installed with pip install -e) imports only mopt.api / mopt.hookspecs and adds
a DistilBERT family, a layer-dropping `distill` kind producing an `hf-checkpoint`, and an
NVIDIA L4 profile. Through the real CLI: the family is built by `synthetic` and estimated by
`check`; the distilled checkpoint goes through mopt-ml's onnx, validate, bench and select;
the no-op rebuild takes the fast path."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import run_mopt

pytest.importorskip("mopt_ml", reason="the ML kinds are in mopt-ml")
pytest.importorskip("acme_distil", reason="pip install -e tests/thirdparty_plugin")

RECIPE = """\
schema = 1

[models.distil]
family = "distilbert"
task = "embedding"
source = { synthetic = "distilbert", seed = 0 }

[distil.cpu]
targets = ["weights", "small", "onnx", "onnx-small", "validate", "bench", "best"]
check_texts = 8

[distil.cpu.small]
kind = "distill"
layers = 1

[distil.cpu.onnx]
input = "weights"

[distil.cpu.onnx-small]
kind = "onnx"
input = "small"

[distil.cpu.validate]
min_cosine = 0.0
on_fail = "record"

[distil.cpu.bench]
batch_sizes = [1]
seq_lens = [16]
warmup = 1
min_samples = 6
max_samples = 8
max_seconds = 0.3
baseline = false

[distil.cpu.best]
kind = "select"
objective = "min_latency_p50"
normalize = false  # bench times no PyTorch reference here (baseline = false)

[distil.l4]
hardware = "nvidia-l4"
targets = ["weights", "onnx"]
check_texts = 8  # the same onnx node as distil.cpu's: built once
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The recipe built once, at the default -j."""
    p = tmp_path_factory.mktemp("thirdparty")
    (p / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (p / "r.toml").write_text(RECIPE)
    proc = run_mopt("build", "r.toml", "--json", cwd=p, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return p, json.loads(proc.stdout)


def test_plugin_is_listed_with_what_it_registered(tmp_path: Path) -> None:
    proc = run_mopt("plugins", "--json", cwd=tmp_path)
    acme = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}["acme"]
    assert acme["distribution"] == "acme-distil-plugin"
    assert acme["registered"] == {
        "targets": ["distill"],
        "families": ["distilbert", "gpt2"],
        "hardware": ["nvidia-l4", "jetson-orin-nano"],
    }


def test_check_estimates_the_new_family_from_its_config_keys(tmp_path: Path) -> None:
    """DistilBERT's config says dim / n_layers / n_heads / hidden_dim: the family's dims()
    reads them, and the estimator counts exactly what transformers builds."""
    pytest.importorskip("transformers")
    import torch
    from acme_distil.plugin import DistilBertFamily
    from transformers import AutoConfig, AutoModel

    (tmp_path / "r.toml").write_text(RECIPE)
    proc = run_mopt("check", "r.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["findings"] == []
    # the vocabulary too: the family's synthetic_defaults say it, and the build makes it
    assert data["model_configs"]["distil"] == "synthetic source config over the family's synthetic defaults"
    (est,) = [e for e in data["estimates"] if e["section"] == "distil.l4"]
    assert est["hardware"] == "nvidia-l4" and est["capacity_bytes"] == 24 * 2**30
    cfg = DistilBertFamily.synthetic_defaults
    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.for_model("distilbert", **cfg))
    assert est["params"] == sum(p.numel() for p in model.parameters())


def test_distilled_checkpoint_goes_through_onnx_validate_bench_and_select(built: tuple[Path, dict]) -> None:
    p, data = built
    status = {n["id"]: n["status"] for n in data["nodes"]}
    assert set(status.values()) == {"built"}
    assert "distil.l4:onnx" not in status  # shared with distil.cpu:onnx (not per hardware)
    assert (p / "build/distil/l4/onnx/model.onnx").is_file()
    for node in ("small", "onnx-small", "validate[onnx-small]", "bench[onnx-small]", "best"):
        assert f"distil.cpu:{node}" in status
    small = json.loads((p / "build/distil/cpu/small/config.json").read_text())
    full = json.loads((p / "build/distil/cpu/weights/config.json").read_text())
    assert (small["n_layers"], full["n_layers"]) == (1, 3)
    assert full["vocab_size"] == 1024  # the family's synthetic_defaults', as `mopt check` estimated
    assert json.loads((p / "build/distil/cpu/onnx-small/mopt_ml.json").read_text())["family"] == "distilbert"
    report = json.loads((p / "build/distil/cpu/validate[onnx-small]/report.json").read_text())
    assert report["family"] == "distilbert" and report["metrics"]["n"] > 100
    bench = json.loads((p / "build/distil/cpu/bench[onnx-small]/bench.json").read_text())
    assert bench["results"]
    selection = json.loads((p / "build/distil/cpu/best/selection.json").read_text())
    assert {r["label"] for r in selection["variants"]} == {"onnx", "onnx-small"}
    assert selection["winner"] in ("onnx", "onnx-small")


def test_estimate_of_the_built_checkpoint_is_its_parameter_count(built: tuple[Path, dict]) -> None:
    p, _ = built
    (p / "w.toml").write_text(
        'schema = 1\n[models.w]\nfamily = "distilbert"\nsource = { path = "build/distil/cpu/weights" }\n'
        '[w.l4]\nhardware = "nvidia-l4"\ntargets = ["weights"]\n'
    )
    proc = run_mopt("check", "w.toml", "--json", cwd=p)
    assert proc.returncode == 0, proc.stderr
    (est,) = json.loads(proc.stdout)["estimates"]
    manifest = json.loads((p / "build/distil/cpu/weights/manifest.json").read_text())
    assert est["params"] == manifest["num_parameters"]


def test_noop_rebuild_takes_the_fast_path(built: tuple[Path, dict]) -> None:
    p, _ = built
    # (the tests before wrote files into the project: a folder on `python -m`'s sys.path)
    first = run_mopt("build", "r.toml", "--json", cwd=p)
    assert first.returncode == 0, first.stderr
    second = json.loads(run_mopt("build", "r.toml", "--json", cwd=p).stdout)
    assert second["io"].get("noop") is True, second["io"].get("noop_miss")
    assert set(second["counts"]) == {"cached"}


def test_wrong_input_names_the_format(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text(
        RECIPE.replace('[distil.cpu.best]', '[distil.cpu.slim]\nkind = "onnx-slim"\ninput = "small"\n\n[distil.cpu.best]')
        .replace('"validate", "bench", "best"]', '"validate", "bench", "best", "slim"]')
    )
    proc = run_mopt("plan", "r.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith(
        "[distil.cpu.slim] input: input 'small' is a 'distill' (format 'hf-checkpoint'), which kind "
        "'onnx-slim' does not take (it takes: format onnx, kind onnx)"
    )


def _fake_distribution(site: Path, dist: str, ep_name: str, module: str, kind: str) -> None:
    """A distribution `dist` (a dist-info folder, as pip leaves one) whose plugin registers the
    target kind `kind`: on sys.path, importlib.metadata finds it like an installed one."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text("")
    (site / module / "plugin.py").write_text(
        "from mopt.api import Params, TargetKind, hookimpl\n\n\n"
        "class Clash(TargetKind):\n"
        f"    name = {kind!r}\n"
        "    Params = Params\n\n"
        "    def run(self, ctx):\n"
        "        return None\n\n\n"
        "@hookimpl\n"
        "def mopt_register_targets(register):\n"
        "    register(Clash)\n"
    )
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[mopt]\n{ep_name} = {module}.plugin\n")


def test_a_third_party_named_mopt_something_is_blamed_for_a_clash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mopt-acme2` is a third party's name (the mopt- prefix is the ecosystem's convention,
    as pytest-* is): its `onnx` clashes with mopt-ml's, and it is the one blamed, with a fix
    that disables it, not all of mopt-ml's kinds."""
    from mopt.errors import PluginError
    from mopt.plugins import _entry_points, build_registry, make_plugin_manager

    _fake_distribution(tmp_path, "mopt-acme2", "acme2", "mopt_acme2", "onnx")
    monkeypatch.syspath_prepend(str(tmp_path))
    _entry_points.cache_clear()
    try:
        names = [ep.name for ep in _entry_points()]
        assert names.index("ml") < names.index("acme2")
        with pytest.raises(PluginError) as exc:
            build_registry(make_plugin_manager())
    finally:
        monkeypatch.undo()
        _entry_points.cache_clear()
        sys.modules.pop("mopt_acme2.plugin", None)
        sys.modules.pop("mopt_acme2", None)
    assert exc.value.message.startswith(
        "plugin 'acme2' (mopt-acme2 0.1.0) registers target kind 'onnx', already registered by plugin 'ml' (mopt-ml "
    )
    assert exc.value.hint == "rename it in 'acme2', or disable 'acme2' with MOPT_DISABLE_PLUGINS=acme2"
    # through the CLI as well
    proc = run_mopt("plugins", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "plugin 'acme2' (mopt-acme2 0.1.0) registers target kind 'onnx'" in proc.stderr
    assert "MOPT_DISABLE_PLUGINS=acme2" in proc.stderr and "MOPT_DISABLE_PLUGINS=ml" not in proc.stderr
    # the first-party set is what plugins/ ships
    from mopt.plugins import FIRST_PARTY_DISTRIBUTIONS

    root = Path(__file__).resolve().parents[1]
    shipped = {
        re.search(r'^name = "([^"]+)"', (d / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
        for d in (root / "plugins").iterdir()
        if (d / "pyproject.toml").is_file()
    }
    assert shipped == FIRST_PARTY_DISTRIBUTIONS


def test_a_first_party_plugin_registered_after_a_third_party_is_not_blamed() -> None:
    """Even out of order (a third party registered first), the clash is the third party's."""
    import types

    from mopt.api import Params as NoParams
    from mopt.api import TargetKind, hookimpl
    from mopt.errors import PluginError
    from mopt.plugins import build_registry, make_plugin_manager

    class Clash(TargetKind):
        name = "onnx"
        Params = NoParams

        def run(self, ctx: object) -> None:
            return None

    mod = types.ModuleType("mopt_acme3")
    mod.mopt_register_targets = hookimpl(lambda register: register(Clash))  # type: ignore[attr-defined]
    pm = make_plugin_manager(disable=["ml"])
    pm.register(mod, name="acme3")
    import mopt_ml.plugin

    pm.register(mopt_ml.plugin, name="ml")
    with pytest.raises(PluginError) as exc:
        build_registry(pm)
    assert exc.value.message.startswith("plugin 'acme3' registers target kind 'onnx', which plugin 'ml' (mopt-ml ")
    assert exc.value.hint == "rename it in 'acme3', or disable 'acme3' with MOPT_DISABLE_PLUGINS=acme3"


PTQ = """\
[distil.l4.ptq]
kind = "modelopt-ptq"
calib_texts = "calib.txt"

"""

SERVING = """\
schema = 1

[models.distil]
family = "distilbert"
task = "embedding"
source = { synthetic = "distilbert", seed = 0 }

[distil.l4]
hardware = "nvidia-l4"
targets = ["weights", "small", "ptq", "vllm", "ov", "vllm-small", "trtllm-small", "check-small",
           "ov-small", "tc-small", "aoti-small"]

[distil.l4.small]
kind = "distill"
layers = 1

{PTQ}[distil.l4.ov]
kind = "openvino"

[distil.l4.vllm-small]
kind = "vllm"
input = "small"

[distil.l4.trtllm-small]
kind = "trtllm"
input = "small"

[distil.l4.check-small]
kind = "serve-check"
input = ["vllm-small", "small"]

[distil.l4.ov-small]
kind = "openvino"
input = "small"

[distil.l4.tc-small]
kind = "torch-compile"
input = "small"

[distil.l4.aoti-small]
kind = "aoti"
input = "small"
""".replace("{PTQ}", PTQ)


def test_a_third_party_hf_checkpoint_feeds_every_kind_that_takes_the_format(tmp_path: Path) -> None:
    """`distill` produces an `hf-checkpoint`: vllm, trtllm, serve-check, openvino,
    torch-compile and aoti take it as they take `weights` (they used to name their kinds:
    "which kind 'vllm' does not take"). Unnamed, they still pick what they did: modelopt-ptq,
    then weights (not ambiguous with the third party's checkpoint); openvino onnx, then weights."""
    pytest.importorskip("mopt_serve", reason="vllm, trtllm and serve-check are in mopt-serve")
    pytest.importorskip("mopt_openvino", reason="openvino is in mopt-openvino")
    pytest.importorskip("mopt_torch", reason="torch-compile and aoti are in mopt-torch")
    (tmp_path / "r.toml").write_text(SERVING)
    (tmp_path / "calib.txt").write_text("a calibration text\n")
    proc = run_mopt("plan", "r.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    inputs = {n["id"].removeprefix("distil.l4:"): n["inputs"] for n in json.loads(proc.stdout)["nodes"]}
    small = ["distil.l4:small"]
    assert inputs["vllm-small"] == {"model": small}
    assert inputs["trtllm-small"] == {"model": small}
    assert inputs["ov-small"] == {"model": small}
    assert inputs["tc-small"] == {"weights": small}
    assert inputs["aoti-small"] == {"weights": small}
    assert inputs["check-small"] == {
        "serve": ["distil.l4:vllm-small"],
        "model": small,
        "reference": ["distil.l4:weights"],
    }
    assert inputs["vllm"] == {"model": ["distil.l4:ptq"]}  # the preferred kind, as before
    assert inputs["ov"] == {"model": ["distil.l4:weights"]}
    # without modelopt-ptq, weights: preferred over the third party's checkpoint, not ambiguous
    (tmp_path / "r.toml").write_text(SERVING.replace('"ptq", ', "").replace(PTQ, ""))
    proc = run_mopt("plan", "r.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (vllm,) = [n for n in json.loads(proc.stdout)["nodes"] if n["id"] == "distil.l4:vllm"]
    assert vllm["inputs"] == {"model": ["distil.l4:weights"]}


@pytest.mark.parametrize("value", ['"2"', "2.0", "true"])
def test_a_coerced_param_of_the_third_partys_kind_is_refused(tmp_path: Path, value: str) -> None:
    """Recipe params are strict (pydantic's strict mode, for every kind's `Params`): `layers =
    "2"` is not quietly read as 2, nor 2.0 or true."""
    (tmp_path / "r.toml").write_text(RECIPE.replace("layers = 1", f"layers = {value}"))
    proc = run_mopt("plan", "r.toml", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = RECIPE.splitlines().index("layers = 1") + 1
    assert proc.stderr.splitlines() == [
        f"error: r.toml:{line}: [distil.cpu.small] layers: input should be a valid integer, got "
        f"{json.loads(value)!r} (transformer layers to keep)"
    ]


GPT2 = """\
schema = 1

[models.tiny]
family = "gpt2"
task = "text-generation"
source = { synthetic = "gpt2", seed = 0 }

[tiny.cpu]
targets = ["weights", "onnx"]

[tiny.jetson]
hardware = "jetson-orin-nano"
targets = ["weights"]
"""


def test_a_causal_lm_family_as_the_docs_write_one(tmp_path: Path) -> None:
    """docs/plugins.md's causal-LM contract, as a third party follows it: acme's GPT-2 family
    (TransformersFamily, its shape, a byte-level BPE synthetic tokenizer) is estimated by
    `check` from its synthetic defaults, vocabulary included, with the memory a Jetson's GPU
    shares with its CPU counted once for both; and built to weights and the KV-cache ONNX."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

    (tmp_path / "mopt.toml").write_text('[store]\npath = ".mopt"\n')
    (tmp_path / "r.toml").write_text(GPT2)
    proc = run_mopt("check", "r.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model_configs"]["tiny"] == "synthetic source config over the family's synthetic defaults"
    est = {e["section"]: e for e in data["estimates"]}
    jetson = est["tiny.jetson"]
    assert jetson["capacity_bytes"] == 8 * 2**30
    (runtime,) = [ln for ln in jetson["lines"] if ln["name"] == "runtime"]
    assert runtime["bytes"] == 2**29 + jetson["bytes"]["weights"]  # the CUDA context + the host's copy
    assert "host copy" in runtime["formula"] and "shared with the CPU" in runtime["formula"]

    proc = run_mopt("build", "r.toml", "tiny.cpu", "--json", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    weights = tmp_path / "build/tiny/cpu/weights"
    assert json.loads((weights / "config.json").read_text())["vocab_size"] == 512
    meta = json.loads((tmp_path / "build/tiny/cpu/onnx/mopt_ml.json").read_text())
    assert (meta["task"], meta["vocab_size"]) == ("text-generation", 512)
    assert meta["check"]["decode"]["top1_agreement"] == 1.0
    tok = PreTrainedTokenizerFast.from_pretrained(str(weights))
    text = "Grüße, 東京 ✓"  # bytes no learnt merge covers still spell: byte-level
    assert tok.decode(tok(text)["input_ids"]) == text

    # GPT-2 small's shape: the estimator's decoder block (llama-like) leaves out GPT-2's learned
    # position table and its LayerNorm and MLP biases, 0.7 % of the parameters (docs/plugins.md)
    small = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    (tmp_path / "s.toml").write_text(GPT2.replace("seed = 0 }", f"seed = 0, config = {_toml(small)} }}"))
    proc = run_mopt("check", "s.toml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (est,) = [e for e in json.loads(proc.stdout)["estimates"] if e["section"] == "tiny.cpu"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GPT2Config(**small))
    real = sum(p.numel() for p in model.parameters())  # 124,439,808: GPT-2 small
    assert real == 124_439_808 and 0.99 * real < est["params"] < real


def _toml(d: dict) -> str:
    return "{ " + ", ".join(f"{k} = {v}" for k, v in d.items()) + " }"


def test_a_wordpiece_tokenizer_is_refused_for_text_generation(built: tuple[Path, dict]) -> None:
    """A family that says text-generation but keeps TransformersFamily's WordPiece synthetic
    tokenizer, or a checkpoint whose tokenizer is WordPiece, is refused for the task, naming
    what to do; the embedding task keeps them."""
    pytest.importorskip("transformers")
    from acme_distil.plugin import DistilBertFamily

    from mopt.api import TEXT_GENERATION

    class ChattyBert(DistilBertFamily):
        tasks = ("embedding", TEXT_GENERATION)

    fam = ChattyBert()
    with pytest.raises(ValueError, match=r"has only a WordPiece synthetic tokenizer: it lower-cases") as exc:
        fam.synthetic_tokenizer(["a text"], task=TEXT_GENERATION)
    assert "a causal LM needs a byte-level BPE one (docs/plugins.md, *Causal language models*)" in str(exc.value)
    weights = built[0] / "build/distil/cpu/weights"
    with pytest.raises(ValueError, match=r"is WordPiece: it lower-cases"):
        fam.load_tokenizer(weights, task=TEXT_GENERATION)
    assert fam.load_tokenizer(weights).is_fast
