"""Every stream, key and consumer group Rill uses, named in one place, with each stream's cap.

An engine's streams and keys carry the hash tag `{engine:e}`, and a KV hand-off's chunks the
tag of their transfer: on a Redis Cluster each lives in one slot, so one engine's step talks to
one master and different engines spread over the masters.
"""

from __future__ import annotations

from dataclasses import dataclass

# Groups of replicated readers.
TOKENIZER_GROUP = "tokenizers"
DETOKENIZER_GROUP = "detokenizers"
SCHEDULER_GROUP = "scheduler"


@dataclass(frozen=True)
class Streams:
    """Every stream and key name, derived from one prefix so test runs never collide."""

    prefix: str = "rill"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def detok(self) -> str:
        return f"{self.prefix}:detok"

    def engine_in(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:in"

    def plan(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:plan"

    def result(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:result"

    def stats_key(self, engine: int) -> str:
        return f"{self.prefix}:{{engine:{engine}}}:stats"

    def prefix_summary_key(self, engine: int) -> str:
        """The short hashes of the prompt-prefix blocks the engine has cached, for cache-aware
        routing (services/scheduler/prefix_summary.py has the format)."""
        return f"{self.prefix}:{{engine:{engine}}}:prefixes"

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

    def gateways_key(self) -> str:
        """Set of the reply streams of gateways that have announced themselves."""
        return f"{self.prefix}:gateways"

    def kv_chunk(self, transfer_id: str, index: int) -> str:
        """One chunk of an exported KV payload (prefill/decode disaggregation); expires by itself."""
        return f"{self.prefix}:kv:{{{transfer_id}}}:{index}"

    def cap(self, stream: str) -> int | None:
        """The MAXLEN of one of our streams, from its name (None: not one of ours)."""
        if not stream.startswith(f"{self.prefix}:"):
            return None
        rest = stream[len(self.prefix) + 1:]
        if rest in ("requests", "detok"):
            return MAXLEN[rest]
        if rest.startswith("reply:"):
            return MAXLEN["reply"]
        if rest.startswith("{engine:"):
            kind = rest.rsplit(":", 1)[-1]
            return {"in": MAXLEN["engine_in"], "plan": MAXLEN["plan"], "result": MAXLEN["result"]}.get(kind)
        return None


# Caps (MAXLEN ~): far above any real backlog, since trimming ignores pending entries.
MAXLEN = {"requests": 100_000, "engine_in": 100_000, "plan": 1_000, "result": 1_000,
          "detok": 20_000, "reply": 20_000}
