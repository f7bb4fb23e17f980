"""The kernel chooser: it picks the faster candidate by measuring on this machine, keeps its table
keyed by the machine, and every candidate of every op gives the incumbent's results."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rill.kernels import chooser, cpu_native, cpu_tuning, torch_attention, torch_ops
from rill.kernels.chooser import KernelTable, Probe
from rill.kernels.ops import make_attention_metadata

SHAPES = cpu_tuning.ModelShapes(linears=((96, 64), (64, 128)), logits=(200, 64), heads=4, kv_heads=2, head_dim=64)


@pytest.fixture
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    return tmp_path


def _matmuls(times: int) -> Probe | None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(192, 192, generator=g), torch.randn(192, 192, generator=g)

    def run(n: int):
        def call() -> torch.Tensor:
            for _ in range(n - 1):
                a @ b
            return a @ b
        return call

    # Same result, one does `times` x the work; the slow one listed first is the incumbent.
    return Probe("toy", (192,), 1, {"slow": run(times), "fast": run(1)})


def test_picks_the_faster_candidate_and_keeps_a_close_incumbent() -> None:
    entry = chooser.measure(_matmuls(6))
    assert entry["choice"] == "fast"
    assert entry["us"]["slow"] > entry["us"]["fast"]
    # Within MARGIN the incumbent stays: two candidates doing the same work.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 64, generator=g)
    same = chooser.measure(Probe("toy", (64,), 1, {"first": lambda: a @ a, "second": lambda: a @ a}))
    assert same["choice"] in ("first", "second") and same["dropped"] == []


def test_a_candidate_with_other_results_is_dropped() -> None:
    a = torch.ones(8, 8)
    entry = chooser.measure(Probe("toy", (8,), 1, {"right": lambda: a * 2, "wrong": lambda: a * 3}))
    assert entry["choice"] == "right" and entry["dropped"] == ["wrong"] and "wrong" not in entry["us"]


def test_a_cold_probe_primes_each_candidate_after_the_eviction_and_frees_the_buffer(
        cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the eviction and each timed call the candidate's own prime runs (its route on other
    weights, as the layer before it in a step); the eviction buffer is not kept after tuning."""
    events: list[str] = []
    evict = chooser._evict_caches
    monkeypatch.setattr(chooser, "EVICT_MAX", 1 << 20)
    monkeypatch.setattr(chooser, "_evict_caches", lambda: (events.append("evict"), evict()))
    a = torch.ones(8, 8)

    def run(name: str) -> torch.Tensor:
        events.append(name)
        return a * 2

    probe = Probe("toy", (8,), 1, {"x": lambda: run("x"), "y": lambda: run("y")}, cold=True,
                  primes={"x": lambda: events.append("prime x"), "y": lambda: events.append("prime y")})
    _, measured = chooser.tune([lambda: probe], ["toy|8|1"])
    assert measured == 1
    timed = events[2:]  # after the two set-up calls
    assert timed[:6] == ["evict", "prime x", "x", "evict", "prime y", "y"]
    assert len(timed) % 3 == 0 and all(timed[i:i + 3] in (["evict", "prime x", "x"], ["evict", "prime y", "y"])
                                       for i in range(0, len(timed), 3))
    assert chooser._eviction_buffer.cache_info().currsize == 0


def test_real_kernels_the_choice_is_the_fastest_measured() -> None:
    """On whatever CPU this runs: decode attention has a native kernel and a torch path several
    times apart; the chooser must not pick the slow one, and its pick is its own fastest."""
    probe = cpu_tuning.decode_probe(SHAPES, torch.float32)
    if probe is None:
        pytest.skip("no native decode kernel here (no C compiler)")
    entry = chooser.measure(probe)
    us = entry["us"]
    assert entry["choice"] != "torch" and us["torch"] > us[entry["choice"]]
    fastest = min(us, key=us.__getitem__)
    assert entry["choice"] == fastest or us[entry["choice"]] * (1 - chooser.MARGIN) <= us[fastest]


def test_cache_is_read_back_and_invalidated_by_a_changed_machine_key(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []

    def make() -> Probe | None:
        built.append(1)
        return _matmuls(4)

    table, measured = chooser.tune([make], ["toy|192|1"])
    assert measured == 1 and table.choice("toy", (192,), 1) == "fast"
    path = chooser.table_path()
    assert json.loads(path.read_text())["entries"]["toy|192|1"]["choice"] == "fast"
    again, measured = chooser.tune([make], ["toy|192|1"])
    assert measured == 0 and len(built) == 1 and again.entries == table.entries  # read back, not measured
    for attr, value in ((chooser, ("cpu_model", lambda: "Another CPU")), (torch, ("__version__", "9.9.9"))):
        with monkeypatch.context() as m:
            m.setattr(attr, *value)
            assert chooser.table_path() != path
            _, measured = chooser.tune([make], ["toy|192|1"])
            assert measured == 1
    assert len(built) == 3
    _, measured = chooser.tune([make], ["toy|192|1"], remeasure=True)
    assert measured == 1


def _gemm_probes(dtype: torch.dtype, quantization: str) -> list[Probe]:
    probes = []
    for n, k in (*SHAPES.linears, SHAPES.logits):
        for rows in (1, 16, 64, 256):
            maker = cpu_tuning.int8_probe if quantization == "int8" else cpu_tuning.gemm_probe
            probe = maker(n, k, dtype, rows, (n, k) == SHAPES.logits)
            if probe is not None:
                probes.append(probe)
    return probes


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, "none"), (torch.bfloat16, "int8"),
                                                (torch.float32, "int8")])
def test_every_gemm_candidate_gives_the_incumbents_results(dtype: torch.dtype, quantization: str) -> None:
    probes = _gemm_probes(dtype, quantization)
    if quantization == "none" and cpu_native.small_gemm_rows() == 0:
        assert probes == []  # oneDNN only: nothing to choose, nothing measured
        pytest.skip("no AVX512-BF16 small GEMM on this CPU")
    assert probes
    for probe in probes:
        outs = {name: run().float() for name, run in probe.candidates.items()}
        first = next(iter(outs.values()))
        for name, out in outs.items():
            assert torch.allclose(out, first, rtol=2e-2, atol=2e-2 * (1 + first.abs().max().item())), \
                (probe.op, probe.shape, probe.bucket, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_candidate_matches_a_float64_reference(dtype: torch.dtype) -> None:
    """Prefill (a fresh chunk, a chunk after context) and decode candidates, each against
    attention computed in float64 from the same cache."""
    probes = [cpu_tuning.prefill_probe(SHAPES, dtype, b) for b in chooser.CONTEXT_BUCKETS]
    probes.append(cpu_tuning.decode_probe(SHAPES, dtype))
    probes = [p for p in probes if p is not None]
    if not probes:
        pytest.skip("no native attention kernels here (no C compiler)")
    for probe in probes:
        assert len(probe.candidates) >= 2
        outs = {name: run().double() for name, run in probe.candidates.items()}
        ref = _reference(probe, dtype)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for name, out in outs.items():
            assert torch.allclose(out, ref, rtol=tol, atol=tol), (probe.op, probe.bucket, name)


def _reference(probe: Probe, dtype: torch.dtype) -> torch.Tensor:
    """The probe's inputs rebuilt (same seed) and attended in float64."""
    if probe.op == "decode":
        seq_lens, qlens = [cpu_tuning.DECODE_CONTEXT] * cpu_tuning.DECODE_BATCH, [1] * cpu_tuning.DECODE_BATCH
    else:
        seq_lens, qlens = [max(cpu_tuning.PREFILL_CHUNK, probe.bucket // 4)], [cpu_tuning.PREFILL_CHUNK]
    q, k_cache, v_cache, meta = cpu_tuning._paged(seq_lens, qlens, SHAPES, dtype)
    outs = []
    group = SHAPES.heads // SHAPES.kv_heads
    for i, (n, ql) in enumerate(zip(seq_lens, qlens, strict=True)):
        blocks = meta.block_tables[i, :-(-n // cpu_tuning.BLOCK_SIZE)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        qi = q[meta.query_start_loc_host[i]:meta.query_start_loc_host[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * SHAPES.head_dim ** -0.5
        pos = torch.arange(n - ql, n)[:, None] >= torch.arange(n)[None, :]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~pos, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def test_linear_follows_the_installed_route(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_native.small_gemm_rows() == 0:
        pytest.skip("no AVX512-BF16 small GEMM on this CPU")
    calls: list[int] = []
    real = cpu_native.small_gemm
    monkeypatch.setattr(cpu_native, "small_gemm", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).bfloat16()
    shape = torch_ops.gemm_shape(w)
    table = KernelTable({KernelTable.key("gemm", shape, b): {"choice": "onednn" if b == 4 else "small", "us": {}}
                         for b in chooser.ROW_BUCKETS})
    chooser.install(table)
    lin = torch_ops.Linear(w, None)
    for rows in (1, 3, 4, 5, 16):
        lin(torch.randn(rows, 64, generator=g).bfloat16())
    assert calls == [1, 5, 16]  # 2..4 rows fall in bucket 4, which chose oneDNN
    never = KernelTable({k: {"choice": "onednn", "us": {}} for k in table.entries})
    chooser.install(never)
    assert torch_ops.Linear(w, None).small is None  # no second copy of a weight no bucket runs small


def test_attention_follows_the_installed_table() -> None:
    if not cpu_native.decode_supported(torch.empty(1, 4, 64), torch.empty(1, 16, 2, 64)):
        pytest.skip("no native attention kernels here (no C compiler)")
    q_all = torch.randn(1 + 40, 4, 64)
    caches = torch.randn(2, 8, 16, 2, 64).unbind(0)
    _, meta = make_attention_metadata([[0, 1], [2, 3, 4]], [20, 0], [1, 40], 16)
    shape = torch_attention.attention_shape(q_all, caches[0])
    assert torch_attention.attention_kernels(meta, q_all, caches[0]) == ("native", torch_attention.prefill_candidates(
        q_all, caches[0])[0])
    chooser.install(KernelTable({KernelTable.key("decode", shape, 0): {"choice": "torch", "us": {}},
                                 KernelTable.key("prefill", shape, 1024): {"choice": "sdpa", "us": {}},
                                 KernelTable.key("prefill", shape, 8192): {"choice": "vector", "us": {}}}))
    assert torch_attention.attention_kernels(meta, q_all, caches[0]) == ("torch", "sdpa")
    _, long_meta = make_attention_metadata([list(range(8))], [100], [20], 16)
    long_meta.seq_lens_host = [2000]  # only the bucket is read: the longest prompt context
    assert torch_attention.attention_kernels(long_meta, q_all, caches[0])[1] == "vector"


def test_silu_and_mul_follows_the_installed_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """SiLU(gate) * up takes the native pass in the row buckets that measured it faster, torch's
    ops in the others; unmeasured, the native pass where its 16-lane path is built."""
    if cpu_native.library() is None:
        pytest.skip("no native kernels here (no C compiler)")
    calls: list[int] = []
    real = cpu_native.silu_and_mul
    monkeypatch.setattr(cpu_native, "silu_and_mul", lambda x: calls.append(x.shape[0]) or real(x))
    f = 48
    for rows in (1, 5):
        torch_ops.silu_and_mul(torch.randn(rows, 2 * f))
    assert calls == ([1, 5] if cpu_native.silu_mul_vec16() else [])
    calls.clear()
    key = torch_ops.silu_key(f, torch.float32)
    chooser.install(KernelTable({KernelTable.key(torch_ops.SILU_OP, key, b): {"choice": "torch" if b == 4 else "native",
                                                                              "us": {}} for b in chooser.ROW_BUCKETS}))
    for rows in (1, 3, 5, 16):
        x = torch.randn(rows, 2 * f)
        torch.testing.assert_close(torch_ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :f]) * x[:, f:])
    assert calls == [1, 5, 16]  # 2..4 rows fall in bucket 4, which chose torch


def test_tune_model_measures_silu_for_a_swiglu_model(cache) -> None:
    if cpu_native.library() is None:
        pytest.skip("no native kernels here (no C compiler)")
    shapes = cpu_tuning.ModelShapes(linears=((96, 64),), logits=(200, 64), heads=4, kv_heads=2, head_dim=64,
                                    silu_widths=(96,))
    table, keys = cpu_tuning.tune_model(shapes, torch.float32)
    silu = [k for k in keys if k.startswith(torch_ops.SILU_OP + "|")]
    assert len(silu) == len(chooser.ROW_BUCKETS)
    assert all(table.entries[k]["choice"] in ("native", "torch") and len(table.entries[k]["us"]) == 2 for k in silu)


def test_tune_model_measures_within_its_bound_and_reports(cache) -> None:
    t = time.perf_counter()
    table, keys = cpu_tuning.tune_model(SHAPES, torch.bfloat16)
    took = time.perf_counter() - t
    if not keys:
        pytest.skip("native kernels off")
    assert chooser.installed() is table and all(k in table.entries for k in keys)
    assert took < len(keys) * (chooser.BUDGET_S + 0.2)
    text = chooser.report(table, keys)
    assert chooser.cpu_model() in text and "decode" in text and "*" in text
    _, measured = chooser.tune(cpu_tuning.model_probes(SHAPES, torch.bfloat16), keys)
    assert measured == 0


def test_tune_gguf_creates_entries_for_each_part_and_the_lm_head(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    from rill.kernels import gguf_blocks, gguf_linear, gguf_native

    if not gguf_native.dequant_supported(gguf_blocks.Q8_0):
        pytest.skip("no native GGUF kernels here (no C compiler)")
    monkeypatch.setattr(chooser, "_installed", KernelTable())
    shapes = [(64, 256, gguf_blocks.Q4_K), (40, 64, gguf_blocks.Q8_0), (64, 256, gguf_blocks.Q4_K)]
    table, keys = cpu_tuning.tune_gguf(shapes, torch.bfloat16, logits=(200, 64, gguf_blocks.Q8_0))
    assert chooser.installed() is table
    assert len(keys) == 2 * len(chooser.ROW_BUCKETS) + len(chooser.LOGIT_BUCKETS)  # the repeated shape once
    assert "gguf_gemm|64x256xQ4_Kxbfloat16|1" in keys
    assert "gguf_gemm|200x64xQ8_0xbfloat16xlogits|128" in keys
    for k in keys:
        assert table.entries[k]["choice"] in gguf_linear.ROUTES and not table.entries[k]["dropped"], k
        assert set(table.entries[k]["us"]) == set(gguf_linear.ROUTES), k  # all three measured
    # The float copies' own GEMM entries were measured first, so "float" was timed as it serves.
    assert "gemm|40x64xbfloat16|16" in table.entries and "gemm|200x64xbfloat16xlogits|128" in table.entries
    route = gguf_linear.installed_route(40, 64, gguf_blocks.Q8_0, torch.bfloat16)
    assert route.choices == tuple(table.entries[k]["choice"] for k in keys if "|40x64x" in k)
    # Measured bucket by bucket over the parts: a start out of time leaves the widest buckets.
    buckets = [int(k.rsplit("|", 1)[1]) for k in keys]
    assert buckets == sorted(buckets) and len(set(buckets[:3])) == 1
    _, again = chooser.tune([lambda: None] * len(keys), keys)  # cached: nothing measured anew
    assert again == 0


def test_decode_buckets_pin_the_blocks_where_that_is_cheap() -> None:
    """From 1 row up to DECODE_ROWS every part goes on its blocks (the GEMMs whose rows do not
    depend on the call's size) until a bucket where that costs more than DECODE_PIN_PRICE of the
    chosen routes' time, each part counted as often as the model has it, or a bucket where some
    part's blocks were not timed. Prompt-sized buckets keep their choice."""
    from rill.kernels import gguf_blocks, gguf_linear

    a, b, head = (64, 256, gguf_blocks.Q4_1), (128, 256, gguf_blocks.Q4_1), (512, 256, gguf_blocks.Q8_0)
    Override = dict[tuple[tuple[int, int, int], int], tuple[float, float]]

    def table_of(at: Override) -> KernelTable:
        """Blocks 1 µs, float 2 (0.5 for prompt chunks), but (blocks, float) at[(part, bucket)]."""
        table = KernelTable()
        for shape, logits in ((a, False), (b, False), (head, True)):
            for bucket in chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS:
                blocks, float_ = at.get((shape, bucket), (1.0, 2.0 if bucket <= 64 else 0.5))
                us = {"blocks": blocks, "float": float_}
                key = KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(*shape, torch.bfloat16, logits), bucket)
                table.entries[key] = {"choice": min(us, key=us.__getitem__), "us": us}
        return table

    def choices(table: KernelTable, shape: tuple[int, int, int]) -> list[str]:
        key = gguf_linear.gguf_key(*shape, torch.bfloat16)
        return [str(table.choice(gguf_linear.OP, key, bucket)) for bucket in chooser.ROW_BUCKETS]

    def settle(table: KernelTable) -> tuple[int, dict[int, float]] | None:
        return cpu_tuning.settle_decode_rows(table, [a, a, a, b], head, torch.bfloat16)  # a in three layers

    cheap = table_of({(a, 1): (1.05, 1.0)})  # a's float copy wins at 1 row by 5%
    assert choices(cheap, a)[0] == "float"
    assert settle(cheap) == (64, {1: pytest.approx((3 * 1.05 + 1 + 1) / (3 + 1 + 1) - 1), 4: 0, 16: 0, 32: 0, 64: 0})
    assert choices(cheap, a) == ["blocks"] * 5 + ["float"] * 2  # prompt chunks keep the float copies
    dear = table_of({(a, 1): (1.5, 1.0)})
    assert settle(dear) == (0, {1: pytest.approx(0.3), 4: 0, 16: 0, 32: 0, 64: 0})
    assert choices(dear, a)[0] == "float"
    # Dear from 32 rows: pinned up to 16.
    partial = table_of({(a, 1): (1.05, 1.0), (a, 32): (1.5, 1.0)})
    assert settle(partial)[0] == 16 and choices(partial, a)[:5] == ["blocks"] * 3 + ["float", "blocks"]
    # b 40% dearer on its blocks at 4 rows, by itself: 8% over the whole model, counted per layer
    # (13% with each shape counted once); so pinned.
    weighted = table_of({(b, 4): (1.4, 1.0)})
    assert settle(weighted) == (64, {1: 0, 4: pytest.approx(0.08), 16: 0, 32: 0, 64: 0})
    assert choices(weighted, b)[1] == "blocks"
    # b's blocks untimed at 16 rows (a first start out of time): the pin stops below 16; untimed
    # at 1 row: nothing is pinned.
    untimed = table_of({(a, 1): (1.05, 1.0), (b, 16): (1.02, 1.0)})
    del untimed.entries[KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(*b, torch.bfloat16), 16)]["us"]["blocks"]
    assert settle(untimed) == (4, {1: pytest.approx(0.03), 4: 0})
    assert choices(untimed, a)[0] == "blocks" and choices(untimed, b)[2] == "float"
    untimed = table_of({(a, 1): (1.05, 1.0)})
    del untimed.entries[KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(*b, torch.bfloat16), 1)]["us"]["blocks"]
    assert settle(untimed) is None
    assert choices(untimed, a)[0] == "float"


def test_a_lone_float_bucket_between_blocks_keeps_the_blocks() -> None:
    """A float win with the blocks winning on both sides is noise that would cost a float copy of
    the part: it is settled to the blocks; runs of float wins, and wins at an end, stay."""
    from rill.kernels import gguf_blocks, gguf_linear

    def settled(choices: list[str]) -> list[str]:
        shape = (64, 256, gguf_blocks.Q8_0)
        cases = [(shape, False, b) for b in chooser.ROW_BUCKETS]
        table = KernelTable()
        key = gguf_linear.gguf_key(64, 256, gguf_blocks.Q8_0, torch.bfloat16)
        for b, c in zip(chooser.ROW_BUCKETS, choices, strict=True):
            table.entries[KernelTable.key(gguf_linear.OP, key, b)] = {"choice": c, "us": {}, "dropped": []}
        cpu_tuning.settle_lone_floats(table, cases, torch.bfloat16)
        return [str(table.choice(gguf_linear.OP, key, b)) for b in chooser.ROW_BUCKETS]

    b, f, d = "blocks", "float", "dequant"
    n = len(chooser.ROW_BUCKETS)

    def at(i: int, choice: str, rest: str = b) -> list[str]:
        return [choice if j == i else rest for j in range(n)]

    assert settled(at(3, f)) == [b] * n
    assert settled([f if j % 2 and j < n - 2 else b for j in range(n - 1)] + [f]) == at(n - 1, f)
    for kept in ([b, f, f] + [b] * (n - 3), at(0, f), at(n - 1, f), [b, d, f] + [b] * (n - 3)):
        assert settled(kept) == kept
