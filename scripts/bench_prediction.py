#!/usr/bin/env python3
"""Predicted outputs (`prediction`) against none, in one run of one `rill serve`: a greedy chat
reply, then the same request with predictions of three qualities: the reply itself, the reply
with one word in 15 changed (an edit), and unrelated text. Prints per kind the median latency
over --turns alternating turns, its ratio to none, the prediction tokens accepted and rejected,
whether the text equals the reply, and the CPU.

    .venv/bin/python scripts/bench_prediction.py [MODEL] [--max-tokens 200] [--turns 3] [-- SERVE ARGS]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from _serve import serving  # noqa: E402

from rill.kernels import chooser  # noqa: E402
from rill.kernels.native_build import cpu_flags  # noqa: E402

ASK = "Describe how a lighthouse works, in detail."
UNRELATED = "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n" * 8


def edited(text: str) -> str:
    return " ".join(w if i % 15 != 7 else "banana" for i, w in enumerate(text.split(" ")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--port", type=int, default=8123)
    own = sys.argv[1:]
    cut = own.index("--") if "--" in own else len(own)  # what follows "--" is the server's, MODEL or not
    args, serve_args = ap.parse_args(own[:cut]), own[cut + 1:]
    argv = [sys.executable, "-m", "rill.services.cli", "serve", *([args.model] if args.model else []),
            "--port", str(args.port), *serve_args]
    with serving(argv, args.port) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": ASK}]

        def ask(prediction: str | None) -> tuple[float, openai.types.chat.ChatCompletion]:
            extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
            t0 = time.perf_counter()
            resp = client.chat.completions.create(model=model, messages=msgs, temperature=0,
                                                  max_tokens=args.max_tokens, **extra)
            return time.perf_counter() - t0, resp

        ask(None)  # the prompt's blocks cached: every turn below starts alike
        reply = ask(None)[1].choices[0].message.content or ""
        kinds = {"none": None, "the reply": reply, "1 word in 15 changed": edited(reply), "unrelated": UNRELATED}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        last: dict[str, openai.types.chat.ChatCompletion] = {}
        for _ in range(args.turns):
            for kind, prediction in kinds.items():
                seconds, last[kind] = ask(prediction)
                times[kind].append(seconds)
    base = statistics.median(times["none"])
    print(f"\n{'prediction':>22} | {'median s':>8} | {'vs none':>7} | {'accepted':>8} | {'rejected':>8} | same text")
    print("-" * 78)
    for kind in kinds:
        details = last[kind].usage.completion_tokens_details
        accepted, rejected = (details.accepted_prediction_tokens, details.rejected_prediction_tokens) \
            if details and details.accepted_prediction_tokens is not None else (0, 0)
        med = statistics.median(times[kind])
        print(f"{kind:>22} | {med:>8.2f} | {base / med:>6.2f}x | {accepted:>8} | {rejected:>8} | "
              f"{last[kind].choices[0].message.content == reply}")
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in cpu_flags().split())
    print(f"\n{last['none'].usage.completion_tokens} output tokens; CPU {chooser.cpu_model()} [{flags}]")


if __name__ == "__main__":
    main()
