"""An OpenAI-compatible embeddings server for a mopt ONNX embedding artifact, on CPU.

Runs inside the `embed` image (Python 3 + fastapi, uvicorn, onnxruntime, tokenizers,
prometheus-client); it imports nothing of mopt. mopt's ONNX graphs take `input_ids` /
`attention_mask` and return the pooled, normalised embedding (`mopt_embedding`), so the
server only tokenizes, pads and runs the graph: the pooling is the graph's, the one that
`validate` checked.

    python3 embed_server.py --model /models/minilm --port 8000 --served-model-name minilm

Endpoints: POST /v1/embeddings (OpenAI schema: `input` a string or a list of strings,
`encoding_format` float or base64), GET /v1/models, GET /health (200 once the model is
loaded: the port opens only then), GET /metrics (Prometheus).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Gauge, Histogram, make_asgi_app
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

REQUESTS = Counter("mopt_embed_requests_total", "embedding requests by HTTP status", ["status"])
LATENCY = Histogram(
    "mopt_embed_request_seconds", "embedding request latency",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
)
TOKENS = Counter("mopt_embed_prompt_tokens_total", "tokens embedded")
INPUTS = Counter("mopt_embed_inputs_total", "texts embedded")
INFLIGHT = Gauge("mopt_embed_requests_in_flight", "requests being served")
OUTPUT = "mopt_embedding"


class Embedder:
    """Tokenizer + ONNX session of one mopt model folder."""

    def __init__(self, folder: Path, max_length: int, threads: int) -> None:
        onnx = folder / "model.onnx"
        if not onnx.is_file():
            sys.exit(f"{folder} holds no model.onnx (a mopt onnx / onnx-slim / ort-quantize artifact)")
        opts = ort.SessionOptions()
        if threads > 0:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(onnx), opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.output = OUTPUT if OUTPUT in outputs else outputs[0]
        self.dim = self.session.get_outputs()[outputs.index(self.output)].shape[-1]
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        pad_id, pad_token = self._pad(folder)
        # what the transformers fast tokenizer does with padding=True, truncation=True
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)

    def _pad(self, folder: Path) -> tuple[int, str]:
        cfg: dict[str, Any] = {}
        p = folder / "tokenizer_config.json"
        if p.is_file():
            cfg = json.loads(p.read_text())
        token = cfg.get("pad_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self.tokenizer.token_to_id(token) is not None:
            return int(self.tokenizer.token_to_id(token)), token
        return 0, self.tokenizer.id_to_token(0) or "[PAD]"

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        enc = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        out = self.session.run([self.output], {k: v for k, v in feeds.items() if k in self.inputs})[0]
        return out.astype(np.float32), int(mask.sum())


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None
    encoding_format: str = Field(default="float", pattern="^(float|base64)$")
    user: str | None = None


def make_app(embedder: Embedder, name: str, max_batch: int) -> FastAPI:
    app = FastAPI(title="mopt embeddings", docs_url=None, redoc_url=None)
    app.mount("/metrics", make_asgi_app())

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Any:
        if request.url.path != "/v1/embeddings":
            return await call_next(request)
        t0 = time.perf_counter()
        INFLIGHT.inc()
        try:
            response = await call_next(request)
        finally:
            INFLIGHT.dec()
        LATENCY.observe(time.perf_counter() - t0)
        REQUESTS.labels(str(response.status_code)).inc()
        return response

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "mopt"}]}

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingRequest) -> JSONResponse:  # sync: runs in the thread pool
        if req.model not in (None, name):
            raise HTTPException(404, f"model {req.model!r} is not served here (this server serves {name!r})")
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or len(texts) > max_batch:
            raise HTTPException(400, f"input must hold 1 to {max_batch} texts")
        vectors, tokens = embedder.embed(texts)
        TOKENS.inc(tokens)
        INPUTS.inc(len(texts))
        data = []
        for i, v in enumerate(vectors):
            emb: Any = base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="a mopt ONNX embedding folder")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    ap.add_argument("--max-length", type=int, default=512, help="tokens per text (longer ones are truncated)")
    ap.add_argument("--max-batch", type=int, default=256, help="texts per request")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: all cores)")
    a = ap.parse_args(argv)
    name = a.served_model_name or a.model.name
    embedder = Embedder(a.model, a.max_length, a.threads)  # load before listening: /health means ready
    print(f"mopt-embed-server: {name} ({a.model}, dim {embedder.dim}) on {a.host}:{a.port}", flush=True)
    uvicorn.run(make_app(embedder, name, a.max_batch), host=a.host, port=a.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
