"""The closed sets of words on the wire (shared/kinds.py): msgspec refuses a message that carries
any other word, and every word the services send decodes."""

from __future__ import annotations

import time
from typing import Any, get_args

import msgspec
import pytest

from rill.shared.kinds import ENGINE_ROLES, AbortReason, FinishReason, HandoffStatus, RequestKind
from rill.shared.request_params import ChatMessage, SamplingParams
from rill.shared.schema import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    KVTransferAck,
    TextDelta,
    encode,
    engine_input_decoder,
    generate_decoder,
    stats_decoder,
)


def generate(kind: Any, role: Any = "user") -> GenerateRequest:
    return GenerateRequest(request_id="r", reply_to="g", kind=kind, params=SamplingParams(), arrival_time=time.time(),
                           messages=[ChatMessage(role=role, content="hi")])


def test_every_word_of_a_set_decodes() -> None:
    for kind in get_args(RequestKind):
        assert generate_decoder.decode(encode(generate(kind))).kind == kind
    for status in get_args(HandoffStatus):
        ack = KVTransferAck(transfer_id="t", request_id="r", decode_engine=1, status=status)
        assert engine_input_decoder.decode(encode(ack)) == ack
    for reason in get_args(AbortReason):
        assert engine_input_decoder.decode(encode(AbortRequest(["r"], reason=reason))).reason == reason
    for role in ENGINE_ROLES:
        assert stats_decoder.decode(encode(EngineStats(engine_id=0, role=role))).role == role
    for reason in (*get_args(FinishReason), None):
        delta = TextDelta("r", 0, 1, "x", finish_reason=reason)
        assert msgspec.msgpack.decode(encode(delta), type=TextDelta) == delta


@pytest.mark.parametrize("bad, decoder", [
    (generate("edit"), generate_decoder),
    (generate("chat", role="narrator"), generate_decoder),
    (KVTransferAck(transfer_id="t", request_id="r", decode_engine=1, status="maybe"), engine_input_decoder),
    (AbortRequest(["r"], reason="bored"), engine_input_decoder),  # type: ignore[arg-type]
    (EngineStats(engine_id=0, role="both-ways"), stats_decoder),  # type: ignore[arg-type]
])
def test_a_word_outside_its_set_is_refused(bad: msgspec.Struct, decoder: msgspec.msgpack.Decoder) -> None:
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value"):
        decoder.decode(encode(bad))
