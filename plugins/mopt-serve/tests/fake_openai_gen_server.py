"""A tiny OpenAI-compatible *generation* server for the CPU tests of serve-check's generation
checks: /health, /v1/models, /v1/completions and /v1/chat/completions (both with `stream`,
SSE `data:` chunks ending in `data: [DONE]`, usage in a last chunk when
`stream_options.include_usage`), greedy "generation" from a deterministic rule over token ids
(next = (last * 31 + 7) % VOCAB, or `--wrong-after N`: off by one from position N), top-k
logprobs as `token_id:N` keys (`return_tokens_as_token_ids`), `prompt_logprobs` as vLLM gives
them (per prompt position after the first, the top-k and the prompt's own token, each
{"logprob", "rank", "decoded_token"}, of a distribution whose rule token has logit
`--sharpness S` (default 6) and every other token 0), and /metrics with vLLM's prefix-cache
counters. A prompt's "tokens" are its ids (lists of ints) or its UTF-8 bytes (strings).
`python fake_openai_gen_server.py PORT [DELAY_S] [--wrong-after N] [--sharpness S]`."""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import ThreadingHTTPServer

from fake_openai_server import Handler as _BaseHandler  # the sibling file (run as a script)

MODEL = os.environ.get("FAKE_MODEL", "fake-gen")
VOCAB = int(os.environ.get("FAKE_VOCAB", "1000"))
COUNT = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0, "queries": 0, "hits": 0}
SEEN: set[tuple[int, ...]] = set()  # 16-token blocks seen (prefix caching, roughly)
DELAY = 0.0
WRONG_AFTER: int | None = None
SHARPNESS = 6.0


def prompt_logprobs(ids: list[int], k: int) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's `prompt_logprobs` of `ids`: position t's rule token (after ids[:t]) at logit
    SHARPNESS, the rest at 0; the top-k is the rule token then (rule + 13 j) % VOCAB, plus the
    prompt's own token with its rank."""
    import math

    z = math.log(math.exp(SHARPNESS) + VOCAB - 1)
    out: list[dict[str, dict[str, object]] | None] = [None]
    for t in range(1, len(ids)):
        r = reference_next(ids[:t])
        top = [r] + [(r + 13 * j) % VOCAB for j in range(1, k)]
        d = {str(x): {"logprob": (SHARPNESS if x == r else 0.0) - z, "rank": i + 1, "decoded_token": f"<{x}>"}
             for i, x in enumerate(top)}  # fmt: skip
        if str(ids[t]) not in d:
            d[str(ids[t])] = {"logprob": -z, "rank": 2, "decoded_token": f"<{ids[t]}>"}
        out.append(d)
    return out


def next_token(ids: list[int], pos: int) -> int:
    t = (ids[-1] * 31 + 7) % VOCAB if ids else 7
    return (t + 1) % VOCAB if WRONG_AFTER is not None and pos >= WRONG_AFTER else t


def reference_next(ids: list[int]) -> int:
    """What a correct model generates after `ids` (the tests' reference)."""
    return (ids[-1] * 31 + 7) % VOCAB if ids else 7


def logprobs_for(t: int, k: int) -> dict[str, float]:
    out = {f"token_id:{t}": -0.1}
    for j in range(1, k):
        out[f"token_id:{(t + j * 13) % VOCAB}"] = -2.0 - j
    return out


def tokens_of(prompt: object) -> list[int]:
    if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
        return list(prompt)
    return list(str(prompt).encode())[:4096]


def chat_tokens(messages: list[dict]) -> list[int]:
    text = (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        + "<|im_start|>assistant\n"
    )
    return list(text.encode())


class Handler(_BaseHandler):
    """The embedding fake's HTTP plumbing (TCP_NODELAY, quiet log, `_send`), generation routes."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": MODEL, "max_model_len": 4096}]}).encode())
        elif self.path == "/metrics":
            c = COUNT
            text = (
                "# HELP vllm:prompt_tokens_total x\n"
                f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {c["prompt_tokens"]}\n'
                f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {c["generation_tokens"]}\n'
                f'vllm:request_success_total{{finished_reason="length"}} {c["requests"]}\n'
                f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} {c["queries"]}\n'
                f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {c["hits"]}\n'
                "vllm:num_requests_running 0\n"
            )
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path not in ("/v1/completions", "/v1/chat/completions") or body.get("model") != MODEL:
            self._send(404, json.dumps({"error": {"message": "unknown model or path"}}).encode())
            return
        chat = self.path.endswith("chat/completions")
        ids = chat_tokens(body["messages"]) if chat else tokens_of(body["prompt"])
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        k = (
            int(body.get("logprobs") or 0)
            if not chat
            else (int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0)
        )
        blocks = [tuple(ids[i : i + 16]) for i in range(0, len(ids) - len(ids) % 16, 16)]
        COUNT["queries"] += len(ids)
        COUNT["hits"] += 16 * sum(1 for b in blocks if b in SEEN)
        SEEN.update(blocks)
        COUNT["prompt_tokens"] += len(ids)
        COUNT["requests"] += 1
        out, seq = [], list(ids)
        for pos in range(n):
            t = next_token(seq, pos)
            out.append(t)
            seq.append(t)
        COUNT["generation_tokens"] += n
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        text = [f"<{t}>" for t in out]
        if not body.get("stream"):
            time.sleep(DELAY * (1 + n / 8))
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text)},
                    "finish_reason": "length",
                }
                if k:
                    choice["logprobs"] = {
                        "content": [
                            {
                                "token": f"token_id:{t}",
                                "logprob": -0.1,
                                "top_logprobs": [
                                    {"token": kk, "logprob": v} for kk, v in logprobs_for(t, k).items()
                                ],
                            }
                            for t in out
                        ]
                    }
            else:
                choice = {"index": 0, "text": "".join(text), "finish_reason": "length"}
                if k:
                    choice["logprobs"] = {
                        "tokens": [f"token_id:{t}" for t in out],
                        "token_logprobs": [-0.1] * n,
                        "top_logprobs": [logprobs_for(t, k) for t in out],
                    }
                if body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(ids, int(body["prompt_logprobs"]))
            self._send(
                200,
                json.dumps(
                    {
                        "id": "x",
                        "object": "text_completion",
                        "model": MODEL,
                        "choices": [choice],
                        "usage": usage,
                    }
                ).encode(),
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj: object) -> None:
            data = f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        time.sleep(DELAY)
        for s in text:
            if chat:
                chunk({"choices": [{"index": 0, "delta": {"content": s}, "finish_reason": None}]})
            else:
                chunk({"choices": [{"index": 0, "text": s, "finish_reason": None}]})
            time.sleep(DELAY / 8)
        chunk(
            {"choices": [{"index": 0, "delta": {} if chat else None, "text": "", "finish_reason": "length"}]}
        )
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk({"choices": [], "usage": usage})
        chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    args = sys.argv[1:]
    for flag in ("--host", "--port"):  # serve_command's `--host 127.0.0.1 --port P` (the port wins)
        if flag in args:
            i = args.index(flag)
            value = args[i + 1]
            del args[i : i + 2]
            if flag == "--port":
                args.insert(0, value)
    if "--wrong-after" in args:
        i = args.index("--wrong-after")
        WRONG_AFTER = int(args[i + 1])
        del args[i : i + 2]
    if "--sharpness" in args:
        i = args.index("--sharpness")
        SHARPNESS = float(args[i + 1])
        del args[i : i + 2]
    DELAY = float(args[1]) if len(args) > 1 else 0.0
    ThreadingHTTPServer(("127.0.0.1", int(args[0])), Handler).serve_forever()
