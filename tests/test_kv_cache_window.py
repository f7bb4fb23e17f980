"""The KV-cache manager with a sliding window: blocks wholly behind the window go back to the
pool, released entries never reach the worker as a bad id, and the prefix cache stays right.
(The scheduler and model side: tests/test_sliding_window.py.)"""

from __future__ import annotations

from rill.services.scheduler.kv_cache_manager import RELEASED, KVCacheManager, block_hashes


def test_kv_manager_releases_blocks_behind_the_window() -> None:
    """A long generation, one token a step: the request holds at most the blocks its window
    spans, released ones read as block 0 to the worker, hashed ones stay cached (a later
    prefix hit may use them until they are handed out again), and sharing a prompt whose blocks
    were released falls back to computing it."""
    window, bs = 6, 4
    kv = KVCacheManager(32, bs, enable_prefix_caching=True, sliding_window=window)
    tokens = list(range(100, 140))
    assert kv.allocate("a", 9) is not None
    for pos in range(9, 40):  # decode: the token at `pos` runs next
        kv.register_full_blocks("a", block_hashes(tokens[:pos], bs), pos)
        kv.release_behind_window("a", pos)
        assert kv.allocate("a", pos + 1) is not None
        kv.check_invariants()
        live = [b for b in kv.tables["a"] if b != RELEASED]
        assert len(live) <= -(-window // bs) + 1
        first_needed = pos - window + 1
        assert all(b != RELEASED for b in kv.tables["a"][first_needed // bs:])
    assert kv.num_free_blocks == 32 - len(live)
    assert kv.block_ids("a")[0] == 0 and RELEASED not in kv.block_ids("a")
    assert kv.shareable_prefix("a", 3) == []
    # Released full blocks keep their hash: the first 3 blocks of the prompt are a cache hit.
    hit = kv.lookup(block_hashes(tokens[:13], bs), 13)
    assert len(hit) == 3 and all(kv.ref_cnt[b] == 0 for b in hit)
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks == 32
    # Without a window nothing is released.
    plain = KVCacheManager(8, bs)
    plain.allocate("b", 30)
    assert plain.release_behind_window("b", 29) == 0
