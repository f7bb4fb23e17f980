"""/metrics after a known workload, --api-key, request-body limits and /openapi.json.

A real gateway (uvicorn, real Redis) whose downstream services the test plays: it reads the
GenerateRequests and answers on the gateway's reply stream, so every token count and finish
reason of the workload is known exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import msgspec
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from service_stack import SentRequests
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from rill.services.gateway.app import create_app
from rill.services.gateway.metrics import GatewayMetrics
from rill.services.scheduler.kv_cache_manager import KVCacheManager
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
from rill.services.scheduler.step_stats import QUEUE_TIME_BOUNDS
from rill.shared.broker import free_port
from rill.shared.bus import FIELD
from rill.shared.request_params import SamplingParams, sample_request_id
from rill.shared.schema import (
    EngineStats,
    ErrorReply,
    GenerateRequest,
    ReplyBatch,
    StepResult,
    TextDelta,
    TokenizedRequest,
    encode,
    generate_decoder,
)
from rill.shared.streams import DETOKENIZER_GROUP, Streams

MODEL = "test-model"
KEY = "sk-rill-test-key"

# ---------------------------------------------------------------------------------------------
# Harness


class Server:
    """create_app served by uvicorn in a background thread, on a free port and its own prefix."""

    def __init__(self, redis_url: str, prefix: str, **kw: object) -> None:
        self.prefix = prefix
        self.port = free_port()
        self.app = create_app(redis_url, prefix, MODEL, 2048, **kw)  # type: ignore[arg-type]
        self.gateway = self.app.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def make_server(redis_url: str, prefix: str) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(**kw: object) -> Server:
        servers.append(Server(redis_url, f"{prefix}-{len(servers)}", **kw))
        return servers[-1]

    yield make
    r = redis.Redis.from_url(redis_url)
    for s in servers:
        s.stop()
        keys = list(r.scan_iter(match=f"{s.prefix}:*"))
        if keys:
            r.delete(*keys)
    r.close()


class Downstream:
    """Plays tokenizer + detokenizer: reads the gateway's requests and writes its replies."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.streams = Streams(prefix)
        self.r = aioredis.Redis.from_url(redis_url)
        self.sent = SentRequests(self.r, self.streams)

    async def next_request(self, timeout: float = 5.0) -> GenerateRequest:
        return generate_decoder.decode(await self.sent.next(timeout))

    async def num_requests(self) -> int:
        return await self.sent.count()

    async def reply(self, req: GenerateRequest, deltas: list[TextDelta]) -> None:
        await self.r.xadd(req.reply_to, {FIELD: encode(ReplyBatch(deltas=deltas))})

    async def error(self, req: GenerateRequest, status: int) -> None:
        await self.r.xadd(req.reply_to, {FIELD: encode(ErrorReply(req.request_id, "it failed", status=status))})


@pytest.fixture
async def down_of(redis_url: str) -> AsyncIterator[Callable[[Server], Downstream]]:
    made: list[Downstream] = []

    def make(server: Server) -> Downstream:
        made.append(Downstream(redis_url, server.prefix))
        return made[-1]

    yield make
    for d in made:
        await d.r.aclose()


def deltas(request_id: str, tokens: list[int], finish: str | None, prompt_tokens: int) -> list[TextDelta]:
    """One delta per entry of `tokens` (its token count); the last one carries `finish`."""
    out, off = [], 0
    for i, n in enumerate(tokens):
        last = i == len(tokens) - 1
        out.append(TextDelta(request_id, off, n, f"<{i}>", finish if last else None, prompt_tokens, off + n))
        off += n
    return out


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus exposition: (name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


# ---------------------------------------------------------------------------------------------
# /metrics after a known workload


async def test_metrics_match_a_known_workload(make_server, down_of) -> None:
    srv = make_server()
    down = down_of(srv)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        # 1. completion, stop: prompt 5, tokens 1+2+1 (3 after the first: 3 inter-token observations)
        t1 = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a"}))
        r1 = await down.next_request()
        await down.reply(r1, deltas(r1.request_id, [1, 2, 1], "stop", 5))
        assert (await t1).status_code == 200

        # 2. streamed completion, length: prompt 3, tokens 1+2 (2 inter-token), in separate batches
        t2 = asyncio.create_task(c.post("/v1/completions", json={"prompt": "b", "stream": True}))
        r2 = await down.next_request()
        d2 = deltas(r2.request_id, [1, 2], "length", 3)
        await down.reply(r2, d2[:1])
        await asyncio.sleep(0.05)
        await down.reply(r2, d2[1:])
        assert (await t2).status_code == 200

        # 3. chat with n=2: sample 0 stops after 1+2 tokens, sample 1 hits the length after 1;
        # counted once, as "length", with 3 + 1 generation tokens and the prompt (6) once.
        t3 = asyncio.create_task(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "c"}], "n": 2}))
        r3 = await down.next_request()
        assert r3.params.n == 2
        await down.reply(r3, deltas(sample_request_id(r3.request_id, 1, 2), [1], "length", 6)
                         + deltas(sample_request_id(r3.request_id, 0, 2), [1, 2], "stop", 6))
        resp3 = await t3
        assert resp3.status_code == 200, resp3.text
        assert resp3.json()["usage"]["completion_tokens"] == 4

        # 4. a pipeline error (503) after the request was queued: "error", no tokens
        t5 = asyncio.create_task(c.post("/v1/completions", json={"prompt": "e"}))
        r5 = await down.next_request()
        await down.error(r5, 503)
        assert (await t5).status_code == 503

        # 5. refused by the tokenizer (400, e.g. too long): never ran, counted nowhere
        t6 = asyncio.create_task(c.post("/v1/completions", json={"prompt": "f"}))
        r6 = await down.next_request()
        await down.error(r6, 400)
        assert (await t6).status_code == 400

        # 6. invalid before it was sent (the gateway's own validation): counted nowhere
        assert (await c.post("/v1/completions", json={"prompt": "g", "temperature": 7})).status_code == 400

    # 7. over the WebSocket: one token, then cancelled: "abort", prompt 2, 1 generation token
    async with connect(f"ws://127.0.0.1:{srv.port}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "completion", "id": "w", "prompt": "h"}))
        r4 = await down.next_request()
        await down.reply(r4, deltas(r4.request_id, [1], None, 2))
        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "delta"
        await ws.send(json.dumps({"type": "cancel", "id": "w"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["finish_reason"] == "abort"

    # Engine-side series come from the stats keys at scrape time.
    s = Streams(srv.prefix)
    queue = EngineStats(engine_id=1, num_running=3, num_waiting=2, kv_usage=0.25, prefix_cache_queries=100,
                        prefix_cache_hits=40, preemptions=5, queue_time_bounds=[0.1, 1.0],
                        queue_time_counts=[1, 3, 4], queue_time_sum=5.5, role="decode", num_transferring=2,
                        kv_transfers_received=6, kv_bytes_received=12345, kv_handoff_seconds_sum=0.9,
                        kv_transfer_failures=1)
    r = aioredis.Redis.from_url(srv.gateway.redis_url)
    await r.sadd(s.engines_key(), "0", "1")
    await r.set(s.stats_key(0), encode(EngineStats(engine_id=0, num_running=7, kv_usage=0.5)))
    await r.set(s.stats_key(1), encode(queue))
    # Replica backlog: 3 entries on the detokenizers' stream, one delivered and not acked.
    await r.xgroup_create(s.detok(0), DETOKENIZER_GROUP, id="0", mkstream=True)
    for _ in range(3):
        await r.xadd(s.detok(0), {FIELD: b"x"})
    await r.xreadgroup(DETOKENIZER_GROUP, "detok-a", {s.detok(0): ">"}, count=1)
    await r.aclose()

    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        resp = await c.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    m = scrape(resp.text)

    success = {reason: value(m, "rill:request_success_total", finished_reason=reason)
               for reason in ("stop", "length", "abort", "error")}
    assert success == {"stop": 1, "length": 2, "abort": 1, "error": 1}
    assert value(m, "rill:prompt_tokens_total") == 5 + 3 + 6 + 2
    assert value(m, "rill:generation_tokens_total") == 4 + 3 + 4 + 1
    assert value(m, "rill:time_to_first_token_seconds_count") == 4  # the requests that got a token
    assert value(m, "rill:inter_token_latency_seconds_count") == 3 + 2 + 2 + 0 + 0
    assert value(m, "rill:e2e_request_latency_seconds_count") == 5
    assert value(m, "rill:time_to_first_token_seconds_sum") > 0
    assert value(m, "rill:inter_token_latency_seconds_sum") >= 0.05 / 2  # request 2's gap, per token

    e0, e1 = {"engine": "0", "role": "both"}, {"engine": "1", "role": "decode"}
    assert value(m, "rill:num_requests_running", **e0) == 7
    assert value(m, "rill:num_requests_running", **e1) == 3
    assert value(m, "rill:num_requests_waiting", **e1) == 2
    assert value(m, "rill:kv_cache_usage_perc", **e0) == 0.5
    assert value(m, "rill:prefix_cache_queries_total", **e1) == 100
    assert value(m, "rill:prefix_cache_hits_total", **e1) == 40
    assert value(m, "rill:num_preemptions_total", **e1) == 5
    assert value(m, "rill:request_queue_time_seconds_bucket", **e1, le="0.1") == 1
    assert value(m, "rill:request_queue_time_seconds_bucket", **e1, le="1.0") == 3
    assert value(m, "rill:request_queue_time_seconds_bucket", **e1, le="+Inf") == 4
    assert value(m, "rill:request_queue_time_seconds_count", **e1) == 4
    assert value(m, "rill:request_queue_time_seconds_sum", **e1) == 5.5
    # Disaggregation: per-role queue lengths and transfer totals.
    assert value(m, "rill:num_requests_transferring", **e1) == 2
    assert value(m, "rill:kv_transfer_bytes_total", **e1, direction="received") == 12345
    assert value(m, "rill:kv_transfer_bytes_total", **e0, direction="sent") == 0
    assert value(m, "rill:kv_transfer_failures_total", **e1) == 1
    assert value(m, "rill:kv_handoff_seconds_count", **e1) == 6
    assert value(m, "rill:kv_handoff_seconds_sum", **e1) == 0.9
    assert value(m, "rill:consumer_group_lag", group=DETOKENIZER_GROUP) == 2
    assert value(m, "rill:consumer_group_pending", group=DETOKENIZER_GROUP) == 1
    # Engine 0 published no queue histogram: no series rather than a made-up one.
    assert ("rill:request_queue_time_seconds_count", frozenset({"model_name": MODEL, **e0}.items())) not in m


def test_registries_are_per_gateway() -> None:
    a, b = GatewayMetrics("a"), GatewayMetrics("b")
    req = a.request()
    req.accepted = True
    req.deltas(0, [TextDelta("r", 0, 2, "xy", "stop", 4, 2)])
    req.finish()
    req.abort()  # after the end: ignored
    sa = scrape(a.render([]).decode())
    sb = scrape(b.render([]).decode())
    assert sa[("rill:request_success_total", frozenset({"model_name": "a", "finished_reason": "stop"}.items()))] == 1
    assert sa[("rill:request_success_total", frozenset({"model_name": "a", "finished_reason": "abort"}.items()))] == 0
    assert sb[("rill:request_success_total", frozenset({"model_name": "b", "finished_reason": "stop"}.items()))] == 0


def test_scheduler_queue_time_histogram() -> None:
    """Observed once per client request, when its first sample is first scheduled."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                  KVCacheManager(64, 4))
    now = [1000.0]
    s.clock = lambda: now[0]

    def tok(rid: str, arrival: float, n: int = 1) -> TokenizedRequest:
        return TokenizedRequest(request_id=rid, reply_to="reply", prompt_token_ids=list(range(10, 18)),
                                params=SamplingParams(max_tokens=4, n=n), eos_token_ids=[2], arrival_time=arrival)

    def step() -> bool:
        plan = s.schedule()
        if plan is None:
            return False
        done = [rid for rid, n in zip(plan.scheduled_request_ids, plan.num_scheduled_tokens, strict=True)
                if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens]
        s.update(StepResult(step_id=plan.step_id, request_ids=done, token_ids=[7] * len(done)))
        return True

    s.add(tok("a", 999.7, n=3))  # waited 0.3 s; three samples, one request
    s.add(tok("b", 0.0))  # no arrival time: not observed
    step()
    now[0] = 1002.0
    s.add(tok("c", 999.0))  # waited 3 s
    for _ in range(100):  # samples 1 and 2 of "a" start once sample 0 computed the prompt
        if not step():
            break
    assert not s.has_work
    stats = EngineStats(engine_id=0, **s.stats())
    assert stats.queue_time_bounds == list(QUEUE_TIME_BOUNDS)
    assert stats.queue_time_counts[-1] == 2
    assert stats.queue_time_sum == pytest.approx(3.3)
    by_bound = dict(zip(stats.queue_time_bounds, stats.queue_time_counts, strict=False))
    assert by_bound[0.25] == 0 and by_bound[0.5] == 1 and by_bound[2.5] == 1 and by_bound[5.0] == 2
    # The EngineStats message carries it to the gateway unchanged.
    assert msgspec.msgpack.decode(encode(stats), type=EngineStats) == stats


# ---------------------------------------------------------------------------------------------
# --api-key


async def test_api_key_guards_the_api_only(make_server, down_of) -> None:
    srv = make_server(api_key=KEY)
    down = down_of(srv)
    good = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/v1/models/m"), ("POST", "/tokenize"),
                                 ("POST", "/detokenize"), ("GET", "/tokenizer_info")):
                resp = await c.request(method, path, json={"prompt": "x"}, headers=headers)
                assert resp.status_code == 401, (headers, path)
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "invalid_api_key" and err["message"]
                assert resp.headers["www-authenticate"] == "Bearer"
        for path in ("/health", "/metrics", "/openapi.json", "/stats", "/"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        assert (await c.get("/v1/models", headers={"authorization": f"bearer {KEY}"})).status_code == 200

        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}, headers=good))
        req = await down.next_request()
        await down.reply(req, deltas(req.request_id, [1], "stop", 1))
        assert (await task).status_code == 200
    assert await down.num_requests() == 1  # nothing unauthenticated reached the pipeline

    ws_url = f"ws://127.0.0.1:{srv.port}/v1/ws"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(InvalidStatus):
        async with connect(ws_url, additional_headers={"Authorization": "Bearer nope"}):
            pass
    with pytest.raises(InvalidStatus):
        async with connect(f"{ws_url}?api_key=nope"):
            pass
    async with connect(f"{ws_url}?api_key={KEY}"):  # how the browser page sends it
        pass
    async with connect(ws_url, additional_headers=good) as ws:
        await ws.send(json.dumps({"type": "completion", "id": 1, "prompt": "y"}))
        req = await down.next_request()
        await down.reply(req, deltas(req.request_id, [1], "stop", 1))
        frames = [json.loads(await asyncio.wait_for(ws.recv(), 5)) for _ in range(2)]
        assert frames[-1]["type"] == "done"


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from rill.services.gateway.auth import api_key_from_env

    monkeypatch.setenv("RILL_API_KEY", "from-env")
    assert api_key_from_env(None) == "from-env"
    assert api_key_from_env("flag") == "flag"
    assert api_key_from_env("") is None  # an explicit empty flag: no key
    monkeypatch.delenv("RILL_API_KEY")
    assert api_key_from_env(None) is None


def test_cli_flags_reach_the_gateway_but_the_key_stays_off_command_lines(smollm2_dir: str) -> None:
    from rill.services.cli import build_parser
    from rill.services.launcher import build_children

    ns = build_parser().parse_args(["serve", smollm2_dir, "--api-key", KEY, "--max-request-body-bytes", "4MiB"])
    assert (ns.api_key, ns.max_request_body_bytes) == (KEY, 4 << 20)
    gateway = next(c for c in build_children(ns, smollm2_dir) if c.kind == "gateway")
    assert gateway.argv[gateway.argv.index("--max-request-body-bytes") + 1] == str(4 << 20)
    assert not any(KEY in a for a in gateway.argv)  # passed through the environment instead
    one = build_parser().parse_args(["service", "gateway", "--api-key", KEY])
    assert one.api_key == KEY and one.max_request_body_bytes == 16 << 20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["service", "gateway", "--max-request-body-bytes", "0"])


# ---------------------------------------------------------------------------------------------
# Body size and content type


async def test_body_limit_and_content_type(make_server, down_of) -> None:
    limit = 1024
    srv = make_server(max_request_body_bytes=limit)
    down = down_of(srv)
    big = json.dumps({"prompt": "x" * (2 * limit)}).encode()
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        # Declared too large: refused before reading.
        resp = await c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        assert str(limit) in resp.json()["error"]["message"]

        # Chunked (no Content-Length): refused once the bytes read pass the limit.
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(big), 256):
                yield big[i:i + 256]

        resp = await c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        assert resp.json()["error"]["type"] == "invalid_request_error"

        # Wrong content type on a JSON endpoint: 400 naming the expected type.
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            resp = await c.post("/v1/chat/completions", content=b'{"messages": []}', headers={"Content-Type": ctype})
            assert resp.status_code == 400, ctype
            assert "application/json" in resp.json()["error"]["message"]
        assert (await c.post("/tokenize", content=b"{}", headers={"Content-Type": "text/plain"})).status_code == 400

        # Within the limit, with a JSON type (parameters too) or none at all, the request goes through.
        for headers in ({"Content-Type": "application/json; charset=utf-8"}, {}):
            body = json.dumps({"prompt": "y" * (limit - 100)}).encode()
            task = asyncio.create_task(c.post("/v1/completions", content=body, headers=headers))
            req = await down.next_request()
            assert req.prompt == "y" * (limit - 100)
            await down.reply(req, deltas(req.request_id, [1], "stop", 1))
            assert (await task).status_code == 200
        # GET routes are not affected by the content-type rule.
        assert (await c.get("/v1/models", headers={"Content-Type": "text/plain"})).status_code == 200
    assert await down.num_requests() == 2


# ---------------------------------------------------------------------------------------------
# /openapi.json


async def test_openapi_document(make_server) -> None:
    srv = make_server(max_logprobs=7)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
        resp = await c.get("/openapi.json")
    assert resp.status_code == 200
    spec = resp.json()
    assert spec["openapi"].startswith("3.1")
    documented = set(spec["paths"])
    assert documented == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/tokenize",
                          "/detokenize", "/v1/tokenize", "/v1/detokenize", "/tokenizer_info", "/health", "/metrics",
                          "/stats", "/openapi.json", "/v1/responses", "/v1/responses/{response_id}",
                          "/v1/responses/{response_id}/input_items"}
    # Every HTTP route of the app is documented (the chat page's files and the WebSocket aside).
    served = {getattr(r, "path", None) for r in srv.app.routes} - {"/", "/static/{name}", "/v1/ws"}
    served = {p.replace(":path}", "}") for p in served}  # a None would fail here, as in the comparison
    assert served == documented
    schemas = spec["components"]["schemas"]
    chat = {k: v["anyOf"][0] if "anyOf" in v else v  # an optional field: its value, not null
            for k, v in schemas["ChatCompletionRequest"]["properties"].items()}
    assert {k: chat["temperature"][k] for k in ("type", "minimum", "maximum")} == {
        "type": "number", "minimum": 0, "maximum": 2}
    assert chat["top_p"]["exclusiveMinimum"] == 0 and chat["top_logprobs"]["maximum"] == 7
    assert set(chat["messages"]["items"]["discriminator"]["mapping"]) == {
        "system", "user", "assistant", "developer", "tool"}
    logprobs = schemas["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]
    assert (logprobs["type"], logprobs["minimum"], logprobs["maximum"]) == ("integer", 0, 7)
    assert schemas["ChatCompletionRequest"]["properties"]["stop"]["anyOf"][1]["maxItems"] == 16
    assert set(spec["paths"]["/v1/completions"]["post"]["responses"]) == {"200", "400", "401", "404", "413", "503"}
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
