#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding, in one
run: the in-process engine (scheduler + model runner, no broker), greedy chat requests with the
model's EOS, on a repetitive prompt (rewrite a given code block) and a free-form one (a story).
Prints per prompt and stream count: output tok/s with and without and their ratio, time per
output token, the acceptance rate and mean accepted length, and the CPU.

    .venv/bin/python scripts/bench_speculative.py [MODEL] [--quantization auto] [--dtype bfloat16]
        [--speculative-config JSON] [--output-len 128] [--streams 1,8] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _inproc_engine import Engine  # noqa: E402

from rill.kernels import chooser  # noqa: E402
from rill.kernels.native_build import cpu_flags  # noqa: E402
from rill.services.scheduler.speculation import Speculator  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared.config import SpeculativeConfig, resolve_quantization  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402

CODE = '''def moving_average(values, window):
    """The mean of every `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages'''
PROMPTS = {
    "repetitive": f"Here is a Python function:\n\n{CODE}\n\nRewrite the whole function exactly as it is, "
                  "but rename `values` to `samples`.",
    "free-form": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def run(runner: ModelRunner, prompt: list[int], streams: int, output_len: int,
        config: SpeculativeConfig | None) -> dict[str, float]:
    speculator = Speculator(config) if config else None
    engine = Engine(runner, budget=2048, caching=True, max_seqs=max(streams, 1), speculator=speculator)
    rids = [f"s{i}" for i in range(streams)]
    start = time.perf_counter()
    for rid in rids:
        engine.submit(rid, prompt, output_len, ignore_eos=False)
    engine.drain()
    wall = time.perf_counter() - start
    times = engine.timeline.token_times
    produced = sum(len(times[r]) for r in rids)
    # Time per output token after the first, per request (accepted drafts arrive together).
    tpot = statistics.median((times[r][-1] - times[r][0]) / max(len(times[r]) - 1, 1) for r in rids)
    out = {"tok_s": produced / wall, "tpot": tpot}
    if speculator and speculator.num_draft_tokens:
        out["acceptance"] = speculator.num_accepted_tokens / speculator.num_draft_tokens
        out["mean_len"] = 1 + speculator.num_accepted_tokens / speculator.num_drafts
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--turns", type=int, default=3, help="runs of each setting, interleaved; medians reported")
    args = p.parse_args()
    model_dir = str(resolve_model(args.model))
    config = SpeculativeConfig.parse(args.speculative_config)
    quantization = resolve_quantization(args.quantization, model_dir, "cpu")
    streams = [int(s) for s in args.streams.split(",")]
    runner = ModelRunner(model_dir, dtype=args.dtype, quantization=quantization, num_blocks=4096)
    # A draft model runs beside the same target weights in a second runner.
    spec_runner = runner if config.method != "draft_model" else ModelRunner(
        model_dir, dtype=args.dtype, quantization=quantization, num_blocks=4096, model=runner.model,
        draft_model=str(resolve_model(config.model)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
                     if f in cpu_flags().split())
    print(f"# {Path(model_dir).name}, {args.dtype}, quantization {quantization}, output <= {args.output_len}, "
          f"{args.speculative_config}; CPU {chooser.cpu_model()} [{flags}]")
    run(spec_runner, [1, 2, 3, 4] * 8, 1, 8, config)  # warm-up
    print("| prompt | streams | tok/s plain | tok/s spec | ratio | TPOT p50 ms plain / spec | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|")
    for name, text in PROMPTS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for n in streams:
            got: dict[str, list[dict[str, float]]] = {"plain": [], "spec": []}
            for turn in range(args.turns):
                for mode in ("plain", "spec") if turn % 2 == 0 else ("spec", "plain"):
                    got[mode].append(run(spec_runner, ids, n, args.output_len, config) if mode == "spec"
                                     else run(runner, ids, n, args.output_len, None))
            tok_s = {m: statistics.median(r["tok_s"] for r in rows) for m, rows in got.items()}
            tpot = {m: statistics.median(r["tpot"] for r in rows) for m, rows in got.items()}
            acc = statistics.median(r.get("acceptance", 0.0) for r in got["spec"])
            mean_len = statistics.median(r.get("mean_len", 1.0) for r in got["spec"])
            print(f"| {name} | {n} | {tok_s['plain']:.1f} | {tok_s['spec']:.1f} | {tok_s['spec'] / tok_s['plain']:.2f}x | "
                  f"{tpot['plain'] * 1e3:.1f} / {tpot['spec'] * 1e3:.1f} | {acc:.2f} | {mean_len:.2f} |")


if __name__ == "__main__":
    main()
