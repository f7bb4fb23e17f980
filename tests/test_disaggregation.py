"""Prefill/decode disaggregation: the KV transport, parked requests in the scheduler, hand-offs
between engines (tiny model, engines as threads over Redis), and the whole stack with SmolLM2
(every service its own OS process): greedy equality with colocated serving, and a decode
engine SIGKILLed mid-transfer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
import redis
import torch
from service_stack import ServiceStack, fast_flags, rill_executable

from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig, Status
from rill.services.worker.kv_transfer import (
    KVTransferError,
    KVTransferExecutor,
    RedisKVTransport,
    gather_blocks,
    scatter_blocks,
)
from rill.services.worker.model_runner import ModelRunner
from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.lifecycle import StopFlag
from rill.shared.request_params import SamplingParams
from rill.shared.schema import (
    AbortRequest,
    EngineStats,
    KVExport,
    KVImport,
    StepPlan,
    StepResult,
    TokenizedRequest,
    TokenLogprobs,
    detok_decoder,
    gateway_input_decoder,
    worker_input_decoder,
)
from rill.shared.streams import Streams

NEAR_TIE = 2e-3

# ---------------------------------------------------------------------------------------------
# The transport (Redis only)


def caches(layers: int = 3, blocks: int = 12, block_size: int = 4, heads: int = 2, dim: int = 8,
           dtype: torch.dtype = torch.float32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, block_size, heads, dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layers)]


@pytest.fixture
def transport(redis_url: str, prefix: str) -> Iterator[RedisKVTransport]:
    r = redis.Redis.from_url(redis_url)
    yield RedisKVTransport(r, Streams(prefix), chunk_bytes=1000, ttl_s=60)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    r.close()


def test_gather_scatter_moves_exact_blocks() -> None:
    src, dst = caches(seed=1), caches(seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    data = gather_blocks(src, [7, 2, 5])
    assert list(data.shape) == [3, 2, 3, 4, 2, 8]
    scatter_blocks(dst, [1, 3, 0], data)
    for (sk, sv), (dk, dv), (bk, _) in zip(src, dst, before, strict=True):
        assert torch.equal(dk[[1, 3, 0]], sk[[7, 2, 5]]) and torch.equal(dv[[1, 3, 0]], sv[[7, 2, 5]])
        untouched = [b for b in range(12) if b not in (0, 1, 3)]
        assert torch.equal(dk[untouched], bk[untouched])  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redis_transport_chunks_checksums_and_cleans_up(transport: RedisKVTransport, dtype: torch.dtype) -> None:
    src, dst = caches(dtype=dtype, seed=3), caches(dtype=dtype, seed=4)
    manifest = transport.export("t1", src, [4, 9, 1, 0, 11], num_tokens=18)
    per_block = 3 * 2 * 4 * 2 * 8 * (4 if dtype == torch.float32 else 2)
    assert manifest.nbytes == 5 * per_block == sum(manifest.chunk_bytes)
    assert len(manifest.chunk_bytes) == -(-manifest.nbytes // 1000) > 1  # really chunked
    assert len(set(manifest.checksums)) == len(manifest.checksums)
    assert manifest.shape == [3, 2, 5, 4, 2, 8] and manifest.num_tokens == 18 and manifest.block_size == 4
    assert all(transport.r.ttl(k) > 0 for k in transport.keys(manifest))  # they expire by themselves
    assert transport.import_into(manifest, dst, [2, 3, 5, 6, 7]) == manifest.nbytes
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[[2, 3, 5, 6, 7]], sk[[4, 9, 1, 0, 11]])
        assert torch.equal(dv[[2, 3, 5, 6, 7]], sv[[4, 9, 1, 0, 11]])
    assert not any(transport.r.exists(k) for k in transport.keys(manifest))  # deleted once imported


def test_corrupted_chunk_is_detected(transport: RedisKVTransport) -> None:
    src, dst = caches(seed=5), caches(seed=6)
    manifest = transport.export("t2", src, [1, 2, 3], num_tokens=12)
    key = transport.keys(manifest)[2]
    data = bytearray(transport.r.get(key))
    data[17] ^= 0x40  # one flipped bit
    transport.r.set(key, bytes(data))
    with pytest.raises(KVTransferError, match="checksum mismatch in chunk 2") as err:
        transport.import_into(manifest, dst, [4, 5, 6])
    assert err.value.retryable
    transport.r.set(key, bytes(data[:-1]) + bytes([data[-1]]))  # same length and bytes: still corrupt
    with pytest.raises(KVTransferError, match="checksum"):
        transport.fetch(manifest)


def test_missing_chunk_is_an_error(transport: RedisKVTransport) -> None:
    manifest = transport.export("t3", caches(seed=7), [0, 1, 2, 3], num_tokens=16)
    transport.r.delete(transport.keys(manifest)[3])
    with pytest.raises(KVTransferError, match="chunk 3 of .* is missing") as err:
        transport.import_into(manifest, caches(seed=8), [0, 1, 2, 3])
    assert err.value.retryable
    transport.discard(manifest)
    assert not any(transport.r.exists(k) for k in transport.keys(manifest))


def test_incompatible_cache_is_refused_without_retry(transport: RedisKVTransport) -> None:
    manifest = transport.export("t4", caches(seed=9), [0, 1], num_tokens=8)
    with pytest.raises(KVTransferError, match="dtype mismatch") as err:
        transport.import_into(manifest, caches(dtype=torch.bfloat16), [0, 1])
    assert not err.value.retryable
    with pytest.raises(KVTransferError, match="geometry mismatch") as err:
        transport.import_into(manifest, caches(block_size=8), [0, 1])
    assert not err.value.retryable


def test_untrusted_manifest_is_checked_before_anything_is_allocated(transport: RedisKVTransport,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest off the broker claiming a huge payload, or naming block ids the cache does not
    have, is refused before fetch() allocates or scatter writes anything."""
    import msgspec

    manifest = transport.export("t5", caches(seed=10), [0, 1], num_tokens=8)
    fetched: list[str] = []
    monkeypatch.setattr(transport, "fetch", lambda m: fetched.append(m.transfer_id))
    huge = msgspec.structs.replace(manifest, nbytes=1 << 40, chunk_bytes=[1 << 40], checksums=[0])
    with pytest.raises(KVTransferError, match="manifest of 1099511627776 bytes") as err:
        transport.import_into(huge, caches(), [0, 1])
    assert not err.value.retryable
    dst = caches(seed=11)
    before = [k.clone() for k, _ in dst]
    for ids in ([0, 12], [-1, 3]):
        with pytest.raises(KVTransferError, match="outside this cache's 0..11"):
            transport.import_into(manifest, dst, ids)
    assert fetched == [] and all(torch.equal(k, b) for (k, _), b in zip(dst, before, strict=True))
    transport.discard(manifest)


@dataclass
class FakeCacheOwner:
    """What KVTransferExecutor needs of a ModelRunner: its KV caches."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


def test_executor_reports_exports_and_imports_in_the_step_result(transport: RedisKVTransport) -> None:
    src, dst = FakeCacheOwner(caches(seed=10)), FakeCacheOwner(caches(seed=11))
    plan = StepPlan(step_id=1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=[], num_scheduled_tokens=[],
                    kv_exports=[KVExport("x1", [3, 4], 7), KVExport("x2", [99], 1)])
    result = StepResult(step_id=1, request_ids=[], token_ids=[])
    KVTransferExecutor(src, [transport]).run(plan, result)  # type: ignore[arg-type]
    good, bad = result.kv_exports
    assert good.error is None and good.nbytes > 0 and good.num_tokens == 7
    assert bad.error is not None and "export failed" in bad.error  # block 99 does not exist
    missing = msgspec.structs.replace(good, transfer_id="never-exported")
    plan = StepPlan(step_id=2, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=[], num_scheduled_tokens=[],
                    kv_imports=[KVImport(good, [0, 1]), KVImport(missing, [2, 3])])
    result = StepResult(step_id=2, request_ids=[], token_ids=[])
    KVTransferExecutor(dst, [transport]).run(plan, result)  # type: ignore[arg-type]
    ok, lost = result.kv_imports
    assert ok.error is None and ok.nbytes == good.nbytes
    assert lost.error is not None and "missing" in lost.error and lost.retryable
    assert torch.equal(dst.kv_caches[1][0][[0, 1]], src.kv_caches[1][0][[3, 4]])


# ---------------------------------------------------------------------------------------------
# Parked requests in the scheduler (no Redis, no model)


def tokenized(rid: str, prompt_len: int, max_tokens: int = 8, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, reply_to="reply", prompt_token_ids=list(range(10, 10 + prompt_len)),
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
                            eos_token_ids=[2], arrival_time=0.0)


def sampled_result(plan: StepPlan, s: Scheduler, token: int = 7) -> StepResult:
    ids = [rid for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True)
           if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens]
    return StepResult(step_id=plan.step_id, request_ids=ids, token_ids=[token] * len(ids))


def prefill_scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=16, role="prefill"), KVCacheManager(num_blocks, 4))


def test_prefill_role_parks_a_request_once_its_first_token_is_sampled() -> None:
    s = prefill_scheduler()
    s.add(tokenized("a", 10, max_tokens=5))
    s.add(tokenized("one", 3, max_tokens=1))  # done with its first token: never parked
    s.add(tokenized("n2", 6, max_tokens=5, n=2))
    parked: list[str] = []
    forgotten: list[str] = []
    for _ in range(10):
        plan = s.schedule()
        if plan is None:
            break
        forgotten += plan.finished_request_ids
        outcome = s.update(sampled_result(plan, s))
        parked += [r.request_id for r in outcome.parked]
        s.check_invariants()
    # Sample 1 shares sample 0's prompt blocks even though sample 0 is parked already.
    assert sorted(parked) == ["a", "n2:0", "n2:1"]
    assert not s.running and not s.waiting and set(s.parked) == {"a", "n2:0", "n2:1"}
    assert all(r.status is Status.PARKED and r.output_token_ids == [7] for r in s.parked.values())
    assert s.requests["a"].num_computed_tokens == 10
    shared = s.kv.block_ids("n2:0")[0]
    assert shared in s.kv.block_ids("n2:1") and s.kv.ref_cnt[shared] == 2
    assert s.counters.decode_tokens == 0
    assert s.stats()["num_transferring"] == 3
    # The worker was told to forget them: exports name the blocks, no worker state is needed.
    assert sorted(forgotten) == ["a", "n2:0", "n2:1", "one"]
    assert s.schedule() is None
    plan = s.schedule(force=True)  # a step that only carries transfers
    assert plan is not None and plan.scheduled_request_ids == [] and plan.finished_request_ids == []
    s.update(StepResult(step_id=plan.step_id, request_ids=[], token_ids=[]))
    assert s.release("a") is not None and s.abort("n2") and s.release("nope") is None
    s.check_invariants()
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.requests


def test_decode_side_adopts_then_unparks_into_the_batch() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, role="decode"), KVCacheManager(8, 4))
    src = Scheduler(SchedulerConfig(), KVCacheManager(8, 4))
    req = src.add(tokenized("r", 9, max_tokens=4))[0]
    req.output_token_ids.append(7)
    assert not s.adopt(req, 9, spare_blocks=6)  # 3 blocks + 6 spare > 8: not yet, nothing changed
    assert s.kv.num_free_blocks == 8 and not s.requests
    assert s.adopt(req, 9)
    assert s.kv.num_free_blocks == 5 and req.status is Status.PARKED and s.schedule() is None
    s.check_invariants()
    s.unpark("r")
    plan = s.schedule()
    assert plan is not None and plan.scheduled_request_ids == ["r"] and plan.num_scheduled_tokens == [1]
    new = plan.new_requests[0]
    assert new.token_ids == list(range(10, 19)) + [7] and new.num_computed_tokens == 9
    assert new.num_output_tokens == 1 and len(new.block_ids) == 3
    outcome = s.update(sampled_result(plan, s, token=8))
    assert outcome.detok is not None and outcome.detok.offsets == [1]  # the second output token
    assert s.counters.prefill_tokens == 0 and s.counters.decode_tokens == 1
    s.check_invariants()


# ---------------------------------------------------------------------------------------------
# Routing and the command line


def test_router_sends_new_requests_to_the_least_loaded_prompt_engine(redis_url: str, prefix: str) -> None:
    from rill.services.tokenizer.router import Router
    from rill.shared.schema import encode

    bus = Bus(redis_url, prefix)
    s = bus.streams
    try:
        bus.r.sadd(s.engines_key(), 0, 1, 2, 3)
        bus.r.set(s.stats_key(0), encode(EngineStats(0, role="prefill", num_running=4, num_waiting=1)))
        bus.r.set(s.stats_key(1), encode(EngineStats(1, role="prefill", num_running=1, num_transferring=1)))
        bus.r.set(s.stats_key(2), encode(EngineStats(2, role="decode")))  # idle, but takes no prompts
        router = Router(bus)  # engine 3 has no stats yet: unknown role, not used while others are known
        picks = [router.pick() for _ in range(5)]
        assert picks == [1, 1, 1, 0, 1]  # load 2 vs 5, plus what this router sent since reading them
        bus.r.srem(s.engines_key(), 0, 1)
        router._read_at = float("-inf")
        assert router.pick() == 3  # only a decode engine and an unknown one: the unknown one
    finally:
        bus.r.delete(s.engines_key(), *(s.stats_key(e) for e in range(4)))
        bus.close()


def test_serve_flags_start_prefill_and_decode_engines() -> None:
    from rill.services.cli import build_parser
    from rill.services.launcher import engine_children, engine_roles

    ns = build_parser().parse_args(["serve", "--prefill-engines", "1", "--decode-engines", "2"])
    assert engine_roles(ns) == [(0, "prefill"), (1, "decode"), (2, "decode")]
    kids = engine_children(ns, "/model", "t")
    assert [k.name for k in kids] == ["worker-0-prefill", "scheduler-0-prefill", "worker-1-decode",
                                      "scheduler-1-decode", "worker-2-decode", "scheduler-2-decode"]
    for kid in kids:
        parsed = build_parser().parse_args(kid.argv[3:])  # after `python -m rill.services.cli`
        assert parsed.command == "service" and parsed.name == kid.kind
        assert (parsed.engine_id, parsed.role) == (int(kid.name.split("-")[1]), kid.name.split("-")[2])
    colocated = build_parser().parse_args(["serve"])
    assert engine_roles(colocated) == [(0, "both")] and len(engine_children(colocated, "m", "t")) == 2
    with pytest.raises(SystemExit):
        engine_roles(build_parser().parse_args(["serve", "--prefill-engines", "1"]))


# ---------------------------------------------------------------------------------------------
# A colocated baseline in this process: the same Scheduler and ModelRunner, no broker


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    n: int = 1

    def sample_ids(self) -> list[str]:
        return [self.rid] if self.n == 1 else [f"{self.rid}:{i}" for i in range(self.n)]


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def colocated_outputs(runner: ModelRunner, jobs: list[Job], eos: list[int], budget: int,
                      block_size: int) -> dict[str, Output]:
    s = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget,
                                  max_model_len=runner.max_model_len),
                  KVCacheManager(runner.num_blocks, block_size))
    runner.reset()
    for job in jobs:
        s.add(TokenizedRequest(request_id=job.rid, reply_to="-", prompt_token_ids=job.prompt, eos_token_ids=eos,
                               params=SamplingParams(temperature=0.0, max_tokens=job.max_tokens, n=job.n,
                                                     logprobs=2), arrival_time=0.0))
    outs: dict[str, Output] = {}
    while (plan := s.schedule()) is not None:
        result = runner.execute(plan)
        assert result.error is None, result.error
        detok = s.update(result).detok
        for i, rid in enumerate(detok.request_ids if detok else []):
            out = outs.setdefault(rid, Output())
            out.tokens += detok.new_token_ids[i]
            out.logprobs += detok.logprobs[i]
            out.finish = detok.finish_reasons[i] or out.finish
    return outs


def assert_same_greedy(label: str, ours: list[int], base: Output) -> None:
    """Token for token; where they part, the baseline's own top-2 log-probabilities must be a
    near-tie there (batches of different shapes round differently), else it is a bug."""
    theirs = base.tokens
    if ours == theirs:
        return
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    assert k < len(base.logprobs), f"{label}: ours {ours} runs past the baseline {theirs}"
    top = base.logprobs[k].logprobs[1:]
    gap = top[0] - top[1]
    assert gap < NEAR_TIE, f"{label}: diverged at output token {k} (top-2 gap {gap:.4g}):\n{ours}\n{theirs}"


# ---------------------------------------------------------------------------------------------
# Engines as threads in this process, over the real broker, with the tiny model


class ThreadEngines:
    """Schedulers and workers run as threads (their services' own `run`); requests go straight
    to an engine's input stream and outputs are read from the detok stream and reply stream."""

    def __init__(self, redis_url: str, prefix: str, model_dir: str) -> None:
        self.url, self.prefix, self.model_dir = redis_url, prefix, model_dir
        self.bus = Bus(redis_url, prefix)
        self.s = self.bus.streams
        self.threads: dict[int, tuple[StopFlag, list[threading.Thread]]] = {}
        self.outputs: dict[str, Output] = {}
        self.errors: dict[str, str] = {}
        self._detok_cursor = {0: b"0-0", 1: b"0-0"}  # per engine: each writes its own detok stream
        self._parked: dict[str, dict[int, tuple[list[int], str | None]]] = {}  # arrived ahead of an earlier offset
        self._reply_cursor = b"0-0"
        self.reply = f"{prefix}:reply:test"

    def start(self, engine: int, role: str, block_size: int = 4, **extra: object) -> None:
        from rill.services.scheduler.service import run as run_scheduler
        from rill.services.worker.service import run as run_worker

        args = EngineArgs(model_dir=self.model_dir, engine_id=engine, role=role, block_size=block_size,
                          kv_cache_memory=1 << 20, dtype="float32", device="cpu", max_num_batched_tokens=32,
                          max_num_seqs=16, **extra)  # type: ignore[arg-type]
        stop = StopFlag(install=False)
        threads = [threading.Thread(target=fn, args=(self.url, self.prefix, args, stop), daemon=True)
                   for fn in (run_worker, run_scheduler)]
        for t in threads:
            t.start()
        self.threads[engine] = (stop, threads)
        self.wait(lambda: self.bus.r.exists(self.s.stats_key(engine)), f"engine {engine} ready")

    def stop(self, engine: int) -> None:
        stop, threads = self.threads.pop(engine)
        stop.set()
        for t in threads:
            t.join(15)

    def close(self) -> None:
        for e in list(self.threads):
            self.stop(e)
        keys = list(self.bus.r.scan_iter(match=f"{self.prefix}:*"))
        if keys:
            self.bus.r.delete(*keys)
        self.bus.close()

    def submit(self, engine: int, job: Job, **params: object) -> None:
        self.bus.send(self.s.engine_in(engine), TokenizedRequest(
            request_id=job.rid, reply_to=self.reply, prompt_token_ids=job.prompt, eos_token_ids=[299],
            params=SamplingParams(temperature=0.0, max_tokens=job.max_tokens, n=job.n, **params),  # type: ignore[arg-type]
            arrival_time=time.time()))

    def poll(self) -> None:
        # Each engine writes its own detok stream, so a handed-off request's tokens from the decode
        # engine may be read before its first one from the prefill engine: applied by offset, as
        # the gateway does, each offset once.
        for e, cursor in self._detok_cursor.items():
            for entry_id, payload in self.bus.read(self.s.detok(e), cursor, block_ms=25, count=500):
                self._detok_cursor[e] = entry_id
                b = detok_decoder.decode(payload)
                for i, rid in enumerate(b.request_ids):
                    out, parked = self.outputs.setdefault(rid, Output()), self._parked.setdefault(rid, {})
                    assert b.offsets[i] >= len(out.tokens) and b.offsets[i] not in parked, f"{rid}: {b.offsets[i]} again"
                    parked[b.offsets[i]] = (b.new_token_ids[i], b.finish_reasons[i])
                    while len(out.tokens) in parked:
                        tokens, finish = parked.pop(len(out.tokens))
                        out.tokens += tokens
                        out.finish = finish or out.finish
                        if not tokens:
                            break
        for entry_id, payload in self.bus.read(self.reply, self._reply_cursor, block_ms=None, count=500):
            self._reply_cursor = entry_id
            msg = gateway_input_decoder.decode(payload)
            self.errors[msg.request_id] = msg.message  # type: ignore[union-attr]

    def wait(self, pred: Callable[[], object], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.poll()

    def stats(self, engine: int) -> EngineStats:
        raw = self.bus.r.get(self.s.stats_key(engine))
        assert raw is not None
        return msgspec.msgpack.decode(raw, type=EngineStats)

    def idle(self, engine: int) -> bool:
        st = self.stats(engine)
        return (st.num_running, st.num_waiting, st.num_transferring) == (0, 0, 0) \
            and st.num_free_blocks == st.num_blocks

    def kv_keys(self) -> list[bytes]:
        return list(self.bus.r.scan_iter(match=f"{self.prefix}:kv:*"))


def importing(r: redis.Redis, streams: Streams, engine: int) -> bool:
    """Whether the engine's scheduler has sent its worker a plan with a KV import."""
    for _, fields in r.xrange(streams.plan(engine)):
        msg = worker_input_decoder.decode(fields[b"m"])
        if isinstance(msg, StepPlan) and msg.kv_imports:
            return True
    return False


@pytest.fixture
def engines(redis_url: str, prefix: str, tiny_llama) -> Iterator[ThreadEngines]:
    e = ThreadEngines(redis_url, prefix, str(tiny_llama[0]))
    try:
        yield e
    finally:
        e.close()


def tiny_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 290, (n,), generator=g).tolist()


@pytest.mark.parametrize("speculative", ["", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'],
                         ids=["plain", "speculative"])
def test_handoff_between_engine_threads_matches_colocated(engines: ThreadEngines, tiny_llama, speculative: str) -> None:
    engines.start(0, "prefill", speculative_config=speculative)
    engines.start(1, "decode", speculative_config=speculative)
    jobs = [Job(f"j{i}", tiny_prompt(i, 3 + (i * 13) % 70), [1, 2, 6, 20, 33][i % 5]) for i in range(10)]
    jobs.append(Job("pair", tiny_prompt(99, 21), 9, n=2))
    for job in jobs:
        engines.submit(0, job)
    samples = [sid for job in jobs for sid in job.sample_ids()]
    engines.wait(lambda: all(engines.outputs.get(s, Output()).finish for s in samples), "every request to finish")
    runner = ModelRunner(str(tiny_llama[0]), dtype="float32", device="cpu", num_blocks=256, block_size=4)
    base = colocated_outputs(runner, jobs, [299], budget=32, block_size=4)
    for sid in samples:
        assert_same_greedy(sid, engines.outputs[sid].tokens, base[sid])
        assert engines.outputs[sid].finish == base[sid].finish
    assert not engines.errors
    engines.wait(lambda: engines.idle(0) and engines.idle(1), "both engines to be idle")
    prefill, decode = engines.stats(0), engines.stats(1)
    handed = sum(1 for s in samples if len(base[s].tokens) > 1)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.kv_transfers_sent == decode.kv_transfers_received == handed > 0
    assert prefill.kv_bytes_sent == decode.kv_bytes_received > 0 and prefill.kv_transfer_seconds_sum > 0
    assert 0 < decode.kv_handoff_seconds_sum < 10 * handed
    assert prefill.decode_tokens == 0, "the prefill engine decoded"
    assert decode.prefill_tokens == 0, "the decode engine ran a prompt"
    assert not engines.kv_keys(), "transfer chunks were left behind"
    if speculative:  # the decode engine verified drafts on handed-over KV, greedy output unchanged
        assert decode.spec_num_accepted_tokens > 0 and prefill.spec_num_drafts == 0


def test_stop_abort_reaching_the_prefill_engine_is_forwarded(engines: ThreadEngines) -> None:
    engines.start(0, "prefill")
    engines.start(1, "decode")
    engines.submit(0, Job("long", tiny_prompt(5, 12), 200), ignore_eos=True)
    engines.wait(lambda: len(engines.outputs.get("long", Output()).tokens) >= 3, "decoding on engine 1")
    # What the detokenizer does when the first token ends in a stop string: abort at its engine.
    engines.bus.send(engines.s.engine_in(0), AbortRequest(request_ids=["long"], reason="stop"))
    engines.wait(lambda: engines.stats(1).aborted_requests == 1, "engine 1 to drop the request")
    engines.wait(lambda: engines.idle(0) and engines.idle(1), "both engines to be idle")
    assert len(engines.outputs["long"].tokens) < 200


def test_incompatible_decode_engine_fails_the_request_cleanly(engines: ThreadEngines) -> None:
    engines.start(0, "prefill", block_size=4)
    engines.start(1, "decode", block_size=8)
    engines.submit(0, Job("r", tiny_prompt(6, 10), 5))
    engines.wait(lambda: "r" in engines.errors, "an error reply")
    assert "block size mismatch" in engines.errors["r"] and "--block-size" in engines.errors["r"]
    engines.wait(lambda: engines.idle(0) and engines.idle(1), "both engines to be idle")
    assert engines.stats(0).kv_transfer_failures == 1 and not engines.kv_keys()


def test_without_a_decode_engine_the_prefill_engine_decodes(engines: ThreadEngines) -> None:
    engines.start(0, "prefill")
    engines.submit(0, Job("solo", tiny_prompt(7, 9), 6), ignore_eos=True)
    engines.wait(lambda: engines.outputs.get("solo", Output()).finish == "length", "the request to finish")
    assert len(engines.outputs["solo"].tokens) == 6
    engines.wait(lambda: engines.idle(0), "engine 0 to be idle")
    assert engines.stats(0).decode_tokens == 5


def test_unacknowledged_transfer_times_out(engines: ThreadEngines, monkeypatch: pytest.MonkeyPatch) -> None:
    from rill.services.scheduler import disagg_prefill

    monkeypatch.setattr(disagg_prefill, "TRANSFER_TIMEOUT_S", 0.5)
    monkeypatch.setenv("RILL_TEST_KV_IMPORT_DELAY_S", "2")  # only the decode worker imports
    engines.start(0, "prefill")
    engines.start(1, "decode")
    engines.submit(0, Job("slow", tiny_prompt(8, 10), 8), ignore_eos=True)
    engines.wait(lambda: "slow" in engines.errors, "an error reply")
    assert "not acknowledged within" in engines.errors["slow"]
    # The decode engine imported it late, then got the prefill engine's abort.
    engines.wait(lambda: engines.idle(0) and engines.idle(1), "both engines to be idle")
    assert not engines.kv_keys()


def test_decode_engine_gone_mid_transfer_fails_its_requests(engines: ThreadEngines,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RILL_TEST_KV_IMPORT_DELAY_S", "4")
    engines.start(0, "prefill")
    engines.start(1, "decode")
    engines.submit(0, Job("a", tiny_prompt(9, 10), 8), ignore_eos=True)
    engines.wait(lambda: importing(engines.bus.r, engines.s, 1), "the import to start")
    engines.stop(1)  # heartbeats stop; its worker is still inside the import
    engines.wait(lambda: "a" in engines.errors, "an error reply", timeout=20)
    assert "decode engine 1 was lost during KV transfer" in engines.errors["a"]
    engines.wait(lambda: engines.idle(0), "engine 0 to be idle")
    assert not engines.kv_keys()


# ---------------------------------------------------------------------------------------------
# The whole stack with SmolLM2: every service its own OS process


def sse_completion(base: str, body: dict) -> dict:
    """One streamed completion: {"status", "tokens" (text chunks), "error"}."""
    out: dict = {"status": 0, "chunks": [], "error": None}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=180) as client, \
                client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["error"] = json.loads(await resp.aread())["error"]["message"]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out["error"] = obj["error"]["message"]
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        out["chunks"].append(choice["text"])

    asyncio.run(go())
    return out


@dataclass
class DisaggStack:
    stack: ServiceStack
    model_dir: str
    flags: list[str]
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)


@pytest.fixture(scope="module")
def disagg_stack(redis_url: str, smollm2_dir: str) -> Iterator[DisaggStack]:
    from rill.shared.broker import free_port

    prefix = f"rilldisagg-{uuid.uuid4().hex[:8]}"
    port = free_port()
    flags = fast_flags(smollm2_dir, redis_url, prefix, port) + [
        "--block-size", "8", "--kv-cache-memory", "256MiB", "--max-num-seqs", "32"]
    cmd = [*rill_executable(), "service"]
    commands = {
        "worker-0": [*cmd, "worker", *flags, "--engine-id", "0", "--role", "prefill"],
        "scheduler-0": [*cmd, "scheduler", *flags, "--engine-id", "0", "--role", "prefill"],
        "worker-1": [*cmd, "worker", *flags, "--engine-id", "1", "--role", "decode"],
        "scheduler-1": [*cmd, "scheduler", *flags, "--engine-id", "1", "--role", "decode"],
        **{name: [*cmd, name, *flags, "--replica-name", f"{name}-0"] for name in ("tokenizer", "detokenizer", "gateway")},
    }
    # One thread per worker: two workers spinning two OpenMP threads each on two cores slow each
    # other down many times over.
    env = dict(os.environ, RILL_WORKER_THREADS="1", PYTHONUNBUFFERED="1")
    stack = ServiceStack(redis_url, prefix, port, commands, env=env).start()
    out = DisaggStack(stack, smollm2_dir, [*cmd, "{name}", *flags])
    try:
        deadline = time.monotonic() + 120
        while not stack.redis.exists(stack.streams.stats_key(1)):
            assert time.monotonic() < deadline, "the decode engine did not start"
            time.sleep(0.3)
        yield out
    finally:
        for p in out.extra:
            if p.poll() is None:
                p.kill()
                p.wait()
        stack.stop()
        keys = list(stack.redis.scan_iter(match=f"{prefix}:*"))
        if keys:
            stack.redis.delete(*keys)


def engine_stats(ds: DisaggStack, engine: int) -> EngineStats:
    raw = ds.stack.redis.get(ds.stack.streams.stats_key(engine))
    assert raw is not None
    return msgspec.msgpack.decode(raw, type=EngineStats)


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def engine_idle(ds: DisaggStack, engine: int) -> bool:
    st = engine_stats(ds, engine)
    return (st.num_running, st.num_waiting, st.num_transferring) == (0, 0, 0) and st.num_free_blocks == st.num_blocks


def smollm2_jobs(tok) -> list[Job]:
    texts = ["The history of the printing press", "A recipe for bread:", "def fibonacci(n):",
             "Dear hiring manager, I am writing to", "Rivers flow to the sea because", "1, 2, 3, 5, 8,",
             "The quick brown fox", "In a distant galaxy, a lone pilot"]
    jobs = []
    for i in range(16):
        filler = " The river keeps flowing past the old mill." * ((i * 7) % 33)
        ids = tok(texts[i % len(texts)] + filler, add_special_tokens=True)["input_ids"]
        jobs.append(Job(f"q{i}", list(ids), [1, 3, 8, 14, 22, 30][i % 6], n=2 if i == 5 else 1))
    return jobs


def test_disaggregated_greedy_equals_colocated_smollm2(disagg_stack: DisaggStack) -> None:
    from transformers import AutoTokenizer

    from rill.shared.config import ModelConfig

    ds = disagg_stack
    tok = AutoTokenizer.from_pretrained(ds.model_dir)
    jobs = smollm2_jobs(tok)
    assert max(len(j.prompt) for j in jobs) > 256  # some prompts take several prefill chunks
    base_url = ds.stack.base_url

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            async def one(job: Job) -> dict:
                resp = await client.post("/v1/completions", json={
                    "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "n": job.n,
                    "logprobs": 1, "return_tokens_as_token_ids": True})
                assert resp.status_code == 200, resp.text
                return resp.json()
            return await asyncio.gather(*[one(j) for j in jobs])

    responses = asyncio.run(run_all())
    eos = sorted(set(ModelConfig.from_dir(ds.model_dir).eos_token_ids) | {tok.eos_token_id})
    runner = ModelRunner(ds.model_dir, dtype="float32", device="cpu", num_blocks=1024, block_size=8,
                         max_model_len=2048)
    base = colocated_outputs(runner, jobs, eos, budget=256, block_size=8)
    handed = 0
    for job, resp in zip(jobs, responses, strict=True):
        for choice, sid in zip(resp["choices"], job.sample_ids(), strict=True):
            ours = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            if base[sid].finish == "stop" and ours == base[sid].tokens[:-1]:
                ours = base[sid].tokens  # the stop token is not shown
            assert_same_greedy(sid, ours, base[sid])
            handed += len(base[sid].tokens) > 1
    wait_for(lambda: engine_idle(ds, 0) and engine_idle(ds, 1), "both engines to be idle", 30)
    prefill, decode = engine_stats(ds, 0), engine_stats(ds, 1)
    assert prefill.kv_transfers_sent == decode.kv_transfers_received == handed > 10
    assert prefill.decode_tokens == 0 and decode.prefill_tokens == 0
    assert decode.kv_import_seconds_sum > 0 and prefill.kv_export_seconds_sum > 0
    assert not list(ds.stack.redis.scan_iter(match=f"{ds.stack.prefix}:kv:*"))


def test_structured_outputs_survive_the_handoff(disagg_stack: DisaggStack) -> None:
    """The decode engine's worker replays the prefill engine's first token into a fresh grammar
    matcher: constrained outputs decoded there still validate."""
    import jsonschema

    ds = disagg_stack
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
    sent_before = engine_stats(ds, 0).kv_transfers_sent

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=ds.stack.base_url, timeout=300) as client:
            async def one(i: int) -> dict:
                resp = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Describe person number {i} as JSON."}],
                    "max_tokens": 60, "temperature": 1.0, "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
                assert resp.status_code == 200, resp.text
                return resp.json()
            return await asyncio.gather(*[one(i) for i in range(6)])

    for resp in asyncio.run(run_all()):
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    wait_for(lambda: engine_idle(ds, 0) and engine_idle(ds, 1), "both engines to be idle", 30)
    assert engine_stats(ds, 0).kv_transfers_sent >= sent_before + 6  # every one decoded on engine 1


def test_killing_the_decode_engine_mid_transfer_fails_requests_and_frees_blocks(disagg_stack: DisaggStack) -> None:
    ds = disagg_stack
    stack = ds.stack
    # A second decode engine whose worker dawdles in every import (test hook), then engine 1 leaves,
    # so every hand-off goes to engine 2 and stays in flight.
    env = dict(stack.env, RILL_TEST_KV_IMPORT_DELAY_S="120")
    for kind in ("worker", "scheduler"):
        argv = [a.replace("{name}", kind) for a in ds.flags] + ["--engine-id", "2", "--role", "decode"]
        ds.extra.append(subprocess.Popen(argv, env=env))
    wait_for(lambda: bool(stack.redis.exists(stack.streams.stats_key(2))), "engine 2 to start", 120)
    for name in ("scheduler-1", "worker-1"):
        stack.procs[name].terminate()
        stack.procs[name].wait(15)
    wait_for(lambda: not stack.redis.exists(stack.streams.heartbeat("scheduler", 1)), "engine 1 to leave")

    results: list[dict] = [{}, {}, {}]

    def client(i: int) -> None:
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": 12, "temperature": 0}
        if i < 2:
            results[i] = sse_completion(stack.base_url, body)
        else:
            r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=180)
            results[i] = {"status": r.status_code, "error": r.json().get("error", {}).get("message")}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()

    wait_for(lambda: importing(stack.redis, stack.streams, 2), "engine 2 to start importing", 60)
    wait_for(lambda: engine_stats(ds, 0).num_transferring == 3, "all three to be in transfer", 30)
    for p in ds.extra:
        p.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(60)
    for r in results[:2]:  # streams: the first token came from the prefill engine, then an error event
        assert r["status"] == 200 and "decode engine 2 was lost during KV transfer" in (r["error"] or ""), r
    assert any(r["chunks"] for r in results[:2]), results
    assert results[2]["status"] == 503
    assert "decode engine 2 was lost during KV transfer" in results[2]["error"]
    wait_for(lambda: engine_idle(ds, 0), "the prefill engine's blocks to be free", 20)
    assert engine_stats(ds, 0).aborted_requests >= 3
    assert not list(stack.redis.scan_iter(match=f"{stack.prefix}:kv:*"))
    # With no decode engine left, the prefill engine serves requests whole.
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
