"""The CPU step budget a worker measures when --max-num-batched-tokens is not given
(services/worker/step_budget.py): the rule on given timings, the measurement on a real model,
its cache, and the scheduler taking the budget the worker announces over a real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan_timing import slow_engine, submit

from rill.services.worker import step_budget
from rill.services.worker.model_runner import ModelRunner
from rill.shared import envs
from rill.shared.broker import free_port
from rill.shared.config import EngineArgs

# A prompt step's seconds per size, shaped like those measured on two machines: one whose
# throughput flattens past 512 tokens, one where every step is slow.
FLATTENS = {128: 0.049, 256: 0.075, 512: 0.139, 1024: 0.285, 2048: 0.556}
SLOW = {128: 0.48, 256: 0.86}


def test_the_budget_is_the_smallest_size_near_the_best_throughput() -> None:
    # 512 reads 3,680 tokens/s; 1,024 and 2,048 no faster, only longer; 256 is 7 % slower.
    assert step_budget.choose(FLATTENS, target_s=1.0) == 512


def test_the_budget_never_passes_the_step_target() -> None:
    assert step_budget.choose(FLATTENS, target_s=0.1) == 256
    assert step_budget.choose({128: 0.1, 256: 0.15, 512: 0.2, 1024: 0.25}, target_s=0.2) == 512


def test_the_smallest_size_when_no_step_fits_the_target() -> None:
    assert step_budget.choose(SLOW, target_s=0.3) == 128


def test_a_size_within_the_knee_of_the_best_is_taken_over_a_larger_one() -> None:
    # 1,024 reads 3 % more tokens per second than 512, within KNEE: the shorter step wins.
    times = {512: 0.100, 1024: 0.194}
    assert step_budget.choose(times, target_s=1.0) == 512
    times[1024] = 0.150  # 33 % more: worth the longer step
    assert step_budget.choose(times, target_s=1.0) == 1024


@pytest.fixture
def runner(tiny_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """The tiny model's runner, set up (kernels built and chosen) in the usual cache folder;
    step budgets then go to a fresh one."""
    path, _ = tiny_llama
    runner = ModelRunner(str(path), dtype="float32", device="cpu", num_blocks=64, block_size=16, max_model_len=256)
    runner.warmup()
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path / "cache"))
    return runner


def counting_steps(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the prompt steps `runner` runs from now on (a step after context: -size)."""
    sizes: list[int] = []
    warmup = runner.warmup

    def counted(n: int = 16, context: int = 0) -> float:
        sizes.append(-n if context else n)
        return warmup(n, context)

    monkeypatch.setattr(runner, "warmup", counted)
    return sizes


def test_a_worker_measures_its_budget_once_per_machine_and_model(
        runner: ModelRunner, tiny_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = EngineArgs(model_dir=str(tiny_llama[0]))
    steps = counting_steps(runner, monkeypatch)
    budget = step_budget.resolve(runner, args)
    # The tiny model's context (256) bounds the sizes tried, each timed after a first run, and
    # leaves no room to time a chunk after context: that cost stays unmeasured.
    assert set(steps) <= {128, 256} and steps[:3] == [128, 128, 128]
    assert budget.tokens in (128, 256) and budget.cost is not None and budget.cost.context == 0
    kept = json.loads(next((tmp_path / "cache" / "step-budget").glob("*.json")).read_text())
    assert kept["budget"] == budget.tokens and set(kept["step_ms"]) <= {"128", "256"}
    steps.clear()
    assert step_budget.resolve(runner, args) == budget  # a later start reads the answer...
    assert steps == []  # ...without stepping
    monkeypatch.setenv("RILL_CPU_STEP_TARGET_MS", "0.001")  # another target is another question
    assert step_budget.resolve(runner, args).tokens == 128  # nothing fits: the smallest size
    assert steps[:3] == [128, 128, 128] and set(steps) == {128}  # stopped at the first size past the target


def test_a_given_budget_is_kept_without_measuring(
        runner: ModelRunner, tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = counting_steps(runner, monkeypatch)
    given = step_budget.resolve(runner, EngineArgs(model_dir=str(tiny_llama[0]), max_num_batched_tokens=200))
    assert given == step_budget.StepBudget(200) and given.cost is None and steps == []  # chunks keep the budget


def test_context_makes_a_prompt_chunk_dearer(smollm2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2: a chunk after 1,024 tokens of context, against one at a prompt's start; the
    runner steps through that context in chunks of the budget first."""
    runner = ModelRunner(smollm2_dir, dtype="auto", device="cpu", num_blocks=96, block_size=16, max_model_len=1536)
    steps = counting_steps(runner, monkeypatch)
    cost = step_budget.context_cost(runner, 128)
    assert steps == [128, 128, -128] and cost > 0
    assert step_budget.context_cost(runner, 768) == 0  # 768 tokens of room left: too little to tell


def chunks_of(worker, rid: str) -> list[int]:
    return [n for plan in worker.plans for r, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens,
                                                       strict=True) if r == rid]


@pytest.mark.parametrize("flag, expected", [(None, 64), (100, 100)])
def test_the_scheduler_steps_in_the_budget_its_worker_announces(
        redis_url: str, prefix: str, flag: int | None, expected: int) -> None:
    """The worker announces 64: the scheduler chunks a 200-token prompt by it, unless the
    engine was given its own budget."""
    args = EngineArgs(model_dir="unused", max_num_seqs=8, max_num_batched_tokens=flag, enable_prefix_caching=False)
    with slow_engine(redis_url, prefix, args, budget=64) as (client, worker, _):
        submit(client, "long", 200, max_tokens=8)
        worker.wait_step(-(-200 // expected) + 1)
        chunks = chunks_of(worker, "long")
    assert sum(chunks[: -(-200 // expected)]) == 200
    assert chunks[: -(-200 // expected)] == [expected] * (200 // expected) + ([200 % expected] if 200 % expected else [])


def test_tensor_parallel_ranks_measure_together_and_agree(tmp_path: Path) -> None:
    """Two ranks over gloo: they step each size together (neither waits on a lock the other holds),
    announce one budget, and both read the kept answer at the next start."""
    from test_tensor_parallel import tiny

    model_dir = tiny(tmp_path / "m", 2, bias=False)
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))  # imports test modules
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), address, model_dir, str(tmp_path)], env=env)
             for rank in (0, 1)]
    assert [p.wait(180) for p in procs] == [0, 0]
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # One answer: the lead's, announced by both ranks at the first start and read back by both at the next.
    assert answers[0][0] == answers[0][1] == answers[1][0] == answers[1][1]
    assert answers[0][0][0] in (128, 256)  # what the context holds


def _rank_main(rank: int, address: str, model_dir: str, out: str) -> None:
    from rill.services.worker.tensor_parallel import TPGroup

    tp = TPGroup.join(rank, 2, address, "cpu")
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=16, block_size=16, max_model_len=256,
                         tp=tp)
    runner.warmup()
    envs.export("RILL_CACHE_DIR", str(Path(out, "cache")))  # budgets in a fresh folder, kernels as usual
    args = EngineArgs(model_dir=model_dir, tensor_parallel_size=2, tp_rank=rank)
    budgets = [dataclasses.astuple(step_budget.resolve(runner, args, tp)) for _ in range(2)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(budgets))
    tp.close()  # as the worker does: left to the interpreter's exit, gloo's teardown can abort it


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), *sys.argv[2:5])
