"""Rill on a Redis Cluster: six valkey-servers (3 masters, 3 replicas) on local ports.

The bus's cluster rules one by one (exactly-once forwarding across slots, the hot path's
pipelines, a failover seen as a restart), then the whole pipeline with 2 engines, 2 tokenizers,
2 detokenizers and 2 gateways: greedy outputs equal a single-Redis stack's, the engines' streams
sit on different masters, and a master killed under load fails what was in flight with a clear
error while new requests succeed without restarting any service.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import redis
from redis.crc import key_slot
from service_stack import ServiceStack, fast_flags, rill_executable

from rill.shared.broker import EmbeddedBroker, PortTaken, free_port, free_ports
from rill.shared.bus import Bus, aconnect, connect
from rill.shared.cluster import Lineage
from rill.shared.local_cluster import LocalCluster
from rill.shared.schema import AbortRequest, DetokBatch, DetokenizeRequest, Hello, encode, stats_decoder
from rill.shared.streams import Streams

N_REQUESTS = 32
MAX_TOKENS = 8
RECOVER_S = 15.0  # the bound from a master's death to new requests succeeding


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as c:
        yield c


def master_of(cluster: LocalCluster, key: str) -> int:
    """The port of the master that serves `key`'s slot, as the masters say."""
    return cluster.master(key_slot(key.encode())).port


def test_a_node_whose_port_was_taken_says_so_or_moves() -> None:
    """A port chosen and then bound by someone else before valkey starts: a broker pinned to it
    fails naming the cause (valkey's log, not an empty reason), one whose port was chosen for it
    moves to another and does not answer for the server already there."""
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with EmbeddedBroker() as first:
        pinned = EmbeddedBroker(first.port)
        with pytest.raises(PortTaken, match="(?i)address already in use"):
            pinned.start()
        pinned.stop()
        moved = EmbeddedBroker()
        moved._use_port(first.port)
        with moved:
            assert moved.port != first.port
            redis.Redis.from_url(moved.url).set("k", "moved")
            assert redis.Redis.from_url(first.url).get("k") is None


def test_forwarding_across_slots_is_exactly_once_and_pinned(cluster: LocalCluster) -> None:
    """A redo (another replica claimed the entry) sends nothing twice, and a redo that would
    route elsewhere still sends the first replica's forward to the first destination."""
    bus = Bus(cluster.url, "rill")
    try:
        assert bus.cluster
        dest_a, dest_b = bus.streams.engine_in(0), bus.streams.engine_in(1)
        engines = {master_of(cluster, dest_a), master_of(cluster, dest_b)}
        assert len(engines) == 2
        # A gateway whose requests stream sits on the third master.
        src = next(bus.streams.requests(g) for g in map(str, range(100))
                   if master_of(cluster, bus.streams.requests(g)) not in engines)
        bus.ensure_group(src, "g")
        entry_id = bus.send(src, DetokenizeRequest(request_id="r", reply_to="", token_ids=[]))
        assert [e for e, _ in bus.read_group(src, "g", "one", block_ms=None)] == [entry_id]
        first = AbortRequest(request_ids=["r"])
        other = AbortRequest(request_ids=["r"], reason="shutdown")
        # The first forward is pinned before it is delivered; a second replica redoing the entry
        # (its forward differs) before the first acked delivers the pinned one, to dest_a, once.
        assert bus.ack_and_send_many(src, "g", [(entry_id, [(dest_a, first)])]) == [True]
        assert bus.ack_and_send_many(src, "g", [(entry_id, [(dest_b, other)])]) == [False]
        assert bus.r.xlen(dest_a) == 1 and bus.r.xlen(dest_b) == 0
        # The middle of the protocol replayed by hand: pinned, delivered, but the replica died
        # before acking. Whoever redoes it delivers nothing new and acks it.
        entry2 = bus.send(src, DetokenizeRequest(request_id="s", reply_to="", token_ids=[]))
        bus.read_group(src, "g", "one", block_ms=None)
        from rill.shared import cluster as cl
        fwd = msgspec.msgpack.encode([(dest_a, 100, encode(first))])
        pin = cl.same_slot(src, f"fwd:{entry2.decode()}")
        assert bus.r.execute_command("EVAL", cl._PIN, 2, src, pin, "g", entry2, 60_000, fwd) == fwd
        seen = cl.same_slot(dest_a, f"seen:{src}:{entry2.decode()}:0")
        assert bus.r.execute_command("EVAL", cl._DELIVER, 2, dest_a, seen, 100, encode(first), 60_000) == 1
        assert bus.ack_and_send_many(src, "g", [(entry2, [(dest_b, other)])]) == [True]
        assert bus.r.xlen(dest_a) == 2 and bus.r.xlen(dest_b) == 0
        assert not bus.r.exists(pin) and bus.r.xpending(src, "g")["pending"] == 0
    finally:
        bus.close()


def _nodes(*nodes: tuple[str, str, str, list[list[str]]]) -> dict[str, dict]:
    """A parsed CLUSTER NODES: (id, flags, the master it replicates, slot ranges) per node."""
    return {f"127.0.0.1:{7000 + i}": {"node_id": n, "flags": f, "master_id": m, "slots": sl}
            for i, (n, f, m, sl) in enumerate(nodes)}


def test_lineage_tells_a_reshard_from_a_failover() -> None:
    """A key's id stays when its slot moves to another master with its keys (and when a master
    left with no slot becomes a replica), and changes when a replica took over (its last writes
    may be lost), whether or not the old master is known to have failed yet, and for a manual
    failover too; the whole cluster's id likewise."""
    moving, on_b = "b", "a"  # slot 3300 (moves to N), slot 15495 (on B)
    lineage = Lineage()
    start = _nodes(("A", "master", "-", [["0", "8191"]]), ("B", "master", "-", [["8192", "16383"]]),
                   ("a", "slave", "A", []), ("b", "slave", "B", []), ("N", "master", "-", []))
    ids = {k: lineage.id(start, k) for k in (moving, on_b, None)}
    # Moved while this node suspects A ("fail?": a busy master's missed pings), not a failover.
    resharded = _nodes(("A", "master,fail?", "-", [["0", "3299"], ["3301", "8191"]]),
                       ("B", "master", "-", [["8192", "16383"]]),
                       ("a", "slave", "A", []), ("b", "slave", "B", []), ("N", "master", "-", [["3300"]]))
    assert {k: lineage.id(resharded, k) for k in (moving, on_b, None)} == ids
    # B's replica promoted, B seen failed: B's keys and the cluster change, the moved key does not.
    failed_over = _nodes(("A", "master", "-", [["0", "3299"], ["3301", "8191"]]), ("B", "master,fail", "-", []),
                         ("a", "slave", "A", []), ("b", "master", "-", [["8192", "16383"]]),
                         ("N", "master", "-", [["3300"]]))
    now = {k: lineage.id(failed_over, k) for k in (moving, on_b, None)}
    assert now[moving] == ids[moving] and now[on_b] != ids[on_b] and now[None] != ids[None]
    # The slot back on A, and N, left with no slot, made A's replica: a reshard still.
    back_on_a = _nodes(("A", "master", "-", [["0", "8191"]]), ("B", "master,fail", "-", []),
                       ("a", "slave", "A", []), ("b", "master", "-", [["8192", "16383"]]), ("N", "slave", "A", []))
    assert lineage.id(back_on_a, moving) == ids[moving] and lineage.id(back_on_a, None) == now[None]
    # A's replica serves A's slots while this node still sees A as a healthy master.
    promoted = _nodes(("A", "master", "-", []), ("B", "master,fail", "-", []),
                      ("a", "master", "-", [["0", "8191"]]), ("b", "master", "-", [["8192", "16383"]]),
                      ("N", "slave", "A", []))
    assert lineage.id(promoted, moving) != ids[moving] and lineage.id(promoted, None) != now[None]
    # A manual failover back (a's old master A takes over, a becomes its replica): lost, by rule.
    lineage2 = Lineage()
    key_id = lineage2.id(start, "k2")  # slot 449, on A
    back = _nodes(("A", "slave", "a", []), ("B", "master", "-", [["8192", "16383"]]),
                  ("a", "master", "-", [["0", "8191"]]), ("b", "slave", "B", []), ("N", "master", "-", []))
    assert lineage2.id(back, "k2") != key_id


def test_a_reshard_moves_a_slot_under_every_client_without_loss(cluster: LocalCluster) -> None:
    """An engine's slot moved key by key to a master that had no slot: the hot path follows ASK
    (a key already moved), TRYAGAIN (a script's keys on both masters) and MOVED (the slot gone),
    redis-py's clients follow an ASK to a master they do not know yet, every write lands once,
    and the engine's server id stays: a reshard loses nothing, unlike a failover."""
    new = cluster.add_master()
    bus = Bus(cluster.url, "rill")
    try:
        s = bus.streams
        keys = [s.engine_in(0), s.plan(0)]  # two streams: whichever moves first, the other stays
        bus.ensure_group(keys[0], "g")
        bus.exchange([("XADD", keys[1], "*", "m", b"0")])
        server = bus.server_id(keys[1])
        slot = key_slot(keys[1].encode())
        assert cluster.move_slot(slot, new, stop_after=1) == 1
        src = redis.Redis(port=master_of(cluster, keys[1]))
        moved = next(k for k in keys if k.encode() not in src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10))
        # ASK, on the hot path (the moved key, a new key) and for both of redis-py's clients.
        bus.exchange([("XADD", moved, "*", "m", b"1"), ("SET", s.held_key(0), b"x")])
        bus.r.xadd(moved, {"m": b"2"})

        async def send() -> None:
            r = aconnect(cluster.url)
            try:
                await r.xadd(moved, {"m": b"3"})
            finally:
                await r.aclose()

        asyncio.run(send())
        # TRYAGAIN while the two streams are on two masters, until the move ends (here, in 0.3 s).
        ending = threading.Timer(0.3, cluster.move_slot, (slot, new))
        ending.start()
        script = "return redis.call('EXISTS', KEYS[1]) + redis.call('EXISTS', KEYS[2])"
        assert bus.exchange([("EVAL", script, 2, *keys)]) == [2]
        ending.join()
        assert master_of(cluster, keys[1]) == new.port
        # MOVED: the hot path's slot map still names the old master.
        replies = bus.exchange([("XADD", moved, "*", "m", b"4"), Bus.xread(moved, b"0-0", None),
                                Bus.xreadgroup(keys[0], "g", "c", None)])
        assert len(Bus.entries(replies[1])) == bus.r.xlen(moved) == 4 + (moved == keys[1])  # every write once
        assert bus.r.get(s.held_key(0)) == b"x"
        assert bus.server_id(keys[1]) == server
    finally:
        bus.close()


def test_hot_path_pipelines_span_masters(cluster: LocalCluster) -> None:
    """One exchange writes to and reads from streams on different masters; a group lost with its
    master (NOGROUP) is re-created on the spot, as on a single broker."""
    bus = Bus(cluster.url, "rill")
    try:
        s = bus.streams
        assert master_of(cluster, s.plan(0)) != master_of(cluster, s.detok(1))  # two engines' streams
        bus.ensure_group(s.detok(1), "g")
        batch = DetokBatch(0, 0, ["d"], [""], [0], [[]], [[]], [None], [0], [[]], [True], [False])
        replies = bus.exchange([bus.xadd(s.plan(0), Hello(scheduler_id="p")),
                                bus.xadd(s.detok(1), batch),
                                Bus.xread(s.plan(0), b"0-0", None),
                                Bus.xreadgroup(s.detok(1), "g", "c", None)])
        assert [len(Bus.entries(r)) for r in replies[2:]] == [1, 1]
        assert Bus.entries(replies[3])[0][1] == encode(batch)
        bus.r.delete(s.detok(1))
        bus.send(s.detok(1), batch)
        assert [e for e, _ in bus.read_group(s.detok(1), "g", "c", None)]  # NOGROUP → group re-created
        assert len(bus.mget([s.stats_key(e) for e in range(4)])) == 4
    finally:
        bus.close()


def test_a_service_started_after_its_first_seed_died_finds_the_cluster(cluster: LocalCluster,
                                                                       redis_url: str) -> None:
    """The URL lists every node; with the first one's master dead and its replica promoted, a
    new client (a restarted service) connects through the others, sync and async, hot path too.
    Several hosts that are not a cluster are refused."""
    victim = cluster.nodes[0]  # the first nodes are the masters
    assert victim.proc is not None and "," in cluster.url
    served = redis.Redis(port=cluster.nodes[1].port)
    victim.proc.kill()
    deadline = time.monotonic() + 30
    while any(sl[2][1] == victim.port for sl in served.execute_command("CLUSTER", "SLOTS")):
        assert time.monotonic() < deadline, "no replica took over the dead master's slots"
        time.sleep(0.2)
    bus = Bus(cluster.url, "rill")
    try:
        keys = [bus.streams.stats_key(e) for e in range(6)]  # slots on every master
        for key in keys:
            bus.r.set(key, b"1")
        assert bus.mget(keys) == [b"1"] * 6
        assert bus.exchange([("SET", keys[0], b"2"), ("GET", keys[0])])[1] == b"2"

        async def read() -> object:
            r = aconnect(cluster.url)
            try:
                return await r.get(keys[1])
            finally:
                await r.aclose()

        assert asyncio.run(read()) == b"1"
    finally:
        bus.close()
    single = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    with pytest.raises(ValueError, match="not a Redis Cluster"):
        connect(redis_url.replace(single, f"{single},{single}", 1))


def _chat(i: int, long: bool = False) -> dict:
    """A short greedy chat; `long`: 64 tokens whatever the model says (EOS ignored), to be in flight."""
    return {"messages": [{"role": "user", "content": f"Count to {3 + i % 7}, then say item {i}."}],
            "max_tokens": 64 if long else MAX_TOKENS, "temperature": 0, **({"ignore_eos": True} if long else {})}


async def _ask(base_urls: list[str], idx: list[int], timeout: float = 120, long: bool = False) -> list[dict]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        async def one(i: int) -> dict:
            try:
                r = await client.post(f"{base_urls[i % len(base_urls)]}/v1/chat/completions", json=_chat(i, long))
                return r.json() | {"status": r.status_code}
            except httpx.HTTPError as exc:
                return {"status": 0, "error": {"message": repr(exc)}}
        return list(await asyncio.gather(*(one(i) for i in idx)))


def _running(r: redis.Redis, s: Streams, engine: int) -> int:
    """Requests in the engine's running batch, from its last published stats (0 before any)."""
    raw = r.get(s.stats_key(engine))
    return 0 if raw is None else stats_decoder.decode(raw).num_running


def _texts(replies: list[dict]) -> list[str]:
    assert all(r["status"] == 200 for r in replies), [r for r in replies if r["status"] != 200][:3]
    return [r["choices"][0]["message"]["content"] for r in replies]


def _cluster_stack(url: str, model_dir: str, ports: list[int]) -> ServiceStack:
    base = fast_flags(model_dir, url, "rill", ports[0])  # a gateway's own --port comes later and wins
    commands: dict[str, list[str]] = {}
    for e in (0, 1):
        for kind in ("worker", "scheduler"):
            commands[f"{kind}-{e}"] = [*rill_executable(), "service", kind, *base, "--engine-id", str(e)]
    for kind in ("tokenizer", "detokenizer"):
        for i in (0, 1):
            commands[f"{kind}-{i}"] = [*rill_executable(), "service", kind, *base, "--replica-name", f"{kind}-{i}"]
    for i, port in enumerate(ports):
        commands[f"gateway-{i}"] = [*rill_executable(), "service", "gateway", *base, "--port", str(port),
                                    "--replica-name", f"gateway-{i}"]
    env = dict(os.environ, RILL_WORKER_THREADS="1", PYTHONUNBUFFERED="1")
    return ServiceStack(url, "rill", ports[0], commands, env=env)


def _wait_ready(stack: ServiceStack, ports: list[int], timeout: float = 300) -> None:
    r = connect(stack.redis_url)
    s = Streams("rill")
    deadline = time.monotonic() + timeout
    while not all(r.exists(s.stats_key(e)) for e in (0, 1)):
        assert stack.alive(), "a service died during start-up"
        assert time.monotonic() < deadline, "the engines did not start"
        time.sleep(0.3)
    for port in ports:
        stack.port = port
        stack.wait_ready(timeout)
    stack.port = ports[0]


def _reshard_under_load(cluster: LocalCluster, bases: list[str], keys: list[str]) -> list[list[dict]]:
    """Moves the slots of `keys` to a new master, key by key, while waves of the 32 requests run;
    the waves' replies."""
    new = cluster.add_master()
    slots = sorted({key_slot(k.encode()) for k in keys})

    def move() -> None:
        for slot in slots:
            cluster.move_slot(slot, new, keys_per_step=1, pause_s=0.05)

    async def run() -> list[list[dict]]:
        mover = asyncio.create_task(asyncio.to_thread(move))
        waves = []
        while not mover.done() or not waves:
            waves.append(await _ask(bases, list(range(N_REQUESTS)), timeout=60))
        await mover
        return waves

    waves = asyncio.run(run())
    assert {master_of(cluster, k) for k in keys} == {new.port}
    return waves


def test_pipeline_on_a_cluster_survives_a_reshard_and_a_master_failover(cluster: LocalCluster, redis_url: str,
                                                                        smollm2_dir: str) -> None:
    ports = [free_port(), free_port()]
    stack = _cluster_stack(cluster.url, smollm2_dir, ports).launch()
    try:
        _wait_ready(stack, ports)
        s = Streams("rill")
        engine_masters = {e: master_of(cluster, s.engine_in(e)) for e in (0, 1)}
        assert engine_masters[0] != engine_masters[1], engine_masters
        for e in (0, 1):  # each engine's streams and keys share its master
            assert {master_of(cluster, k) for k in (s.plan(e), s.result(e), s.detok(e), s.stats_key(e))} \
                == {engine_masters[e]}

        bases = [f"http://127.0.0.1:{p}" for p in ports]
        on_cluster = _texts(asyncio.run(_ask(bases, list(range(N_REQUESTS)))))
        used = {e: connect(cluster.url).xinfo_stream(s.engine_in(e))["entries-added"] for e in (0, 1)}
        assert all(used.values()), used  # both engines served
        # Each gateway sent its requests on its own stream (no stream carries every request).
        sent = [connect(cluster.url).xinfo_stream(stream)["entries-added"] for stream in stack.requests_streams()]
        assert len(sent) == 2 and sum(sent) >= N_REQUESTS and all(sent), sent

        # A master added and engine 1's slot and a gateway's streams moved to it under load: a
        # reshard loses nothing, so nothing fails and every text stays.
        gateway = stack.requests_streams()[1]
        waves = _reshard_under_load(cluster, bases, [s.engine_in(1), gateway, s.reply(gateway.rsplit(":", 1)[1])])
        assert all(_texts(wave) == on_cluster for wave in waves)
        assert stack.alive(), "a service exited"

        # Kill engine 0's master under load: what was in flight ends with a clear error; new
        # requests succeed within 15 s of the kill, and from then on all do; no service restarted.
        async def failover() -> tuple[list[dict], float]:
            # Long replies, and the kill only once engine 0 runs some: on a fast machine short
            # replies were all done a second in, and the kill then had nothing to fail.
            load = asyncio.create_task(_ask(bases, list(range(N_REQUESTS)), timeout=60, long=True))
            deadline, r = time.monotonic() + 20, connect(cluster.url)
            while _running(r, s, 0) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            victim = next(n for n in cluster.nodes if n.port == engine_masters[0])
            assert victim.proc is not None
            victim.proc.kill()
            killed = time.monotonic()
            while time.monotonic() - killed < RECOVER_S:
                got = await _ask(bases, [0, 1], timeout=4)  # a probe stuck in the failover must not hide the next
                if all(r["status"] == 200 for r in got):
                    break
                await asyncio.sleep(0.5)
            first_ok = time.monotonic() - killed
            await asyncio.sleep(max(0.0, RECOVER_S - (time.monotonic() - killed)))
            return await load, first_ok

        in_flight, first_ok = asyncio.run(failover())
        assert first_ok <= RECOVER_S, f"no success {first_ok:.1f} s after the kill"
        for r in in_flight:  # finished, or failed with an error that says why
            if r["status"] != 200:
                assert r["status"] >= 500 and r["error"]["message"], r
        assert any(r["status"] != 200 for r in in_flight), "the kill failed nothing"
        assert _texts(asyncio.run(_ask(bases, list(range(8))))) == on_cluster[:8]
        assert stack.alive(), "a service exited"
    finally:
        stack.stop()

    # The same requests on one Redis server give the same text.
    single = _single_stack(redis_url, smollm2_dir)
    try:
        single.start()
        assert _texts(asyncio.run(_ask([single.base_url], list(range(N_REQUESTS))))) == on_cluster
    finally:
        single.stop()


def _single_stack(redis_url: str, model_dir: str) -> ServiceStack:
    from service_stack import standard_stack

    prefix, port = f"rillcl-{os.getpid()}-{time.time_ns() % 10**8}", free_port()
    return standard_stack(redis_url, model_dir, prefix, port)
