"""What the bus does differently when its URL reaches a Redis Cluster.

Every service finds out at connect time (INFO cluster) and then talks through redis-py's
cluster client, which routes each command to the master of its key's slot and follows the
cluster when a replica is promoted. The names in streams.py put each engine's streams and keys
in one slot (hash tag `{engine:e}`), so a step's reads and writes of an engine stay on one
master, and Bus.mget splits a multi-key read (the engines' stats) per slot.

Two things change beside the client:
- Forwarding exactly once (a tokenizer's request to its engine, or its answer to a gateway)
  cannot be one Lua script when source and destination live in different slots. It
  becomes three steps, each in one slot: pin the forward in the source's slot while the entry
  is still pending (the first replica to pin decides route and payload, so a replica that redoes
  the entry after a crash sends the same thing to the same place), deliver to each destination
  under a "seen" key in that destination's slot (a redo delivers nothing twice), then ack the
  entry and drop its pin.
- "The broker restarted" (its streams are gone) becomes "a replica was promoted": it may lack
  the last writes of the master it replaces. An engine watches the master of its own streams
  (another engine's failover leaves it alone); a gateway watches the masters of its own streams
  and of each engine's, and fails what lived on one that changed (all it holds if its own did).
  A reshard also gives a slot another master, but loses nothing (MIGRATE moves keys whole, with
  their consumer groups): Lineage tells the two apart, and the hot path follows the slot's keys
  to their new master (MOVED, ASK, TRYAGAIN) as redis-py's client does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import hiredis
import msgspec
import redis
import redis.asyncio.cluster as aiocluster
from redis.cluster import PRIMARY, ClusterNode, NodesManager, RedisCluster
from redis.crc import key_slot
from redis.exceptions import MovedError

from rill.shared.resp import Command, RespConnection

PROBE_S = 10.0  # how long connecting waits for the broker to answer whether it is a cluster
FORWARD_TTL_MS = 600_000  # pins and seen keys: far longer than any redo takes to happen
REDIRECT_ROUNDS = 50  # a hot-path batch follows redirects this often (TRYAGAIN waits between)
TRYAGAIN_S = 0.02  # a multi-key command whose keys a reshard holds on two masters waits this

_kinds: dict[str, bool] = {}
log = logging.getLogger("rill.bus")


def _redact(url: str) -> str:
    """`url` without its password, for logs."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))


def seed_urls(url: str) -> list[str]:
    """The node URLs a broker URL names. `redis://[auth@]h1:p1,h2:p2/0` lists seed nodes of one
    cluster (any one that answers will do), so that a service started again after its first seed
    failed still finds the cluster; a URL of one host is itself."""
    parts = urlsplit(url)
    auth, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return [url]
    return [urlunsplit(parts._replace(netloc=f"{auth}{at}{host}")) for host in hosts.split(",") if host]


def seed_nodes(url: str) -> list[tuple[str, int]]:
    """(host, port) of each seed node but the first (redis-py takes the first from the URL)."""
    return [(part.hostname or "localhost", part.port or 6379) for part in map(urlsplit, seed_urls(url)[1:])]


def is_cluster(url: str) -> bool:
    """Whether `url` reaches a Redis Cluster (asked once per URL and process, of the first of its
    seeds that answers). A broker that does not answer within PROBE_S is taken for a single
    server; several seeds that do not are an error."""
    if url not in _kinds:
        seeds = seed_urls(url)
        clients = [redis.Redis.from_url(seed, socket_connect_timeout=2, socket_timeout=5) for seed in seeds]
        deadline = time.monotonic() + PROBE_S
        try:
            while url not in _kinds:
                for client in clients:
                    try:
                        _kinds[url] = bool(int(client.info("cluster").get("cluster_enabled", 0)))
                        break
                    except redis.RedisError:
                        continue
                else:
                    if time.monotonic() > deadline:  # not cached: the next connection asks again
                        if len(seeds) > 1:
                            raise redis.ConnectionError(f"no seed node of {_redact(url)} answered in {PROBE_S:.0f} s")
                        log.warning("the broker at %s did not answer for %.0f s: taken for a single server",
                                    _redact(url), PROBE_S)
                        return False
                    time.sleep(0.2)
        finally:
            for client in clients:
                client.close()
        if len(seeds) > 1 and not _kinds[url]:
            raise ValueError(f"{_redact(url)} names several hosts, but they are not a Redis Cluster")
    return _kinds[url]


def serves(node: dict[str, Any], slot: int) -> bool:
    """Whether a node of a parsed CLUSTER NODES holds `slot` (its ranges, or single slots)."""
    return any(int(r[0]) <= slot <= int(r[-1]) for r in node["slots"])


def masters_of(nodes: dict[str, dict[str, Any]], key: str | None = None) -> frozenset[str]:
    """The masters that serve slots (given `key`, the one that serves its slot), from a parsed
    CLUSTER NODES."""
    slot = None if key is None else key_slot(key.encode())
    return frozenset(n["node_id"] for n in nodes.values() if "master" in n["flags"] and n["slots"]
                     and (slot is None or serves(n, slot)))


class Lineage:
    """Per key (None: every slot), an id that changes when the key's last writes may be lost, as
    a single broker's run_id does on a restart: a failover, where a replica (asynchronously
    replicated) now serves the slot, or where its old master failed ("fail", the cluster's
    verdict). A reshard keeps the id: the new master was no replica of the old one, which stays
    up (left without a slot, it may become a replica: cluster-allow-replica-migration)."""

    def __init__(self) -> None:
        self._seen: dict[str | None, tuple[str, frozenset[str], frozenset[str]]] = {}  # id, masters, replicas
        self._losses = 0

    def id(self, nodes: dict[str, dict[str, Any]], key: str | None = None) -> str:
        masters = masters_of(nodes, key)
        replicas = frozenset(n["node_id"] for n in nodes.values() if "slave" in n["flags"])
        # "fail?" is one node's suspicion (a busy master can earn it); "fail" is the cluster's verdict.
        up = {n["node_id"] for n in nodes.values() if "fail" not in n["flags"].split(",")}
        seen = self._seen.get(key)
        if seen is None:
            ident = f"{','.join(sorted(masters))}@{self._losses}"
        else:
            ident, before, replicas_before = seen
            if masters != before and (masters & replicas_before or not before <= up):
                self._losses += 1  # the count tells this id from any earlier one of the same masters
                ident = f"{','.join(sorted(masters))}@{self._losses}"
        self._seen[key] = (ident, masters, replicas)
        return ident


class _Nodes(NodesManager):
    """redis-py follows an ASK to a master it does not know (one with no slot yet: a reshard's
    first slot onto a new master) into an AttributeError (redis-py issue 4015); such a master
    becomes known here, as a MOVED's target does."""

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and host and port:
            node = self.nodes_cache.setdefault(f"{host}:{port}", ClusterNode(host, port, PRIMARY))
        return node


class _AsyncNodes(aiocluster.NodesManager):
    """_Nodes, for the asyncio client."""

    __slots__ = ()  # as its base's: follow_asks swaps the class of a live manager

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> aiocluster.ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and host and port:
            node = self.nodes_cache.setdefault(
                f"{host}:{port}", aiocluster.ClusterNode(host, port, PRIMARY, **self.connection_kwargs))
        return node


def follow_asks(client: RedisCluster | aiocluster.RedisCluster) -> None:
    """Let `client` follow an ASK to a master that holds no slot yet (_Nodes)."""
    manager = client.nodes_manager
    manager.__class__ = _AsyncNodes if isinstance(manager, aiocluster.NodesManager) else _Nodes


def same_slot(key: str, suffix: str) -> str:
    """A key in `key`'s hash slot: `key` itself carries the tag, or becomes it."""
    return f"{key}:{suffix}" if "{" in key else f"{{{key}}}:{suffix}"


class ClusterHot:
    """The hot path's connection (resp.RespConnection's interface: pipeline, post, take) over a
    cluster: a bare RESP connection to each master, commands sent to the master of their key's
    slot, the slot map kept by redis-py's cluster client (refreshed after a failure, moved on a
    MOVED). Sends then acks stay in that order: an XACK after other commands waits for their
    replies (masters answer in no set order), so an entry is never acked before what it produced
    was written. A command a reshard redirected is sent again where its key went (_follow)."""

    def __init__(self, client: RedisCluster, url: str, name: str | None = None) -> None:
        self.r = client
        self.url = urlsplit(url)
        self.name = name
        self._conns: dict[str, RespConnection] = {}
        # Per connection, the places of its posted commands (a connection's take() reads them all).
        self._posted: dict[str, tuple[RespConnection, list[int]]] = {}
        self._commands: list[Command] = []  # everything posted, in order (for redirects)

    def execute(self, *args: bytes | str | int | float) -> Any:
        return self.pipeline([args])[0]

    def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """As RespConnection.pipeline: a batch that fails on a socket is retried once, at once,
        here after learning the slot map again (the master may have changed)."""
        if self._posted:
            self.take()
        try:
            return self._pipeline(commands)
        except redis.ConnectionError:
            return self._pipeline(commands)

    def _pipeline(self, commands: Sequence[Command]) -> list[Any]:
        out: list[Any] = []
        start = 0
        for i, cmd in enumerate(commands):
            if i > start and _name(cmd) == "XACK" and _name(commands[i - 1]) != "XACK":
                self.post(commands[start:i])
                out += self.take()
                start = i
        self.post(commands[start:])
        return out + self.take()

    @property
    def posted(self) -> int:
        return len(self._commands)

    def post(self, commands: Sequence[Command]) -> None:
        by_addr: dict[str, list[int]] = {}
        try:
            for i, cmd in enumerate(commands):
                by_addr.setdefault(self._addr(_key(cmd)), []).append(i)
            for addr, places in by_addr.items():
                conn = self._conn(addr)
                conn.post([commands[i] for i in places])
                self._posted.setdefault(addr, (conn, []))[1].extend(i + len(self._commands) for i in places)
        except redis.ConnectionError:
            self._forget()
            raise
        self._commands.extend(commands)

    def take(self) -> list[Any]:
        posted, self._posted, commands, self._commands = self._posted.values(), {}, self._commands, []
        out: list[Any] = [None] * len(commands)
        try:
            for conn, places in posted:
                for i, reply in zip(places, conn.take(check=False), strict=True):
                    out[i] = reply
            self._follow(commands, out)
        except redis.ConnectionError:
            self._forget()
            raise
        for reply in out:  # every reply was read: the connections stay in step
            if isinstance(reply, hiredis.ReplyError):
                raise redis.ResponseError(str(reply))
        return out

    def _follow(self, commands: Sequence[Command], out: list[Any]) -> None:
        """Send again the commands a reshard redirected, until they ran: MOVED (the slot has a
        new master: the slot map learns it), ASK (the key is already on the master importing
        the slot: ASKING, then the command, there), TRYAGAIN (a multi-key command whose keys
        are on two masters: wait). A redirected command did not run, so it runs once."""
        for _ in range(REDIRECT_ROUNDS):
            redirected = [i for i, r in enumerate(out) if isinstance(r, hiredis.ReplyError)
                          and str(r).startswith(("MOVED ", "ASK ", "TRYAGAIN"))]
            if not redirected:
                return
            if any(str(out[i]).startswith("TRYAGAIN") for i in redirected):
                time.sleep(TRYAGAIN_S)
            sends: dict[str, list[tuple[int, Command]]] = {}
            for i in redirected:
                kind, _, where = str(out[i]).partition(" ")
                if kind == "MOVED":
                    self.r.nodes_manager.move_slot(MovedError(where))
                addr = where.split(" ")[1] if kind in ("MOVED", "ASK") else self._addr(_key(commands[i]))
                if kind == "ASK":
                    sends.setdefault(addr, []).append((-1, ("ASKING",)))
                sends.setdefault(addr, []).append((i, commands[i]))
            for addr, batch in sends.items():
                conn = self._conn(addr)
                conn.post([cmd for _, cmd in batch])
                for (i, _), reply in zip(batch, conn.take(check=False), strict=True):
                    if i >= 0:
                        out[i] = reply
        error = next(r for r in out if isinstance(r, hiredis.ReplyError))
        raise redis.ConnectionError(f"cluster slots kept moving: {error}")

    def _addr(self, key: str) -> str:
        node = self.r.get_node_from_key(key)
        return f"{node.host}:{node.port}"

    def _conn(self, addr: str) -> RespConnection:
        if addr not in self._conns:
            netloc = self.url.netloc.rsplit("@", 1)[0] + "@" if "@" in self.url.netloc else ""
            url = urlunsplit(self.url._replace(netloc=f"{netloc}{addr}"))
            self._conns[addr] = RespConnection(url, name=self.name)
        return self._conns[addr]

    def _forget(self) -> None:
        """After a failure: drop the sockets and learn the slot map again (a replica may have
        been promoted)."""
        self.close()
        with contextlib.suppress(redis.RedisError):
            self.r.nodes_manager.initialize()

    def close(self) -> None:
        """The sockets; the cluster client (its slot map) stays usable, its owner closes it."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._posted, self._commands = {}, []


def _name(cmd: Command) -> str:
    name = cmd[0]
    return (name.decode() if isinstance(name, bytes) else str(name)).upper()


def _key(cmd: Command) -> str:
    """The key a hot-path command works on (the first, for the slot)."""
    name = _name(cmd)
    if name in ("XREAD", "XREADGROUP"):
        key = cmd[[str(a).upper() for a in cmd].index("STREAMS") + 1]
    elif name in ("EVAL", "EVALSHA"):
        key = cmd[3]
    else:
        key = cmd[1]
    return key.decode() if isinstance(key, bytes) else str(key)


# KEYS[1] source stream, KEYS[2] pin; ARGV[1] group, ARGV[2] entry id, ARGV[3] ttl, ARGV[4] the forward.
_PIN = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return false end
redis.call('SET', KEYS[2], ARGV[4], 'NX', 'PX', ARGV[3])
return redis.call('GET', KEYS[2])
"""
# KEYS[1] destination stream, KEYS[2] seen key; ARGV[1] maxlen, ARGV[2] payload, ARGV[3] ttl.
_DELIVER = """
if not redis.call('SET', KEYS[2], 1, 'NX', 'PX', ARGV[3]) then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'm', ARGV[2])
return 1
"""
# KEYS[1] source stream, KEYS[2] pin; ARGV[1] group, ARGV[2] entry id.
_ACK = """
local n = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('DEL', KEYS[2])
return n
"""

Forward = list[tuple[str, int, bytes]]  # (destination stream, maxlen, payload)


def forward_exactly_once(r: RedisCluster, stream: str, group: str,
                         items: Sequence[tuple[bytes, Forward]]) -> list[bool]:
    """For each (entry id, forward): deliver the entry's forward once, then ack it (module doc).
    True where the entry was still pending, so that its (pinned) forward went out."""
    def pin_key(entry_id: bytes) -> str:
        return same_slot(stream, f"fwd:{entry_id.decode()}")

    pipe = r.pipeline(transaction=False)
    for entry_id, forward in items:
        pipe.execute_command("EVAL", _PIN, 2, stream, pin_key(entry_id), group, entry_id, FORWARD_TTL_MS,
                             msgspec.msgpack.encode(forward))
    pinned = pipe.execute()
    pipe = r.pipeline(transaction=False)
    for (entry_id, _), got in zip(items, pinned, strict=True):
        if got is None:
            continue  # acked already: delivered by whoever acked it
        for i, (dest, maxlen, payload) in enumerate(msgspec.msgpack.decode(got, type=Forward)):
            seen = same_slot(dest, f"seen:{stream}:{entry_id.decode()}:{i}")
            pipe.execute_command("EVAL", _DELIVER, 2, dest, seen, maxlen, payload, FORWARD_TTL_MS)
    pipe.execute()
    pipe = r.pipeline(transaction=False)
    for entry_id, _ in items:
        pipe.execute_command("EVAL", _ACK, 2, stream, pin_key(entry_id), group, entry_id)
    pipe.execute()
    return [got is not None for got in pinned]
