"""When the scheduler sends a plan built ahead (services/scheduler/plan_timing.py).

Unit tests of the timer on a fake clock, then the scheduler service over a real broker with a
stand-in worker that takes a fixed time per step: a request that arrives early in a decode step
must ride in the very next plan, not the one after it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rill.services.scheduler import plan_timing
from rill.services.scheduler.plan_timing import PlanTimer
from rill.services.scheduler.service import SchedulerService
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.lifecycle import StopFlag
from rill.shared.request_params import SamplingParams
from rill.shared.schema import (
    Hello,
    StepPlan,
    StepResult,
    TokenizedRequest,
    WorkerReady,
    worker_input_decoder,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def after_one_decode_step(step_s: float) -> tuple[FakeClock, PlanTimer]:
    """A timer that has measured one decode-only step (step 1) of `step_s`."""
    clock = FakeClock()
    timer = PlanTimer(clock)
    timer.sent(1, [1, 1])
    clock.now += step_s
    timer.received(1)
    return clock, timer


def test_without_an_estimate_a_plan_is_due_at_once() -> None:
    clock = FakeClock()
    timer = PlanTimer(clock)
    assert timer.plan_due(None)
    timer.sent(1, [1, 1])
    assert timer.plan_due(1)  # no decode step measured yet


def test_plan_ahead_waits_for_the_last_lead_of_the_running_step() -> None:
    clock, timer = after_one_decode_step(0.040)
    assert timer.decode_step_s == pytest.approx(0.040)
    timer.sent(2, [1, 1])  # sent after result 1: it starts now
    start = clock.now
    assert timer.plan_due_at(2) == pytest.approx(start + 0.040 * (1 - plan_timing.LEAD))
    clock.now += 0.020
    assert not timer.plan_due(2)
    clock.now += 0.011
    assert timer.plan_due(2)


def test_a_queued_step_starts_when_the_one_before_returns() -> None:
    clock = FakeClock()
    timer = PlanTimer(clock)
    timer.sent(1, [1])
    clock.now += 0.010
    timer.sent(2, [1])  # queued behind step 1
    clock.now += 0.030
    timer.received(1)
    assert timer.started_at(2) == pytest.approx(clock.now)  # not when it was sent
    clock.now += 0.050
    timer.received(2)
    # 0.040 then 0.050 measured, smoothed
    assert timer.decode_step_s == pytest.approx(
        plan_timing.SMOOTHING * 0.050 + (1 - plan_timing.SMOOTHING) * 0.040)


def test_the_workers_own_timing_is_preferred() -> None:
    """The result may be read late (the scheduler slept until a due time): the worker's figure
    keeps that delay out of the estimate."""
    clock = FakeClock()
    timer = PlanTimer(clock)
    timer.sent(1, [1])
    clock.now += 0.070  # read 70 ms after the step started...
    timer.received(1, worker_s=0.025)  # ...but the worker ran it in 25 ms
    assert timer.decode_step_s == pytest.approx(0.025)


def test_prompt_steps_do_not_move_the_estimate() -> None:
    clock, timer = after_one_decode_step(0.040)
    timer.sent(2, [1, 300])  # a prompt chunk: ten times longer on a CPU
    clock.now += 0.400
    timer.received(2)
    assert timer.decode_step_s == pytest.approx(0.040)


def test_the_lead_never_drops_below_its_floor() -> None:
    clock, timer = after_one_decode_step(0.004)  # a fast GPU step: a quarter of it would be 1 ms
    timer.sent(2, [1])
    assert timer.plan_due_at(2) == pytest.approx(clock.now + 0.004 - plan_timing.MIN_LEAD_S)


def test_reset_forgets_steps_in_flight_but_keeps_the_estimate() -> None:
    _, timer = after_one_decode_step(0.040)
    timer.sent(2, [1])
    timer.reset()
    assert timer.started_at(2) is None
    assert timer.plan_due(2)
    assert timer.decode_step_s == pytest.approx(0.040)


# ---------------------------------------------------------------------- over a real broker

STEP_S = 0.2  # the stand-in worker's time per step


class SlowWorker(threading.Thread):
    """Answers every plan after STEP_S with token 7 for each row that completes its prompt, and
    records when it started each step and every plan it ran."""

    def __init__(self, bus: Bus, budget: int = 0) -> None:
        super().__init__(daemon=True)
        self.bus = bus
        self.budget = budget  # the step budget it announces (0: none measured)
        self.plan_stream, self.result_stream = bus.streams.plan(0), bus.streams.result(0)
        self.stop = threading.Event()
        self.started: dict[int, float] = {}
        self.step_started = threading.Condition()
        self.plans: list[StepPlan] = []
        self.prompt_left: dict[str, int] = {}

    def ready(self) -> None:
        self.bus.send(self.result_stream, WorkerReady(worker_id="slow", num_blocks=64, block_size=16,
                                                      max_model_len=256, dtype="float32", device="cpu",
                                                      max_num_batched_tokens=self.budget))

    def run(self) -> None:
        cursor = b"0-0"
        self.ready()
        while not self.stop.is_set():
            for entry_id, data in self.bus.read(self.plan_stream, cursor, 50):
                cursor = entry_id
                msg = worker_input_decoder.decode(data)
                if isinstance(msg, Hello):
                    self.ready()
                elif isinstance(msg, StepPlan):
                    self.execute(msg)

    def execute(self, plan: StepPlan) -> None:
        with self.step_started:
            self.started[plan.step_id] = time.monotonic()
            self.plans.append(plan)
            self.step_started.notify_all()
        for new in plan.new_requests:
            self.prompt_left[new.request_id] = len(new.token_ids) - new.num_computed_tokens
        sampled = []
        for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True):
            left = self.prompt_left.get(rid, 0) - n
            self.prompt_left[rid] = max(left, 0)
            if left <= 0:
                sampled.append(rid)
        time.sleep(STEP_S)
        self.bus.send(self.result_stream, StepResult(step_id=plan.step_id, request_ids=sampled,
                                                     token_ids=[7] * len(sampled), forward_ms=STEP_S * 1e3))

    def wait_step(self, step_id: int, timeout: float = 30.0) -> float:
        with self.step_started:
            assert self.step_started.wait_for(lambda: step_id in self.started, timeout), f"step {step_id} never ran"
            return self.started[step_id]

    def first_step_with(self, rid: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.step_started:
                for plan in self.plans:
                    if rid in plan.scheduled_request_ids:
                        return plan.step_id
            time.sleep(0.01)
        raise AssertionError(f"{rid} was never scheduled")


@contextmanager
def slow_engine(redis_url: str, prefix: str, args: EngineArgs,
                budget: int = 0) -> Iterator[tuple[Bus, SlowWorker, SchedulerService]]:
    """A real scheduler over the broker with a SlowWorker behind it (announcing `budget`), both
    running: (a client's bus, the worker, the service); stopped and closed after."""
    worker_bus, sched_bus, client = (Bus(redis_url, prefix, name=f"{n}-{uuid.uuid4().hex[:6]}")
                                     for n in ("worker", "scheduler", "client"))
    worker = SlowWorker(worker_bus, budget)
    stop = StopFlag(install=False)
    service = SchedulerService(sched_bus, args, stop)
    client.r.set(service.guard.worker_key, b"1", ex=120)  # the worker's heartbeat
    worker.start()
    loop = threading.Thread(target=service.run, daemon=True)
    loop.start()
    try:
        yield client, worker, service
    finally:
        stop.set()
        worker.stop.set()
        loop.join(10)
        worker.join(10)
        for bus in (worker_bus, sched_bus, client):
            bus.close()


def submit(bus: Bus, rid: str, prompt_len: int, max_tokens: int = 200) -> None:
    bus.send(bus.streams.engine_in(0), TokenizedRequest(
        request_id=rid, reply_to=f"{bus.streams.prefix}:reply:test", prompt_token_ids=list(range(3, 3 + prompt_len)),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), eos_token_ids=[2],
        arrival_time=time.time()))


@pytest.mark.parametrize("lead, steps_later", [(plan_timing.LEAD, 1), (1.0, 2)])
def test_a_request_arriving_early_in_a_decode_step_joins_the_next_plan(
        redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, lead: float, steps_later: int) -> None:
    """With the timer, a request arriving 30 ms into a 200 ms decode step rides in the plan
    right after it. Sending plans ahead as soon as the step starts (lead 1.0: the behaviour
    before the timer) puts it one step later: the check can tell the two apart."""
    monkeypatch.setattr(plan_timing, "LEAD", lead)
    args = EngineArgs(model_dir="unused", max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    with slow_engine(redis_url, prefix, args) as (client, worker, service):
        submit(client, "a", 5)
        worker.wait_step(6)  # a's prompt, then decode steps to measure
        with worker.step_started:
            running = max(worker.started)
        worker.wait_step(running + 1)  # the start of a fresh decode step
        time.sleep(0.03)
        submit(client, "b", 5)
        joined = worker.first_step_with("b")
        assert joined == running + 1 + steps_later, f"b arrived during step {running + 1}, ran first in {joined}"
        assert service.timer.decode_step_s == pytest.approx(STEP_S, rel=0.5)
