"""The closed sets of words the messages carry, each named once. schema.py types its fields with
them, so msgspec refuses a message with any other value when it decodes it; the code that
branches on one of these words names the set it comes from.
"""

from __future__ import annotations

from typing import Literal, get_args

# What a GenerateRequest asks for: a chat completion (messages) or a text completion (prompt).
RequestKind = Literal["chat", "completion"]

# What an engine runs (services/scheduler/disagg.py): everything, or one side of a hand-off.
EngineRole = Literal["both", "prefill", "decode"]
ENGINE_ROLES: tuple[EngineRole, ...] = get_args(EngineRole)

# What became of a KV hand-off, as the decode engine tells the prefill engine (KVTransferAck).
HandoffStatus = Literal["ok", "aborted", "failed"]

# Why a request's output ended, as the detokenizer and the gateway pass it on to the client.
FinishReason = Literal["stop", "length", "abort", "error"]

# Why an engine is asked to drop requests (AbortRequest): the client went away ("abort"), a stop
# string ended it ("stop"), it failed ("error"), or its gateway is stopping ("shutdown").
AbortReason = Literal["abort", "stop", "error", "shutdown"]

# Who speaks in a chat turn (the gateway's message types carry the same tags).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
