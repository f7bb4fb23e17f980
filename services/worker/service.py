"""The worker process: load the model, size the KV cache, then run one StepPlan after another.

One process, one synchronous loop: read the engine's plan stream, execute, answer on the
engine's result stream. Neither broker hop waits between two steps: the read of the next plan
is posted before a step runs (its own connection: the read may block until the plan comes, and
nothing else must queue behind it) and taken after, when the plan, sent by the scheduler while
the step ran, is already in the socket; the result is posted without waiting for its reply,
which is taken before the next one is posted. (On a small CPU the gap between two forwards
stays all the same, since the posted result wakes the broker and the scheduler, which then take
the worker's core: the round trip leaves the gap where cores are to spare.)
The worker announces itself with WorkerReady at start and again after
every Hello, so the handshake works whichever of scheduler and worker starts first. Once ready
it keeps a heartbeat key alive (shared/heartbeat.py), by which the scheduler and the gateways
learn that it died; broker errors are retried with backoff.

With tensor parallelism the worker is N processes (tensor_parallel.py). Every rank reads the
plan stream itself, from the id rank 0 hands out at start (a broadcast of each plan instead
cost more: scripts/benchmarks.md); rank 0 alone announces, beats, samples and posts results.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import msgspec
import redis
import torch

from rill.services.worker import step_budget
from rill.services.worker.cpu_setup import release_freed_memory, resolve_device
from rill.services.worker.invariance import agreeing_rows, invariance_gaps
from rill.services.worker.kv_transfer import KVTransferExecutor, RedisKVTransport
from rill.services.worker.memory import resident_bytes, weight_bytes
from rill.services.worker.model_runner import ModelRunner
from rill.services.worker.step_threads import StepThreads
from rill.services.worker.tensor_parallel import TensorParallelError, TPGroup
from rill.shared import envs
from rill.shared.bus import Backoff, Bus, hot_connection
from rill.shared.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DTYPE_BYTES,
    EngineArgs,
    ModelConfig,
    SpeculativeConfig,
    fitted_max_model_len,
    kv_cache_blocks,
)
from rill.shared.heartbeat import Heartbeat
from rill.shared.lifecycle import EXIT_CONFIG, POLL_MS, StopFlag
from rill.shared.model_files import resolve_model
from rill.shared.schema import Hello, Shutdown, StepPlan, StepResult, WorkerReady, worker_input_decoder

log = logging.getLogger("rill.worker")


def _kv_bytes(runner: ModelRunner, args: EngineArgs) -> int:
    """KV-cache budget: the configured bytes, the CPU default, or on CUDA a share of the GPU."""
    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    if runner.device != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    # What weights plus a full-size warm-up step use is not available to the cache. Experts are
    # weights like any other, and the fused-MoE buffers are sized for the worst routing
    # (triton_moe.py), so the warm-up prompt (one token id repeated: every row picks the same
    # experts) still measures a MoE step's peak.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    runner.warmup(args.step_token_budget(runner.device))
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    cache_now = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    return max(0, int(total * args.gpu_memory_utilization) - (used - cache_now))


def draft_model_dir(args: EngineArgs) -> str | None:
    """The checkpoint folder of --speculative-config's draft model (a .gguf converted once), or None."""
    if not args.speculative_config:
        return None
    config = SpeculativeConfig.parse(args.speculative_config)
    return str(resolve_model(config.model)) if config.method == "draft_model" else None


def join_group(args: EngineArgs) -> TPGroup | None:
    """This worker's tensor-parallel group (None with one rank); a group that does not form
    ends start-up with one line naming why."""
    if args.tensor_parallel_size <= 1:
        return None
    address = args.tp_address or envs.RILL_TP_ADDRESS
    try:
        return TPGroup.join(args.tp_rank, args.tensor_parallel_size, address, resolve_device(args.device))
    except TensorParallelError as exc:
        raise SystemExit(f"rill worker: {exc}") from None


def build_runner(args: EngineArgs, tp: TPGroup | None = None) -> ModelRunner:
    device = resolve_device(args.device)
    cfg = ModelConfig.from_dir(args.model_dir)
    max_len = args.max_model_len or cfg.max_position_embeddings
    # Enough blocks for the warm-up step; the real cache replaces it once sized.
    probe_tokens = max(16, min(args.step_token_budget(device), max_len))
    # The runner resolves "auto" (after setting its CPU threads, which the probe should use).
    rss = resident_bytes()
    runner = ModelRunner(args.model_dir, dtype=args.dtype, device=device,
                         num_blocks=-(-probe_tokens // args.block_size), block_size=args.block_size,
                         max_model_len=max_len, seed=args.seed, quantization=args.quantization, tp=tp,
                         draft_model=draft_model_dir(args))
    if tp is None or tp.rank == 0:  # the rank that samples; overlaps the cache sizing and warm-up below
        runner.grammars.prepare_in_background()
    if device == "cpu":
        release_freed_memory()
    rank = f"rank {tp.rank}/{tp.size} " if tp else ""
    log.info("%sweights: %d MiB held (process resident +%d MiB since before the load)", rank,
             weight_bytes(runner.model) >> 20, (resident_bytes() - rss) >> 20)
    if envs.RILL_BATCH_INVARIANT and (tp is None or tp.rank == 0) and (gaps := invariance_gaps(runner.model, device)):
        log.warning("RILL_BATCH_INVARIANT=1 does not pin %s: a greedy text may still depend on the batch",
                    "; ".join(gaps))
    dtype = runner.dtype
    cfg = runner.cfg  # a rank's own KV heads
    budget = _kv_bytes(runner, args)
    draft_cfg = runner.draft.model.cfg if runner.draft is not None else None
    num_blocks = kv_cache_blocks(cfg, dtype, args.block_size, budget, draft_cfg)
    if tp is not None:  # one block table for every rank: the smallest cache sets it
        num_blocks = tp.all_reduce_min(num_blocks)
    _fit_context(runner, args, num_blocks, budget)
    runner.resize_kv_cache(num_blocks)
    runner.warmup()
    runner.grammars.wait_prepared()
    if device == "cpu":
        release_freed_memory()
    tokens = num_blocks * args.block_size
    log.info("%skv cache: blocks=%d block_size=%d tokens=%d bytes=%d dtype=%s quantization=%s device=%s "
             "(= %d layers x %d tokens x 2 x %d kv_heads x %d head_dim x %d bytes)", rank,
             num_blocks, args.block_size, tokens, tokens * cfg.kv_bytes_per_token(dtype), dtype,
             runner.quantization, device, cfg.num_hidden_layers, tokens, cfg.num_key_value_heads, cfg.head_dim,
             DTYPE_BYTES[dtype])
    if draft_cfg is not None:
        log.info("draft model: %s, its own KV cache in the same blocks: bytes=%d", args.speculative_config,
                 tokens * draft_cfg.kv_bytes_per_token(dtype))
    return runner


def _fit_context(runner: ModelRunner, args: EngineArgs, num_blocks: int, budget: int) -> None:
    """Lower the runner's context to what `num_blocks` hold (shared/config.py's rule); a cache
    that cannot hold what was asked for ends start-up with one line and EXIT_CONFIG, which the
    supervisor does not restart."""
    tokens = num_blocks * args.block_size
    try:
        if num_blocks < 1:
            raise ValueError(f"a KV-cache budget of {budget} bytes holds no block of {args.block_size} tokens: "
                             "raise --kv-cache-memory (CUDA: --gpu-memory-utilization)")
        max_len = fitted_max_model_len(runner.max_model_len, tokens, args.fit_context)
    except ValueError as exc:
        log.error("cannot serve this configuration: %s", exc)
        runner.grammars.wait_prepared()  # a thread still in native code as the interpreter ends crashes it
        raise SystemExit(EXIT_CONFIG) from None
    if max_len < runner.max_model_len:
        log.warning("max_model_len %d (the model's) lowered to %d, what the KV cache holds (%d MiB): "
                    "raise --kv-cache-memory for a longer context", runner.max_model_len, max_len, budget >> 20)
        runner.max_model_len = max_len


def run(redis_url: str, prefix: str, args: EngineArgs, stop: StopFlag | None = None) -> None:
    stop = stop if stop is not None else StopFlag()
    tp = join_group(args)
    try:
        _serve(redis_url, prefix, args, stop, tp)
    except (RuntimeError, ValueError) as exc:
        if tp is None:
            raise
        # A peer died mid-collective, or this rank failed where its peers cannot follow: either
        # way the engine is gone; exiting lets the supervisor restart every rank together.
        log.error("tensor-parallel rank %d of %d stopped, and the engine with it: %s: %s", tp.rank, tp.size,
                  type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        raise SystemExit(1) from None
    if tp is not None:  # a group left to the interpreter's exit can abort it (SIGABRT) in gloo's teardown
        tp.close()


def _serve(redis_url: str, prefix: str, args: EngineArgs, stop: StopFlag, tp: TPGroup | None) -> None:
    runner = build_runner(args, tp)
    loop = _PlanLoop(redis_url, prefix, args, runner, tp, step_budget.resolve(runner, args, tp))
    try:
        loop.run(stop)
    finally:
        loop.close()


class _PlanLoop:
    """One worker's bus loop: announce, then read a plan, run it and post its result, step after
    step; after a broker outage, reconnect and pick up where it was."""

    def __init__(self, redis_url: str, prefix: str, args: EngineArgs, runner: ModelRunner,
                 tp: TPGroup | None, budget: step_budget.StepBudget) -> None:
        self.redis_url = redis_url
        self.engine_id = args.engine_id
        self.runner = runner
        self.tp = tp
        self.lead = tp is None or tp.lead  # announces, beats and posts results
        me = f"worker-{args.engine_id}-{os.getpid()}" if tp is None else \
            f"worker-{args.engine_id}-r{tp.rank}-{os.getpid()}"
        self.bus = Bus(redis_url, prefix, name=me)
        self.plan_stream = self.bus.streams.plan(args.engine_id)
        self.result_stream = self.bus.streams.result(args.engine_id)
        self.ready = WorkerReady(worker_id=me, num_blocks=runner.num_blocks,
                                 block_size=runner.block_size, max_model_len=runner.max_model_len,
                                 dtype=runner.dtype, device=runner.device, quantization=runner.quantization,
                                 sliding_window=runner.model.sliding_window or 0,
                                 agreeing_rows=agreeing_rows(runner.model, runner.device, self.lead),
                                 max_num_batched_tokens=budget.tokens,
                                 step_cost=budget.cost.wire() if budget.cost else [])
        # Disaggregation: KV exports/imports a plan asks for run after its step (kv_transfer.py).
        self.transfers = KVTransferExecutor(runner, [RedisKVTransport(self.bus.r, self.bus.streams)])
        self.heartbeat: Heartbeat | None = None
        self.backoff = Backoff()
        self.last_id: bytes | None = None  # None until announced
        self.server = ""  # the broker we announced ourselves to
        self.plans = hot_connection(redis_url, name=f"{me}-plans")
        self.results = self.bus.hot  # results are posted here; their replies are taken with the next post
        self.unconfirmed: list[StepResult] = []  # results whose XADD reply was not taken yet
        self.reconnected = False
        # CPU, one process: a step may leave a core to the pipeline's other services (ranks of a
        # tensor-parallel group keep theirs: they step in lock-step).
        timed = runner.device == "cpu" and tp is None and envs.RILL_STEP_THREADS
        self.threads = StepThreads(torch.get_num_threads()) if timed else None

    def run(self, stop: StopFlag) -> None:
        while not stop:
            try:
                if self.last_id is None:
                    self._announce()
                elif self.reconnected:
                    self._resume()
                if not self.plans.posted:
                    self._post_read()
                (reply,) = self.plans.take()
                entries = Bus.entries(reply)
                if not entries and self.results.posted:
                    # Idle: the last result's reply, now. A cluster's reshard can redirect its XADD,
                    # which then runs only when taken, and the scheduler waits for it.
                    self.results.take()
                    self.unconfirmed = []
                for entry_id, payload in entries:  # one plan per read
                    self.last_id = entry_id
                    if not self._handle(entry_id, payload):
                        return
                self.backoff.reset()
            except redis.RedisError as exc:  # broker restarting or unreachable: back off, reconnect
                if not self.backoff.failures:  # once per outage; the retries that follow are quiet
                    log.warning("broker error, reconnecting with backoff: %r", exc)
                self.plans.close()
                self.results.close()
                delay = self.backoff.next()
                self.reconnected = self.last_id is not None
                stop.wait(delay)
        if self.unconfirmed and not self.reconnected:  # stopping: make sure the last result landed
            with contextlib.suppress(redis.RedisError):
                self.results.take()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.plans.close()
        self.bus.close()

    def _announce(self) -> None:
        bus, tp = self.bus, self.tp
        # Read from the newest entry before announcing: a Hello sent in answer is not
        # missed, and plans meant for a previous worker are not replayed.
        self.last_id = bus.last_id(self.plan_stream) if self.lead else None
        if tp is not None:  # every rank reads the same plans from here on
            self.last_id = tp.share(self.last_id)
        self.server = bus.server_id(self.plan_stream)
        if self.lead:
            # Beat before announcing, so the scheduler never sees us ready yet "dead".
            self.heartbeat = self.heartbeat or Heartbeat(
                self.redis_url, bus.streams.heartbeat("worker", self.engine_id)).start()
            bus.send(self.result_stream, self.ready)
        log.info("worker ready: engine=%d plan_stream=%s%s", self.engine_id, self.plan_stream,
                 f" (tensor-parallel rank {tp.rank} of {tp.size})" if tp else "")

    def _resume(self) -> None:
        # Same broker: the scheduler may still wait for results whose post was not
        # confirmed (a duplicate is ignored). A restarted broker lost the plans too;
        # the scheduler starts over with a Hello, so those results are stale.
        bus = self.bus
        if bus.server_id(self.plan_stream) != self.server:
            log.warning("the broker restarted; waiting for the scheduler's hello")
            self.server, self.unconfirmed = bus.server_id(self.plan_stream), []
        if self.unconfirmed:
            bus.exchange([bus.xadd(self.result_stream, r) for r in self.unconfirmed])
            self.unconfirmed = []
        self.reconnected = False

    def _handle(self, entry_id: bytes, payload: bytes) -> bool:
        """Act on one message of the plan stream; False when it asks this worker to stop."""
        try:
            msg = worker_input_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("undecodable message %s on %s: %s", entry_id, self.plan_stream, exc)
            return True
        if isinstance(msg, StepPlan):
            self._post_read()  # the next plan's read waits in the socket while this step runs
            result = self._execute(msg)
            if self.lead:
                self.transfers.run(msg, result)
                self._post_result(result)
        elif isinstance(msg, Hello):
            log.info("hello from scheduler %s: state reset", msg.scheduler_id)
            self.runner.reset()
            self.unconfirmed = []
            if self.lead:
                self.bus.send(self.result_stream, self.ready)
        elif isinstance(msg, Shutdown):
            log.info("shutdown requested: %s", msg.reason or "no reason given")
            return False
        return True

    def _execute(self, plan: StepPlan) -> StepResult:
        if self.threads is None:
            return self.runner.execute(plan)
        threads = self.threads.choose(plan)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        start = time.perf_counter()
        result = self.runner.execute(plan)
        self.threads.record(plan, threads, time.perf_counter() - start)
        return result

    def _post_read(self) -> None:
        self.plans.post([Bus.xread(self.plan_stream, self.last_id, POLL_MS, count=1)])  # type: ignore[arg-type]

    def _post_result(self, result: StepResult) -> None:
        self.unconfirmed.append(result)
        if self.results.posted:
            self.results.take()  # the previous result's reply, long arrived
            self.unconfirmed = [result]
        self.results.post([self.bus.xadd(self.result_stream, result)])
