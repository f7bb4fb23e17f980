"""Which engine gets a new request: data-parallel routing over the engines in Redis.

Policies (`--routing`):
  least-loaded  the engine with the fewest requests (running + waiting + in transfer, from its
                stats key) plus what this replica sent it since it last read them.
  cache-aware   the engine whose prefix cache holds the longest leading run of the prompt's
                full blocks (followed on its prefix stream, shared/prefix_stream.py),
                unless it is overloaded against the least-loaded one (BALANCE_*), as SGLang's
                router does; no match anywhere, a tie or an overload: least-loaded.
  round-robin   the live engines in turn.

A request the gateway sends again because its engine was lost (killed, or restarted: what this
router last read of it may still look alive and idle) names that engine, and goes elsewhere
while another engine is a candidate.

Common rules: only engines that run prompts (role "both" or "prefill"; a "decode" engine gets
its requests from prefill engines, with their KV). Engines that have published no stats yet
(role unknown) are used only when no engine's role is known to run prompts. An engine whose
scheduler or worker heartbeat is missing (killed, or not started) is skipped while another one
beats; with none beating, every listed engine stays a candidate (its requests wait for it).
Everything is read at most every SUMMARY_REFRESH_S: the stats and heartbeats in one MGET, the
prefix streams' new entries (cache-aware) in one pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from rill.shared.block_hash import SUMMARY_REFRESH_S, block_hashes, short_words
from rill.shared.bus import Bus
from rill.shared.heartbeat import engine_beat_keys, engine_ids, engines_alive
from rill.shared.kinds import EngineRole
from rill.shared.prefix_stream import PrefixView
from rill.shared.schema import stats_decoder

log = logging.getLogger("rill.tokenizer")
POLICIES = ("least-loaded", "cache-aware", "round-robin")
DEFAULT_POLICY = "cache-aware"  # scripts/bench_routing.py: multi-turn chats over 2 engines
# The cache-aware pick yields to the least-loaded engine only when it has both BALANCE_ABS more
# requests and BALANCE_REL times as many: a few extra requests cost less than recomputing a
# long prefix (a 1,000-token prefill is many decode steps' work), but an engine holding a hot
# prefix must not take a whole burst while the others idle. SGLang's defaults are 32 and 1.0001
# on GPUs with hundreds of sequences per batch; CPU batches are tens, hence smaller numbers.
BALANCE_ABS = 4
BALANCE_REL = 1.5


@dataclass
class EngineView:
    role: EngineRole | None = None  # None: no stats yet
    load: int = 0
    block_size: int = 0
    cached: set[int] = field(default_factory=set)  # short hashes of its cached blocks
    routed: set[int] = field(default_factory=set)  # prompts sent since the read: cached soon


class Router:
    def __init__(self, bus: Bus, policy: str = DEFAULT_POLICY) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.bus = bus
        self.policy = policy
        self.engines: dict[int, EngineView] = {}
        self.sent: dict[int, int] = {}  # since the last read
        self.prefixes: dict[int, PrefixView] = {}  # followed across refreshes (cache-aware)
        self._unreadable: set[int] = set()  # engines whose prefix stream failed (logged once)
        self._last_rr: int | None = None
        self._read_at = float("-inf")

    # ------------------------------------------------------------------------ reading

    def _refresh(self) -> None:
        s = self.bus.streams
        ids = engine_ids(self.bus.r.smembers(s.engines_key()))
        n = len(ids)
        raw = self.bus.mget([s.stats_key(e) for e in ids] + engine_beat_keys(s, ids))
        live = [e for e, up in zip(ids, engines_alive(raw[n:], n), strict=True) if up]
        if self.policy == "cache-aware":
            self._follow_prefixes(ids)
        engines: dict[int, EngineView] = {}
        for i, e in enumerate(ids):
            if live and e not in live:
                continue
            view = engines[e] = self._view(raw[i])
            if e in self.prefixes:
                view.cached = self.prefixes[e].words
        self.engines, self.sent, self._read_at = engines, {}, time.monotonic()

    def _follow_prefixes(self, ids: list[int]) -> None:
        """Apply each engine's new prefix-stream entries; an engine whose entries do not follow
        on is read again from its snapshot at once, and counts as caching nothing if that fails
        too (an unreadable stream likewise)."""
        self.prefixes = {e: self.prefixes.get(e) or PrefixView() for e in ids}
        todo, now = list(ids), time.monotonic()
        for _ in range(2):
            if not todo:
                break
            pipe = self.bus.r.pipeline(transaction=False)
            for e in todo:
                pipe.xrange(self.bus.streams.prefix_stream(e), self.prefixes[e].start_from(now), "+")
            replies = pipe.execute(raise_on_error=False)
            todo = [e for e, reply in zip(todo, replies, strict=True)
                    if isinstance(reply, Exception) or not self.prefixes[e].apply(reply)]
        for e in todo:
            self.prefixes[e] = PrefixView()
            if e not in self._unreadable:
                log.warning("engine %d's prefix stream cannot be followed (malformed or lost entries): "
                            "routing as if it cached nothing until it can", e)
        self._unreadable = set(todo)

    @staticmethod
    def _view(payload: bytes | None) -> EngineView:
        try:
            st = stats_decoder.decode(payload) if payload is not None else None
        except msgspec.DecodeError:
            st = None
        if st is None:
            return EngineView()
        return EngineView(st.role, st.num_running + st.num_waiting + st.num_transferring, st.block_size)

    # ------------------------------------------------------------------------ picking

    def role(self, engine: int) -> EngineRole | None:
        """The engine's role as of the last read (None: not known yet)."""
        view = self.engines.get(engine)
        return view.role if view is not None else None

    def load(self, engine: int) -> int:
        view = self.engines.get(engine)
        return (view.load if view is not None else 0) + self.sent.get(engine, 0)

    def candidates(self) -> list[int]:
        runs_prompts = [e for e, v in self.engines.items() if v.role in ("both", "prefill")]
        unknown = [e for e, v in self.engines.items() if v.role is None]
        return sorted(runs_prompts or unknown or self.engines) or [0]

    def pick(self, prompt_token_ids: Sequence[int] = (), avoid: int = -1, salt: str | None = None) -> int:
        """The engine for a new request with this prompt and cache salt (they matter to cache-aware only),
        other than `avoid` (the engine that lost it: a re-send) while another one is a candidate."""
        if time.monotonic() - self._read_at >= SUMMARY_REFRESH_S:
            self._refresh()
        candidates = self.candidates()
        candidates = [e for e in candidates if e != avoid] or candidates
        if self.policy == "round-robin":
            later = [e for e in candidates if self._last_rr is None or e > self._last_rr]
            choice = (later or candidates)[0]
            self._last_rr = choice
        elif self.policy == "cache-aware":
            choice = self._cache_aware(candidates, prompt_token_ids, salt)
        else:
            choice = self._least_loaded(candidates)
        self.sent[choice] = self.sent.get(choice, 0) + 1
        return choice

    def _least_loaded(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda e: (self.load(e), e))

    def _cache_aware(self, candidates: list[int], prompt: Sequence[int], salt: str | None) -> int:
        least = self._least_loaded(candidates)
        hashes: dict[int, list[int]] = {}  # by block size: engines may differ
        matched: dict[int, int] = {}
        for e in candidates:
            view = self.engines.get(e)
            if view is None or view.block_size <= 0:
                continue
            if view.block_size not in hashes:
                hashes[view.block_size] = short_words(block_hashes(list(prompt), view.block_size, salt=salt))
            matched[e] = self.matched_blocks(view, hashes[view.block_size])
        best = max(candidates, key=lambda e: (matched.get(e, 0), -self.load(e), -e))
        min_load, load = self.load(least), self.load(best)
        overloaded = load > min_load + BALANCE_ABS and load > BALANCE_REL * min_load
        choice = least if matched.get(best, 0) == 0 or overloaded else best
        view = self.engines.get(choice)
        if view is not None and view.block_size in hashes:  # its cache will hold this prompt soon
            view.routed.update(hashes[view.block_size])
        return choice

    @staticmethod
    def matched_blocks(view: EngineView, short_hashes: list[int]) -> int:
        """How many leading blocks of the prompt the engine has cached (or was just sent)."""
        n = 0
        for h in short_hashes:
            if h not in view.cached and h not in view.routed:
                break
            n += 1
        return n
