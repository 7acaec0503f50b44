"""A closed-loop load generator for OpenAI-compatible embedding servers that keeps every
request: `concurrency` clients (threads, one keep-alive HTTP connection each, no Nagle), each
sending its next request when the last one answered, for at least `min_requests` requests and
`min_s` seconds, at most `max_s` seconds or `max_requests`.

Why not `vllm bench serve` here: its pooling result (vLLM 0.26, `benchmarks/serve.py`) keeps
only aggregates (e2el percentiles, throughput, `input_lens`, `errors`), and the knee search needs
each request's latency and completion time for the p99's interval, goodput and the throughput's
interval. serve-check's grid still uses vLLM's tool.

The texts are random token ids of the model's own vocabulary, decoded, `input_len` long on
average (± `range_ratio`), a fresh set per step from a seed (so configs see the same texts and
no step repeats another's, which the prefix cache would answer).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from mopt_serve.search import Request


def text_maker(
    tokenizer_dir: str | None, input_len: int, range_ratio: float
) -> Callable[[random.Random, int], list[str]]:
    """A function of (RNG, n) returning n texts of about `input_len` tokens each."""
    tok: Any = None
    vocab: list[int] = []
    source = "words (no tokenizer given)"
    if tokenizer_dir:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer_dir)
            special = set(tok.all_special_ids)
            vocab = [i for i in range(tok.vocab_size) if i not in special]
            source = f"random ids of the model's tokenizer ({len(vocab)} ids), decoded"
        except Exception as exc:  # said in what the search records (`texts`), not silent
            tok, source = None, f"words (the tokenizer did not load: {type(exc).__name__}: {exc})"[:300]
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    words = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda")

    def make(rng: random.Random, n: int) -> list[str]:
        lens = [rng.randint(lo, hi) for _ in range(n)]
        if tok is not None:
            return [str(t) for t in tok.batch_decode([rng.choices(vocab, k=k) for k in lens])]
        return [" ".join(rng.choices(words, k=k)) for k in lens]

    make.source = source  # type: ignore[attr-defined]
    return make


def closed_loop(
    base_url: str,
    model: str,
    texts: list[str],
    concurrency: int,
    *,
    min_requests: int,
    min_s: float,
    max_s: float,
    max_requests: int,
    warmup: int = 0,
    texts_per_request: int = 1,
    timeout_s: float = 120.0,
) -> tuple[list[Request], float, str]:
    """Run one step; (requests, duration in s, the first error's text or ""). `texts` are used
    in order (warm-up first), cycling if the step outlasts them."""
    u = urlparse(base_url)
    lock = threading.Lock()
    issued = [0]
    out: list[Request] = []
    errors: list[str] = []
    t0 = [0.0]
    stop_at = [0.0]

    def connect() -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def one(conn: http.client.HTTPConnection, text: str) -> int:
        body = json.dumps({"model": model, "input": [text] * texts_per_request})
        conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
        return int(json.loads(raw).get("usage", {}).get("prompt_tokens", 0))

    def take(limit: int | None) -> int | None:
        """The next request's index, or None when the step is over."""
        with lock:
            i = issued[0]
            now = time.perf_counter()
            if limit is not None:
                if i >= limit:
                    return None
            elif i >= max_requests or now >= stop_at[0] or (i >= min_requests and now - t0[0] >= min_s):
                return None
            issued[0] += 1
            return i

    def client(offset: int, limit: int | None, keep: bool) -> None:
        conn = connect()
        try:
            while (i := take(limit)) is not None:
                text = texts[(offset + i) % len(texts)]
                start = time.perf_counter()
                try:
                    tokens = one(conn, text)
                    ok = True
                except Exception as e:  # a failed request is counted; the client goes on
                    tokens, ok = 0, False
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    conn.close()
                    conn = connect()
                end = time.perf_counter()
                if keep:
                    with lock:
                        out.append(Request(end - start, end - t0[0], tokens, ok))
        finally:
            conn.close()

    def run(offset: int, limit: int | None, keep: bool) -> float:
        issued[0] = 0
        t0[0] = time.perf_counter()
        stop_at[0] = t0[0] + max_s
        threads = [
            threading.Thread(target=client, args=(offset, limit, keep), daemon=True)
            for _ in range(concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0[0]

    if warmup:
        run(0, warmup, False)
        errors.clear()
    duration = run(warmup, None, True)
    return out, duration, errors[0][:300] if errors else ""
