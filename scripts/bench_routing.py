#!/usr/bin/env python3
"""Data-parallel routing on multi-turn chats: least-loaded against cache-aware, same run.

Starts `rill serve --data-parallel-size ENGINES --routing POLICY` (2 engines by default) once per policy (a fresh server
each time, so every run starts with empty caches) and plays the same workload: CONVERSATIONS
chats of TURNS turns, each opening with one of SYSTEMS long system prompts (and, with
--doc-words, a document of its own in the first user message); the chats run concurrently, the
turns of one chat in order, each turn appending the assistant's reply and a new user message (a
pasted passage and a question). Streamed greedy requests, MAX_TOKENS each.

Reported per policy: the prefix-cache hit rate (prompt tokens whose KV was reused over prompt
tokens looked up, summed over the engines' EngineStats, after minus before the workload; a
preempted request looking up again is counted apart, as vLLM does) beside its ceiling for the
same prompts (every full block an earlier turn left cached, its prompt and reply, reused as one
unbounded cache would; the prompts tokenized by the server's /tokenize) and its ceiling as routed
(one unbounded cache per engine, each prompt finding what its own engine was sent before: what the
policy's choices allow, whatever the cache size); how often a chat's turn ran on the engine of its
previous turn (the x-rill-engine response header, which gives both); TTFT p50/p99 at the client;
the prompt tokens the engines computed (preempted requests' recomputation included); tokens/s
(MAX_TOKENS a request: an upper bound if a reply ends early) and requests/s over the workload's
wall time; and how the requests split over the engines. Then cache-aware against each other
policy: the ratios, and the hit rate a 2x ratio would need beside what that policy's own routing
allowed (its ceiling as routed) and its caches kept.

    .venv/bin/python scripts/bench_routing.py [MODEL] [--conversations 8] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _serve import engine_stats, serving  # noqa: E402

from rill.shared.broker import free_port  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402

WORDS = ("river stone market signal harbor winter lantern copper meadow engine orbit thread canyon ledger "
         "falcon garden mirror quiet silver tunnel velvet willow anchor basket candle desert ember forest "
         "glacier hollow island jungle kettle ladder marble needle ocean pepper quarry rocket saddle timber").split()


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {' '.join(isa)}{'' if 'amx_tile' in flags else ', no AMX'}"


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def turn(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]],
               max_tokens: int) -> tuple[float, str, int, int]:
    """One streamed chat turn: (TTFT seconds, the reply, the engine that served it, its tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, parts, generated = time.perf_counter(), None, [], max_tokens
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        engine = int(resp.headers.get("x-rill-engine", -1))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            if obj.get("usage"):
                generated = obj["usage"]["completion_tokens"]
            for choice in obj["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(piece)
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts), engine, generated


async def conversation(client: httpx.AsyncClient, model: str, c: int, args: argparse.Namespace, systems: list[str],
                       ttfts: list[float], prompts: dict[tuple[int, int], list[dict[str, str]]],
                       engines: list[int], generated: dict[tuple[int, int], int]) -> int:
    rng = random.Random(1000 + c)
    messages = [{"role": "system", "content": systems[c % len(systems)]}]
    tokens = 0
    for t in range(args.turns):
        if t and args.think_time > 0:  # the user reads the reply and types the next message
            await asyncio.sleep(rng.expovariate(1 / args.think_time))
        doc = f"My document: {text(rng, args.doc_words)}.\n\n" if t == 0 and args.doc_words else ""
        words = rng.randint(*args.user_words_range) if args.user_words_range else args.user_words
        messages.append({"role": "user", "content": f"{doc}Passage {t}: {text(rng, words)}. "
                                                     f"What does passage {t} say about the {rng.choice(WORDS)}?"})
        prompts[(t, c)] = list(messages)
        ttft, reply, engine, generated[(t, c)] = await turn(client, model, messages, args.max_tokens)
        ttfts.append(ttft)
        engines.append(engine)
        messages.append({"role": "assistant", "content": reply})
        tokens += args.max_tokens
    return tokens


def reused(p: list[int], cached: list[list[int]], block_size: int) -> int:
    """Tokens of prompt p a cache holding `cached` serves: the full blocks of its longest common
    prefix with one of them, all but p's last token."""
    common = max((next((i for i, (a, b) in enumerate(zip(p, q, strict=False)) if a != b), min(len(p), len(q)))
                  for q in cached), default=0)
    return min(common, len(p) - 1) // block_size * block_size


async def ceilings(client: httpx.AsyncClient, prompts: dict[tuple[int, int], list[dict[str, str]]],
                   block_size: int, engine_of: dict[tuple[int, int], int],
                   generated: dict[tuple[int, int], int]) -> tuple[float, float]:
    """The hit rate of one unbounded prefix cache over these prompts, turn by turn (`reused`: the
    scheduler's rule, kv_cache_manager.lookup), each turn leaving its prompt and all but the last of
    its reply's tokens cached (the reply read from the chat's next prompt); and the same with one
    unbounded cache per engine, each prompt looking in its own engine's (what this run's routing
    allows, whatever the caches)."""
    ids = {}
    for key, messages in sorted(prompts.items()):
        resp = await client.post("/v1/tokenize", json={"messages": messages})
        resp.raise_for_status()
        ids[key] = resp.json()["tokens"]
    seen: list[tuple[int, list[int]]] = []  # (engine, cached sequence) in the order sent
    hits = routed = total = 0
    for (t, c) in sorted(ids):
        p, engine = ids[(t, c)], engine_of[(t, c)]
        hits += reused(p, [q for _, q in seen], block_size)
        routed += reused(p, [q for e, q in seen if e == engine], block_size)
        total += len(p)
        after = ids.get((t + 1, c))  # this turn's reply as the chat's next prompt renders it
        seen.append((engine, after[:len(p) + generated[(t, c)] - 1] if after else p))
    return hits / max(1, total), routed / max(1, total)


async def workload(base: str, args: argparse.Namespace
                   ) -> tuple[list[float], float, list[dict[str, Any]], float, float, float]:
    """TTFTs, wall seconds, the engines' stats after the warm-up (before the chats), the ceiling
    of the hit rate for the prompts sent, that ceiling under this run's routing (the gateway's
    x-rill-engine header), and how often a chat's turn ran where its previous one did."""
    rng = random.Random(7)
    systems = [f"You are assistant {i}. Rules: {text(rng, args.system_words)}." for i in range(args.systems)]
    ttfts: list[float] = []
    prompts: dict[tuple[int, int], list[dict[str, str]]] = {}  # (turn, chat) -> messages
    engines: list[list[int]] = [[] for _ in range(args.conversations)]  # each chat's, turn by turn
    generated: dict[tuple[int, int], int] = {}  # (turn, chat) -> reply tokens
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # Warm both engines with unrelated prompts (no shared prefix: spread by load).
        await asyncio.gather(*[turn(client, model, [{"role": "user", "content": text(random.Random(i), 20)}], 2)
                               for i in range(4)])
        await asyncio.sleep(0.6)  # their stats and summaries written
        before = engine_stats(base)
        start = time.perf_counter()
        await asyncio.gather(*[conversation(client, model, c, args, systems, ttfts, prompts, engines[c], generated)
                               for c in range(args.conversations)])
        wall = time.perf_counter() - start
        stays = [a == b for chat in engines for a, b in zip(chat, chat[1:], strict=False)]
        engine_of = {(t, c): chat[t] for c, chat in enumerate(engines) for t in range(len(chat))}
        best, routed = await ceilings(client, prompts, before[0]["block_size"], engine_of, generated)
        return ttfts, wall, before, best, routed, sum(stays) / max(1, len(stays))


def run_policy(model_dir: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "rill.services.cli", "serve", model_dir, "--port", str(port),
            "--data-parallel-size", str(args.engines), "--routing", policy, "--dtype", args.dtype,
            "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "4096", "--log-level", "WARNING"]
    argv += ["--chat-template", args.chat_template] if args.chat_template else []
    print(f"[{policy}] starting rill serve --data-parallel-size {args.engines} ...", flush=True)
    with serving(argv, port) as base:
        ttfts, wall, before, best, routed, stay = asyncio.run(workload(base, args))
        time.sleep(0.6)  # the engines' last stats writes
        after = engine_stats(base)
    diff = lambda key: sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before, strict=True))  # noqa: E731
    n = args.conversations * args.turns
    return {"policy": policy, "hit_rate": diff("prefix_cache_hits") / max(1, diff("prefix_cache_queries")),
            "ceiling": best, "routed": routed, "stay": stay,
            "prompt_tokens": diff("prefix_cache_queries"),
            "computed": diff("prefix_cache_queries") - diff("prefix_cache_hits")
            + diff("prefix_cache_preempted_queries") - diff("prefix_cache_preempted_hits"),
            "preemptions": diff("preemptions"), "ttft_p50": percentile(ttfts, 0.5) * 1e3,
            "ttft_p99": percentile(ttfts, 0.99) * 1e3, "tok_s": n * args.max_tokens / wall, "req_s": n / wall,
            "wall": wall, "split": "/".join(str(a.get("finished_requests", 0) - b.get("finished_requests", 0))
                              for a, b in zip(after, before, strict=True))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--systems", type=int, default=2, help="distinct system prompts, shared by the chats")
    p.add_argument("--system-words", type=int, default=300, help="about 1.3 tokens a word")
    p.add_argument("--user-words", type=int, default=80)
    p.add_argument("--user-words-range", type=lambda v: tuple(int(x) for x in v.split(":")), default=None,
                   metavar="MIN:MAX", help="words of each user turn drawn uniformly from MIN..MAX (overrides "
                   "--user-words): turns of equal length keep an engine's chats in step, their prompts arriving together")
    p.add_argument("--doc-words", type=int, default=0,
                   help="a document of its own opening each chat's first user turn (document chats); 0: none")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean seconds between a reply and the chat's next turn (exponential); 0: none")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="for a model without one (rill serve's flag)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per engine")
    p.add_argument("--policies", default="least-loaded,cache-aware")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every policy, interleaved (a shared machine is noisy); then medians")
    args = p.parse_args()
    model_dir = str(resolve_model(args.model))
    print(f"CPU: {cpu_line()}")
    turn_words = "-".join(map(str, args.user_words_range)) if args.user_words_range else f"~{args.user_words}"
    print(f"{args.conversations} chats x {args.turns} turns, {args.systems} system prompts of ~{args.system_words} "
          f"words, {f'a ~{args.doc_words}-word document a chat, ' if args.doc_words else ''}"
          f"user turns of {turn_words} words, max_tokens {args.max_tokens}, {args.engines} engines, "
          f"KV cache {args.kv_cache_memory} each", flush=True)
    policies = args.policies.split(",")
    rows = [run_policy(model_dir, policy, args) for _ in range(args.repeat) for policy in policies]
    if args.repeat > 1:
        keys = ("hit_rate", "ceiling", "routed", "stay", "prompt_tokens", "computed", "preemptions", "ttft_p50", "ttft_p99", "tok_s", "req_s")
        rows += [{"policy": f"{policy} (median)", "split": "-",
                  **{k: statistics.median(r[k] for r in rows if r["policy"] == policy) for k in keys}}
                 for policy in policies]
    print("\n| routing | prefix-cache hit rate | its ceiling | ceiling as routed | next turn on the same engine | prompt tokens | computed "
          "| preemptions | TTFT p50 ms | TTFT p99 ms | tok/s | req/s | requests per engine |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ceiling']:.1%} | {r['routed']:.1%} | {r['stay']:.0%} | {r['prompt_tokens']:.0f} | {r['computed']:.0f} | "
              f"{r['preemptions']:.0f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {r['split']} |")
    verdict(rows, policies)


def verdict(rows: list[dict[str, Any]], policies: list[str]) -> None:
    """Cache-aware against each other policy (medians if repeated), and what bounds the hit-rate
    ratio: the other policy's ceiling as routed is what its choices allow with unbounded caches,
    so a ratio r needs its caches to lose the rest down to the hit rate r times lower."""
    last = {r["policy"].removesuffix(" (median)"): r for r in rows}  # the medians come last
    if "cache-aware" not in last:
        return
    ca = last["cache-aware"]
    for policy in (p for p in policies if p != "cache-aware"):
        o = last[policy]
        print(f"\ncache-aware against {policy}: hit rate {ca['hit_rate'] / max(o['hit_rate'], 1e-9):.2f}x, "
              f"prompt tokens computed {o['computed'] / max(ca['computed'], 1):.2f}x fewer, TTFT p50 "
              f"{o['ttft_p50'] / ca['ttft_p50']:.2f}x and p99 {o['ttft_p99'] / ca['ttft_p99']:.2f}x lower, "
              f"tok/s {ca['tok_s'] / o['tok_s']:.2f}x. A 2x hit rate needs {policy} at {ca['hit_rate'] / 2:.1%}; "
              f"its own routing allowed {o['routed']:.1%} (ceiling as routed), its caches kept {o['hit_rate']:.1%}.")


if __name__ == "__main__":
    main()
