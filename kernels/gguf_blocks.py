"""GGUF (ggml) block-quantized weight formats: their sizes, and a vectorized torch dequantizer
that gives the same float32 values as `gguf.quants.dequantize`, bit for bit.

A quantized weight row is a run of blocks; each block holds `elements` weights in `nbytes`
bytes: fp16 scales (at `halves`, byte offsets) and packed integers. The layouts are ggml's
(ggml-common.h). The dequantizer repeats the reference's float operations in the same order
(fp16 -> fp32, then one multiply and at most one add or subtract per step), so the results are
equal, not just close; the native GEMM (cpu_gguf.c) reads the same blocks without unpacking them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # ggml type ids


@dataclass(frozen=True)
class BlockFormat:
    name: str
    elements: int  # weights per block
    nbytes: int  # bytes per block
    halves: tuple[int, ...]  # byte offsets of the block's fp16 scale fields


FORMATS: dict[int, BlockFormat] = {
    Q4_0: BlockFormat("Q4_0", 32, 18, (0,)),
    Q4_1: BlockFormat("Q4_1", 32, 20, (0, 2)),
    Q5_0: BlockFormat("Q5_0", 32, 22, (0,)),
    Q5_1: BlockFormat("Q5_1", 32, 24, (0, 2)),
    Q8_0: BlockFormat("Q8_0", 32, 34, (0,)),
    Q4_K: BlockFormat("Q4_K", 256, 144, (0, 2)),
    Q5_K: BlockFormat("Q5_K", 256, 176, (0, 2)),
    Q6_K: BlockFormat("Q6_K", 256, 210, (208,)),
}
SUPPORTED: frozenset[int] = frozenset(FORMATS)


def name(qtype: int) -> str:
    return FORMATS[qtype].name if qtype in FORMATS else f"ggml type {qtype}"


def block_format(qtype: int) -> BlockFormat:
    if qtype not in FORMATS:
        raise ValueError(f"unsupported GGUF block format: {name(qtype)}")
    return FORMATS[qtype]


def random_blocks(qtype: int, n: int, k: int, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """Random raw blocks uint8 [n, row_bytes(qtype, k)] with finite fp16 scales in (-scale, scale)
    where random bits would give NaNs and infinities (for kernel tests and timing)."""
    fmt = block_format(qtype)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // fmt.elements, fmt.nbytes), dtype=torch.uint8, generator=g)
    for at in fmt.halves:
        scales = ((torch.rand(blocks.shape[0], 1, generator=g) * 2 - 1) * scale).half()
        blocks[:, at:at + 2] = scales.view(torch.uint8)
    return blocks.reshape(n, -1)


@functools.cache  # asked on every block GEMM call
def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of k elements; ValueError unless k is a whole number of blocks."""
    fmt = block_format(qtype)
    if k <= 0 or k % fmt.elements:
        raise ValueError(f"{fmt.name} rows hold a multiple of {fmt.elements} elements, not {k}")
    return k // fmt.elements * fmt.nbytes


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, as float32 [blocks, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor, group: int) -> torch.Tensor:
    """Per `group` bytes: their low nibbles, then their high nibbles ([blocks, 2 * bytes])."""
    q = q.reshape(q.shape[0], -1, 1, group)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(q.shape[0], -1)


def _bits(q: torch.Tensor, width: int) -> torch.Tensor:
    """Fields of `width` bits, lowest first, of each byte: [blocks, bytes] -> [blocks, bytes, 8 / width]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=q.device)
    return (q.unsqueeze(-1) >> shifts) & ((1 << width) - 1)


@dataclass
class Affine:
    """Blocks as w = scale * (codes - offset) + zero per `group` consecutive weights: every format
    here is one (K formats: their sub-block scale folded into `scale`, their min into `zero`).
    codes uint8 [blocks, elements]; scale and zero fp32 [blocks, elements / group] (zero None
    for the formats without a min)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    offset: int
    group: int
    bits: int  # codes < 2 ** bits

    def values(self) -> torch.Tensor:
        """float32 [blocks, elements], the reference's operations in its order: one multiply, then
        the add of the min (K formats: d * sc * q - dmin * m, as a + (-b), which is exact)."""
        nb, e = self.codes.shape
        q = self.codes.reshape(nb, -1, self.group)
        w = self.scale.unsqueeze(-1) * (q.to(torch.int16) - self.offset if self.offset else q).float()
        if self.zero is not None:
            w += self.zero.unsqueeze(-1)
        return w.reshape(nb, e)


def _q8_0(b: torch.Tensor) -> Affine:
    return Affine(b[:, 2:] ^ 0x80, _half(b, 0), None, 128, 32, 8)  # int8 -> uint8 + 128


def _q4_0(b: torch.Tensor) -> Affine:
    return Affine(_nibbles(b[:, 2:], 16), _half(b, 0), None, 8, 32, 4)


def _q4_1(b: torch.Tensor) -> Affine:
    return Affine(_nibbles(b[:, 4:], 16), _half(b, 0), _half(b, 2), 0, 32, 4)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32) as 0 or 16 per element."""
    return _bits(qh, 1).reshape(qh.shape[0], 32) << 4


def _q5_0(b: torch.Tensor) -> Affine:
    return Affine(_nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6]), _half(b, 0), None, 16, 32, 5)


def _q5_1(b: torch.Tensor) -> Affine:
    return Affine(_nibbles(b[:, 8:], 16) | _high_bits(b[:, 4:8]), _half(b, 0), _half(b, 2), 0, 32, 5)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor, bits: int) -> Affine:
    """d * sc * q - dmin * m per 32-element sub-block (the products rounded as the reference does)."""
    sc, mn = _k_scales(b[:, 4:16])
    return Affine(q, _half(b, 0) * sc.float(), -(_half(b, 2) * mn.float()), 0, 32, bits)


def _q4_k(b: torch.Tensor) -> Affine:
    return _k_affine(b, _nibbles(b[:, 16:], 32), 4)


def _q5_k(b: torch.Tensor) -> Affine:
    high = _bits(b[:, 16:48], 1).transpose(1, 2).reshape(b.shape[0], 256) << 4  # sub-block s: bit s
    return _k_affine(b, _nibbles(b[:, 48:], 32) | high, 5)


def _q6_k(b: torch.Tensor) -> Affine:
    nb = b.shape[0]
    low = _nibbles(b[:, :128], 64)  # per 128-element half: 4 runs of 32
    high = _bits(b[:, 128:192].reshape(nb, 2, 32), 2).permute(0, 1, 3, 2).reshape(nb, 256) << 4
    return Affine(low | high, _half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float(), None, 32, 16, 6)


_AFFINE: dict[int, Callable[[torch.Tensor], Affine]] = {
    Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
}


def _blocks(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    fmt = block_format(qtype)
    rb = row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb:
        raise ValueError(f"{fmt.name} weight of {k} columns: want uint8 [n, {rb}], got {raw.dtype} {list(raw.shape)}")
    return raw.contiguous().reshape(-1, fmt.nbytes)


def affine(raw: torch.Tensor, qtype: int, k: int) -> Affine:
    """Raw blocks uint8 [n, row_bytes(qtype, k)] as one Affine over the rows: codes [n, k], scale
    and zero [n, k / group] (what a kernel without this format's bit layout multiplies)."""
    a = _AFFINE[qtype](_blocks(raw, qtype, k))
    n = raw.shape[0]
    return Affine(a.codes.reshape(n, k), a.scale.reshape(n, -1), None if a.zero is None else a.zero.reshape(n, -1),
                  a.offset, a.group, a.bits)


def dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Raw blocks uint8 [n, row_bytes(qtype, k)] -> float32 [n, k], equal to gguf's dequantizer."""
    return _AFFINE[qtype](_blocks(raw, qtype, k)).values().reshape(raw.shape[0], k)


X16_FORMATS = frozenset({Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K})  # the formats with a 16-row repacked GEMM (cpu_gguf_x16.c)
X16_KEEPS_ROWS = frozenset({Q4_K, Q5_K})  # repacked with products of its scales: the rows cannot be rebuilt


def _x16_fields(qtype: int) -> tuple[int, int, int, int]:
    """(bytes of a (converted) block of 32 values, bytes of its scale fields before the values,
    bytes of its values, bytes of one field)."""
    if qtype == Q4_K:
        return 24, 8, 16, 4  # fp32 d and m, nibbles
    if qtype == Q5_K:
        return 28, 8, 20, 4  # fp32 d and m, nibbles, fifth bits
    if qtype == Q6_K:
        return 28, 4, 24, 2  # d, (sc0, sc1); low nibbles, high bits
    return (20, 4, 16, 2) if qtype in (Q4_0, Q4_1) else (34, 2, 32, 2)


_BIT_OF_RUN = torch.arange(8, dtype=torch.uint8).view(8, 1)


def _k_as_f(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Q4_K / Q5_K rows as blocks of 32 values: fp32 d sc and -dmin m (exact), then 16 bytes of
    nibbles laid out as Q4_1's (value i low, value i + 16 high); Q5_K then 4 bytes of fifth bits
    (bit u of byte e: value 4 u + e)."""
    a = affine(raw, qtype, k)
    codes = a.codes.reshape(-1, 32)
    assert a.zero is not None
    nibbles = (codes[:, :16] & 15) | ((codes[:, 16:] & 15) << 4)
    d, m = a.scale.reshape(-1, 1).contiguous(), a.zero.reshape(-1, 1).contiguous()
    fields = [d.view(torch.uint8), m.view(torch.uint8), nibbles]
    if qtype == Q5_K:
        fields.append(((codes >> 4).reshape(-1, 8, 4) << _BIT_OF_RUN).sum(dim=1, dtype=torch.uint8))
    return torch.cat(fields, dim=1).reshape(raw.shape[0], -1)


_Q6_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)


def _q6_k_as_q6_f(raw: torch.Tensor, k: int) -> torch.Tensor:
    """Q6_K rows as blocks of 32 values (28 bytes): the super-block's d, the two 16-value scales,
    the low nibbles laid out as Q4_1's (value i low, i + 16 high), then 8 bytes of high 2-bit
    fields (bits 2c of byte 4j + e: value 16j + 4c + e). A permutation of the file's bits."""
    b = raw.reshape(-1, 210)
    u = affine(raw, Q6_K, k).codes.reshape(-1, 8, 32)  # 0..63, value order
    nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    high = ((u >> 4).reshape(-1, 8, 2, 4, 4) << _Q6_SHIFTS).sum(dim=3, dtype=torch.uint8).reshape(-1, 8, 8)
    d = b[:, 208:210].unsqueeze(1).expand(-1, 8, 2)
    return torch.cat([d, b[:, 192:208].reshape(-1, 8, 2), nibbles, high], dim=2).reshape(raw.shape[0], -1)


def q6_k_blocks(u: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks uint8 [blocks, 210] from their codes u (0..63, value order) uint8 [blocks, 256],
    16-value scales (int8 bits) uint8 [blocks, 16] and d (fp16 bytes) uint8 [blocks, 2]: ggml's
    layout (per 128-value half: the low nibbles of runs 0 and 2, of 1 and 3; then the high bits)."""
    u = u.reshape(-1, 2, 4, 32)  # [block, half, run of 32, l]
    ql = torch.cat([(u[:, :, 0] & 15) | (u[:, :, 2] << 4), (u[:, :, 1] & 15) | (u[:, :, 3] << 4)], dim=2)
    qh = ((u >> 4) << _Q6_SHIFTS).sum(dim=2, dtype=torch.uint8)  # [block, half, 32]
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, d], dim=1)


def _q6_f_as_q6_k(rows: torch.Tensor) -> torch.Tensor:
    """_q6_k_as_q6_f undone."""
    c = rows.reshape(-1, 8, 28)
    nib, high = c[..., 4:20], c[..., 20:28].reshape(-1, 8, 2, 1, 4)
    u = torch.cat([nib & 15, nib >> 4], dim=2) | (((high >> _Q6_SHIFTS) & 3).reshape(-1, 8, 32) << 4)
    return q6_k_blocks(u, c[:, :, 2:4].reshape(-1, 16), c[:, 0, 0:2]).reshape(rows.shape[0], -1)


def _q4_0_as_q4_1(raw: torch.Tensor) -> torch.Tensor | None:
    """Q4_0 rows as Q4_1 ones (d (q - 8) = d q + m, m = -8 d: exact in fp16), or None where some
    -8 d overflows fp16."""
    n = raw.shape[0]
    b = raw.reshape(-1, 18)
    m = (_half(b, 0) * -8).half()
    if not torch.isfinite(m).all():
        return None
    return torch.cat([b[:, :2], m.view(torch.uint8), b[:, 2:]], dim=1).reshape(n, -1)


def _q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows as Q8_0 ones: the same scale, codes q - 16 as signed bytes (exact)."""
    n, b = raw.shape[0], raw.reshape(-1, 22)
    codes = (_nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6])).to(torch.int16) - 16
    return torch.cat([b[:, :2], codes.to(torch.int8).view(torch.uint8)], dim=1).reshape(n, -1)


def _q8_0_as_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """_q5_0_as_q8_0 undone."""
    n, b = raw.shape[0], raw.reshape(-1, 34)
    q = (b[:, 2:].view(torch.int8).to(torch.int16) + 16).to(torch.uint8)  # 0..31
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    bits = (q >> 4).to(torch.int64) << torch.arange(32)
    qh = bits.sum(dim=1).to(torch.int32).view(torch.uint8).reshape(-1, 4)  # little-endian uint32
    return torch.cat([b[:, :2], qh, qs], dim=1).reshape(n, -1)


def pack_x16(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """Rows uint8 [n, row_bytes] of an X16_FORMATS format -> the x16 layout (cpu_gguf_x16.c): per
    group of 16 rows (zero rows pad the last), per block of 32 values, the 16 rows' scale fields (and
    Q4_1's mins, which Q4_0 gets as -8 d), then their values as 64-byte loads whose 4-byte lane r is
    row r's next 4 bytes (Q8_0's + 128; Q5_0 goes as Q8_0, Q4_K and Q5_K as Q4_1 with fp32 fields,
    Q6_K per 32 values: _q6_k_as_q6_f). Flat uint8; None for a Q4_0 weight whose mins fp16 cannot hold."""
    assert qtype in X16_FORMATS and raw.dtype == torch.uint8
    if qtype == Q4_0:
        q41 = _q4_0_as_q4_1(raw)
        return None if q41 is None else pack_x16(q41, Q4_1, k)
    if qtype == Q5_0:
        return pack_x16(_q5_0_as_q8_0(raw), Q8_0, k)
    if qtype in X16_KEEPS_ROWS:
        raw = _k_as_f(raw, qtype, k)
    elif qtype == Q6_K:
        raw = _q6_k_as_q6_f(raw, k)
    size, head, vals, width = _x16_fields(qtype)
    n, nb = raw.shape[0], k // 32
    groups = -(-n // 16)
    rows = torch.zeros((groups * 16, nb, size), dtype=torch.uint8)
    rows[:n] = raw.reshape(n, nb, size)
    blocks = rows.view(groups, 16, nb, size).permute(0, 2, 1, 3)  # [group, block, row, bytes]
    fields = [blocks[..., at:at + width].reshape(groups, nb, 16 * width) for at in range(0, head, width)]
    values = blocks[..., head:].reshape(groups, nb, 16, vals // 4, 4).transpose(2, 3).reshape(groups, nb, 16 * vals)
    if qtype == Q8_0:
        values = values ^ 0x80  # signed bytes moved to unsigned ones
    return torch.cat([*fields, values], dim=2).reshape(-1).contiguous()


@functools.cache
def _x16_lanes(qtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For row r of a 16-row group of the x16 layout: the int16 indices (in the group) of its fp16
    fields, [16, blocks * fields], and the int32 indices of its 4-byte value lanes, [16, blocks * lanes]."""
    size, head, vals, _ = _x16_fields(qtype)
    nb, r = k // 32, torch.arange(16)[:, None]
    block = torch.arange(nb)[:, None] * (16 * size)  # byte offset of each block's group
    fields = ((block + torch.arange(head // 2)[None, :] * 32) // 2).reshape(-1)[None, :] + r
    lanes = ((block + 16 * head + torch.arange(vals // 4)[None, :] * 64) // 4).reshape(-1)[None, :] + r
    return fields, lanes


def select_x16(packed: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a pack_x16 layout as uint8 [len(ids), row_bytes], each row's fields and value
    lanes gathered from its group (an embedding lookup on a tied head's repacked blocks)."""
    assert qtype not in X16_KEEPS_ROWS  # read its rows
    if qtype == Q5_0:
        return _q8_0_as_q5_0(select_x16(packed, Q8_0, k, ids))
    q = Q4_1 if qtype == Q4_0 else qtype
    size, head, vals, _ = _x16_fields(q)
    fields, lanes = _x16_lanes(q, k)
    nb, m = k // 32, len(ids)
    group_bytes = 16 * nb * size
    base, r = torch.div(ids, 16, rounding_mode="floor")[:, None], ids % 16
    f = packed.view(torch.int16).take(base * (group_bytes // 2) + fields[r])
    v = packed.view(torch.int32).take(base * (group_bytes // 4) + lanes[r])
    rows = torch.cat([f.view(torch.uint8).view(m, nb, head), v.view(torch.uint8).view(m, nb, vals)], dim=2)
    if qtype == Q8_0:
        rows[..., head:] ^= 0x80
    elif qtype == Q4_0:  # drop the mins it was packed with
        rows = torch.cat([rows[..., :2], rows[..., 4:]], dim=2)
    elif qtype == Q6_K:
        return _q6_f_as_q6_k(rows)
    return rows.reshape(m, -1)


def unpack_x16(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """pack_x16 undone: the rows uint8 [n, row_bytes] again."""
    assert qtype in X16_FORMATS and qtype not in X16_KEEPS_ROWS
    if qtype == Q4_0:  # packed as Q4_1: drop the mins
        b = unpack_x16(packed, Q4_1, n, k).reshape(-1, 20)
        return torch.cat([b[:, :2], b[:, 4:]], dim=1).reshape(n, -1).contiguous()
    if qtype == Q5_0:
        return _q8_0_as_q5_0(unpack_x16(packed, Q8_0, n, k)).contiguous()
    size, head, vals, _ = _x16_fields(qtype)
    nb = k // 32
    blocks = packed.view(-1, nb, 16 * size)
    groups = blocks.shape[0]
    fields = [blocks[..., 16 * at:16 * (at + 2)].reshape(groups, nb, 16, 2) for at in range(0, head, 2)]
    values = blocks[..., 16 * head:]
    if qtype == Q8_0:
        values = values ^ 0x80
    values = values.reshape(groups, nb, vals // 4, 16, 4).transpose(2, 3).reshape(groups, nb, 16, vals)
    rows = torch.cat([*fields, values], dim=3).permute(0, 2, 1, 3)  # [group, row, block, bytes]
    rows = rows.reshape(groups * 16, nb * size)[:n]
    return _q6_f_as_q6_k(rows).contiguous() if qtype == Q6_K else rows.contiguous()
