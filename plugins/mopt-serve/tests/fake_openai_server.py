"""A tiny OpenAI-embeddings-compatible server for the CPU tests of serve-check's checks:
/health, /v1/models, /v1/embeddings (a deterministic vector per text, `usage.prompt_tokens`
= words), /metrics (Prometheus text). `python fake_openai_server.py PORT [DELAY_S [KNEE SLOW_S]]`: with KNEE,
a request that arrives while more than KNEE requests are in flight (itself included) takes
SLOW_S instead of DELAY_S, so a closed loop's p99 breaks an SLO between them exactly above
concurrency KNEE (the knee of the serving search's tests)."""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
COUNT = {"prompt_tokens": 0, "requests": 0}
INFLIGHT = [0]
LOCK = threading.Lock()
KNEE: int | None = None
SLOW = 0.0


def vector(text: str, dim: int = 8) -> list[float]:
    h = hashlib.sha256(text.encode()).digest()
    return [(b - 128) / 128.0 for b in h[:dim]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": MODEL}]}).encode())
        elif self.path == "/metrics":
            text = (
                "# HELP vllm:prompt_tokens_total x\n"
                f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {COUNT["prompt_tokens"]}\n'
                f'vllm:request_success_total{{finished_reason="stop"}} {COUNT["requests"]}\n'
                "vllm:num_requests_running 0\n"
            )
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/embeddings" or body.get("model") != MODEL:
            self._send(404, json.dumps({"error": "unknown model or path"}).encode())
            return
        with LOCK:
            INFLIGHT[0] += 1
            busy = INFLIGHT[0]
        try:
            time.sleep(SLOW if KNEE is not None and busy > KNEE else DELAY)
        finally:
            with LOCK:
                INFLIGHT[0] -= 1
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        toks = sum(len(t.split()) for t in texts)
        COUNT["prompt_tokens"] += toks
        COUNT["requests"] += 1
        data = [{"index": i, "embedding": vector(t)} for i, t in enumerate(texts)]
        self._send(200, json.dumps({"data": data, "usage": {"prompt_tokens": toks}}).encode())


if __name__ == "__main__":
    DELAY = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    if len(sys.argv) > 4:
        KNEE, SLOW = int(sys.argv[3]), float(sys.argv[4])
    ThreadingHTTPServer.request_queue_size = 256
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
