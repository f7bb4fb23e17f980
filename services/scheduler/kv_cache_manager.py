"""Paged KV-cache bookkeeping: which blocks each request owns. No I/O, no tensors.

The worker holds the actual K/V tensors; this class only hands out block ids, so the
scheduler can decide every step without asking the worker anything.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.num_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens.

        Returns the newly added block ids (possibly empty), or None, changing nothing, when
        there are not enough free blocks.
        """
        owned = self._owned.setdefault(request_id, [])
        need = blocks_for(num_tokens, self.block_size) - len(owned)
        if need <= 0:
            return []
        if need > len(self._free):
            if not owned:
                del self._owned[request_id]
            return None
        new = [self._free.popleft() for _ in range(need)]
        owned.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Give back every block of the request; returns how many. Safe to call twice."""
        owned = self._owned.pop(request_id, None)
        if not owned:
            return 0
        # Last block first: the front of the request is the most reusable part (prefix caching).
        self._free.extend(reversed(owned))
        return len(owned)
