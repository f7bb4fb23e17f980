"""`rill bench serve`: load-test any OpenAI-compatible server (Rill, vLLM, llama.cpp) or Rill's
WebSocket, the way `vllm bench serve` does, with datasets generated locally (no downloads).

Latency definitions (as vLLM's): TTFT = request sent → first text; ITL = gaps between text
chunks; TPOT = (E2E − TTFT) / (output tokens − 1); E2E = request sent → last byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from rill.services.clients.http_stream import Head, LineSplitter, ProtocolError, stream_lines

WORDS = ("the river carries light across stone and time while engines hum softly under a quiet sky "
         "every token finds its place in a block of memory that the scheduler lends and takes back "
         "clouds drift over cities where people ask questions and wait for answers to stream in").split()


@dataclass
class Prompt:
    prompt: str | list[int]  # text (chat dataset) or token ids (random dataset)
    input_len: int  # tokens (exact for ids; estimated for text)
    output_len: int


@dataclass
class Outcome:
    ok: bool
    input_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _len_range(text: str, default: int) -> tuple[int, int]:
    if not text:
        return default, default
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_dataset(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    in_lo, in_hi = _len_range(args.input_len_range, args.input_len)
    out_lo, out_hi = _len_range(args.output_len_range, args.output_len)
    prompts = []
    for _ in range(args.num_prompts + args.warmup):
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        if args.dataset == "random":
            # Ids from a range every common vocabulary has, so the length is exact in tokens.
            prompts.append(Prompt([rng.randint(1000, 20000) for _ in range(n_in)], n_in, n_out))
        else:  # chat-style text: about 1.3 tokens per English word
            words = [rng.choice(WORDS) for _ in range(max(1, int(n_in / 1.3)))]
            prompts.append(Prompt("Continue this story: " + " ".join(words), n_in, n_out))
    return prompts


def _body(args: argparse.Namespace, p: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": p.output_len, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = p.output_len  # llama.cpp and vLLM honour one or the other
    if args.backend == "openai-chat":
        text = p.prompt if isinstance(p.prompt, str) else " ".join(WORDS[t % len(WORDS)] for t in p.prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = p.prompt
    return body


async def _http_one(client: httpx.AsyncClient, args: argparse.Namespace, p: Prompt) -> Outcome:
    path = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    url, body = args.base_url + path, _body(args, p)
    out = Outcome(ok=False, input_len=p.input_len)
    start = time.perf_counter()
    events = _EventReader(args.backend == "openai-chat", out, start)
    try:
        if url.startswith("http://"):  # the lean reader (http_stream.py); TLS stays with httpx
            await asyncio.wait_for(stream_lines(url, msgspec.json.encode(body), events.line, on_head=events.head),
                                   args.timeout)
        else:
            async with client.stream("POST", url, json=body) as r:
                events.status = r.status_code
                lines = LineSplitter()
                async for data in r.aiter_bytes():
                    if any(events.line(line) for line in lines.feed(data)):
                        break
                else:
                    if tail := lines.rest():
                        events.line(tail)
    # ValueError: a bad Content-Length, undecodable JSON (msgspec).
    except (httpx.HTTPError, OSError, EOFError, asyncio.TimeoutError, ProtocolError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    events.finish()
    if out.error:
        return out
    out.e2e = time.perf_counter() - start
    out.ok = out.output_tokens > 0
    if not out.ok:
        out.error = "no text received"
    return out


_decode_event = msgspec.json.Decoder(dict).decode


class _EventReader:
    """Times the text chunks of an OpenAI SSE stream into `out`, one body line at a time (TTFT,
    ITL, output tokens: the usage figure when the server sends one, else the number of text
    chunks). A non-200 answer's body becomes the error."""

    def __init__(self, chat: bool, out: Outcome, start: float) -> None:
        self.chat, self.out = chat, out
        self.clock = _TextClock(out, start)
        self.status = 200
        self.usage_tokens = 0
        self.error_body: list[bytes] = []

    def head(self, head: Head) -> None:
        self.status = head.status

    def line(self, line: bytes) -> bool:
        """True once the stream is over ([DONE] or an error event)."""
        if self.status != 200:
            self.error_body.append(line)
            return False
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        msg = _decode_event(data)
        if "error" in msg:
            self.out.error = str(msg["error"])[:200]
            return True
        if msg.get("usage"):
            self.usage_tokens = msg["usage"].get("completion_tokens", 0) or self.usage_tokens
        for choice in msg.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                self.clock.tick()
        return False

    def finish(self) -> None:
        if self.status != 200:
            text = b"\n".join(self.error_body).decode(errors="replace")
            self.out.error = f"HTTP {self.status}: {text[:200]}"
        elif not self.out.error and self.clock.chunks:
            self.out.output_tokens = self.usage_tokens or self.clock.chunks


class _TextClock:
    """TTFT and the inter-token gaps of one request, from the arrival of each text chunk."""

    def __init__(self, out: Outcome, start: float) -> None:
        self.out, self.start, self.last, self.chunks = out, start, start, 0

    def tick(self) -> None:
        now = time.perf_counter()
        if self.chunks == 0:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        self.chunks += 1


async def _ws_one(args: argparse.Namespace, p: Prompt, rid: int) -> Outcome:
    import websockets

    url = args.base_url.replace("http", "ws", 1) + "/v1/ws"
    out = Outcome(ok=False, input_len=p.input_len)
    frame: dict[str, Any] = {"type": "completion", "id": f"b{rid}", "prompt": p.prompt,
                             "max_tokens": p.output_len, "temperature": args.temperature}
    if args.ignore_eos:
        frame["ignore_eos"] = True
    clock = _TextClock(out, time.perf_counter())
    try:
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps(frame))
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "delta" and msg.get("text"):
                    clock.tick()
                elif msg["type"] == "done":
                    out.output_tokens = msg.get("usage", {}).get("completion_tokens", clock.chunks)
                    break
                elif msg["type"] == "error":
                    out.error = str(msg.get("error"))[:200]
                    return out
    except (OSError, websockets.WebSocketException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e = time.perf_counter() - clock.start
    out.ok = clock.chunks > 0
    return out


async def run_benchmark(args: argparse.Namespace, dataset: list[Prompt] | None = None) -> dict[str, Any]:
    """`dataset`: the prompts to send, warm-up ones first (default: make_dataset(args))."""
    from tqdm import tqdm

    prompts = make_dataset(args) if dataset is None else dataset
    warm, prompts = prompts[: args.warmup], prompts[args.warmup:]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        if not args.model:
            args.model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

        async def one(i: int, p: Prompt) -> Outcome:
            async with sem:
                return await (_ws_one(args, p, i) if args.backend == "rill-ws" else _http_one(client, args, p))

        if warm:
            await asyncio.gather(*(one(-1 - i, p) for i, p in enumerate(warm)))
        rng = random.Random(args.seed + 1)
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.quiet)
        tasks = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(i, p)))
            tasks[-1].add_done_callback(lambda _t: bar.update())
            if args.request_rate != float("inf") and i < len(prompts) - 1:
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(args, outcomes, duration)


def _stats(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    return {"mean": statistics.mean(s) * scale, "median": statistics.median(s) * scale,
            "p99": s[min(len(s) - 1, int(0.99 * (len(s) - 1) + 0.5))] * scale}


def summarize(args: argparse.Namespace, outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.input_len for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    return {
        "label": args.label or urlsplit(args.base_url).netloc or args.base_url,
        "backend": args.backend, "base_url": args.base_url, "model": args.model, "dataset": args.dataset,
        "num_prompts": len(outcomes), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration, "total_token_throughput": (out_tokens + in_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _stats([o.ttft for o in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for o in ok for g in o.itl]), "e2e_ms": _stats([o.e2e for o in ok]),
        "outcomes": [asdict(o) | {"itl": None} for o in outcomes] if args.save_detailed else None,
    }


def print_result(r: dict[str, Any]) -> None:
    line = "=" * 50
    print(f"{line}\n{' Serving Benchmark Result ':=^50}\n{line}")
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
            ("Benchmark duration (s):", f"{r['duration_s']:.2f}"),
            ("Total input tokens:", r["total_input_tokens"]), ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for name, key in (("Time to First Token", "ttft_ms"), ("Time per Output Token (excl. 1st token)", "tpot_ms"),
                      ("Inter-token Latency", "itl_ms"), ("End-to-end Latency", "e2e_ms")):
        print(f"{name:-^50}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            print(f"{(stat.capitalize() if stat != 'p99' else 'P99') + ' ' + short + ' (ms):':<40}{r[key][stat]:>10.2f}")
    print(line)
    for err in r["errors"]:
        print(f"error: {err}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--backend", default="openai-completions", choices=["openai-completions", "openai-chat", "rill-ws"])
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--dataset", default="random", choices=["random", "chat"],
                   help="random: token-id prompts of exact length; chat: generated English text")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len-range", default="", help="MIN:MAX, overrides --input-len")
    p.add_argument("--output-len-range", default="", help="MIN:MAX, overrides --output-len")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent and discarded before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")
    p.add_argument("--label", default=None,
                   help="the system's name in the saved result, for scripts/plot_bench.py (default: the URL's host:port)")
    p.add_argument("--save-detailed", action="store_true", help="include every request in the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> dict[str, Any]:
    result = asyncio.run(run_benchmark(args))
    print_result(result)
    if args.save_result:
        save_result(result, args.save_result)
    return result


def save_result(result: dict[str, Any], path: str) -> None:
    """The --save-result file (read back by scripts/plot_bench.py): the result, unset fields left out."""
    with open(path, "w") as f:
        json.dump({k: v for k, v in result.items() if v is not None}, f, indent=2)
