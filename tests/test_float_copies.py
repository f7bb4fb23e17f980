"""GGUF float copies within a memory budget (kernels/float_copies.py)."""

from __future__ import annotations

import pytest
import torch

from rill.kernels import chooser, float_copies, gguf_blocks, gguf_linear, gguf_native, torch_ops

Q = gguf_blocks.Q4_K
BF16 = torch.bfloat16


def entry(choice: str, **us: float) -> dict[str, object]:
    return {"choice": choice, "us": us, "dropped": []}


def key(shape: tuple[int, int, int], bucket: int, logits: bool = False) -> str:
    return chooser.KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(*shape, BF16, logits), bucket)


@pytest.fixture(autouse=True)
def native() -> None:
    if not gguf_native.dequant_supported(Q):
        pytest.skip("needs the native GGUF kernels")


def table_of(shapes: dict[tuple[int, int, int], float]) -> chooser.KernelTable:
    """Every bucket measured: float at 16+ rows, saving `saved` µs against dequant."""
    t = chooser.KernelTable()
    for shape, saved in shapes.items():
        for b in chooser.ROW_BUCKETS:
            t.entries[key(shape, b)] = entry("float", float=10.0, dequant=10.0 + saved, blocks=50.0) if b >= 16 \
                else entry("blocks", float=30.0, dequant=40.0, blocks=10.0)
    return t


def test_copies_kept_by_time_saved_per_byte_within_the_budget() -> None:
    big, small, useless = (1024, 256, Q), (256, 256, Q), (512, 256, Q)
    parts = [big, big, small, small, useless]  # two layers of two shapes, one of the third
    table = table_of({big: 5.0, small: 4.0, useless: 0.01})
    float_rows = tuple(b for b in chooser.ROW_BUCKETS if b >= 16)
    copy = {s: count * torch_ops.copy_bytes(s[0], 256, BF16, rows=float_rows)
            for s, count in ((big, 2), (small, 2), (useless, 1))}
    fit = float_copies.fit(table, parts, None, BF16, copy[small] + copy[big])
    assert fit.wanted == sum(copy.values()) and fit.kept == copy[small] + copy[big] and fit.dropped == 1
    # The shape saving least per byte lost its copy: its float buckets go to the next-fastest route.
    assert [fit.table.entries[key(useless, b)]["choice"] for b in chooser.ROW_BUCKETS] == \
        ["blocks" if b < 16 else "dequant" for b in chooser.ROW_BUCKETS]
    assert fit.table.entries[key(big, 64)]["choice"] == "float"
    assert table.entries[key(useless, 64)]["choice"] == "float", "the measured table itself is left as it was"
    # Saving per byte: small (4 µs x 2 layers over 256 rows each) beats big (5 x 2 over 1024 rows).
    fit = float_copies.fit(table, parts, None, BF16, copy[small])
    assert fit.kept == copy[small] and fit.dropped == 2
    assert fit.table.entries[key(small, 512)]["choice"] == "float"
    assert fit.table.entries[key(big, 512)]["choice"] == "dequant"


def test_no_budget_or_enough_keeps_the_table_and_unmeasured_buckets_leave_float() -> None:
    shape = (1024, 256, Q)
    table = table_of({shape: 5.0})
    assert float_copies.fit(table, [shape], None, BF16, None).table is table
    assert float_copies.fit(table, [shape], None, BF16, 1 << 30).dropped == 0
    # A head measured nowhere, in a format the x16 GEMM does not serve: its incumbent is float from
    # 16 rows; with no budget the dequant route serves there.
    head = (49152, 256, gguf_blocks.Q5_1)
    fit = float_copies.fit(chooser.KernelTable(), [], head, BF16, 0)
    float_rows = tuple(b for b in chooser.LOGIT_BUCKETS if gguf_linear.incumbent(b, gguf_blocks.Q5_1) == "float")
    routes = [fit.table.entries[key(head, b, logits=True)]["choice"] for b in float_rows]
    assert float_rows and routes == ["dequant"] * len(float_rows)
    assert fit.kept == 0 and fit.wanted == torch_ops.copy_bytes(49152, 256, BF16, True, float_rows) >= 49152 * 256 * 2
    # Where the x16 GEMM serves the format, the blocks are the incumbent everywhere: no copy asked.
    if gguf_native.x16_supported(gguf_blocks.Q8_0):
        assert float_copies.fit(chooser.KernelTable(), [], (49152, 256, gguf_blocks.Q8_0), BF16, 0).wanted == 0


def test_budget_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [(1024, 256, Q)] * 4
    monkeypatch.setenv("RILL_GGUF_FLOAT_COPIES", "2GiB")
    assert float_copies.budget(parts, None) == 2 << 30
    monkeypatch.setenv("RILL_GGUF_FLOAT_COPIES", "0")
    assert float_copies.budget(parts, None) == 0
    monkeypatch.setenv("RILL_GGUF_FLOAT_COPIES", "lots")
    with pytest.raises(ValueError, match="RILL_GGUF_FLOAT_COPIES"):
        float_copies.budget(parts, None)
    monkeypatch.delenv("RILL_GGUF_FLOAT_COPIES")
    available = float_copies.available_memory()
    assert available is not None and available > 0
    blocks = 4 * 1024 * gguf_blocks.row_bytes(Q, 256)
    assert abs(float_copies.budget(parts, None) - max(0, available // 2 - blocks)) < 64 << 20
