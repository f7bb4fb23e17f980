"""The native CPU decode attention (kernels/cpu_paged_attention.c) against float64 references,
through the kernel interface the model calls, and its fallback when it cannot be built."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from paged_case import PagedCase, close, decode_lengths, kv_heads_for

from rill.kernels import cpu_native, native_build, ops, torch_attention, torch_ops

TOL = {torch.float32: (5e-5, 5e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(autouse=True)
def native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "1")
    if cpu_native.library() is None:
        pytest.fail("the native kernels did not build on this machine (gcc is part of its setup)")


def run_step(case: PagedCase, computed: list[int], query_lens: list[int], q: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch_attention._AttentionPlan]:
    bs = case.bs
    blocks = [[int(b) for b in row[: -(-n // bs)]] for row, n in zip(case.tables, case.seq_lens, strict=True)]
    _, meta = ops.make_attention_metadata(blocks, computed, query_lens, bs, "cpu")
    out = ops.paged_attention(case.q if q is None else q, case.k_cache, case.v_cache, meta, case.scale)
    return out, meta.aux["torch_plan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_native_decode_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Single-token rows at lengths around block edges; every slot a sequence does not own is
    NaN, so a read past a sequence's end or through a wrong block id shows up."""
    lens = decode_lengths(block_size)
    case = PagedCase(lens, [1] * len(lens), block_size, kv_heads_for(group), group, head_dim, dtype,
                     seed=block_size * 1000 + head_dim * 10 + group)
    out, plan = run_step(case, [n - 1 for n in lens], [1] * len(lens))
    assert plan.native is not None and not plan.decode_groups
    close(out, case.reference(), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_native_decode_of_many_sequences_matches_reference(group: int, dtype: torch.dtype) -> None:
    """Enough sequences that one work item takes all of a sequence's kv heads (the kernel splits
    few sequences by (sequence, kv head) instead): every row still matches the reference."""
    lens = (decode_lengths(16) * 8)[: 4 * torch.get_num_threads() + 3]
    case = PagedCase(lens, [1] * len(lens), 16, kv_heads_for(group), group, 64, dtype, seed=500 + group)
    out, plan = run_step(case, [n - 1 for n in lens], [1] * len(lens))
    assert plan.native is not None
    close(out, case.reference(), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_register_path_agrees_with_the_generic_loop(group: int, dtype: torch.dtype) -> None:
    """head_dim 64 with a group of up to 4 takes the AVX-512 register path where the CPU has it;
    it runs the same operations in the same order as the generic loop, so the two agree to the
    last bits (and both match the float64 reference)."""
    lens = decode_lengths(16)
    case = PagedCase(lens, [1] * len(lens), 16, kv_heads_for(group), group, 64, dtype, seed=77 + group)
    rows = torch.arange(len(lens), dtype=torch.int64)
    outs = []
    for generic_only in (False, True):
        out = torch.full_like(case.q, float("nan"))
        cpu_native.paged_decode(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, rows, out,
                                max(lens), case.scale, generic_only=generic_only)
        close(out, case.reference(), *TOL[dtype])
        outs.append(out)
    close(outs[0], outs[1], 1e-6, 1e-6 if dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_decode_in_a_mixed_step_with_strided_q(dtype: torch.dtype) -> None:
    """Decode rows interleaved with prefill chunks, and q a strided slice of a fused qkv output
    (how the model passes it): decode rows go to the native kernel, chunks to SDPA, all exact."""
    computed = [3, 500, 0, 17, 260, 40, 900, 8]
    query_lens = [1, 1, 33, 1, 1, 20, 1, 1]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, 16, 3, 3, 64, dtype, seed=5)
    heads, kv = case.q.shape[1], case.k_cache.shape[2]
    fused = torch.full((case.q.shape[0], heads + 2 * kv, 64), float("nan"), dtype=dtype)
    fused[:, :heads] = case.q
    q = fused[:, :heads]
    assert not q.is_contiguous()
    # The prefill rows' own K/V must be readable from the cache: the native prefill reads them there.
    out, plan = run_step(case, computed, query_lens, q=q)
    assert plan.native is not None and plan.native_prefill is not None and plan.prefills == []
    close(out, case.reference(), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [20, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_prefill_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Prompt chunks with and without context, of lengths that leave partial key chunks, partial
    tiles and partial row vectors, next to decode rows; every slot past a sequence's end is NaN,
    so a read past the causal edge shows."""
    computed = [0, 37, 0, 250, 5, 0]
    query_lens = [2, 40, 130, 17, 1, 64]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, block_size, 2, group, head_dim, dtype, seed=group * head_dim)
    out, plan = run_step(case, computed, query_lens)
    assert plan.native_prefill is not None and plan.prefills == []
    close(out, case.reference(), *TOL[dtype])


@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_amx_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    """The AMX tile kernel (bf16) on the same cases as the vector kernel: chunks with and
    without context, key chunks cut short, 16-row tiles partly filled, slots past each
    sequence's end NaN; and it agrees with the vector kernel to bf16 rounding."""
    if not cpu_native.amx_prefill_available():
        pytest.skip("this CPU (or its OS, or the compiler) has no AMX-BF16")
    computed = [0, 37, 0, 250, 5, 0, 31]
    query_lens = [2, 40, 130, 17, 1, 64, 33]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, block_size, 2, group, head_dim, torch.bfloat16,
                     seed=group * head_dim + block_size)
    out, plan = run_step(case, computed, query_lens)  # bf16, head_dim % 32 == 0: the AMX kernel
    p = plan.native_prefill
    assert p is not None and plan.prefills == []
    close(out, case.reference(), *TOL[torch.bfloat16])
    vector = out.clone()
    cpu_native.paged_prefill(case.q, case.k_cache, case.v_cache, p.block_tables, p.q_starts, p.q_lens, p.ctx_lens,
                             vector, case.scale, kernel="vector")
    rows = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(p.q_starts, p.q_lens, strict=True)])
    assert not torch.equal(out[rows], vector[rows])  # two different kernels ran
    close(out[rows], vector[rows], 2e-2, 2e-2)


@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [20, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_dot_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    """The AVX512-BF16 dot-product kernel on the vector kernel's cases: chunks with and without
    context, key chunks and key pairs cut short, partial row vectors, slots past each sequence's
    end NaN (a padded key pair must not carry them into P.V); and it agrees with the vector
    kernel to bf16 rounding."""
    if not cpu_native.dot_prefill_available():
        pytest.skip("this CPU (or the compiler) has no AVX512-BF16")
    computed = [0, 37, 0, 250, 5, 0, 31]
    query_lens = [2, 40, 130, 17, 1, 64, 33]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, block_size, 2, group, head_dim, torch.bfloat16,
                     seed=group * head_dim + block_size + 1)
    _, plan = run_step(case, computed, query_lens)
    p = plan.native_prefill
    assert p is not None and plan.prefills == []
    outs = {}
    for kernel in ("dot", "vector"):
        out = torch.full_like(case.q, float("nan"))
        cpu_native.paged_prefill(case.q, case.k_cache, case.v_cache, p.block_tables, p.q_starts, p.q_lens,
                                 p.ctx_lens, out, case.scale, kernel=kernel)
        outs[kernel] = out
    rows = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(p.q_starts, p.q_lens, strict=True)])
    close(outs["dot"][rows], case.reference()[rows], *TOL[torch.bfloat16])
    assert not torch.equal(outs["dot"][rows], outs["vector"][rows])  # two different kernels ran
    close(outs["dot"][rows], outs["vector"][rows], 2e-2, 2e-2)


def test_prefill_kernel_choice_is_checked() -> None:
    case = PagedCase([5], [5], 16, 1, 1, 64, torch.bfloat16, seed=3)
    _, plan = run_step(case, [0], [5])
    p = plan.native_prefill
    assert p is not None
    with pytest.raises(ValueError, match="kernel must be one of"):
        cpu_native.paged_prefill(case.q, case.k_cache, case.v_cache, p.block_tables, p.q_starts, p.q_lens,
                                 p.ctx_lens, torch.empty_like(case.q), case.scale, kernel="fastest")


def test_native_prefill_agrees_with_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (SDPA over gathered keys) and the native kernel give the same attention."""
    computed, query_lens = [0, 100, 0], [512, 200, 3]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, 16, 3, 3, 64, torch.float32, seed=11)
    native, plan = run_step(case, computed, query_lens)
    assert plan.native_prefill is not None
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")
    plain, plan = run_step(case, computed, query_lens)
    assert plan.native_prefill is None and len(plan.prefills) == 3
    torch.testing.assert_close(native, plain, atol=2e-5, rtol=2e-5)


def test_native_is_as_accurate_as_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [1, 7, 16, 17, 64, 300, 301, 129, 2, 45] * 3
    case = PagedCase(lens, [1] * len(lens), 16, 3, 3, 64, torch.bfloat16, seed=3)
    # The torch path reads whole padded blocks (and masks them): give the poison a number.
    case.k_cache = torch.nan_to_num(case.k_cache, nan=0.5)
    case.v_cache = torch.nan_to_num(case.v_cache, nan=0.5)
    native, plan = run_step(case, [n - 1 for n in lens], [1] * len(lens))
    assert plan.native is not None
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")
    plain, plan = run_step(case, [n - 1 for n in lens], [1] * len(lens))
    assert plan.native is None and plan.decode_groups
    # The torch path rounds the probabilities to bf16 before P @ V; the native kernel keeps them
    # in fp32, so it is at least as close to the float64 reference.
    want = case.reference()
    close(native, want, *TOL[torch.bfloat16])
    close(plain, want, 5e-2, 5e-2)
    assert (native.double() - want).abs().max() <= (plain.double() - want).abs().max()


def test_failed_build_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """No working compiler: one warning, and attention still runs (the plain-torch path)."""
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exists, always fails
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    with caplog.at_level(logging.WARNING, logger="rill.kernels"):
        assert cpu_native.library() is None
    assert "native CPU kernels unavailable" in caplog.text
    lens = [5, 40]
    case = PagedCase(lens, [1, 1], 16, 2, 2, 64, torch.float32, seed=1)
    case.k_cache = torch.nan_to_num(case.k_cache, nan=0.5)
    case.v_cache = torch.nan_to_num(case.v_cache, nan=0.5)
    out, plan = run_step(case, [4, 39], [1, 1])
    assert plan.native is None
    close(out, case.reference(), *TOL[torch.float32])
    assert not list(tmp_path.glob("kernels/*.so"))


def test_build_is_cached_per_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """A fresh cache folder builds once, saying so before it starts (a start waits on it); a
    changed source builds a second library beside it. (One small source stands for all of them:
    the rule is the same.)"""
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "SOURCES", [Path(native_build.__file__).with_name("cpu_sampling.c")])
    with caplog.at_level("INFO", logger=native_build.log.name):
        first = cpu_native._build()
        assert first.exists() and cpu_native._build() == first
    said = [r.getMessage() for r in caplog.records if r.name == native_build.log.name]
    assert len(said) == 2 and said[0].startswith("building") and said[1].startswith("built"), said
    changed = tmp_path / "changed.c"
    changed.write_text(native_build.SOURCES[-1].read_text() + "\n// changed\n")
    monkeypatch.setattr(native_build, "SOURCES", [*native_build.SOURCES[:-1], changed])
    second = cpu_native._build()
    assert second != first and second.exists()


def test_a_march_beyond_this_cpu_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """RILL_NATIVE_MARCH for instructions this CPU lacks would die on the first one (SIGILL): no
    build, a warning naming them, the torch kernels. A level below the CPU's builds."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    here = native_build.isa_macros(cc, "native")
    beyond = next((m for m in ("sapphirerapids", "znver5", "skylake-avx512", "haswell")
                   if native_build.isa_macros(cc, m) - here), None)
    if beyond is None:
        pytest.skip("this CPU has every instruction of the levels tried")
    monkeypatch.setenv("RILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("RILL_NATIVE_MARCH", beyond)
    monkeypatch.setattr(native_build, "SOURCES", [Path(native_build.__file__).with_name("cpu_sampling.c")])
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    with caplog.at_level(logging.WARNING, logger="rill.kernels"):
        assert cpu_native.library() is None
    assert f"RILL_NATIVE_MARCH={beyond} needs instructions this CPU lacks" in caplog.text
    assert not list(tmp_path.glob("kernels/*.so"))
    monkeypatch.setenv("RILL_NATIVE_MARCH", "x86-64")
    assert native_build.build(tmp_path / "kernels")[0].exists()


@pytest.mark.parametrize("march", ["x86-64", "haswell"], ids=["plain-C", "AVX2"])
def test_every_source_compiles_without_avx512(march: str) -> None:
    """The library is built for the serving CPU: on one without AVX-512 every source must still
    compile (the AVX-512 paths behind their #ifs), or that machine silently serves on torch's
    kernels alone (the failed-build fallback above)."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    flags = [f for f in native_build.FLAGS if f not in ("-shared", "-fPIC")]
    proc = subprocess.run([cc, *flags, f"-march={march}", "-fsyntax-only", "-I", str(native_build.HEADERS[0].parent),
                           *map(str, native_build.SOURCES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-800:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (32, 1536), (257, 576)])
def test_native_quantize_rows_equals_torch(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Same scales and the same int8 values as the torch fallback, bit for bit (rows with an
    outlier channel, an all-zero row, and a strided view included)."""
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape[0], shape[1] + 8, generator=g) * 3
    x[:, 5] *= 40  # an outlier channel sets each row's step
    x[0] = 0.0
    x = x.to(dtype)[:, 4:4 + shape[1]]  # rows not contiguous with each other
    q, scale = cpu_native.quantize_rows(x, 1e-8)
    q_ref, scale_ref = torch_ops.quantize_rows(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_dequantize_equals_torch(dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(7)
    acc = torch.randint(-(2**20), 2**20, (33, 960), generator=g, dtype=torch.int32)
    row = torch.rand(33, 1, generator=g) * 0.01
    col = torch.rand(960, generator=g) * 0.01
    bias = torch.randn(960, generator=g) if with_bias else None
    got = cpu_native.dequantize(acc, row, col, bias, dtype)
    want = acc.float().mul_(row).mul_(col)
    if bias is not None:
        want.add_(bias)
    assert torch.equal(got, want.to(dtype))


def test_int8_linear_native_equals_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Int8Linear gives the same output with and without the native passes."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g).bfloat16()
    bias = torch.randn(200, generator=g).bfloat16()
    layer = torch_ops.Int8Linear(w, bias)
    x = torch.randn(2, 5, 96, generator=g).bfloat16()
    native = layer(x)
    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")
    assert torch.equal(layer(x), native)


def _torch_path(monkeypatch: pytest.MonkeyPatch, fn, *args):  # noqa: ANN001, ANN202
    """fn(*args) through the plain-torch code of torch_ops (native kernels off)."""
    with monkeypatch.context() as m:
        m.setenv("RILL_NATIVE_KERNELS", "0")
        return fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])  # decode sizes run serially, prefill sizes in parallel
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_matches_torch(monkeypatch: pytest.MonkeyPatch, rows: int, dtype: torch.dtype,
                                       with_residual: bool) -> None:
    """The fused residual add + RMSNorm equals the torch code's result to float rounding (a
    different summation order), and its residual output is the same sum, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got = torch_ops.rms_norm(x, w, 1e-5, res)
    want = _torch_path(monkeypatch, torch_ops.rms_norm, x, w, 1e-5, res)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == dtype and got.shape == x.shape
    # bf16: a rounding step of the normalised value may land the other way (one bf16 ulp)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # ... and both are close to the float64 formula
    s = x.double() + (0 if res is None else res.double())
    ref = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(got.double(), ref, atol=TOL[dtype][0] * 10, rtol=TOL[dtype][1] * 10)


def test_model_step_uses_the_native_rms_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel interface the model calls reaches the native op for CPU rows, rows of a wider
    tensor too (one kv head's k sliced from the fused qkv output: copied first, so that every row
    is normed with the same bits)."""
    calls: list[int] = []
    real = cpu_native.rms_norm
    monkeypatch.setattr(cpu_native, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.ones(64)
    ops.rms_norm(torch.randn(4, 64), w, 1e-6, torch.randn(4, 64))
    ops.rms_norm(torch.randn(4, 64), w, 1e-6)
    assert len(calls) == 2
    x = torch.randn(4, 128)[:, 64:]
    got = ops.rms_norm(x, w, 1e-6)
    assert len(calls) == 3
    assert torch.equal(got, ops.rms_norm(x.contiguous(), w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 600])  # decode sizes run serially, prefill sizes in parallel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("normed", [False, True], ids=["slices", "qk-normed"])
def test_native_rope_and_kv_write_equal_torch(monkeypatch: pytest.MonkeyPatch, tokens: int, heads: int,
                                              kv_heads: int, head_dim: int, dtype: torch.dtype,
                                              normed: bool) -> None:
    """RoPE on q/k slices of a fused qkv output (or, as Gemma 3 and Qwen3 have them, q and k normed
    into tensors of their own, three row strides) plus the cache write: bit-identical to the torch
    ops (same rounding), every slot written by exactly the torch path's values, slots < 0 left alone."""
    from rill.services.worker.rope import cos_sin_cache
    from rill.shared.config import ModelConfig

    g = torch.Generator().manual_seed(tokens * heads)
    cfg = ModelConfig(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True)
    cs = cos_sin_cache(cfg, 4096, "cpu")
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    if normed:
        q, k = q.contiguous(), k.contiguous()
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    num_slots = 2 * tokens + 8
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    caches = [torch.full((num_slots // 4 + 1, 4, kv_heads, head_dim), 7.0, dtype=dtype) for _ in range(4)]
    got_q, got_k = torch_ops.rope_and_write_kv(q, k, v, positions, cs, caches[0], caches[1], slots)
    want_q, want_k = _torch_path(monkeypatch, torch_ops.rope_and_write_kv, q, k, v, positions, cs,
                                 caches[2], caches[3], slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not torch.equal(got_q, q)  # it did rotate
    # A padding token (slot -1) is rotated but not stored.
    slots[0] = -1
    before = [c.clone() for c in caches[:2]]
    cpu_native.rope_and_write_kv(q, k, v, positions, cs, caches[0], caches[1], slots)
    written = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(written[slots[1:]], got_k[1:])
    untouched = torch.ones(written.shape[0], dtype=torch.bool)
    untouched[slots[1:]] = False
    assert torch.equal(written[untouched], before[0].view(-1, kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("tokens", [1, 3])
def test_model_step_uses_the_native_rope(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """ops.rope_and_write_kv reaches the native pass for the model's qkv slices, also for a
    single token (a batch-1 decode step), whose row views report different stride(0)s."""
    calls: list[int] = []
    real = cpu_native.rope_and_write_kv
    monkeypatch.setattr(cpu_native, "rope_and_write_kv", lambda *a, **k: calls.append(1) or real(*a, **k))
    qkv = torch.randn(tokens, 4 * 16)  # GQA: two query heads, one kv head
    q, k, v = (x.view(tokens, -1, 16) for x in qkv.split([32, 16, 16], dim=-1))
    cache = torch.zeros(4, 4, 1, 16)
    ops.rope_and_write_kv(q, k, v, torch.arange(tokens), torch.randn(8, 16), cache, cache.clone(),
                          torch.arange(tokens))
    ops.rope_and_write_kv(q.contiguous(), k.contiguous(), v, torch.arange(tokens), torch.randn(8, 16), cache,
                          cache.clone(), torch.arange(tokens))  # q and k normed per head: three strides
    assert calls == [1, 1]


needs_silu_mul = pytest.mark.skipif(not cpu_native.silu_mul_supported(torch.zeros(1, 2)),
                                    reason="no native kernels here (no C compiler)")


@needs_silu_mul
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "f"), [(1, 1536), (7, 37), (300, 1536)])  # tails; serial and parallel
def test_native_silu_and_mul_matches_torch(monkeypatch: pytest.MonkeyPatch, rows: int, f: int,
                                           dtype: torch.dtype) -> None:
    """SiLU(gate) * up in one pass: torch's two ops to within one rounding step of the dtype
    (its exp is a polynomial), over gates from -100 to 100 with zeros."""
    g = torch.Generator().manual_seed(rows + f)
    x = (torch.randn(rows, 2 * f, generator=g) * 8).to(dtype)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    x[0, f:f + 4] = torch.tensor([3.0, 2.0, 1.5, 0.0])
    got = cpu_native.silu_and_mul(x)  # whatever the chooser would pick here
    want = _torch_path(monkeypatch, torch_ops.silu_and_mul, x)
    assert got.dtype == dtype and got.shape == (rows, f)
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20  # relative: a few units of rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=1e-30)
    assert abs(got[0, 1].item()) < 1e-30 and got[0, 2].item() == 150.0  # saturated ends, no overflow
    gate, up = x[:, :f].double(), x[:, f:].double()
    ref = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(got.double(), ref, rtol=2 * step, atol=1e-30)


needs_small_gemm = pytest.mark.skipif(cpu_native.small_gemm_rows() == 0, reason="no AVX512-BF16 on this CPU")


@needs_small_gemm
# 1-8: one tile holds every row; 9-128: 6-row groups of 4-, 2- and 1-block tiles, tails included.
@pytest.mark.parametrize("rows", [*range(1, 9), 9, 13, 32, 61, 128, 301, 1024])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (577, 1536), (5, 64), (49, 6), (112, 64)])  # N off the 16-row blocks too
def test_small_gemm_matches_reference(rows: int, n: int, k: int) -> None:
    """bf16 x [rows, K] @ W.T (+ bias) through the packed small GEMM: the float64 product within
    bf16 rounding, with and without a bias, and the same as oneDNN's up to summation order."""
    g = torch.Generator().manual_seed(rows * n + k)
    w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((n, k), (rows, k), (n,)))
    packed = cpu_native.small_gemm_pack(w)
    for bias in (b, None):
        got = cpu_native.small_gemm(x, packed, n, bias)
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * (1 + want.abs().max().item() / 16))
        onednn = torch.nn.functional.linear(x, w, bias)
        assert (got.float() - onednn.float()).abs().max() <= 2e-2 * (1 + want.abs().max().item())


@needs_small_gemm
@pytest.mark.parametrize("rows", [3, 7, 16])
def test_small_gemm_is_the_same_whichever_thread_takes_a_block(rows: int) -> None:
    """Threads work through their own share of the output blocks and take blocks from the back of
    others' shares when they run out (more threads than cores: they are preempted all the time,
    so shares change hands). Every block is computed once, by some thread, in the same order of
    additions whatever tile took it: the output is bit-identical to one thread's."""
    g = torch.Generator().manual_seed(rows)
    n, k = 577, 576  # 37 blocks, the last one partial
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    packed = cpu_native.small_gemm_pack(w)
    before = torch.get_num_threads()
    try:
        for threads in (3, 8):
            for _ in range(20):  # a fresh input each time: a block left unwritten cannot match by chance
                x = torch.randn(rows, k, generator=g).bfloat16()
                torch.set_num_threads(1)
                want = [cpu_native.small_gemm(x, packed, n, b, dt) for dt in (torch.bfloat16, torch.float32)]
                torch.set_num_threads(threads)
                got = [cpu_native.small_gemm(x, packed, n, b, dt) for dt in (torch.bfloat16, torch.float32)]
                assert all(torch.equal(a, c) for a, c in zip(got, want, strict=True))
    finally:
        torch.set_num_threads(before)


@needs_small_gemm
def test_linear_takes_the_small_gemm_up_to_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Linear runs decode-sized inputs (up to small_gemm_rows()) through the small GEMM and
    larger ones through oneDNN, with the same values either way (to bf16 rounding)."""
    calls: list[int] = []
    real = cpu_native.small_gemm
    monkeypatch.setattr(cpu_native, "small_gemm", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    lin = torch_ops.Linear(w, b)
    limit = cpu_native.small_gemm_rows()
    x = torch.randn(limit + 1, 64, generator=g).bfloat16()
    small, large = lin(x[:limit]), lin(x)
    assert calls == [limit]
    assert torch.allclose(small.float(), large[:limit].float(), rtol=2e-2, atol=2e-2 * (1 + large.abs().max().item()))
    assert torch_ops.Linear(w.float(), b.float()).small is None  # fp32 keeps oneDNN only


@needs_small_gemm
def test_logits_take_the_small_gemm_up_to_their_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 logits (float_out) come from the small GEMM's sums up to LOGITS_SMALL_ROWS rows and
    from oneDNN beyond, the same values either way (to bf16 rounding of the products' order)."""
    calls: list[int] = []
    real = cpu_native.small_gemm
    monkeypatch.setattr(cpu_native, "small_gemm", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 64, generator=g).bfloat16()
    lin = torch_ops.Linear(w, None, logits=True)
    x = torch.randn(torch_ops.LOGITS_SMALL_ROWS + 1, 64, generator=g).bfloat16()
    small, large = lin.float_out(x[:-1]), lin.float_out(x)
    assert calls == [torch_ops.LOGITS_SMALL_ROWS]
    assert small.dtype == large.dtype == torch.float32
    assert torch.allclose(small, large[:-1], rtol=2e-2, atol=2e-2 * (1 + large.abs().max().item()))


@needs_small_gemm
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_small_gemm_writes_fp32_sums_for_logits(rows: int) -> None:
    """Out in fp32 the small GEMM keeps its sums unrounded: closer to float64 than the bf16 out,
    which is exactly its rounding. Linear.float_out takes that path for rows it serves."""
    g = torch.Generator().manual_seed(rows)
    w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((200, 96), (rows, 96), (200,)))
    packed = cpu_native.small_gemm_pack(w)
    f32 = cpu_native.small_gemm(x, packed, 200, b, torch.float32)
    bf16 = cpu_native.small_gemm(x, packed, 200, b)
    assert f32.dtype == torch.float32 and torch.equal(f32.bfloat16(), bf16)
    want = x.double() @ w.double().t() + b.double()
    assert (f32.double() - want).abs().max() < 1e-4 * (1 + want.abs().max())
    assert torch.equal(torch_ops.Linear(w, b).float_out(x), f32)


@pytest.mark.parametrize(("rows", "cols"), [(1, 5), (3, 16), (32, 49152), (7, 1000)])
def test_native_argmax_equals_torch(rows: int, cols: int) -> None:
    """First index of the largest value per row, as torch's argmax: with ties inside and across
    vector lanes, a maximum in the tail, and a NaN (ranked highest by torch)."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g).round()  # many ties
    x[0, -1] = 100.0  # the maximum in the scalar tail
    if rows > 2:
        x[1, 3] = x[1, cols - 1] = 50.0  # a tie: the first one wins
        x[2, cols // 2] = float("nan")
    assert cpu_native.argmax_supported(x)
    assert torch.equal(cpu_native.argmax_rows(x), x.argmax(dim=-1))
    assert not cpu_native.argmax_supported(x.bfloat16())
    assert rows == 1 or not cpu_native.argmax_supported(x.t())  # strided: torch's argmax
