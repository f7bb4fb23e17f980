#!/usr/bin/env python3
"""Structured outputs' cost: decode step time (TPOT) at N streams with every row under a JSON
schema against the same rows unconstrained, measured in the same run on the worker's model
runner, plus each test schema's compile time and the per-step mask cost of llguidance (what Rill
runs) against xgrammar (when installed).

Both runs decode the same number of steps for every row (a row whose grammar completed keeps
sampling EOS, as the scheduler's plan-ahead can make it), so the batches match; the rows sample
at temperature 1. Prints the CPU it ran on beside the figures.

    .venv/bin/python scripts/bench_structured.py [--streams 32] [--steps 48] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
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
from rill.shared.request_params import SamplingParams  # noqa: E402
from rill.shared.schema import NewRequestData, StepPlan  # noqa: E402

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


def compare_engines(runner: ModelRunner, rows: int, steps: int) -> None:
    """Per-step cost of the masks alone for `rows` rows under the test schemas: llguidance (what
    Rill runs: its fill, then Rill's native apply) against xgrammar (its fill and CPU apply), the
    rows walked by random allowed tokens. Needs `pip install xgrammar` for the second line."""
    from rill.services.worker.structured import apply_bitmask

    schemas = list(SCHEMAS.values())
    vocab = runner.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def walk(fill, apply, accept) -> float:  # noqa: ANN001 - the two engines' own calls
        logits = torch.randn(rows, vocab, generator=gen)
        spent = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            mask = fill()
            x = logits.clone()
            apply(x, mask)
            spent += time.perf_counter() - t0
            accept((x + torch.rand(rows, vocab, generator=gen)).argmax(-1).tolist())
        return spent / steps

    g = runner.grammars
    ms = [g.matcher(_from_json(schemas[i % len(schemas)], "s")) for i in range(rows)]
    llg = walk(lambda: g.bitmask(ms), lambda x, m: apply_bitmask(x, list(range(rows)), m),
               lambda toks: [m.consume_token(t) if not m.is_stopped() else m.reset() for m, t in zip(ms, toks, strict=True)])
    line = f"mask fill + apply, {rows} rows, mean of {steps} steps: llguidance {1e3 * llg:.2f} ms"
    try:
        import xgrammar as xgr
        from transformers import AutoTokenizer
    except ImportError:
        print(line + " (xgrammar not installed: no comparison)")
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(runner.grammars.model_dir), vocab_size=vocab))
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    xms = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(rows)]
    bits = xgr.allocate_token_bitmask(rows, vocab)

    def xfill() -> torch.Tensor:
        for i, m in enumerate(xms):
            if m.is_terminated():  # finished: only EOS, as llguidance's stopped matchers give
                m.reset()
            m.fill_next_token_bitmask(bits, i)
        return bits

    xg = walk(xfill, lambda x, m: xgr.apply_token_bitmask_inplace(x, m),
              lambda toks: [m.accept_token(t) for m, t in zip(xms, toks, strict=True) if not m.is_terminated()])
    print(f"{line}, xgrammar {1e3 * xg:.2f} ms ({xg / llg:.1f}x llguidance's)")


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
    compare_engines(runner, args.streams, 30)
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
