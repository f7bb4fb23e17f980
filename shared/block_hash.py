"""Names of full KV-cache blocks: a blake2b hash of a block's tokens chained with its
predecessor's, stable across processes and restarts (unlike Python's `hash`).

Shared by the scheduler's prefix cache (services/scheduler/kv_cache_manager.py) and the
tokenizer's cache-aware router (services/tokenizer/router.py), which must compute the same
names for the same prompt; torch-free, so a tokenizer replica stays light.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

NONE_HASH = b"\x00" * 16
SHORT_HASH_BYTES = 8  # what an engine's prefix summary keeps of each hash (collisions: ~2^-64)
SUMMARY_REFRESH_S = 0.25  # routers read the summaries this often; schedulers write no faster


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def block_hashes(token_ids: list[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, extending `known` (a prefix of them)."""
    out = list(known or [])
    parent = out[-1] if out else NONE_HASH
    for i in range(len(out), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def pack_summary(hashes: Iterable[bytes]) -> bytes:
    """An engine's prefix summary value: the short form of each hash, concatenated, no order."""
    return b"".join(h[:SHORT_HASH_BYTES] for h in hashes)


def parse_summary(value: bytes | None) -> frozenset[bytes]:
    """The short hashes a summary value holds (empty for a missing key)."""
    if not value:
        return frozenset()
    n = SHORT_HASH_BYTES
    return frozenset(value[i:i + n] for i in range(0, len(value) - n + 1, n))
