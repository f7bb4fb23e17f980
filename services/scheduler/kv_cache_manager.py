"""Paged KV-cache bookkeeping: block ownership, reference counts, prefix cache. No I/O, no tensors.

The worker holds the K/V tensors; this class only hands out block ids, so the scheduler decides
every step without asking the worker anything.

Prefix caching: a full block is named by a hash chained with its predecessor's (blake2b, stable
across processes and restarts, unlike Python's `hash`; shared/block_hash.py). When a request's block becomes full it is
registered under that hash; later requests whose tokens hash the same reuse the block by
reference count. A block whose count drops to zero stays cached in the free queue, ordered least
recently used first, and is evicted (its hash dropped) only when the block is handed out again.

Sliding windows (`sliding_window`, set only when every layer of the model slides, Mistral-style):
a query at position p reads keys p - window + 1 .. p only, so once a request's next query is far
enough on, the blocks wholly behind its window are released (`release_behind_window`, as vLLM's
SlidingWindowManager does). Their table entries become RELEASED, which the worker is sent as
block 0 (`block_ids`): the kernels never read a table entry before the window, so any valid id
will do. A released block keeps its prefix-cache hash, like any freed block, until it is handed
out again: its content is intact until then, so a later prefix hit on it is still right.
A model with any full-attention layer (Gemma 3: one global layer in six) keeps every block: the
global layers read the whole context, and one table serves all layers. Sizing a second pool per
layer type (vLLM's hybrid allocator) would release the sliding layers' share; not done.
"""

from __future__ import annotations

from collections import OrderedDict

from rill.shared.block_hash import NONE_HASH, block_hashes, hash_block

__all__ = ["NONE_HASH", "RELEASED", "KVCacheManager", "block_hashes", "blocks_for", "hash_block"]

RELEASED = -1  # a table entry whose block was released behind a sliding window


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Bumped whenever `cached` gains or loses a hash: the engine publishes its prefix cache
        # (services/scheduler/prefix_summary.py) only when this moved. `changed` lists those
        # hashes since the publisher last took them (None: nobody publishes; vLLM's KV events).
        self.cache_version = 0
        self.changed: list[bytes] | None = None
        # Blocks with no owner, eviction order first. Cached ones keep their hash until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}  # how many leading blocks of a table are registered
        self.num_released: dict[str, int] = {}  # leading table entries released behind the window
        self.released_total = 0  # blocks released behind a window, ever (stats)
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of those, tokens found
        # A preempted request's lookups again, counted apart as vLLM does: it finds its own
        # blocks, which would make the hit rate read higher the more an engine preempts.
        self.preempted_queries = 0
        self.preempted_hits = 0

    # ------------------------------------------------------------------------------ views

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (unowned, whether or not they hold cached data)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue if self.block_hash[b] is not None)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as the worker is sent it: released entries read as block 0
        (never read: they are behind every query's window)."""
        table = self.tables.get(request_id, [])
        if not self.num_released.get(request_id):
            return table
        return [0 if b == RELEASED else b for b in table]

    def shareable_prefix(self, request_id: str, num_blocks: int) -> list[int]:
        """The request's first `num_blocks` blocks for another sample of its prompt to start from,
        or none when some were released (that sample then computes its prompt itself)."""
        if self.num_released.get(request_id):
            return []
        return self.tables.get(request_id, [])[:num_blocks]

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.num_blocks

    # ------------------------------------------------------------------------ prefix cache

    def lookup(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """Cached blocks for the longest known prefix; at least one token is left to compute,
        because the step must produce the logits of the last token."""
        if not self.enable_prefix_caching:
            return []
        limit = (num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:limit]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_query(self, num_tokens: int, num_hit_tokens: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit_tokens
        else:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def register_full_blocks(self, request_id: str, hashes: list[bytes], num_computed_tokens: int) -> None:
        """Publish the request's blocks that are now full and computed under their hashes."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(request_id)
        if not table:
            return
        start = self.num_hashed.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(hashes), len(table))
        for i in range(start, end):
            block, h = table[i], hashes[i]
            if block == RELEASED:  # released behind the window before its result came back
                continue
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                self._cache_changed(h)
            # else: the same content already has a cached block; this copy stays anonymous.
        if end > start:
            self.num_hashed[request_id] = end

    # ------------------------------------------------------------------------- ownership

    def _take_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: its content is about to be overwritten
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                self._cache_changed(h)
        return block

    def _touch(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def allocate(self, request_id: str, num_tokens: int, prefix_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens.

        `prefix_blocks` (only for a request with no table yet) are shared blocks that start it:
        prefix-cache hits or a parent's prompt. Returns the newly added block ids, or None,
        changing nothing, when there are not enough blocks.
        """
        table = self.tables.get(request_id)
        if table is not None and not prefix_blocks and len(table) * self.block_size >= num_tokens:
            return []  # the common decode step: the last block still has room
        shared = prefix_blocks or []
        if table is None:
            table = []
        elif shared:
            raise ValueError("prefix blocks can only start a new block table")
        have = len(table) + len(shared)
        need = blocks_for(num_tokens, self.block_size) - have
        # A shared block that sits in the free queue is reusable but no longer free once taken.
        reclaimed = sum(1 for b in shared if self.ref_cnt[b] == 0)
        if max(need, 0) + reclaimed > len(self.free_queue):
            return None
        for b in shared:
            self._touch(b)
        new = [self._take_free() for _ in range(max(need, 0))]
        for b in new:
            self.ref_cnt[b] = 1
        if request_id not in self.tables:
            self.tables[request_id] = table
            if shared:
                self.num_hashed[request_id] = sum(1 for b in shared if self.block_hash[b] is not None)
        table.extend(shared)
        table.extend(new)
        return shared + new

    def free(self, request_id: str) -> int:
        """Drop the request's references; returns how many blocks it held. Safe to call twice."""
        table = self.tables.pop(request_id, None)
        self.num_hashed.pop(request_id, None)
        released = self.num_released.pop(request_id, 0)
        if not table:
            return 0
        # Last block first: the tail of a sequence is the least likely to be shared again, so it
        # is evicted before the head.
        for block in reversed(table[released:]):
            self._unref(block)
        return len(table) - released

    def _unref(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is None:  # anonymous: nothing can reuse it, evict it first
                self.free_queue.move_to_end(block, last=False)

    def release_behind_window(self, request_id: str, next_position: int) -> int:
        """Release the request's blocks that no query from `next_position` on can read: those
        wholly before position next_position - window + 1. Only with a sliding window; the worker
        runs steps in order, so a step already in flight still finds those blocks as they were.
        Returns how many blocks were released."""
        if self.sliding_window is None:
            return 0
        table = self.tables.get(request_id)
        if not table:
            return 0
        start = self.num_released.get(request_id, 0)
        end = min(max(0, next_position - self.sliding_window + 1) // self.block_size, len(table))
        for i in range(start, end):
            self._unref(table[i])
            table[i] = RELEASED
        if end <= start:
            return 0
        self.num_released[request_id] = end
        self.released_total += end - start
        return end - start

    def reset_prefix_cache(self) -> int:
        """Forget every cached-but-unowned block (e.g. after the worker lost its KV)."""
        dropped = 0
        for block in self.free_queue:
            h = self.block_hash[block]
            if h is not None:
                self.block_hash[block] = None
                self.cached.pop(h, None)
                self._cache_changed(h)
                dropped += 1
        return dropped

    def _cache_changed(self, h: bytes) -> None:
        """`cached` gained or lost `h`: what the prefix-cache publisher watches."""
        self.cache_version += 1
        if self.changed is not None:
            self.changed.append(h)

    def check_invariants(self) -> None:
        """For tests: every structure agrees with every other."""
        refs = [0] * self.num_blocks
        for rid, table in self.tables.items():
            released = self.num_released.get(rid, 0)
            assert all(b == RELEASED for b in table[:released]), "a released entry still names a block"
            for b in table[released:]:
                assert b != RELEASED, "a released entry after the window's first block"
                refs[b] += 1
        assert refs == self.ref_cnt, "reference counts differ from block-table references"
        for b in range(self.num_blocks):
            assert (b in self.free_queue) == (refs[b] == 0), f"block {b} free-queue membership wrong"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, "hash map and block hash disagree"
        assert sum(1 for h in self.block_hash if h is not None) == len(self.cached)
