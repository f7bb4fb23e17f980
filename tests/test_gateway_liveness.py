"""A scheduler that lost a gateway's heartbeat (services/scheduler/guard.py), over a real broker
with a stand-in worker: the gateway's requests are aborted with an error reply it can pass on,
and once it beats and announces itself again its new requests are served, not dropped unread.

In a Redis Cluster failover the gateway's heartbeat key can vanish with its master while the
gateway lives: before, the scheduler then dropped every later request of that gateway without
a word, and its clients waited until their own timeouts.
"""

from __future__ import annotations

import time
import uuid

import pytest
import test_plan_timing
from test_plan_timing import slow_engine

from rill.shared.bus import Bus
from rill.shared.config import EngineArgs
from rill.shared.request_params import SamplingParams
from rill.shared.schema import ErrorReply, TokenizedRequest, gateway_input_decoder


def errors_for(bus: Bus, stream: str, rid: str) -> list[ErrorReply]:
    out = []
    for _, fields in bus.r.xrange(stream):
        msg = gateway_input_decoder.decode(fields[b"m"])
        if isinstance(msg, ErrorReply) and msg.request_id == rid:
            out.append(msg)
    return out


def wait_for(check, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(what)


def test_a_gateway_that_beats_again_is_served_again(redis_url: str, prefix: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_plan_timing, "STEP_S", 0.05)  # 240 tokens: 12 s a request
    args = EngineArgs(model_dir="unused", max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    with slow_engine(redis_url, prefix, args) as (client, worker, _):
        s = client.streams
        gateway = s.reply(f"gw-{uuid.uuid4().hex[:6]}")
        beat = s.heartbeat("gateway", gateway)

        def announce() -> None:  # what the gateway's heartbeat thread does every second
            client.r.set(beat, b"1", ex=120)
            client.r.sadd(s.gateways_key(), gateway)

        def submit(rid: str) -> None:
            client.send(s.engine_in(0), TokenizedRequest(
                request_id=rid, reply_to=gateway, prompt_token_ids=list(range(3, 8)),
                params=SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True), eos_token_ids=[2],
                arrival_time=time.time()))

        announce()
        submit("a")
        worker.first_step_with("a")
        client.r.delete(beat)  # its key went with a failed master; the gateway itself lives on
        (err,) = wait_for(lambda: errors_for(client, gateway, "a"), 15, "a's abort sent no error reply")
        assert err.status == 503 and "gateway" in err.message
        assert client.r.ttl(gateway) > 0  # a gateway that is really gone leaves no stream behind

        announce()
        submit("b")
        worker.first_step_with("b")
        time.sleep(4)  # four reaping passes later b still runs: it was neither dropped nor failed
        assert "b" in worker.plans[-1].scheduled_request_ids
        assert errors_for(client, gateway, "b") == []
