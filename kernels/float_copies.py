"""Which GGUF weights keep a float copy: those saving the most time per byte, within a budget.

The kernel chooser sends a row bucket of a GGUF layer to the "float" route (a dequantized copy
that oneDNN multiplies) wherever that measured fastest, whatever the copy costs: on CPUs without
AMX most layers from 16 rows on. The blocks are 3.5-7x smaller than a bf16 copy, so unbounded
copies can outgrow the machine a quantized model was chosen to fit. `fit` keeps the copies that
save the most time per byte while they fit the budget (RILL_GGUF_FLOAT_COPIES; auto: half the
memory available at start, less the blocks), and sends every other bucket to its fastest route
without a copy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rill.kernels import chooser, gguf_blocks, gguf_linear, gguf_native, torch_ops
from rill.shared import envs
from rill.shared.config import parse_size

GgufShape = tuple[int, int, int]  # (out features n, in features k, ggml type id) of one weight part


@dataclass
class Fit:
    table: chooser.KernelTable  # the installed table with the dropped copies' buckets re-routed
    budget: int
    kept: int  # bytes of the float copies kept
    wanted: int  # bytes of the float copies the measured choices asked for
    dropped: int  # weight shapes that lost their copy


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def budget(parts: list[GgufShape], head: GgufShape | None) -> int | None:
    """Bytes the float copies may take; None: no bound."""
    setting = envs.RILL_GGUF_FLOAT_COPIES
    if setting != "auto":
        try:
            return parse_size(setting)
        except ValueError:
            raise ValueError(f"RILL_GGUF_FLOAT_COPIES={setting!r}: want auto, or a size such as 2GiB or 0") from None
    available = available_memory()
    if available is None:
        return None
    blocks = sum(n * gguf_blocks.row_bytes(q, k) for n, k, q in [*parts, *([head] if head else [])])
    return max(0, available // 2 - blocks)


def fit(table: chooser.KernelTable, parts: list[GgufShape], head: GgufShape | None, dtype: torch.dtype,
        limit: int | None) -> Fit:
    """`table` with the float copies cut to `limit` bytes (see the module docstring)."""
    copies = []  # (µs saved per byte, bytes, re-routed entries)
    shapes = Counter((p, False) for p in parts) + Counter([(head, True)] if head else [])
    for ((n, k, q), logits), count in shapes.items():
        if not gguf_native.dequant_supported(q):
            continue  # no route without the copy
        key_shape = gguf_linear.gguf_key(n, k, q, dtype, logits)
        # Without a measurement: the x16 GEMM where the blocks are repacked for it (the dequant
        # route would unpack them every call), else dequantized tiles.
        unmeasured = "blocks" if gguf_native.x16_supported(q) else "dequant"
        saved, rerouted = 0.0, {}
        for bucket in chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS:
            key = chooser.KernelTable.key(gguf_linear.OP, key_shape, bucket)
            entry = table.entries.get(key)
            choice = str(entry["choice"]) if entry is not None and entry["choice"] else gguf_linear.incumbent(bucket, q)
            if choice != "float":
                continue
            us: dict[str, float] = dict(entry["us"]) if entry is not None else {}  # type: ignore[arg-type]
            others = {name: t for name, t in us.items() if name != "float"}
            best = min(others, key=others.__getitem__) if others else unmeasured
            if others and "float" in us:
                saved += (others[best] - us["float"]) * count
            rerouted[key] = {**(entry or {"us": {}, "dropped": []}), "choice": best}
        if rerouted:
            float_rows = tuple(int(key.rsplit("|", 1)[1]) for key in rerouted)
            size = count * torch_ops.copy_bytes(n, k, dtype, logits, float_rows)
            copies.append((saved / size, size, rerouted))
    wanted = sum(size for _, size, _ in copies)
    if limit is None or wanted <= limit:
        return Fit(table, limit or 0, wanted, wanted, 0)
    entries, kept, dropped = dict(table.entries), 0, 0
    for _, size, rerouted in sorted(copies, key=lambda c: -c[0]):
        if kept + size <= limit:
            kept += size
        else:
            entries.update(rerouted)
            dropped += 1
    return Fit(chooser.KernelTable(entries), limit, kept, wanted, dropped)
