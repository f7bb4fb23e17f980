#!/usr/bin/env python3
"""Inter-token latency of running streams when a long prompt arrives, with and without chunked
prefill, on the same model and requests.

Eight streams decode; a long prompt (default 4096 tokens) arrives. Without chunking the whole
prompt runs in one step and every stream stalls for it; with a step budget it is spread over
steps that each still carry every decode. `--budget` lists the budgets to compare: numbers, and
`measured` for the one a worker measures on this machine (services/worker/step_budget.py; 512 was
the fixed CPU default before it), run twice: chunks of the whole budget, and chunks shortened
deep in the prompt by the measured context cost, as `rill serve` runs them.

    .venv/bin/python scripts/bench_chunked_prefill.py [MODEL] [--prompt 4096] [--budget 512,measured]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _inproc_engine import Engine, percentile  # noqa: E402

from rill.services.worker import step_budget  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared import envs  # noqa: E402
from rill.shared.config import StepCost  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402


def run(runner: ModelRunner, budget: int, prompt: int, streams: int, out_tokens: int,
        step_cost: StepCost | None = None) -> dict[str, float]:
    runner.reset()
    engine = Engine(runner, budget=budget, caching=False, step_cost=step_cost)
    for i in range(streams):
        engine.submit(f"s{i}", [100 + i, 200, 300, 400, 500 + i], max_tokens=out_tokens)
    for _ in range(5):  # streams are decoding
        engine.step()
    engine.submit("long", [(7 * i) % 40000 + 50 for i in range(prompt)], max_tokens=1)
    engine.drain()
    gaps = [g * 1e3 for i in range(streams) for g in engine.timeline.gaps(f"s{i}")]
    return {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99), "max": max(gaps),
            "long_ttft": engine.timeline.ttft("long") * 1e3, "max_step": max(engine.timeline.step_tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--budget", default="512,measured", help="comma-separated: token counts, `measured`")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    runner = ModelRunner(model_dir, dtype=args.dtype, num_blocks=(args.prompt + 2048) // 16 + 64, block_size=16,
                         max_model_len=args.prompt + 1024)
    runner.warmup()
    budgets: list[tuple[str, int, StepCost | None]] = [("off (whole prompt)", args.prompt + 1024, None)]
    for b in args.budget.split(","):
        if b.strip() == "measured":
            target_s = envs.RILL_CPU_STEP_TARGET_MS / 1e3
            times, n, cost = step_budget.measure_budget(runner, target_s)
            print("measured: " + ", ".join(f"{k} -> {t * 1e3:.0f} ms" for k, t in times.items()) + f" => {n}; {cost}")
            budgets += [(f"measured ({n})", n, None), (f"measured ({n}) + ctx", n, cost)]
        else:
            budgets.append((f"budget {int(b)}", int(b), None))
    rows = []
    for label, budget, cost in budgets:
        print(f"running: {label} ...", flush=True)
        rows.append((label, run(runner, budget, args.prompt, args.streams, args.out_tokens, cost)))
    print(f"\n{args.streams} decoding streams, a {args.prompt}-token prompt arrives ({runner.dtype})")
    print(f"{'step budget':>20} | {'ITL p50 ms':>10} | {'ITL p99 ms':>10} | {'ITL max ms':>10} | "
          f"{'long TTFT ms':>12} | {'max step tok':>12}")
    print("-" * 90)
    for label, r in rows:
        print(f"{label:>20} | {r['p50']:>10.1f} | {r['p99']:>10.1f} | {r['max']:>10.1f} | "
              f"{r['long_ttft']:>12.1f} | {r['max_step']:>12}")
    for label, r in rows[1:]:
        print(f"ITL p99 off / {label}: {rows[0][1]['p99'] / r['p99']:.2f}x")


if __name__ == "__main__":
    main()
