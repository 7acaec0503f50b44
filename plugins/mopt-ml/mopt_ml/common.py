"""Helpers shared by the targets: tool versions, text sets, artifact metadata, ONNX Runtime
sessions and embedding metrics.

Nothing here imports torch, transformers or onnx at module level; numpy and onnxruntime are
imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: the output every exported graph has: pooled, L2-normalised embeddings [batch, hidden]
OUTPUT_NAME = "mopt_embedding"
#: the graph's inputs, in order
INPUT_NAMES = ("input_ids", "attention_mask")
#: metadata file written next to every model.onnx this plugin produces
META_FILE = "mopt_ml.json"
#: how many of the shipped sentences are the calibration split (the rest is validation)
CALIBRATION_SIZE = 40

#: tokenizer and config files a model folder may hold; copied next to model.onnx
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
CONFIG_FILES = ("config.json", "generation_config.json")


def versions(*dists: str) -> dict[str, str]:
    """Installed versions of `dists`, read from package metadata (the modules are not
    imported); a missing one is reported as "missing"."""
    out: dict[str, str] = {}
    for dist in dists:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "missing"
    return out


_IMPORT_LOCK = threading.Lock()

#: lazily resolved names imported once, under the lock, before any target uses them
_WARM_NAMES = {
    "transformers": ("AutoConfig", "AutoModel", "AutoTokenizer", "PreTrainedTokenizerFast"),
    "onnxruntime": ("InferenceSession", "SessionOptions"),
    "onnxruntime.quantization": ("quantize_dynamic", "quantize_static", "quant_pre_process"),
}


def require(*modules: str) -> None:
    """Import `modules` (and the lazily loaded names the targets use) once, under a
    process-wide lock, or fail naming the package to install.

    mopt runs actions in threads of one process: two threads importing transformers for
    the first time at once can see a half-initialised module ("cannot import name
    'AutoTokenizer'"), so first imports are serialised here."""
    import importlib
    import importlib.util

    with _IMPORT_LOCK:
        for mod in modules:
            if importlib.util.find_spec(mod) is None:
                raise RuntimeError(f"python package {mod!r} is not installed; pip install {mod}")
            module = importlib.import_module(mod)
            for name in _WARM_NAMES.get(mod, ()):
                getattr(module, name)
            if mod == "onnxruntime":
                importlib.import_module("onnxruntime.quantization")
        if "transformers" in modules:
            for sub in ("transformers.models.bert.modeling_bert", "transformers.models.qwen3.modeling_qwen3"):
                with contextlib.suppress(ImportError):
                    importlib.import_module(sub)


def canonical_json(obj: Any) -> str:
    """Sorted keys, two-space indent, trailing newline: stable bytes for the same data."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def write_json(path: Path, obj: Any) -> None:
    path.write_text(canonical_json(obj), encoding="utf-8")


def spec_hash(obj: Any, length: int = 16) -> str:
    """A short hex digest of JSON-serialisable `obj` (sorted, compact)."""
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:length]


# --------------------------------------------------------------------------- text sets


def shipped_sentences_path() -> Path:
    """The default sentence set shipped with the plugin (one sentence a line)."""
    return Path(str(resources.files("mopt_ml") / "data" / "sentences.txt"))


def read_texts(path: Path) -> list[str]:
    """Texts from a file: `.jsonl` (objects with a "text" key, or plain strings) or text
    (one per line). Blank lines and lines starting with `#` in text files are skipped."""
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    texts: list[str] = []
    if path.suffix in (".jsonl", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                texts.append(item["text"])
            else:
                raise ValueError(f"{path}:{n}: expected a string or an object with a 'text' key")
    else:
        texts = [ln.strip() for ln in raw.splitlines()]
        texts = [t for t in texts if t and not t.startswith("#")]
    if not texts:
        raise ValueError(f"text file {path} holds no texts")
    return texts


def calibration_texts() -> list[str]:
    """The shipped calibration split: the first CALIBRATION_SIZE sentences."""
    return read_texts(shipped_sentences_path())[:CALIBRATION_SIZE]


def validation_texts() -> list[str]:
    """The shipped validation split: every sentence after the calibration split (never
    used for calibration)."""
    return read_texts(shipped_sentences_path())[CALIBRATION_SIZE:]


def texts_from_param(value: str | None, project_dir: Path, default: str) -> list[str]:
    """A recipe's data path (relative to the project) or the shipped split `default`
    ("calibration" or "validation")."""
    if value:
        return read_texts(resolve_data_path(value, project_dir))
    return calibration_texts() if default == "calibration" else validation_texts()


def resolve_data_path(value: str, project_dir: Path) -> Path:
    return (project_dir / value).resolve()


def data_input_files(value: str | None, project_dir: Path) -> list[Path]:
    """What `TargetKind.input_files` returns for a data param: the recipe's file, or the
    shipped sentence file (so that editing either re-keys the target)."""
    if value:
        return [resolve_data_path(value, project_dir)]
    return [shipped_sentences_path()]


# --------------------------------------------------------------------------- folders


def copy_model_files(
    src: Path, dst: Path, names: Iterable[str] = TOKENIZER_FILES + CONFIG_FILES
) -> list[str]:
    """Copy the tokenizer and config files that exist in `src` into `dst`."""
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def read_meta(folder: Path) -> dict[str, Any]:
    """The `mopt_ml.json` of an ONNX artifact folder ({} when absent)."""
    p = folder / META_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def model_onnx(folder: Path) -> Path:
    p = folder / "model.onnx"
    if not p.is_file():
        raise FileNotFoundError(f"{folder} holds no model.onnx")
    return p


def save_onnx(model: Any, path: Path, external: bool | None = None, threshold: float = 1.5e9) -> bool:
    """Save an onnx ModelProto to `path`; weights go to `<name>.data` beside it when
    `external` is true, or, when it is None, when they exceed `threshold` bytes.
    Returns whether external data was used."""
    import onnx

    if external is None:
        external = _initializer_bytes(model) > threshold
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    return bool(external)


def _initializer_bytes(model: Any) -> int:
    import numpy as np
    from onnx import helper

    total = 0
    for t in model.graph.initializer:
        if t.data_location == 1:  # external: size from the dims
            n = int(np.prod(t.dims)) if t.dims else 1
            total += n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        else:
            total += t.ByteSize()
    return total


# --------------------------------------------------------------------------- ORT inference


def ort_session(path: Path, threads: int | None = None, optimize: bool = True) -> Any:
    """A CPU ONNX Runtime session with `threads` intra-op threads (None: ORT's default)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def tokenize(
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int,
    pad_to: int | None = None,
) -> dict[str, np.ndarray]:
    """int64 input_ids / attention_mask, padded to the longest row or to `pad_to`."""
    import numpy as np

    if pad_to:
        enc = tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=pad_to, return_tensors="np"
        )
    else:
        enc = tokenizer(
            list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="np"
        )
    return {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }


def embed_onnx(
    session: Any,
    tokenizer: Any,
    texts: Sequence[str],
    batch_size: int = 32,
    max_length: int = 128,
    pad_to: int | None = None,
) -> np.ndarray:
    """Pooled embeddings [len(texts), hidden] from a graph with this plugin's interface."""
    import numpy as np

    names = {i.name for i in session.get_inputs()}
    out = []
    for i in range(0, len(texts), batch_size):
        feeds = tokenize(tokenizer, texts[i : i + batch_size], max_length, pad_to)
        feeds = {k: v for k, v in feeds.items() if k in names}
        out.append(session.run([OUTPUT_NAME], feeds)[0])
    return np.concatenate(out).astype(np.float32)


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in an artifact folder (a transformers fast tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# --------------------------------------------------------------------------- metrics


def compare(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """Cosine similarity per row (min, mean, p01), max abs difference, and top-1
    neighbour agreement of `candidate` embeddings against `reference` ones."""
    import numpy as np

    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    if ref.shape != cand.shape:
        raise ValueError(f"embedding shapes differ: reference {ref.shape}, candidate {cand.shape}")
    rn = ref / np.maximum(np.linalg.norm(ref, axis=1, keepdims=True), 1e-12)
    cn = cand / np.maximum(np.linalg.norm(cand, axis=1, keepdims=True), 1e-12)
    cos = np.sum(rn * cn, axis=1)
    out: dict[str, float] = {
        "n": len(cos),
        "min_cosine": _sig(cos.min()),
        "mean_cosine": _sig(cos.mean()),
        "p01_cosine": _sig(np.quantile(cos, 0.01)),
        "max_abs_diff": _sig(np.abs(ref - cand).max()),
    }
    if len(cos) > 2:
        out["top1_agreement"] = _sig(top1_agreement(rn, cn))
    return out


def _sig(value: Any, digits: int = 7) -> float:
    """`value` to `digits` significant digits: artifacts that record these numbers keep the
    same bytes when the last bits of a float sum differ between CPUs."""
    return float(f"{float(value):.{digits}g}")


def top1_agreement(ref: np.ndarray, cand: np.ndarray) -> float:
    """Fraction of rows whose nearest other row (by cosine) is the same under both."""
    import numpy as np

    def nn(e: np.ndarray) -> np.ndarray:
        s = e @ e.T
        np.fill_diagonal(s, -np.inf)
        return np.argmax(s, axis=1)

    return float(np.mean(nn(ref) == nn(cand)))


def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    import numpy as np

    rn = reference / np.maximum(np.linalg.norm(reference, axis=1, keepdims=True), 1e-12)
    cn = candidate / np.maximum(np.linalg.norm(candidate, axis=1, keepdims=True), 1e-12)
    return np.sum(rn * cn, axis=1)


def probe_level(probe: dict[str, Any] | None) -> float | None:
    """How fast the machine ran around one bench run, from its drift probe (`timing._probed`): the
    faster of the two readings taken right before and right after the backend's worker
    (`level_ms`). A slowdown at one end only (another tenant of the VM, a process winding down)
    must not rescale the whole run: on a quiet 2-core machine one such reading (26 ms before,
    18 ms after, 16-17 ms for every other bench) made `select` scale a variant 1.5x faster
    than it ran and pick it. Results from before `level_ms` give their median (`p50_ms`)."""
    if not probe:
        return None
    value = probe.get("level_ms") or probe.get("p50_ms")
    return float(value) if value else None


def read_shared_baseline(results: list[dict[str, Any]], shared: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Append the section's `bench-baseline` result (`shared`, its bench.json with `target`)
    to a bench's `results`, after the artifact's `results[0]`; return it and the scale that
    puts its latencies at this run's machine speed: this run's probe level / the baseline
    run's (1 when either has no probe). Shared by the embedding and generation benches."""
    base_res = dict(shared["results"][0], shared_from=shared["target"])
    results.append(base_res)
    mine, theirs = probe_level(results[0].get("probe")), probe_level(base_res.get("probe"))
    return base_res, (mine / theirs if mine and theirs else 1.0)


def cpu_threads(value: int | None) -> int:
    """`value`, or the CPUs this process may use."""
    if value:
        return value
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpu_int8_dot() -> str:
    """The best int8 dot-product instructions of this CPU as ONNX Runtime uses them:
    "amx", "vnni" (x86 AVX512-VNNI / AVX-VNNI), "avx2", "arm-dot" or "none"."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
            break
    if "amx_int8" in flags:
        return "amx"
    if {"avx512_vnni", "avx_vnni"} & flags:
        return "vnni"
    if "avx2" in flags:
        return "avx2"
    if "asimddp" in flags or (platform.machine() in ("arm64", "aarch64") and "asimd" in flags):
        return "arm-dot"
    return "none"
