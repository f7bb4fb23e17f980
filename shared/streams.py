"""Every stream, key and consumer group Rill uses, named in one place, with what each kind of
stream carries: its cap and the message types that may be sent on it (KINDS). The bus derives
both from the stream's name on every send.

An engine's streams and keys carry the hash tag `{engine:e}`, its detok stream included, and a
KV hand-off's chunks the tag of their transfer: on a Redis Cluster each lives in one slot, so one
engine's step talks to one master and different engines spread over the masters. No stream is
shared by every request: each gateway has its own requests stream (beside its reply stream), each
engine its own detok stream, and the replicas of a stage read them all through one consumer group
name (group_consumer.serve_streams), so gateways and engines spread over a cluster's masters too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, get_args

from msgspec import Struct

from rill.shared.prefix_stream import MAX_CHANGE_ENTRIES
from rill.shared.schema import (
    DetokBatch,
    EngineInput,
    GatewayInput,
    TokenizerInput,
    WorkerInput,
    WorkerOutput,
)

# Groups of replicated readers.
TOKENIZER_GROUP = "tokenizers"
DETOKENIZER_GROUP = "detokenizers"
SCHEDULER_GROUP = "scheduler"


@dataclass(frozen=True)
class Streams:
    """Every stream and key name, derived from one prefix so test runs never collide."""

    prefix: str = "rill"

    def requests(self, gateway_id: str) -> str:
        """What one gateway sends the tokenizers (requests, tokenize calls)."""
        return f"{self.prefix}:requests:{gateway_id}"

    def requests_for(self, reply_stream: str) -> str:
        """The requests stream of the gateway whose reply stream this is (gateways_key lists
        reply streams)."""
        return self.requests(reply_stream.removeprefix(f"{self.prefix}:reply:"))

    def detok(self, engine: int) -> str:
        """One engine's new tokens, for the detokenizers."""
        return f"{self.prefix}:{{engine:{engine}}}:detok"

    def engine_in(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:in"

    def plan(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:plan"

    def result(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:result"

    def stats_key(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:stats"

    def prefix_stream(self, engine: int) -> str:
        """The short hashes of the prompt-prefix blocks the engine has cached, for cache-aware
        routing: a snapshot, then the changes (shared/prefix_stream.py has the format)."""
        return f"{self.prefix}:{{engine:{engine}}}:prefixes"

    def held_key(self, engine: int) -> str:
        """The requests the engine's scheduler holds (services/scheduler/held_requests.py)."""
        return f"{self.prefix}:{{engine:{engine}}}:held"

    def reply(self, gateway_id: str) -> str:
        return f"{self.prefix}:reply:{gateway_id}"

    def engines_key(self) -> str:
        """Set of engine ids that are serving; tokenizers route to them."""
        return f"{self.prefix}:engines"

    def heartbeat(self, role: str, ident: str | int) -> str:
        """Liveness key of one process (role "scheduler" / "worker": ident is the engine id;
        role "gateway": ident is its reply stream). It exists while the process beats."""
        return f"{self.prefix}:hb:{role}:{ident}"

    def replicas_key(self, role: str) -> str:
        """Set of the consumer names of a stateless role's replicas ("tokenizer", "detokenizer");
        each one lives while its heartbeat(role, name) key does."""
        return f"{self.prefix}:replicas:{role}"

    def tokenizer_info_key(self) -> str:
        """What GET /tokenizer_info serves (JSON), kept by the tokenizer replicas' heartbeats."""
        return f"{self.prefix}:tokenizer_info"

    def gateways_key(self) -> str:
        """Set of the reply streams of gateways that have announced themselves."""
        return f"{self.prefix}:gateways"

    def response_key(self, response_id: str) -> str:
        """A stored /v1/responses response and the conversation before it; expires by itself."""
        return f"{self.prefix}:response:{response_id}"

    def kv_chunk(self, transfer_id: str, index: int) -> str:
        """One chunk of an exported KV payload (prefill/decode disaggregation); expires by itself."""
        return f"{self.prefix}:kv:{{{transfer_id}}}:{index}"

    def kind(self, stream: str) -> StreamKind | None:
        """What one of our streams carries and its cap, from its name (None: not one of ours)."""
        if not stream.startswith(f"{self.prefix}:"):
            return None
        rest = stream[len(self.prefix) + 1:]
        if rest.startswith("requests:"):
            return KINDS["requests"]
        if rest.startswith("reply:"):
            return KINDS["reply"]
        if rest.startswith("{engine:"):
            return KINDS.get(_ENGINE_KINDS.get(rest.rsplit(":", 1)[-1], ""))
        return None

    def cap(self, stream: str) -> int | None:
        """The MAXLEN of one of our streams, from its name (None: not one of ours)."""
        kind = self.kind(stream)
        return None if kind is None else kind.cap

    def admit(self, stream: str, msg: Struct) -> int:
        """The cap to send `msg` to `stream` with; WrongStream if that stream does not carry
        its type (or is not one of ours): every send goes through here."""
        kind = _kind_of(self, stream)
        if kind is None:
            raise WrongStream(f"{stream!r} is not one of the streams of prefix {self.prefix!r}")
        if not isinstance(msg, kind.types):
            raise WrongStream(f"{type(msg).__name__} may not be sent on {stream!r}, which carries "
                              f"{', '.join(t.__name__ for t in kind.types) or 'raw entries of its one writer only'}")
        return kind.cap


class WrongStream(TypeError):
    """A message sent to a stream that does not carry its type, or to no stream of ours."""


@dataclass(frozen=True)
class StreamKind:
    """One kind of stream: the most entries it keeps and the message types sent on it."""

    cap: int  # MAXLEN ~
    types: tuple[type[Struct], ...]  # the members of the schema union its readers decode; none:
    # written raw by its one writer, which keeps it under the cap (prefix streams)


def _members(union: Any) -> tuple[type[Struct], ...]:
    return get_args(union) or (union,)


# Caps (MAXLEN ~): far above any real backlog, since trimming ignores pending entries. The types
# are the unions schema.py builds each stream's decoder from.
KINDS: dict[str, StreamKind] = {
    "requests": StreamKind(100_000, _members(TokenizerInput)),
    "engine_in": StreamKind(100_000, _members(EngineInput)),
    "plan": StreamKind(1_000, _members(WorkerInput)),
    "result": StreamKind(1_000, _members(WorkerOutput)),
    "detok": StreamKind(20_000, _members(DetokBatch)),
    "reply": StreamKind(20_000, _members(GatewayInput)),
    "prefixes": StreamKind(1 + MAX_CHANGE_ENTRIES, ()),  # a snapshot and changes: prefix_stream.py
}
_ENGINE_KINDS = {"in": "engine_in", "plan": "plan", "result": "result", "detok": "detok", "prefixes": "prefixes"}


@lru_cache(maxsize=4096)
def _kind_of(streams: Streams, stream: str) -> StreamKind | None:
    """Streams.kind, remembered: a sender names the same few streams again and again."""
    return streams.kind(stream)
