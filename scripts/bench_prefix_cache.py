#!/usr/bin/env python3
"""TTFT with and without automatic prefix caching, on the same model and requests.

Requests share a long system prompt (default ~1000 tokens) and differ in the user turn; they
arrive one after another, as a chat app's users would. With caching, every request after the
first computes only its own tokens.

    .venv/bin/python scripts/bench_prefix_cache.py [MODEL] [--requests 8] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _inproc_engine import Engine  # noqa: E402

from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-chars", type=int, default=5000)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model_dir = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    system = ("You are a careful assistant for a shipping company. Answer briefly and politely. "
              * 200)[: args.system_chars]
    prompts = []
    for i in range(args.requests):
        out = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": f"Question {i}: where is parcel {1000 + i}?"}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    print(f"model {model_dir}\n{args.requests} requests, prompt ~{len(prompts[0])} tokens each, "
          f"shared system prompt", flush=True)
    runner = ModelRunner(model_dir, dtype=args.dtype, num_blocks=2048, block_size=16)
    runner.warmup()
    results = {}
    for caching in (False, True):
        runner.reset()
        engine = Engine(runner, budget=4096, caching=caching)
        for i, ids in enumerate(prompts):  # one after another: each sees the previous one's cache
            engine.submit(f"r{i}", ids, max_tokens=1)
            engine.drain()
        ttfts = [engine.timeline.ttft(f"r{i}") * 1e3 for i in range(1, len(prompts))]
        results[caching] = (statistics.median(ttfts), engine.sched.kv.hits, engine.sched.kv.queries)
        print(f"  prefix caching {'on ' if caching else 'off'}: median TTFT {results[caching][0]:.1f} ms", flush=True)
    off, on = results[False][0], results[True][0]
    print(f"\n{'prefix caching':>15} | {'median TTFT ms':>14} | {'hit tokens':>10} | {'queried':>8}")
    print("-" * 58)
    for caching in (False, True):
        t, hits, queries = results[caching]
        print(f"{'on' if caching else 'off':>15} | {t:>14.1f} | {hits:>10} | {queries:>8}")
    print(f"\nTTFT ratio off/on: {off / on:.2f}x (requests 2..{len(prompts)}, dtype {runner.dtype})")


if __name__ == "__main__":
    main()
