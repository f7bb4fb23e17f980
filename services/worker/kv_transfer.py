"""Moving one request's KV blocks between engines (prefill/decode disaggregation), worker side.

A prefill engine's worker exports the KV of a request whose prompt it computed; the decode
engine's worker imports it into blocks its own scheduler allocated. Both only ever act on a
StepPlan's `kv_exports` / `kv_imports` and answer in the StepResult (KVTransferExecutor); which
request goes where, retries and timeouts are the schedulers' business (scheduler/disagg.py).

`KVTransport` is the interface: export a list of blocks from every layer's cache under a transfer
id and describe it in a KVManifest; import a manifest into a list of blocks; discard what an export
stored. `RedisKVTransport` works on any machine that shares the broker: the blocks, gathered into
one [layers, 2, blocks, block_size, kv_heads, head_dim] array, are cut into chunks stored under
`{prefix}:kv:{transfer_id}:{i}` with a TTL, each with a blake2b checksum in the manifest, and
fetched, verified and deleted by the importer. A GPU-direct transport (NCCL, NIXL: RDMA straight
into the destination's blocks) is another implementation of the same three methods, named by
the manifest's `transport`.

Both sides must use the same block size, dtype and model geometry; the import checks and refuses
a mismatch with a clear error rather than converting.

Test hook: RILL_TEST_KV_IMPORT_DELAY_S (seconds, default 0) makes this worker sleep before every
import, so a test can reliably kill a decode engine while transfers are in flight. Never set it
in production.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis
import torch

from rill.shared import envs
from rill.shared.schema import KVImportResult, KVManifest, StepPlan, StepResult
from rill.shared.streams import Streams

if TYPE_CHECKING:
    from rill.services.worker.model_runner import ModelRunner

log = logging.getLogger("rill.worker.kv")

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]

CHUNK_BYTES = 4 << 20  # a few MB per key: large enough to be cheap per byte, small enough to pipeline
CHUNK_TTL_S = 300  # chunks outlive any transfer timeout; the importer deletes them at once

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class KVTransferError(Exception):
    """A transfer that cannot complete. `retryable`: a fresh export may succeed (lost or corrupt
    data); otherwise the engines are incompatible and retrying is pointless."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' K and V from every layer as one contiguous CPU tensor
    [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
    k0 = kv_caches[0][0]
    out = torch.empty((len(kv_caches), 2, len(block_ids), *k0.shape[1:]), dtype=k0.dtype)
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        for j, cache in enumerate((k, v)):
            if cache.device.type == "cpu":
                torch.index_select(cache, 0, index, out=out[layer, j])
            else:
                out[layer, j].copy_(cache.index_select(0, index))
    return out


def scatter_blocks(kv_caches: KVCaches, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write `data` (as gather_blocks returns it) into these blocks of every layer, in place."""
    k0 = kv_caches[0][0]
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[layer, 0].to(k.device, non_blocking=True))
        v.index_copy_(0, index, data[layer, 1].to(v.device, non_blocking=True))


def expected_shape(kv_caches: KVCaches, num_blocks: int) -> list[int]:
    return [len(kv_caches), 2, num_blocks, *kv_caches[0][0].shape[1:]]


def check_compatible(manifest: KVManifest, kv_caches: KVCaches, block_ids: Sequence[int]) -> None:
    """Refuse a payload this cache cannot hold as it is (no conversion between geometries)."""
    local_dtype = dtype_name(kv_caches[0][0].dtype)
    if manifest.dtype != local_dtype:
        raise KVTransferError(f"KV dtype mismatch: the prefill engine exported {manifest.dtype}, this decode "
                              f"engine's cache is {local_dtype}; start every engine with the same --dtype",
                              retryable=False)
    want = expected_shape(kv_caches, len(block_ids))
    if list(manifest.shape) != want:
        raise KVTransferError(f"KV geometry mismatch: payload {list(manifest.shape)} vs this cache {want} "
                              f"([layers, 2, blocks, block_size, kv_heads, head_dim]); engines must serve the "
                              f"same model with the same --block-size", retryable=False)
    # The manifest comes off the broker: nothing in it is allocated or indexed before it is
    # checked against what this cache can hold.
    size = math.prod(want) * kv_caches[0][0].element_size()
    if manifest.nbytes != size:
        raise KVTransferError(f"KV manifest of {manifest.nbytes} bytes for a payload of {size}", retryable=False)
    num_blocks = kv_caches[0][0].shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise KVTransferError(f"KV block id {bad[0]} outside this cache's 0..{num_blocks - 1}", retryable=False)


class KVTransport(ABC):
    """Where exported KV lives between the two workers."""

    name: str

    @abstractmethod
    def export(self, transfer_id: str, kv_caches: KVCaches, block_ids: Sequence[int],
               num_tokens: int) -> KVManifest:
        """Store these blocks' KV under `transfer_id`; the manifest says how to find and check it."""

    @abstractmethod
    def import_into(self, manifest: KVManifest, kv_caches: KVCaches, block_ids: Sequence[int]) -> int:
        """Fetch, verify and write the payload into these blocks; returns the bytes moved.
        Raises KVTransferError (the blocks' contents are then undefined)."""

    @abstractmethod
    def discard(self, manifest: KVManifest) -> None:
        """Drop what an export stored (idempotent)."""


class RedisKVTransport(KVTransport):
    """Chunks in plain Redis keys with a TTL: works wherever the broker reaches."""

    name = "redis"

    def __init__(self, r: redis.Redis, streams: Streams, chunk_bytes: int = CHUNK_BYTES,
                 ttl_s: int = CHUNK_TTL_S) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        self.r = r
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s

    def keys(self, manifest: KVManifest) -> list[str]:
        return [self.streams.kv_chunk(manifest.transfer_id, i) for i in range(len(manifest.chunk_bytes))]

    def export(self, transfer_id: str, kv_caches: KVCaches, block_ids: Sequence[int],
               num_tokens: int) -> KVManifest:
        start = time.perf_counter()
        data = gather_blocks(kv_caches, block_ids)
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        sizes: list[int] = []
        sums: list[str] = []
        pipe = self.r.pipeline(transaction=False)
        for i, offset in enumerate(range(0, len(raw), self.chunk_bytes)):
            piece = raw[offset:offset + self.chunk_bytes]
            sizes.append(len(piece))
            sums.append(checksum(piece))
            pipe.set(self.streams.kv_chunk(transfer_id, i), piece, ex=self.ttl_s)
            if len(pipe) >= 8:  # bound what one round trip carries
                pipe.execute()
        pipe.execute()
        return KVManifest(transfer_id=transfer_id, transport=self.name, num_tokens=num_tokens,
                          block_size=int(data.shape[3]), dtype=dtype_name(data.dtype), shape=list(data.shape),
                          chunk_bytes=sizes, checksums=sums, nbytes=len(raw),
                          export_ms=(time.perf_counter() - start) * 1e3)

    def fetch(self, manifest: KVManifest) -> bytearray:
        """Every chunk, verified, joined into one buffer."""
        if len(manifest.checksums) != len(manifest.chunk_bytes) or sum(manifest.chunk_bytes) != manifest.nbytes:
            raise KVTransferError(f"transfer {manifest.transfer_id}: malformed manifest", retryable=False)
        buf = bytearray(manifest.nbytes)
        view = memoryview(buf)
        keys = self.keys(manifest)
        offset = 0
        for first in range(0, len(keys), 8):
            batch = keys[first:first + 8]
            for i, payload in enumerate(self.r.mget(batch), start=first):
                if payload is None:
                    raise KVTransferError(f"transfer {manifest.transfer_id}: chunk {i} of {len(keys)} is missing "
                                          f"(expired or deleted)")
                if len(payload) != manifest.chunk_bytes[i] or checksum(payload) != manifest.checksums[i]:
                    raise KVTransferError(f"transfer {manifest.transfer_id}: checksum mismatch in chunk {i} "
                                          f"of {len(keys)} (the data was corrupted)")
                view[offset:offset + len(payload)] = payload
                offset += len(payload)
        return buf

    def import_into(self, manifest: KVManifest, kv_caches: KVCaches, block_ids: Sequence[int]) -> int:
        check_compatible(manifest, kv_caches, block_ids)
        buf = self.fetch(manifest)
        data = torch.frombuffer(buf, dtype=torch.uint8).view(_DTYPES[manifest.dtype]).view(manifest.shape)
        scatter_blocks(kv_caches, block_ids, data)
        self.discard(manifest)  # imported: nobody needs the chunks any more
        return manifest.nbytes

    def discard(self, manifest: KVManifest) -> None:
        keys = self.keys(manifest)
        if keys:
            self.r.unlink(*keys)


class KVTransferExecutor:
    """Runs a plan's exports and imports against the runner's cache after its forward step and
    records the outcomes in the step's result. A failed transfer never fails the step."""

    def __init__(self, runner: ModelRunner, transports: Sequence[KVTransport]) -> None:
        self.runner = runner
        self.transports = {t.name: t for t in transports}
        self.default = transports[0]

    def run(self, plan: StepPlan, result: StepResult) -> None:
        if plan.kv_exports:
            result.kv_exports = [self._export(e.transfer_id, e.block_ids, e.num_tokens) for e in plan.kv_exports]
        if plan.kv_imports:
            result.kv_imports = [self._import(i.manifest, i.block_ids) for i in plan.kv_imports]

    def _export(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> KVManifest:
        try:
            return self.default.export(transfer_id, self.runner.kv_caches, block_ids, num_tokens)
        except (redis.RedisError, RuntimeError, ValueError, IndexError) as exc:
            log.warning("KV export %s failed: %r", transfer_id, exc)
            return KVManifest(transfer_id=transfer_id, transport=self.default.name, error=f"export failed: {exc}")

    def _import(self, manifest: KVManifest, block_ids: list[int]) -> KVImportResult:
        delay = envs.RILL_TEST_KV_IMPORT_DELAY_S
        if delay > 0:
            time.sleep(delay)  # test hook only (see module doc)
        start = time.perf_counter()
        transport = self.transports.get(manifest.transport)
        try:
            if transport is None:
                raise KVTransferError(f"this worker has no {manifest.transport!r} KV transport", retryable=False)
            nbytes = transport.import_into(manifest, self.runner.kv_caches, block_ids)
        except KVTransferError as exc:
            log.warning("KV import %s failed: %s", manifest.transfer_id, exc)
            return KVImportResult(transfer_id=manifest.transfer_id, error=str(exc), retryable=exc.retryable)
        except (redis.RedisError, RuntimeError, ValueError, IndexError) as exc:
            log.warning("KV import %s failed: %r", manifest.transfer_id, exc)
            return KVImportResult(transfer_id=manifest.transfer_id, error=f"import failed: {exc}", retryable=True)
        return KVImportResult(transfer_id=manifest.transfer_id, nbytes=nbytes,
                              import_ms=(time.perf_counter() - start) * 1e3)
