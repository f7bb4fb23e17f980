"""Prometheus metrics at GET /metrics (prometheus-client), named `rill:*` after vLLM's V1 names
where the meaning is the same. Every Gateway owns its own CollectorRegistry (several gateways can
live in one process, as in the tests), and every series carries `model_name`.

Frontend metrics are measured here, on the gateway's monotonic clock, per client request:

- rill:time_to_first_token_seconds: from the request's arrival (its stream is registered, right
  after validation) to the first delta that carries tokens, of any sample. A delta whose tokens
  decode to no text yet (half a UTF-8 character) still counts: the token was generated.
- rill:inter_token_latency_seconds: per token, between consecutive token deltas of one sample.
  A delta with k tokens that arrives g seconds after the previous one observes g/k, k times, so
  the histogram's count is the number of tokens after each sample's first one.
- rill:e2e_request_latency_seconds, rill:prompt_tokens, rill:generation_tokens and
  rill:request_success{finished_reason}: once per finished request. As in vLLM, "success" counts
  every request that reached the pipeline and ended: stop, length, abort (cancelled, client
  gone) and error (an error reply or a failed generation after the request was queued).
  A request refused with a 4xx error reply before any token (the tokenizer's length checks)
  never ran and is counted nowhere, like a request vLLM rejects in its frontend. With n > 1
  samples the request counts once: its generation tokens are the sum over samples, its prompt
  tokens counted once, its reason the most severe of its samples' (error > abort > length > stop).

Engine metrics (running/waiting requests, KV cache usage, prefix cache queries/hits,
preemptions, queue time) are read at scrape time from every engine's EngineStats key and
labelled `engine` as well; queue time is known only to the scheduler, which keeps it as a
cumulative histogram in EngineStats.

Replica backlog (rill:consumer_group_lag, rill:consumer_group_pending, by `group`): per consumer
group of the replicated stages (tokenizers, detokenizers), the entries of its stream not yet
delivered to any replica and those delivered but not acked, read from XINFO GROUPS at scrape time.
A growing lag means the stage needs replicas (an autoscaler can act on it).

Counters are per process: each gateway replica counts the requests it served (and exports every
engine's series, identical across replicas). Prometheus sums the replicas' frontend counters;
engine series should be read from one replica (or with max by engine).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rill.services.gateway.engine_stats import read_engine_stats
from rill.shared.heartbeat import engine_ids
from rill.shared.schema import EngineStats, ErrorReply, TextDelta
from rill.shared.streams import DETOKENIZER_GROUP, TOKENIZER_GROUP

if TYPE_CHECKING:
    from rill.services.gateway.gateway import Gateway

log = logging.getLogger("rill.gateway.metrics")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Fine at the low end: a small model on a GPU decodes a token every few milliseconds.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 3600.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
_SEVERITY = {"error": 3, "abort": 2, "length": 1, "stop": 0}  # unknown reasons rank below stop


class GatewayMetrics:
    """The registry of one gateway and the frontend metrics' label-bound children."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("rill:time_to_first_token_seconds", "Time to first token, from arrival at the gateway.",
                              lab, registry=reg, buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("rill:inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
                             lab, registry=reg, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("rill:e2e_request_latency_seconds", "Arrival to the end of a request.",
                             lab, registry=reg, buckets=E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter("rill:prompt_tokens", "Prompt tokens of finished requests.",
                                     lab, registry=reg).labels(model_name)
        self.generation_tokens = Counter("rill:generation_tokens", "Generated tokens of finished requests.",
                                         lab, registry=reg).labels(model_name)
        success = Counter("rill:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self._success = success
        self.resent = Counter("rill:requests_resent", "Requests sent again after their engine was lost before "
                              "their client saw any of them.", lab, registry=reg).labels(model_name)
        for reason in FINISH_REASONS:  # present (at 0) before the first request, as dashboards expect
            success.labels(model_name, reason)
        self.engines = EngineCollector(model_name)
        reg.register(self.engines)
        self.backlogs = BacklogCollector(model_name)
        reg.register(self.backlogs)

    def request(self, n: int = 1) -> RequestMetrics:
        return RequestMetrics(self, n)

    def finished(self, reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.e2e.observe(e2e_s)

    def render(self, engine_stats: Sequence[EngineStats], backlogs: Sequence[GroupBacklog] = ()) -> bytes:
        """The exposition text, with the engine series taken from `engine_stats` and the replica
        backlog series from `backlogs`."""
        # Set and generate without an await in between: concurrent scrapes cannot interleave.
        self.engines.snapshot = list(engine_stats)
        self.backlogs.snapshot = list(backlogs)
        return generate_latest(self.registry)


class RequestMetrics:
    """The timings and counts of one request, fed by its RequestStream; reports once at its end.

    `accepted` is set while the request is (being) sent to the pipeline; a request whose send
    failed was answered with an error at once and is not counted.
    """

    __slots__ = ("m", "arrival", "first_token", "last_token", "reasons", "prompt_tokens", "completion_tokens",
                 "accepted", "done")

    def __init__(self, m: GatewayMetrics, n: int = 1) -> None:
        self.m = m
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: list[float | None] = [None] * n  # per sample
        self.reasons: list[str | None] = [None] * n
        self.prompt_tokens = 0
        self.completion_tokens = [0] * n
        self.accepted = False
        self.done = False

    def deltas(self, index: int, deltas: list[TextDelta]) -> None:
        """In-order deltas of sample `index`, as its sequencer releases them."""
        now = time.monotonic()
        for d in deltas:
            if d.num_tokens > 0:
                if self.first_token is None:
                    self.first_token = now
                    self.m.ttft.observe(now - self.arrival)
                last = self.last_token[index]
                if last is not None:
                    per_token = (now - last) / d.num_tokens
                    for _ in range(d.num_tokens):
                        self.m.itl.observe(per_token)
                self.last_token[index] = now
            self.prompt_tokens = max(self.prompt_tokens, d.prompt_tokens)
            # Offsets count output tokens, so they bound the count even if a delta omits it.
            self.completion_tokens[index] = max(self.completion_tokens[index], d.completion_tokens,
                                                d.offset + d.num_tokens)
            if d.finish_reason is not None:
                self.reasons[index] = d.finish_reason

    def restart(self) -> None:
        """Sent again after its engine was lost: the wait for the new engine is no inter-token gap."""
        self.last_token = [None] * len(self.last_token)

    def finish(self) -> None:
        """Every sample finished, or one failed (the request ends in error)."""
        reasons = [r for r in self.reasons if r is not None] or ["stop"]
        self._end(max(reasons, key=lambda r: _SEVERITY.get(r, -1)))

    def fail(self, err: ErrorReply) -> None:
        if err.status < 500 and self.first_token is None:
            self.done = True  # refused before it ran (e.g. the prompt is too long): not a request
            return
        self._end("error")

    def abort(self) -> None:
        self._end("abort")

    def _end(self, reason: str) -> None:
        if self.done or not self.accepted:
            return
        self.done = True
        self.m.finished(reason, self.prompt_tokens, sum(self.completion_tokens), time.monotonic() - self.arrival)


S = TypeVar("S")  # a snapshot row


class _SnapshotCollector(Generic[S]):
    """Series built from a snapshot the gateway reads just before each scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[S] = []

    def describe(self) -> Iterator[Metric]:
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        return self._families(self.snapshot)

    def _families(self, rows: list[S]) -> Iterator[Metric]:
        raise NotImplementedError


# Per-engine series that are one EngineStats field each: (family, name, help, field).
_ENGINE_SERIES: list[tuple[type[Metric], str, str, str]] = [
    (GaugeMetricFamily, "num_requests_running", "Requests in the engine's running batch.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_usage"),
    (CounterMetricFamily, "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache (a preempted request's lookups again not counted).",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", "prefix_cache_hits"),
    (CounterMetricFamily, "num_preemptions", "Requests preempted (recomputed later).", "preemptions"),
    (GaugeMetricFamily, "num_requests_transferring",
     "Requests whose KV is being handed to or taken from another engine.", "num_transferring"),
    (CounterMetricFamily, "kv_transfer_failures", "KV transfers that failed.", "kv_transfer_failures"),
    # Speculative decoding: vLLM's counters (the two ratios a dashboard wants come below).
    (CounterMetricFamily, "spec_decode_num_drafts", "Decode rows that verified draft tokens.", "spec_num_drafts"),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_num_draft_tokens"),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
]


class EngineCollector(_SnapshotCollector[EngineStats]):
    """Engine-side series, from the engines' EngineStats."""

    def _families(self, stats: list[EngineStats]) -> Iterator[Metric]:
        lab = ["model_name", "engine", "role"]  # role: both | prefill | decode (disaggregation)
        plain = [(family(f"rill:{name}", doc, labels=lab), field)  # type: ignore[call-arg]
                 for family, name, doc, field in _ENGINE_SERIES]
        queue = HistogramMetricFamily("rill:request_queue_time_seconds",
                                      "Arrival at the gateway to the first schedule.", labels=lab)
        kv_bytes = CounterMetricFamily("rill:kv_transfer_bytes", "KV bytes moved between engines.",
                                       labels=[*lab, "direction"])
        # Sum and count: hand-offs the decode engine acknowledged, first token -> ack on the
        # prefill engine; imports done, first token -> request in the decode batch.
        transfer_s = SummaryMetricFamily("rill:kv_transfer_seconds",
                                         "Prefill engine: first token to the decode engine's ack.", labels=lab)
        handoff_s = SummaryMetricFamily("rill:kv_handoff_seconds",
                                        "Decode engine: first token (on the prefill engine) to joining the batch.",
                                        labels=lab)
        rate = GaugeMetricFamily("rill:spec_decode_acceptance_rate", "Accepted / proposed draft tokens.", labels=lab)
        length = GaugeMetricFamily("rill:spec_decode_mean_accepted_length",
                                   "Tokens per verifying decode row: 1 + accepted drafts / rows.", labels=lab)
        for st in stats:
            values = [self.model_name, str(st.engine_id), st.role]
            for family, field in plain:
                family.add_metric(values, getattr(st, field))  # type: ignore[attr-defined]
            kv_bytes.add_metric([*values, "sent"], st.kv_bytes_sent)
            kv_bytes.add_metric([*values, "received"], st.kv_bytes_received)
            transfer_s.add_metric(values, st.kv_transfers_sent, st.kv_transfer_seconds_sum)
            handoff_s.add_metric(values, st.kv_transfers_received, st.kv_handoff_seconds_sum)
            buckets = queue_buckets(st)
            if buckets is not None:
                queue.add_metric(values, buckets, st.queue_time_sum)
            if st.spec_num_drafts:  # engines that have verified drafts
                rate.add_metric(values, st.spec_num_accepted_tokens / st.spec_num_draft_tokens)
                length.add_metric(values, 1 + st.spec_num_accepted_tokens / st.spec_num_drafts)
        yield from (family for family, _ in plain)
        yield from (queue, kv_bytes, transfer_s, handoff_s, rate, length)


def queue_buckets(st: EngineStats) -> list[tuple[str, float]] | None:
    """The queue-time histogram of one engine as (le, cumulative count) pairs ending at +Inf,
    or None when the scheduler sent none (or a malformed one: the counts must fit the bounds)."""
    bounds, counts = st.queue_time_bounds, st.queue_time_counts
    if not counts or len(counts) != len(bounds) + 1:
        return None
    return [(floatToGoString(b), c) for b, c in zip(bounds, counts[:-1], strict=True)] + [("+Inf", counts[-1])]


@dataclass(frozen=True)
class GroupBacklog:
    """One consumer group's backlog: entries not yet delivered (None: the broker cannot tell)
    and entries delivered but not acked."""

    group: str
    lag: int | None
    pending: int


class BacklogCollector(_SnapshotCollector[GroupBacklog]):
    """Replica backlog series, from the consumer groups' state."""

    def _families(self, backlogs: list[GroupBacklog]) -> Iterator[Metric]:
        lab = ["model_name", "group"]
        lag = GaugeMetricFamily("rill:consumer_group_lag",
                                "Entries of a replicated stage's stream not yet delivered to a replica.", labels=lab)
        pending = GaugeMetricFamily("rill:consumer_group_pending",
                                    "Entries delivered to a replica and not yet acked.", labels=lab)
        for b in backlogs:
            if b.lag is not None:
                lag.add_metric([self.model_name, b.group], b.lag)
            pending.add_metric([self.model_name, b.group], b.pending)
        yield from (lag, pending)


async def replica_groups(gw: Gateway) -> list[tuple[str, str]]:
    """(stream, consumer group) of every replicated stage's streams: every listed gateway's
    requests stream (tokenizers) and every listed engine's detok stream (detokenizers)."""
    assert gw.bus is not None
    s = gw.bus.streams
    replies, engines = await asyncio.gather(gw.bus.r.smembers(s.gateways_key()), gw.bus.r.smembers(s.engines_key()))
    return ([(s.requests_for(r.decode() if isinstance(r, bytes) else r), TOKENIZER_GROUP) for r in sorted(replies)]
            + [(s.detok(e), DETOKENIZER_GROUP) for e in engine_ids(engines)])


async def read_backlogs(gw: Gateway) -> list[GroupBacklog]:
    """XINFO GROUPS of the replicated stages' streams, summed per group (a stream not created
    yet, or expired with its gateway, counts nothing); what an autoscaler watches."""
    assert gw.bus is not None
    pairs = await replica_groups(gw)
    replies = await asyncio.gather(*(gw.bus.r.xinfo_groups(stream) for stream, _ in pairs), return_exceptions=True)
    lag: dict[str, int | None] = {}
    pending: dict[str, int] = {}
    for (_, group), groups in zip(pairs, replies, strict=True):
        if isinstance(groups, BaseException):
            continue  # no such stream
        for g in groups:
            if g["name"] in (group, group.encode()):
                one, before = g.get("lag"), lag.get(group, 0)
                lag[group] = None if one is None or before is None else before + one
                pending[group] = pending.get(group, 0) + int(g["pending"])
    return [GroupBacklog(group, lag[group], pending[group]) for group in lag]


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        stats = await read_engine_stats(gw.bus)
        backlogs = await read_backlogs(gw)
    except Exception as exc:  # the broker is away: still serve the gateway's own series
        log.debug("engine stats unavailable for /metrics: %r", exc)
        stats, backlogs = [], []
    return Response(gw.metrics.render(stats, backlogs), media_type=CONTENT_TYPE_LATEST)


def routes() -> list[Route]:
    return [Route("/metrics", metrics, methods=["GET"])]
