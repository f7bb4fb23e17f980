"""Names of full KV-cache blocks: a blake2b hash of a block's tokens chained with its
predecessor's, stable across processes and restarts (unlike Python's `hash`).

Shared by the scheduler's prefix cache (services/scheduler/kv_cache_manager.py) and the
tokenizer's cache-aware router (services/tokenizer/router.py), which must compute the same
names for the same prompt; torch-free, so a tokenizer replica stays light.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16
NONE_HASH = b"\x00" * HASH_BYTES
SHORT_HASH_BYTES = 8  # what an engine's prefix stream keeps of each hash (collisions: ~2^-64)
SUMMARY_REFRESH_S = 0.25  # routers read the prefix streams this often; schedulers write no faster


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=HASH_BYTES).digest()


def salt_root(salt: str) -> bytes:
    # Its own blake2b personalisation: no salt can name a chain an unsalted prompt makes.
    return hashlib.blake2b(salt.encode(), digest_size=HASH_BYTES, person=b"cache_salt").digest()


def block_hashes(token_ids: list[int], block_size: int, known: list[bytes] | None = None,
                 salt: str | None = None) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, extending `known` (a prefix of them).
    A `salt` (a request's cache_salt) roots the chain elsewhere: only requests with the same salt
    share blocks, so one tenant cannot learn from cache timing what another's prompts hold."""
    out = list(known or [])
    extend_block_hashes(out, token_ids[len(out) * block_size:], block_size, salt)
    return out


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, salt: str | None = None) -> None:
    """Append to `hashes` (those of the blocks before `token_ids`) the hashes of token_ids' full blocks."""
    parent = hashes[-1] if hashes else salt_root(salt) if salt else NONE_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)


def pack_summary(hashes: Sequence[bytes]) -> bytes:
    """The first SHORT_HASH_BYTES of each hash, concatenated, as an engine's prefix stream carries
    them (every other 8-byte word of the hashes joined: 3x cheaper than slicing each)."""
    joined = b"".join(hashes)
    assert len(joined) == HASH_BYTES * len(hashes) and HASH_BYTES == 2 * SHORT_HASH_BYTES
    return memoryview(joined).cast("Q")[::2].tobytes()


def short_words(hashes: Sequence[bytes]) -> list[int]:
    """Hashes as the routers hold them (shared/prefix_stream.py): short hashes as 8-byte words, in order."""
    return array("Q", pack_summary(hashes)).tolist()
