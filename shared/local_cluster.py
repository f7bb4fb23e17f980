"""A Redis Cluster of embedded valkey-servers on loopback ports: masters with one replica each.

For the cluster tests and for trying a cluster deployment on one machine
(`python -m rill.shared.local_cluster`). The cluster is formed the way `valkey-cli --cluster
create` does it, with plain commands: MEET, ADDSLOTSRANGE in equal thirds, REPLICATE; it grows
as `--cluster add-node` and `--cluster reshard` grow one: a master with no slot, then slots
moved to it key by key (SETSLOT IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import redis

from rill.shared.broker import EmbeddedBroker, PortTaken, free_ports
from rill.shared.cluster import serves

SLOTS = 16384


class LocalCluster:
    """`masters` masters, each with `replicas` replicas; `url` reaches the whole cluster."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 2000) -> None:
        self.args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
                     "--shutdown-on-sigterm", "now")  # a master would wait for its replicas to catch up
        n = masters * (1 + replicas)
        ports = free_ports(2 * n)
        # The cluster bus's port is given: its default, port + 10000, can be past 65535.
        self.bus_ports = ports[n:]
        self.nodes = [self._node(port, bus) for port, bus in zip(ports[:n], self.bus_ports, strict=True)]
        self.masters = masters

    def _node(self, port: int, bus: int) -> EmbeddedBroker:
        return EmbeddedBroker(port, args=(*self.args, "--cluster-port", str(bus)))

    @property
    def url(self) -> str:
        """Every node as a seed (shared/cluster.py seed_urls): a service started after the first
        node failed still finds the cluster."""
        first = self.nodes[0].url
        netloc = urlsplit(first).netloc
        return first.replace(netloc, ",".join(urlsplit(n.url).netloc for n in self.nodes), 1)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            return self._form(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, i: int) -> None:
        """Start node `i`, on other ports if another process bound a chosen one before valkey did."""
        for attempt in range(3):
            try:
                self.nodes[i].start()
                return
            except PortTaken:
                if attempt == 2:
                    raise
                self.nodes[i].stop()
                taken = {n.port for n in self.nodes} | set(self.bus_ports)
                port, bus = [p for p in free_ports(len(taken) + 2) if p not in taken][:2]
                self.bus_ports[i] = bus
                self.nodes[i] = self._node(port, bus)

    def _form(self, timeout: float) -> LocalCluster:
        for i in range(len(self.nodes)):
            self._start(i)
        clients = [redis.Redis(port=n.port) for n in self.nodes]
        first = clients[0]
        for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        step = SLOTS // self.masters
        for i, client in enumerate(clients[:self.masters]):
            end = SLOTS - 1 if i == self.masters - 1 else (i + 1) * step - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, end)
        deadline = time.monotonic() + timeout
        ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients[:self.masters]]
        for i, client in enumerate(clients[self.masters:]):
            while True:  # a replica can follow its master once it has learnt of it by gossip
                try:
                    client.execute_command("CLUSTER", "REPLICATE", ids[i % self.masters])
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        # Ready once every replica holds its master's data: one still in its first sync cannot
        # take over, and a master killed then would leave its slots unserved.
        while not all(self._ok(c) for c in clients) or not all(self._synced(c) for c in clients[self.masters:]):
            if time.monotonic() > deadline:
                raise TimeoutError("the local cluster did not reach cluster_state:ok with its replicas in sync")
            time.sleep(0.1)
        for client in clients:
            client.close()
        return self

    def add_master(self, timeout: float = 30.0) -> EmbeddedBroker:
        """A new master, known to the cluster, that serves no slot yet."""
        port, bus = free_ports(2)
        self.nodes.append(self._node(port, bus))
        self.bus_ports.append(bus)
        self._start(len(self.nodes) - 1)
        node, bus = self.nodes[-1], self.bus_ports[-1]
        first, new = redis.Redis(port=self.live_masters()[0].port), redis.Redis(port=node.port)
        first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + timeout
        while not self._ok(new):
            if time.monotonic() > deadline:
                raise TimeoutError("the new master did not join the cluster")
            time.sleep(0.1)
        first.close()
        new.close()
        return node

    def move_slot(self, slot: int, to: EmbeddedBroker, keys_per_step: int = 1, pause_s: float = 0.0,
                  stop_after: int | None = None) -> int:
        """Move `slot` and its keys, `keys_per_step` at a time, to the master `to`; how many keys
        moved. The slot's clients meet ASK while it moves, MOVED after. Given `stop_after`, the
        move stops (the slot left migrating) once that many keys moved; a second call ends it."""
        source = self.master(slot)
        if source is to:
            return 0
        src, dst = redis.Redis(port=source.port), redis.Redis(port=to.port)
        try:
            ids = {c: c.execute_command("CLUSTER", "MYID").decode() for c in (src, dst)}
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
            moved = 0
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, keys_per_step):
                if stop_after is not None and moved >= stop_after:
                    return moved
                src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause_s)
            for client in (dst, src):  # the new owner first, as valkey-cli does
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
            return moved
        finally:
            src.close()
            dst.close()

    def master(self, slot: int) -> EmbeddedBroker:
        """The master that serves `slot`, as the masters themselves say (CLUSTER NODES, myself)."""
        for node, me in self._views():
            if "master" in me["flags"] and serves(me, slot):
                return node
        raise LookupError(f"no live master serves slot {slot}")

    def live_masters(self) -> list[EmbeddedBroker]:
        """The nodes that are masters now: a failover, or a master left with no slot (it becomes a
        replica of the slot's new owner, cluster-allow-replica-migration), changes the list."""
        return [node for node, me in self._views() if "master" in me["flags"]]

    def _views(self) -> Iterator[tuple[EmbeddedBroker, dict]]:
        """Each live node with its own line of CLUSTER NODES."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            client = redis.Redis(port=node.port)
            try:
                yield node, next(n for n in client.cluster("NODES").values() if "myself" in n["flags"])
            except redis.RedisError:
                continue
            finally:
                client.close()

    @staticmethod
    def _ok(client: redis.Redis) -> bool:
        info = client.cluster("INFO")
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) > 1

    @staticmethod
    def _synced(client: redis.Redis) -> bool:
        return client.info("replication").get("master_link_status") == "up"

    def stop(self) -> None:
        for node in self.nodes:  # all at once: each takes a moment to shut down
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a local Redis Cluster of valkey-servers.")
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a handler (not a mask, which children inherit)
        signal.signal(sig, lambda *_: stop.set())
    with LocalCluster(args.masters, args.replicas) as cluster:
        print(f"cluster ready: --redis-url {cluster.url} ({args.masters} masters, {args.replicas} replicas each; "
              "any node of the URL will do); Ctrl-C stops it", flush=True)
        while not stop.wait(1.0):
            pass


if __name__ == "__main__":
    main()
