#!/usr/bin/env python3
"""Structured outputs' cost: decode step time (TPOT) at N streams with every row under a JSON
schema against the same rows unconstrained, measured in the same run on the worker's model
runner, plus each test schema's compile time.

Both runs decode the same number of steps for every row (a row whose grammar completed keeps
sampling EOS, as the scheduler's plan-ahead can make it), so the batches match; the rows sample
at temperature 1. Prints the CPU it ran on beside the figures.

    .venv/bin/python scripts/bench_structured.py [--streams 32] [--steps 48] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# The schemas of tests/test_structured_outputs.py, and one whose strings run long.
from test_structured_outputs import SCHEMAS  # noqa: E402

from rill.kernels.chooser import cpu_model  # noqa: E402
from rill.services.gateway.structured import _from_json  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402
from rill.shared.model_files import resolve_model  # noqa: E402
from rill.shared.schema import NewRequestData, SamplingParams, StepPlan  # noqa: E402

LONG = {"type": "object", "required": ["lines"], "additionalProperties": False,
        "properties": {"lines": {"type": "array", "minItems": 40, "items": {"type": "string"}}}}


def cpu_flags() -> str:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f" {f}" in flags) or "none of avx2/avx512/amx"


def compile_times(runner: ModelRunner) -> None:
    import llguidance

    runner.grammars._tok()  # the one-time tokenizer tables, not a schema's cost
    print("schema compile (gateway grammar + validate, worker matcher + first mask), ms:")
    for name, schema in {**SCHEMAS, "long": LONG}.items():
        t0 = time.perf_counter()
        grammar = _from_json(schema, name)
        why = llguidance.LLMatcher.validate_grammar(grammar)
        t1 = time.perf_counter()
        m = runner.grammars.matcher(grammar)
        runner.grammars.bitmask([m])
        t2 = time.perf_counter()
        runner.grammars.bitmask([runner.grammars.matcher(grammar)])
        t3 = time.perf_counter()
        assert not why, why
        print(f"  {name:7s} gateway {1e3 * (t1 - t0):6.2f}  worker cold {1e3 * (t2 - t1):6.2f}  "
              f"worker cached {1e3 * (t3 - t2):6.2f}")


def decode(runner: ModelRunner, streams: int, steps: int, grammar: str | None, prompt: list[int]) -> list[float]:
    """Per-step seconds of `steps` decode steps over `streams` rows (after their prefill)."""
    per_req = -(-(len(prompt) + steps + 1) // runner.block_size)
    ids = [f"r{i}" for i in range(streams)]
    new = [NewRequestData(request_id=rid, token_ids=prompt, params=SamplingParams(temperature=1.0, seed=i,
                                                                                   grammar=grammar),
                          block_ids=list(range(i * per_req, (i + 1) * per_req))) for i, rid in enumerate(ids)]
    plan = StepPlan(step_id=0, new_requests=new, cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=ids, num_scheduled_tokens=[len(prompt)] * streams)
    res = runner.execute(plan)
    assert res.error is None and not res.errors, (res.error, res.errors)
    times = []
    for step in range(steps):
        plan = StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                        scheduled_request_ids=ids, num_scheduled_tokens=[1] * streams)
        t0 = time.perf_counter()
        res = runner.execute(plan)
        times.append(time.perf_counter() - t0)
        assert res.error is None and not res.errors, (res.error, res.errors)
    runner.execute(StepPlan(step_id=-1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                            scheduled_request_ids=[], num_scheduled_tokens=[], finished_request_ids=ids))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each (the medians count)")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    print(f"cpu: {cpu_model()} ({torch.get_num_threads()} threads; {cpu_flags()})")
    per_req = -(-(32 + args.steps + 1) // 16)
    runner = ModelRunner(model, dtype="auto", device="cpu", num_blocks=per_req * args.streams, block_size=16)
    print(f"model: {Path(model).name} dtype {runner.dtype}; {args.streams} streams x {args.steps} decode steps")
    compile_times(runner)
    prompt = list(range(100, 132))
    grammar = _from_json(LONG, "long")
    decode(runner, args.streams, 4, None, prompt)  # warm both paths
    decode(runner, args.streams, 4, grammar, prompt)
    free: list[float] = []
    constrained: list[float] = []
    for _ in range(args.rounds):  # alternate, so drift in the machine hits both alike
        free += decode(runner, args.streams, args.steps, None, prompt)
        constrained += decode(runner, args.streams, args.steps, grammar, prompt)
    f, c = statistics.median(free), statistics.median(constrained)
    print(f"decode step (TPOT), median of {len(free)}: unconstrained {1e3 * f:.2f} ms, every row under a JSON "
          f"schema {1e3 * c:.2f} ms: {c / f:.3f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
