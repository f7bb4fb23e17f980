"""The worker's per-step thread choice (services/worker/step_threads.py), on step times given to it."""

from __future__ import annotations

from rill.services.worker.step_threads import MAX_BACKOFF, RETRY_STEPS, StepThreads
from rill.shared.schema import StepPlan


def plan(*tokens: int) -> StepPlan:
    return StepPlan(step_id=0, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=[f"r{i}" for i in range(len(tokens))], num_scheduled_tokens=list(tokens))


def serve(threads: StepThreads, p: StepPlan, seconds: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps of `p`, each taking `seconds[count]`; the counts chosen, in order."""
    chosen = []
    for _ in range(steps):
        n = threads.choose(p)
        threads.record(p, n, seconds[n])
        chosen.append(n)
    return chosen


def test_each_batch_size_runs_on_the_count_it_measured_faster() -> None:
    threads = StepThreads(4)
    one, wide = plan(1), plan(*[1] * 32)
    small = serve(threads, one, {4: 0.009, 3: 0.005}, 20)
    big = serve(threads, wide, {4: 0.030, 3: 0.040}, 20)
    assert small[:2] == [4, 3] and set(small[2:]) == {3}  # both timed, then the faster
    assert big[:2] == [4, 3] and set(big[2:]) == {4}
    assert threads.summary() == {1: 3, 32: 4}
    # 17-32 rows share a size: 20 rows is timed as 32.
    assert threads.choose(plan(*[1] * 20)) == 4


def test_the_slower_count_is_timed_again_less_often_each_time_it_loses() -> None:
    threads = StepThreads(2)
    chosen = serve(threads, plan(1, 1), {2: 0.010, 1: 0.015}, 2 + RETRY_STEPS * 7 + 8)
    tries = [i for i, n in enumerate(chosen) if n == 1]
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps[0] == RETRY_STEPS + 1  # lost once: 64 steps, then tried again
    assert gaps[1] == 2 * RETRY_STEPS + 1 and gaps[2] == 4 * RETRY_STEPS + 1
    assert RETRY_STEPS << MAX_BACKOFF < 10**6  # the backoff is bounded: it is always retried


def test_a_retry_that_now_wins_takes_over() -> None:
    threads = StepThreads(2)
    p = plan(1)
    serve(threads, p, {2: 0.010, 1: 0.015}, 10)
    assert threads.choose(p) == 2
    # The load changed: fewer threads are now faster. The retry's fresh time decides at once.
    after = serve(threads, p, {2: 0.010, 1: 0.004}, 2 * RETRY_STEPS)
    retried = after.index(1)
    assert retried <= RETRY_STEPS and after[retried:].count(2) <= 1  # the other count only retried


def test_prompt_steps_and_single_thread_workers_take_every_thread() -> None:
    threads = StepThreads(2)
    for p in (plan(512), plan(1, 7), plan()):
        assert serve(threads, p, {2: 0.5, 1: 0.1}, 5) == [2] * 5
    assert threads.summary() == {}
    lone = StepThreads(1)
    assert lone.options == (1,) and serve(lone, plan(1), {1: 0.1}, 3) == [1, 1, 1]


def test_a_size_settled_on_fewer_threads_is_logged_once(caplog) -> None:
    threads = StepThreads(2)
    with caplog.at_level("INFO", logger="rill.worker"):
        serve(threads, plan(1), {2: 0.009, 1: 0.005}, 3 * RETRY_STEPS)
        serve(threads, plan(*[1] * 8), {2: 0.010, 1: 0.015}, 10)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(lines) == 1 and lines[0].startswith("decode batches of 1 rows run on 1 threads"), lines
