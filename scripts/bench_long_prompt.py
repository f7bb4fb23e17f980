#!/usr/bin/env python3
"""A lone long prompt (the RAG case): Rill's time to first token against one transformers forward.

For each prompt length (default 1024 / 4096 / 7900 tokens of random ids), in turns: `rill serve`
answers `/v1/completions` with `max_tokens` 1 (the whole request, over HTTP, as a client sees it),
and transformers runs one forward of the same ids in this process (same dtype, same threads).
Each side runs --turns times per length, alternating, and the best of each is compared, so a
drifting VM slows both alike. Prefix caching is off: no turn reuses another's KV.

    .venv/bin/python scripts/bench_long_prompt.py [model] [--lengths 1024,4096,7900] [--dtype auto]
                                                  [--turns 2] [--max-num-batched-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `rill service worker` sets it
import torch  # noqa: E402

from rill.kernels import chooser  # noqa: E402
from rill.services.worker.dtype_choice import resolve_dtype  # noqa: E402
from rill.shared.broker import free_port  # noqa: E402
from rill.shared.config import ModelConfig  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def rill_ttft(port: int, ids: list[int]) -> float:
    body = json.dumps({"model": served_model(port), "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.loads(resp.read())
    took = time.perf_counter() - t
    if reply["usage"]["prompt_tokens"] != len(ids):
        raise RuntimeError(f"served {reply['usage']['prompt_tokens']} prompt tokens, sent {len(ids)}")
    return took


def hf_forward(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        model(x, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("--lengths", default="1024,4096,7900")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Rill's step budget (default Rill's)")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    model_dir = str(resolve_model(args.model))
    cfg = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(args.dtype, "cpu")
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) >= cfg.max_position_embeddings:
        raise SystemExit(f"lengths must stay below the model's {cfg.max_position_embeddings} positions")
    print(f"{chooser.cpu_model()}, {torch.get_num_threads()} threads, dtype {dtype}, torch {torch.__version__}",
          flush=True)
    port = free_port()
    cmd = [sys.executable, "-m", "rill.services.cli", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", dtype, "--no-enable-prefix-caching", "--max-num-seqs", "8"]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline() if server.stdout else ""
        if "ready at" not in line:
            raise RuntimeError(f"rill serve did not start: {line!r}")
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        rng = random.Random(0)
        warm = [rng.randint(1000, 20000) for _ in range(64)]
        rill_ttft(port, warm)
        hf_forward(hf, warm)
        print(f"{'prompt tokens':>13} | {'Rill TTFT s':>11} | {'HF forward s':>12} | {'Rill / HF':>9}", flush=True)
        for n in lengths:
            best = {"rill": float("inf"), "hf": float("inf")}
            for turn in range(args.turns):
                ids = [rng.randint(1000, 20000) for _ in range(n)]  # fresh ids each turn
                order = ("rill", "hf") if turn % 2 == 0 else ("hf", "rill")
                for side in order:
                    took = rill_ttft(port, ids) if side == "rill" else hf_forward(hf, ids)
                    best[side] = min(best[side], took)
            print(f"{n:>13} | {best['rill']:>11.2f} | {best['hf']:>12.2f} | {best['rill'] / best['hf']:>8.2f}x",
                  flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
