"""The Triton kernels against float64 references, and a whole model step Triton vs torch.

Without a GPU every kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set below
before any kernel module is imported), so the cases are small; bf16 is GPU-only (the
interpreter's bf16 dot is wrong; the kernels upcast there anyway). Inputs are N(0, 1)-scaled so
the softmax is far from uniform, a few keys are boosted to force max-rescaling, every output is
poisoned with NaN before the run, and cache slots that must not be read hold NaN.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_case import PagedCase, close, decode_lengths, gen, kv_heads_for  # noqa: E402

from rill.kernels import ops, triton_attention, triton_ops  # noqa: E402
from rill.kernels.triton_attention import choose_num_splits, decode_attention, extend_attention  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# (atol, rtol) for attention-sized outputs (|out| <~ 3)
TOL = {torch.float32: (5e-5, 5e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
GROUPS = [1, 3, 4, 8]


# ------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_attention(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    lens = decode_lengths(block_size)
    case = PagedCase(lens, [1] * len(lens), block_size, kv_heads_for(group), group, head_dim, dtype,
                     seed=block_size * 1000 + head_dim * 10 + group, device=DEVICE)
    want = case.reference()
    atol, rtol = TOL[dtype]
    for splits in (1, 4):  # the single-pass path and split-K + reduce (with empty trailing splits)
        out = decode_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.scale,
                               max(lens), num_splits=splits, out=case.poisoned_out())
        close(out, want, atol, rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_extend_attention_mixed_batch(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    bs = block_size
    # (cached prefix, new tokens): a fresh prompt, a chunk after a prefix ending mid-block, a
    # decode deep into its context, a one-token prompt, a short chunk after a short prefix.
    shape = [(0, 37), (bs + 3, 2 * bs - 1), (5 * bs - 2, 1), (0, 1), (2, 9)]
    seq_lens = [c + n for c, n in shape]
    query_lens = [n for _, n in shape]
    case = PagedCase(seq_lens, query_lens, bs, kv_heads_for(group), group, head_dim, dtype,
                     seed=7 + block_size * 1000 + head_dim * 10 + group, device=DEVICE)
    out = extend_attention(case.q, case.k_cache, case.v_cache, case.tables, case.seq_lens_t, case.qsl, case.scale,
                           max(query_lens), out=case.poisoned_out())
    close(out, case.reference(), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_paged_attention_dispatch_from_step_metadata(dtype: torch.dtype) -> None:
    """`paged_attention` with metadata built by `make_attention_metadata`: a pure-decode step
    takes the split-K kernel (splits chosen automatically), a mixed step the extend kernel."""
    bs, group, kv_heads, head_dim = 16, 4, 2, 64
    for query_lens, computed in (([1, 1, 1], [40, 3, 130]), ([1, 12, 1], [40, 5, 130])):
        seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
        case = PagedCase(seq_lens, query_lens, bs, kv_heads, group, head_dim, dtype, seed=sum(query_lens),
                         device=DEVICE)
        blocks = [[int(b) for b in row[: -(-n // bs)]] for row, n in zip(case.tables.cpu(), seq_lens, strict=True)]
        _, meta = ops.make_attention_metadata(blocks, computed, query_lens, bs, DEVICE)
        out = triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, meta, case.scale)
        close(out, case.reference(), *TOL[dtype])


def test_torch_attention_groups_decodes_by_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-torch CPU path (no native kernel) pads each decode group's KV to its longest
    row: rows of very different lengths are split into groups (fewer padded blocks), and every
    row still equals the reference, prefill chunks in the same step included."""
    from rill.kernels import torch_attention

    monkeypatch.setenv("RILL_NATIVE_KERNELS", "0")

    bs = 16
    assert [sorted(g) for g in torch_attention.split_by_length([1, 1, 2, 30, 31, 2, 30])] == [[0, 1, 2, 5], [3, 4, 6]]
    assert torch_attention.split_by_length([4, 4, 5]) == [[0, 1, 2]]  # not worth a second group
    assert sorted(i for g in torch_attention.split_by_length([7, 3, 9, 1, 120, 64] * 5) for i in g) == list(range(30))
    computed = [3, 500, 17, 260, 40, 900, 8, 120]
    query_lens = [1, 1, 1, 1, 1, 1, 1, 1]
    computed += [0, 70]
    query_lens += [33, 20]
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    case = PagedCase(seq_lens, query_lens, bs, 3, 3, 64, torch.float32, seed=11)
    # The CPU path reads padding blocks (and masks them): they must hold numbers, not the poison.
    case.k_cache = torch.nan_to_num(case.k_cache.cpu(), nan=0.5)
    case.v_cache = torch.nan_to_num(case.v_cache.cpu(), nan=0.5)
    blocks = [[int(b) for b in row[: -(-n // bs)]] for row, n in zip(case.tables.cpu(), seq_lens, strict=True)]
    _, meta = ops.make_attention_metadata(blocks, computed, query_lens, bs, "cpu")
    out = torch_attention.paged_attention(case.q.cpu(), case.k_cache, case.v_cache, meta, case.scale)
    assert len(meta.aux["torch_plan"].decode_groups) > 1
    close(out, case.reference(), 2e-5, 2e-5)


def test_num_splits_follow_work_not_batch() -> None:
    sms = 132
    # Few (seq, kv head) pairs and a long context: split to fill the GPU.
    assert choose_num_splits(1, 8, 8192, sms) > 8
    # Same batch, longer context: at least as many splits (never fewer for more work per pair).
    for b in (1, 4, 16, 32, 48):
        assert choose_num_splits(b, 8, 8192, sms) >= choose_num_splits(b, 8, 1024, sms) >= 1
    # A mid-size batch at long context still splits (the batch-only rule would stop at ~16 seqs).
    assert choose_num_splits(32, 8, 8192, sms) > 1
    # Short contexts or a grid that already fills the GPU: one pass, no reduce.
    assert choose_num_splits(4, 8, 100, sms) == 1
    assert choose_num_splits(256, 8, 8192, sms) == 1
    # Each split keeps at least two tiles of work.
    assert choose_num_splits(1, 1, 300, sms, tile_n=64) <= 3


# ------------------------------------------------------------------------------------- fused element-wise


def _llama3_cos_sin(head_dim: int, max_pos: int) -> torch.Tensor:
    from rill.services.worker.rope import cos_sin_cache
    from rill.shared.config import ModelConfig

    cfg = ModelConfig(vocab_size=10, hidden_size=head_dim, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=max_pos, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return cos_sin_cache(cfg, max_pos, DEVICE)


def _rope_ref(x: torch.Tensor, positions: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    x = x.double().cpu()
    half = x.shape[-1] // 2
    c = cs.double().cpu()[positions.cpu()][:, None, :]
    cos, sin = c[..., :half], c[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _elem_tol(dtype: torch.dtype) -> tuple[float, float]:
    # one or two roundings of an O(1..10) value
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (64, 8), (128, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rope_and_write_kv(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Fused RoPE (Llama-3 scaled tables) + cache write on views of a fused qkv row, in place;
    padding slots (-1) are skipped, and no other cache slot is touched."""
    g = gen(head_dim + group + block_size)
    kv_heads = 2
    heads = kv_heads * group
    tokens, num_blocks = 11, 6
    qkv = (torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=g) * 2).to(dtype).to(DEVICE)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(DEVICE)
    cs = _llama3_cos_sin(head_dim, 4096)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    q_want, k_want = _rope_ref(q, positions, cs), _rope_ref(k, positions, cs)
    v_before = v.clone()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)

    q_out, k_out = triton_ops.rope_and_write_kv(q, k, v, positions, cs, k_cache, v_cache, slots)
    atol, rtol = _elem_tol(dtype)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    close(q_out, q_want, atol, rtol)
    close(k_out, k_want, atol, rtol)
    assert torch.equal(v, v_before)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    written = slots >= 0
    assert torch.equal(flat_k[slots[written]], k_out[written])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_apply_rotary_and_write_kv_unfused(dtype: torch.dtype) -> None:
    g = gen(3)
    q = torch.randn((5, 6, 64), generator=g).to(dtype).to(DEVICE)
    k = torch.randn((5, 2, 64), generator=g).to(dtype).to(DEVICE)
    v = torch.randn((5, 2, 64), generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 1, 63, 64, 1000], device=DEVICE)
    cs = _llama3_cos_sin(64, 1024)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = triton_ops.apply_rotary(q, k, positions, cs, q_out=torch.full_like(q, float("nan")),
                                           k_out=torch.full_like(k, float("nan")))
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # out of place
    close(q_out, _rope_ref(q, positions, cs), *_elem_tol(dtype))
    close(k_out, _rope_ref(k, positions, cs), *_elem_tol(dtype))
    k_cache = torch.full((3, 16, 2, 64), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([47, 0, -1, 16, 5], device=DEVICE)
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 64)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, 2, 64)[slots[keep]], v[keep])
    assert int(torch.isnan(k_cache).any(-1).any(-1).sum()) == 48 - 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [72, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(hidden: int, with_residual: bool, dtype: torch.dtype) -> None:
    g = gen(hidden)
    x = (torch.randn((7, hidden), generator=g) * 3).to(dtype).to(DEVICE)
    res = torch.randn((7, hidden), generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(hidden, generator=g) * 2).to(dtype).to(DEVICE)
    eps = 1e-5
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    got = triton_ops.rms_norm(x, w, eps, res if with_residual else None, out=out, residual_out=res_out)
    xs = x.double() + res.double() if with_residual else x.double()
    want = w.double() * xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
    atol, rtol = _elem_tol(dtype)
    if with_residual:
        normed, summed = got
        assert normed.data_ptr() == out.data_ptr() and summed.data_ptr() == res_out.data_ptr()
        close(summed, xs, atol, rtol)
        # the sum is rounded to the dtype before the norm (HF order): compare against that
        xs_r = summed.double()
        want = w.double() * xs_r * torch.rsqrt(xs_r.pow(2).mean(-1, keepdim=True) + eps)
        close(normed, want, 2 * atol, 2 * rtol)
    else:
        close(got, want, 2 * atol, 2 * rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    g = gen(11)
    f = 1100  # two column blocks, the second partial
    x = (torch.randn((5, 2 * f), generator=g) * 3).to(dtype).to(DEVICE)
    out = triton_ops.silu_and_mul(x, out=torch.full((5, f), float("nan"), dtype=dtype, device=DEVICE))
    gate, up = x.double()[:, :f], x.double()[:, f:]
    close(out, gate * torch.sigmoid(gate) * up, *(2 * t for t in _elem_tol(dtype)))


# ------------------------------------------------------------------------------------- backend + model


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, x = torch.zeros(1), torch.zeros(1, device=DEVICE)
    try:
        monkeypatch.setenv("RILL_KERNELS", "torch")
        ops.set_backend(None)
        assert ops.backend() == "torch" and not ops.uses_triton(x)
        monkeypatch.setenv("RILL_KERNELS", "triton")
        ops.set_backend(None)
        assert ops.backend() == "triton" and ops.uses_triton(x)
        assert ops._impl_for(x) is triton_ops
        # Compiled GPU kernels cannot take CPU tensors: forced Triton reaches them only when interpreted.
        assert ops.uses_triton(cpu) == triton_ops.INTERPRET
        monkeypatch.delenv("RILL_KERNELS")
        ops.set_backend(None)
        assert ops.backend() == "auto" and not ops.uses_triton(cpu)  # auto: CPU tensors -> torch
        assert ops.uses_triton(x) == CUDA  # ...and CUDA tensors -> Triton
        monkeypatch.setenv("RILL_KERNELS", "cuda-please")
        ops.set_backend(None)
        with pytest.raises(ValueError):
            ops.backend()
        with pytest.raises(ValueError):
            ops.set_backend("fast")
    finally:
        ops.set_backend(None)
        monkeypatch.delenv("RILL_KERNELS", raising=False)
        ops.set_backend(None)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      initializer_range=0.1, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _blocks() -> list[list[int]]:
    """Three disjoint, shuffled 6-block tables out of 24 blocks."""
    perm = random.Random(5).sample(range(24), 24)
    return [perm[0:6], perm[6:12], perm[12:18]]


def _three_steps(model, backend: str, block_size: int) -> tuple[list[torch.Tensor], list]:
    """Two prompts, then a mixed step (decode + prompt chunk + a new prompt), then a decode step."""
    ops.set_backend(backend)
    try:
        kv = model.allocate_kv_cache(24, block_size)
        blocks = _blocks()
        steps = [([0, 1], [0, 0], [37, 20]), ([0, 1, 2], [37, 20, 0], [1, 5, 3]), ([0, 1, 2], [38, 25, 3], [1, 1, 1])]
        logits = []
        for seqs, computed, qlens in steps:
            positions, meta = ops.make_attention_metadata([blocks[s] for s in seqs], computed, qlens, block_size,
                                                          DEVICE)
            ids = torch.tensor([(7 * p + 3 * s) % 300 for s, c, n in zip(seqs, computed, qlens, strict=True)
                                for p in range(c, c + n)], device=DEVICE)
            last = torch.tensor(meta.query_start_loc_host[1:], device=DEVICE) - 1
            with torch.inference_mode():
                logits.append(model.forward(ids, positions, meta, kv, last))
        return logits, kv
    finally:
        ops.set_backend(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_model_step_triton_equals_torch(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    from rill.services.worker.llama import LlamaModel

    model = LlamaModel.load(tiny_model_dir, dtype=dtype, device=DEVICE)
    want, kv_want = _three_steps(model, "torch", 16)
    got, kv_got = _three_steps(model, "triton", 16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        assert scale > 1.0  # logits that differ by whole units, so the tolerance means something
        assert (a - b).abs().max().item() <= tol * scale
    for (kg, vg), (kw, vw) in zip(kv_got, kv_want, strict=True):
        assert (kg.float() - kw.float()).abs().max().item() <= tol * 10
        assert (vg.float() - vw.float()).abs().max().item() <= tol * 10


def test_padded_decode_graph_step_matches_plain_step(tiny_model_dir: Path) -> None:
    """The CUDA-graph decode runner's padded step (run eagerly here: no GPU): 3 sequences padded
    to 4 lanes give the plain step's logits and leave the cache exactly as the plain step does."""
    from rill.services.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_wanted
    from rill.services.worker.llama import LlamaModel

    assert capture_sizes(4) == [1, 2, 4] and capture_sizes(20)[-1] == 20
    model = LlamaModel.load(tiny_model_dir, dtype=torch.float32, device=DEVICE)
    assert not graphs_wanted("cpu", model)
    bs = 16
    _, kv = _three_steps(model, "triton", bs)  # three sequences with 39, 26 and 4 tokens cached
    kv_plain = [(k.clone(), v.clone()) for k, v in kv]
    blocks = _blocks()
    computed, tokens = [39, 26, 4], [11, 12, 13]
    ops.set_backend("triton")
    try:
        positions, meta = ops.make_attention_metadata(blocks, computed, [1, 1, 1], bs, DEVICE)
        with torch.inference_mode():
            want = model.forward(torch.tensor(tokens, device=DEVICE), positions, meta, kv_plain,
                                 torch.arange(3, device=DEVICE))
        runner = DecodeGraphs(model, kv, bs, max_model_len=256, max_batch=4)
        got = runner.run(tokens, computed, blocks)
    finally:
        ops.set_backend(None)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    for (kg, vg), (kw, vw) in zip(kv, kv_plain, strict=True):
        assert torch.equal(kg, kw) and torch.equal(vg, vw)


def test_every_kernel_compiles_for_sm90_without_spills() -> None:
    """The interpreter cannot see GPU-only failures (dot shape limits, loop-carried types, register
    spills), so compile each production variant for sm_90 with Triton's bundled ptxas (no GPU
    needed) through `scripts/gpu_check.py --compile-only`."""
    import subprocess
    import sys

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton wheel ships no ptxas")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), "--compile-only"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPILED ")]
    assert len(lines) >= 10, proc.stdout
    for ln in lines:
        assert "spill_bytes=0 " in ln, ln
        regs = int(ln.split("regs=")[1].split()[0])
        assert 0 < regs <= 255, ln


def test_gpu_check_script_runs_every_section_at_smoke_shapes() -> None:
    """scripts/gpu_check.py is run for real only when a GPU is lent; `--smoke` runs all of its
    sections (peaks, checks, kernel timings, decode steps eager vs graph runner) at tiny shapes
    under the interpreter so the script cannot rot unnoticed, and its checks must pass."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    table = proc.stdout.split("RILL GPU CHECK SUMMARY", 1)[1]
    for section in ("peak", "correct", "kernel", "step"):
        assert f"\n{section} " in table, section
    assert "graph vs eager logits rel diff 0.0e+00" in table or CUDA
    assert "correctness/compile failures: 0" in table
