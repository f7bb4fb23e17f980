#!/usr/bin/env python3
"""--quantization none vs int8 on SmolLM2 through ModelRunner, both measured in the same run.

Speed: median decode step time at batch 32 with contexts spread over 20-430 tokens, and the time
of one 512-token prefill step, in the model dtype (default bfloat16) with and without W8A8 int8
linear layers. The two runners alternate rep by rep so that load from other processes hits both.
Quality: teacher-forced over the chat prompts of tests/test_quantization.py against the fp32
model: top-1 next-token agreement and mean |logprob difference| of fp32's argmax token, for int8
with the default SmoothQuant alphas, without smoothing, and with each --alphas spec (the syntax of
RILL_SMOOTHQUANT_ALPHA: "0.6" or "qkv=0.7,down=0.4").

    .venv/bin/python scripts/bench_quant.py [MODEL] [--dtype bfloat16] [--batch 32] [--reps 5]
        [--skip-speed] [--skip-quality] [--alphas SPEC ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quantization import chat_ids, quality  # noqa: E402

from rill.services.worker import smoothquant  # noqa: E402
from rill.services.worker.llama import TORCH_DTYPES, LlamaModel  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402
from rill.shared.request_params import SamplingParams  # noqa: E402
from rill.shared.schema import NewRequestData, StepPlan  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BLOCK = 16


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(1000, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class DecodeBatch:
    """`batch` requests with contexts spread evenly over [lo, hi], prefilled, then decoded a step at a time."""

    def __init__(self, runner: ModelRunner, batch: int, lo: int, hi: int, room: int) -> None:
        self.runner = runner
        self.ids = [f"d{i}" for i in range(batch)]
        lens = [lo + (hi - lo) * i // max(1, batch - 1) for i in range(batch)]
        per = -(-(hi + room) // BLOCK)
        news = [NewRequestData(rid, tokens(i, n), GREEDY, list(range(i * per, (i + 1) * per)))
                for i, (rid, n) in enumerate(zip(self.ids, lens, strict=True))]
        self.step_id = 0
        for c in range(0, batch, 8):  # prefill in a few steps of a few thousand tokens
            part = news[c:c + 8]
            self._run(StepPlan(step_id=self._next(), new_requests=part, cached_request_ids=[],
                               cached_new_block_ids=[], scheduled_request_ids=[n.request_id for n in part],
                               num_scheduled_tokens=[len(n.token_ids) for n in part]))
        self.blocks_used = batch * per

    def _next(self) -> int:
        self.step_id += 1
        return self.step_id

    def _run(self, plan: StepPlan) -> float:
        res = self.runner.execute(plan)
        if res.error:
            raise RuntimeError(res.error)
        return res.forward_ms

    def step(self) -> float:
        n = len(self.ids)
        return self._run(StepPlan(step_id=self._next(), new_requests=[], cached_request_ids=self.ids,
                                  cached_new_block_ids=[[] for _ in self.ids], scheduled_request_ids=self.ids,
                                  num_scheduled_tokens=[1] * n))


def prefill_ms(runner: ModelRunner, first_block: int, n: int, seed: int) -> float:
    """One step that runs a fresh n-token prompt (and samples its first token); forgotten after."""
    rid = f"p{seed}"
    plan = StepPlan(step_id=-seed, new_requests=[NewRequestData(rid, tokens(10_000 + seed, n), GREEDY,
                                                                list(range(first_block, first_block + -(-n // BLOCK))))],
                    cached_request_ids=[], cached_new_block_ids=[], scheduled_request_ids=[rid],
                    num_scheduled_tokens=[n])
    res = runner.execute(plan)
    if res.error:
        raise RuntimeError(res.error)
    runner.execute(StepPlan(step_id=-seed, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                            scheduled_request_ids=[], num_scheduled_tokens=[], finished_request_ids=[rid]))
    return res.forward_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", default="20:430", help="decode contexts, spread evenly over LO:HI tokens")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--reps", type=int, default=5, help="alternating rounds per variant")
    p.add_argument("--steps", type=int, default=6, help="decode steps timed per round")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--alphas", nargs="*", default=[], help="extra SmoothQuant alpha specs to measure quality for")
    args = p.parse_args()

    model_dir = str(resolve_model(args.model))
    if not args.skip_speed:
        speed(model_dir, args)
    if not args.skip_quality:
        quality_table(model_dir, args.dtype, args.alphas)


def speed(model_dir: str, args: argparse.Namespace) -> None:
    lo, hi = (int(x) for x in args.context.split(":"))
    room = args.reps * (args.steps + 1) + 4
    variants = ("none", "int8")
    runners, batches = {}, {}
    for q in variants:
        t0 = time.perf_counter()
        r = ModelRunner(model_dir, dtype=args.dtype, device="cpu", num_blocks=1, block_size=BLOCK, quantization=q)
        load_s = time.perf_counter() - t0
        per = -(-(hi + room) // BLOCK)
        r.resize_kv_cache(args.batch * per + -(-args.prefill // BLOCK))
        r.warmup()
        runners[q], batches[q] = r, DecodeBatch(r, args.batch, lo, hi, room)
        print(f"loaded {q}: {load_s:.1f} s", flush=True)
    load_before = os.getloadavg()
    decode: dict[str, list[float]] = {q: [] for q in variants}
    prefill: dict[str, list[float]] = {q: [] for q in variants}
    for rep in range(args.reps):
        for q in variants:
            b = batches[q]
            b.step()  # the first step after switching runners warms caches; not timed
            decode[q] += [b.step() for _ in range(args.steps)]
            prefill[q].append(prefill_ms(runners[q], b.blocks_used, args.prefill, rep + 1))
    load_after = os.getloadavg()

    print(f"\nSmolLM2, {args.dtype}, {torch.get_num_threads()} threads; load average (1 min) "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{'quantization':<13} | {f'decode ms/step (batch {args.batch}, ctx {lo}-{hi})':>38} | "
          f"{'tok/s':>7} | {f'prefill {args.prefill} ms':>13}")
    print("-" * 82)
    for q in variants:
        d, pf = statistics.median(decode[q]), statistics.median(prefill[q])
        print(f"{q:<13} | {d:>38.1f} | {args.batch / d * 1e3:>7.0f} | {pf:>13.1f}")
    dn, di = statistics.median(decode["none"]), statistics.median(decode["int8"])
    pn, pi = statistics.median(prefill["none"]), statistics.median(prefill["int8"])
    print(f"int8 speed-up: decode {dn / di:.2f}x, prefill {pn / pi:.2f}x")



def quality_table(model_dir: str, dtype: str, alpha_specs: list[str]) -> None:
    seqs = chat_ids(model_dir)
    ref = LlamaModel.load(model_dir, torch.float32)
    print(f"\nquality vs fp32, teacher-forced over {sum(map(len, seqs))} chat positions")
    print(f"{'model':<32} | {'top-1 agreement':>15} | {'mean |d logprob|':>16}")
    print("-" * 70)
    # (label, quantization, SmoothQuant alphas: None = the default)
    variants: list[tuple[str, str, float | dict[str, float] | None]] = [
        ("", "none", None), ("+int8", "int8", None), ("+int8 unsmoothed", "int8", 0.0)]
    variants += [(f"+int8 alpha {spec}", "int8", smoothquant.parse_alphas(spec)) for spec in alpha_specs]
    for dt in dict.fromkeys(("float32", dtype)):
        for label, q, alpha in variants:
            if dt == "float32" and q == "none":
                continue  # the reference itself
            model = LlamaModel.load(model_dir, TORCH_DTYPES[dt], quantization=q, smoothquant_alpha=alpha)
            agree, diff, _ = quality(ref, model, seqs)
            print(f"{dt + label:<32} | {agree:>15.3f} | {diff:>16.3f}")


if __name__ == "__main__":
    main()
