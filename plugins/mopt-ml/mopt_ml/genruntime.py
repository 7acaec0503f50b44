"""The generation runtime shared by the text-generation kinds: one interface, several backends.

`open_generator(path, format=...)` opens a causal LM artifact and returns a `Generator`:

- format "hf-checkpoint" (a `weights` folder, any HF causal-LM folder): backend
  "torch-eager", transformers' `AutoModelForCausalLM` with a `DynamicCache`, fp32 unless
  `dtype` says otherwise; `device="cuda"` runs it on the GPU. This is the reference.
- format "onnx" (an `onnx` / `ort-quantize` folder of task text-generation): backend
  "onnxruntime", the KV-cache graph run step by step (prefill with an empty past, then one
  token per step feeding `present.*` back as `past_key_values.*` through an IO binding, so
  the cache never goes through numpy). `device="cuda"` uses the CUDA execution provider.

Every backend decodes greedily (argmax; ties go to the lowest id, as numpy / torch argmax
do), so two backends that compute the same logits give the same tokens. Token ids in,
token ids out: tokenizing (and the chat template) is the caller's, e.g. with
`load_tokenizer(path)` and `chat_ids(tokenizer, messages)`.

The interface (G2's validate / bench and G3's serving code against it):

    gen = open_generator(path, format="onnx", device="cpu", dtype=None, threads=None)
    gen.backend            # "torch-eager" | "onnxruntime"
    gen.vocab_size         # logits width
    gen.eos_token_ids      # frozenset of ids that end a reply (generation_config.json / config.json)
    gen.pad_token_id       # id used for left padding in generate_batch
    gen.logits(ids)        # np.float32 [len(ids), vocab]: teacher-forced next-token logits at every position
    gen.generate(prompt_ids, max_new_tokens, on_token=None, stop_at_eos=False) -> list[int]
                           # greedy; on_token(token_id, time.perf_counter()) right after each new
                           # token is known (the first call marks time to first token)
    gen.generate_batch(prompts, max_new_tokens) -> list[list[int]]
                           # greedy, left-padded batch; per prompt the same tokens as generate()
                           # up to numerics; always max_new_tokens per prompt (no early stop)
    gen.close()

Checks shared by the kinds: `causal_logits(model, tokenizer, texts)` (teacher-forced logits
of a transformers model) and `compare_logits(reference, candidate)` (cosine, max abs diff,
top-1 agreement of next-token logits, position by position).

Optional keyword arguments of `open_generator`: `attn_implementation` (torch backend;
default "eager" on CPU, "sdpa" on CUDA) and `provider_options` (onnxruntime backend).
`threads` sets torch's intra-op threads (process-wide) or ORT's intra-op threads.

The ONNX graph layout this runtime expects (what the `onnx` kind exports for text-generation;
the Optimum / ONNX Runtime GenAI naming): inputs `input_ids` [batch, sequence],
`attention_mask` [batch, past_sequence + sequence], `position_ids` [batch, sequence] (int64),
`past_key_values.{i}.key` / `.value` [batch, kv_heads, past_sequence, head_dim]; outputs
`logits` [batch, sequence, vocab] and `present.{i}.key` / `.value` [batch, kv_heads,
past_sequence + sequence, head_dim]. The number of layers, KV heads, head size and the
cache's element type are read from the graph itself.

numpy, torch and onnxruntime are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FORMATS", "Generator", "OnnxGenerator", "TorchGenerator", "causal_logits", "chat_ids",
           "compare_logits", "eos_ids", "load_tokenizer", "open_generator", "past_names"]  # fmt: skip

#: formats `open_generator` opens, with the backend each gets
FORMATS = {"hf-checkpoint": "torch-eager", "onnx": "onnxruntime"}

TokenCallback = Callable[[int, float], None]


@runtime_checkable
class Generator(Protocol):
    """A greedy causal-LM runner over token ids (see the module docstring)."""

    backend: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    pad_token_id: int

    def logits(self, input_ids: Sequence[int]) -> np.ndarray: ...

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, *,
        on_token: TokenCallback | None = None, stop_at_eos: bool = False,
    ) -> list[int]: ...  # fmt: skip

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def close(self) -> None: ...


def open_generator(
    path: Path | str,
    *,
    format: str,
    device: str = "cpu",
    dtype: str | None = None,
    threads: int | None = None,
    **options: Any,
) -> Generator:
    """A `Generator` over the artifact folder `path` of `format` ("hf-checkpoint" or "onnx")."""
    folder = Path(path)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected 'cpu' or 'cuda'")
    if format == "hf-checkpoint":
        return TorchGenerator(folder, device=device, dtype=dtype, threads=threads, **options)
    if format == "onnx":
        if dtype is not None:
            raise ValueError(
                f"dtype={dtype!r} for an onnx artifact: its precision is fixed at export "
                "(ort-quantize / autocast make other precisions)"
            )
        return OnnxGenerator(folder, device=device, threads=threads, **options)
    raise ValueError(f"format {format!r} has no generation backend (known: {', '.join(FORMATS)})")


# --------------------------------------------------------------------------- helpers


def load_tokenizer(path: Path | str) -> Any:
    """The fast tokenizer of a model or artifact folder (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding on some versions
        out = out["input_ids"]
    return [int(t) for t in out]


def eos_ids(folder: Path) -> frozenset[int]:
    """The ids that end a reply: generation_config.json's eos_token_id (int or list), else
    config.json's."""
    for name in ("generation_config.json", "config.json"):
        p = folder / name
        if p.is_file():
            value = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(value, int):
                return frozenset({value})
            if isinstance(value, list) and value:
                return frozenset(int(v) for v in value)
    return frozenset()


def _pad_id(folder: Path, eos: frozenset[int]) -> int:
    for name in ("generation_config.json", "config.json"):
        p = folder / name
        if p.is_file():
            value = json.loads(p.read_text()).get("pad_token_id")
            if isinstance(value, int):
                return value
    return min(eos) if eos else 0


def past_names(layers: int) -> list[str]:
    """Graph input names of the KV cache, in order: past_key_values.{i}.key / .value."""
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def _left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[Any, Any, Any]:
    """int64 input_ids, attention_mask and position_ids [batch, longest] of left-padded prompts."""
    import numpy as np

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = np.asarray(p, dtype=np.int64)
        mask[r, width - len(p) :] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    return ids, mask, pos


def _check_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    if len(ids) == 0:
        raise ValueError(f"{what}: needs at least one token")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")


# --------------------------------------------------------------------------- torch eager


class TorchGenerator:
    """transformers `AutoModelForCausalLM` with a `DynamicCache`: the reference backend."""

    backend = "torch-eager"

    def __init__(
        self, folder: Path, *, device: str = "cpu", dtype: str | None = None, threads: int | None = None,
        attn_implementation: str | None = None,
    ) -> None:  # fmt: skip
        import torch
        from transformers import AutoModelForCausalLM

        from mopt_ml.families import quiet_transformers, torch_dtype

        if threads:
            torch.set_num_threads(int(threads))
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA GPU")
        quiet_transformers()
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype or "fp32")
        attn = attn_implementation or ("sdpa" if device == "cuda" else "eager")
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=self.dtype, attn_implementation=attn
        ).eval().to(self.device)  # fmt: skip
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_token_ids = eos_ids(folder)
        self.pad_token_id = _pad_id(folder, self.eos_token_ids)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize()

    def logits(self, input_ids: Sequence[int]) -> np.ndarray:
        import torch

        _check_ids(input_ids, self.vocab_size, "logits")
        with torch.inference_mode():
            ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, use_cache=False).logits[0]
            return out.float().cpu().numpy()

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, *,
        on_token: TokenCallback | None = None, stop_at_eos: bool = False,
    ) -> list[int]:  # fmt: skip
        import torch
        from transformers import DynamicCache

        _check_ids(prompt_ids, self.vocab_size, "generate")
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            pos = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)
            while True:
                res = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
                token = int(torch.argmax(res.logits[0, -1]).item())  # .item() synchronises
                out.append(token)
                if on_token is not None:
                    on_token(token, time.perf_counter())
                if len(out) >= max_new_tokens or (stop_at_eos and token in self.eos_token_ids):
                    return out
                cache = res.cache
                ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
                pos = pos[:, -1:] + 1

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        import torch
        from transformers import DynamicCache

        for p in prompts:
            _check_ids(p, self.vocab_size, "generate_batch")
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        ids_np, mask_np, pos_np = _left_pad(prompts, self.pad_token_id)
        dev = self.device
        outs: list[list[int]] = [[] for _ in prompts]
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            ids, mask, pos = (torch.from_numpy(a).to(dev) for a in (ids_np, mask_np, pos_np))
            for step in range(max_new_tokens):
                res = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1,
                )  # fmt: skip
                tokens = torch.argmax(res.logits[:, -1], dim=-1)
                for r, t in enumerate(tokens.tolist()):
                    outs[r].append(int(t))
                if step + 1 == max_new_tokens:
                    break
                cache = res.cache
                ids = tokens.view(-1, 1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = pos[:, -1:] + 1
        return outs

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- onnxruntime


class OnnxGenerator:
    """ONNX Runtime over the KV-cache graph of the `onnx` kind (layout in the module docstring)."""

    backend = "onnxruntime"

    def __init__(
        self, folder: Path, *, device: str = "cpu", threads: int | None = None,
        provider_options: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        import onnxruntime as ort

        model = folder / "model.onnx"
        if not model.is_file():
            raise FileNotFoundError(f"{folder} holds no model.onnx")
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError("device='cuda' but this onnxruntime has no CUDAExecutionProvider")
            providers: list[Any] = [("CUDAExecutionProvider", provider_options or {}), "CPUExecutionProvider"]
        else:
            providers = [("CPUExecutionProvider", provider_options or {})]
        self.session = ort.InferenceSession(str(model), so, providers=providers)
        self.device = device
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        missing = [n for n in ("input_ids", "attention_mask", "position_ids") if n not in inputs]
        if missing or "logits" not in outputs:
            raise ValueError(
                f"{model} is not a text-generation graph with a KV cache: inputs {sorted(inputs)}, "
                f"outputs {sorted(outputs)} (expected input_ids, attention_mask, position_ids, "
                "past_key_values.{i}.key/value → logits, present.{i}.key/value)"
            )
        self.layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        self.past = past_names(self.layers)
        self.present = [n.replace("past_key_values.", "present.", 1) for n in self.past]
        absent = [n for n in self.past if n not in inputs] + [n for n in self.present if n not in outputs]
        if self.layers == 0 or absent:
            raise ValueError(f"{model}: KV-cache inputs/outputs missing or misnamed: {absent[:4] or 'no past'}")
        shape = inputs[self.past[0]].shape  # [batch, kv_heads, past_sequence, head_dim]
        if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
            raise ValueError(f"{model}: {self.past[0]} has no static kv_heads/head_dim ({shape})")
        self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.kv_dtype = {"tensor(float)": "float32", "tensor(float16)": "float16",
                         "tensor(bfloat16)": "bfloat16"}[inputs[self.past[0]].type]  # fmt: skip
        vocab = outputs["logits"].shape[-1]
        self.vocab_size = int(vocab) if isinstance(vocab, int) else int(_config(folder).get("vocab_size", 0))
        self.eos_token_ids = eos_ids(folder)
        self.pad_token_id = _pad_id(folder, self.eos_token_ids)

    # one forward pass; past: OrtValues (or None for an empty cache); returns (logits, present)
    def _step(self, ids: Any, mask: Any, pos: Any, past: list[Any] | None, batch: int) -> tuple[Any, list[Any]]:
        import numpy as np

        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        io.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(pos))
        if past is None:
            empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
            for name in self.past:
                io.bind_cpu_input(name, empty)
        else:
            for name, value in zip(self.past, past, strict=True):
                io.bind_ortvalue_input(name, value)
        out_device = "cuda" if self.device == "cuda" else "cpu"
        io.bind_output("logits", "cpu")
        for name in self.present:
            io.bind_output(name, out_device)
        self.session.run_with_iobinding(io)
        values = io.get_outputs()
        return values[0], list(values[1:])

    def logits(self, input_ids: Sequence[int]) -> np.ndarray:
        import numpy as np

        _check_ids(input_ids, self.vocab_size, "logits")
        n = len(input_ids)
        ids = np.asarray([list(input_ids)], dtype=np.int64)
        logits, _ = self._step(ids, np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None], None, 1)
        return logits.numpy()[0].astype(np.float32)

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, *,
        on_token: TokenCallback | None = None, stop_at_eos: bool = False,
    ) -> list[int]:  # fmt: skip
        import numpy as np

        _check_ids(prompt_ids, self.vocab_size, "generate")
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        n = len(prompt_ids)
        ids = np.asarray([list(prompt_ids)], dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)[None]
        past = None
        total = n
        while True:
            logits, past = self._step(ids, np.ones((1, total), np.int64), pos, past, 1)
            token = int(np.argmax(logits.numpy()[0, -1]))
            out.append(token)
            if on_token is not None:
                on_token(token, time.perf_counter())
            if len(out) >= max_new_tokens or (stop_at_eos and token in self.eos_token_ids):
                return out
            ids = np.asarray([[token]], dtype=np.int64)
            pos = np.asarray([[total]], dtype=np.int64)
            total += 1

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        import numpy as np

        for p in prompts:
            _check_ids(p, self.vocab_size, "generate_batch")
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        ids, mask, pos = _left_pad(prompts, self.pad_token_id)
        outs: list[list[int]] = [[] for _ in prompts]
        past = None
        for step in range(max_new_tokens):
            logits, past = self._step(ids, mask, pos, past, len(prompts))
            tokens = np.argmax(logits.numpy()[:, -1], axis=-1)
            for r, t in enumerate(tokens.tolist()):
                outs[r].append(int(t))
            if step + 1 == max_new_tokens:
                break
            ids = tokens.astype(np.int64).reshape(-1, 1)
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
            pos = pos[:, -1:] + 1
        return outs

    def close(self) -> None:
        self.session = None


def _config(folder: Path) -> dict[str, Any]:
    p = folder / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


# --------------------------------------------------------------------------- checks


def causal_logits(model: Any, tokenizer: Any, texts: Sequence[str], max_length: int = 64) -> list[Any]:
    """Teacher-forced logits (np.float32 [tokens, vocab]) of each text under a transformers
    causal LM, one text at a time (no padding)."""
    import torch

    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
            t = torch.tensor([ids], dtype=torch.long)
            out.append(model(input_ids=t, use_cache=False).logits[0].float().numpy())
    return out


def compare_logits(reference: Sequence[Any], candidate: Sequence[Any]) -> dict[str, float]:
    """Next-token logits of `candidate` against `reference` (lists of [tokens, vocab] arrays,
    position by position): min / mean cosine, max abs difference (and relative to the
    reference's largest |logit|), top-1 agreement."""
    import numpy as np

    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference sequences, {len(candidate)} candidate ones")
    cos, agree, diff, scale, n = [], 0, 0.0, 0.0, 0
    for r, c in zip(reference, candidate, strict=True):
        if r.shape != c.shape:
            raise ValueError(f"logits shapes differ: reference {r.shape}, candidate {c.shape}")
        r64, c64 = r.astype(np.float64), c.astype(np.float64)
        num = np.sum(r64 * c64, axis=1)
        den = np.maximum(np.linalg.norm(r64, axis=1) * np.linalg.norm(c64, axis=1), 1e-30)
        cos.append(num / den)
        agree += int(np.sum(np.argmax(r, axis=1) == np.argmax(c, axis=1)))
        n += r.shape[0]
        diff = max(diff, float(np.abs(r64 - c64).max()))
        scale = max(scale, float(np.abs(r64).max()))
    allcos = np.concatenate(cos)
    return {
        "positions": n,
        "sequences": len(reference),
        "min_cosine": float(f"{allcos.min():.7g}"),
        "mean_cosine": float(f"{allcos.mean():.7g}"),
        "max_abs_diff": float(f"{diff:.4g}"),
        "rel_max_abs_diff": float(f"{diff / max(scale, 1e-30):.4g}"),
        "top1_agreement": float(f"{agree / max(n, 1):.6g}"),
    }
