"""The native layer driver (services/worker/decode_layers.py, kernels/cpu_decode_layers.c) against
the per-op path it replaces for steps of few rows: the same logits and the same KV written, bit for
bit, for decode rows, a verify-like step (several rows of one sequence) and a short prompt."""

from __future__ import annotations

import pytest
import torch

from rill.kernels import cpu_native, ops
from rill.kernels.gguf_linear import QuantLinear
from rill.services.worker.decode_layers import MAX_ROWS, MAX_SEQ_ROWS, DecodeLayers, row_tables, why_not
from rill.services.worker.llama import LlamaModel

pytestmark = [pytest.mark.skipif(cpu_native.library() is None, reason="no native kernels here (no C compiler)"),
              pytest.mark.usefixtures("native_silu")]

BLOCK = 16


def blocks_model(model_dir: str, dtype: torch.dtype) -> LlamaModel:
    """SmolLM2 served from its GGUF blocks at every row count (what the driver multiplies)."""
    model = LlamaModel.load(model_dir, dtype, quantization="gguf")
    for lin in model.linears():
        if isinstance(lin, QuantLinear):
            lin.force("blocks")
    return model


def step(model: LlamaModel, caches: list[tuple[torch.Tensor, torch.Tensor]], tables: list[list[int]],
         computed: list[int], tokens: list[list[int]]) -> torch.Tensor:
    positions, meta = ops.make_attention_metadata(tables, computed, [len(t) for t in tokens], BLOCK)
    ids = torch.tensor([i for t in tokens for i in t])
    return model.forward(ids, positions, meta, caches, torch.arange(len(ids)))


def prefilled(model_dir: str, dtype: torch.dtype) -> tuple[LlamaModel, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model and a KV cache holding three prompts (40, 42 and 44 tokens, blocks 4 apiece),
    run op by op."""
    model = blocks_model(model_dir, dtype)
    assert why_not(model) is None
    caches = model.allocate_kv_cache(32, BLOCK)
    model._driver, model._driver_checked = None, True
    step(model, caches, TABLES, [0, 0, 0], PROMPTS)
    return model, caches


TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
PROMPTS = [list(range(100 + 7 * s, 140 + 9 * s)) for s in range(3)]
LENS = [len(p) for p in PROMPTS]


def restore(caches: list[tuple[torch.Tensor, torch.Tensor]], snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for (k, v), (k0, v0) in zip(caches, snapshot, strict=True):
        k.copy_(k0)
        v.copy_(v0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_equal_the_per_op_path(smollm2_dir: str, dtype: torch.dtype,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows take the same kernels in the same order: the same logits and KV, bit for bit."""
    model, caches = prefilled(smollm2_dir, dtype)
    driver = DecodeLayers(model)
    for tabs, computed, tokens in (([TABLES[0]], [LENS[0]], [[7]]), (TABLES, LENS, [[7], [8], [9]])):
        snapshot = [(k.clone(), v.clone()) for k, v in caches]
        model._driver = None
        want = step(model, caches, tabs, computed, tokens)
        want_kv = [(k.clone(), v.clone()) for k, v in caches]
        restore(caches, snapshot)
        model._driver = driver
        with monkeypatch.context() as m:
            m.setattr(model, "_layers", lambda *a: pytest.fail("the driver declined a decode step"))
            got = step(model, caches, tabs, computed, tokens)
        assert torch.equal(got, want), f"{len(tokens)} rows: logits differ by {(got - want).abs().max().item()}"
        for (k, v), (wk, wv) in zip(caches, want_kv, strict=True):
            assert torch.equal(k, wk) and torch.equal(v, wv), f"{len(tokens)} rows: the KV written differs"


def test_rows_of_one_sequence_attend_as_decode_tokens(smollm2_dir: str) -> None:
    """A verify step (4 rows of one sequence beside another's decode row) or a short prompt: each
    row attends as one decode token over its own context, which is the per-op path's causal
    prompt attention summed in another order."""
    model, caches = prefilled(smollm2_dir, torch.float32)
    k_cache, v_cache = caches[0]
    c = model.cfg
    for tabs, computed, qlens in ((TABLES[:2], LENS[:2], [4, 1]), ([TABLES[2]], [LENS[2]], [6])):
        positions, meta = ops.make_attention_metadata(tabs, computed, qlens, BLOCK)
        t = sum(qlens)
        torch.manual_seed(t)
        q = torch.randn(t, c.num_attention_heads, c.head_dim)
        k, v = (torch.randn(t, c.num_key_value_heads, c.head_dim) for _ in range(2))
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        want = ops.paged_attention(q, k_cache, v_cache, meta, model.scale, k, v)
        tables, lens = row_tables(meta)
        got = torch.empty_like(q)
        cpu_native.paged_decode(q, k_cache, v_cache, tables, lens, torch.arange(t), got, meta.max_seq_len, model.scale)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_of_several_rows_a_sequence_agree_with_the_per_op_path(smollm2_dir: str, dtype: torch.dtype) -> None:
    """End to end, those steps pick the per-op path's greedy tokens up to near-ties; their logits
    are not bit-equal (the attention's last-bit differences move 8-bit activation roundings in
    later layers, and bf16 roundings)."""
    model, caches = prefilled(smollm2_dir, dtype)
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    tokens = [[5, 6, 7, 8], [9]]
    want = step(model, caches, TABLES[:2], LENS[:2], tokens)
    restore(caches, snapshot)
    model._driver = DecodeLayers(model)
    got = step(model, caches, TABLES[:2], LENS[:2], tokens)
    picked = want.gather(1, got.argmax(-1, keepdim=True)).squeeze(1)
    assert (want.max(-1).values - picked).max() < 0.5, "a greedy token that is no near-tie of the per-op one"
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_the_driver_declines_what_it_cannot_run(smollm2_dir: str, tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float model on oneDNN's GEMMs, more rows than it takes, a prompt chunk, or the switch off:
    the per-op path."""
    model_dir, _ = tiny_llama
    fp32 = LlamaModel.load(model_dir, torch.float32)
    caches = fp32.allocate_kv_cache(8, BLOCK)
    positions, meta = ops.make_attention_metadata([[0]], [0], [3], BLOCK)
    h = fp32.embed_lookup(torch.tensor([1, 2, 3]))
    assert DecodeLayers(fp32).run(h, positions, meta, caches) is None  # its linears are not the driver's
    gguf = blocks_model(smollm2_dir, torch.float32)
    caches = gguf.allocate_kv_cache(8, BLOCK)
    rows = MAX_ROWS + 1
    positions, meta = ops.make_attention_metadata([list(range(-(-rows // BLOCK)))], [0], [rows], BLOCK)
    h = gguf.embed_lookup(torch.arange(rows))
    assert DecodeLayers(gguf).run(h, positions, meta, caches) is None  # past MAX_ROWS
    positions, meta = ops.make_attention_metadata([[0, 1]], [0], [MAX_SEQ_ROWS + 1], BLOCK)
    h = gguf.embed_lookup(torch.arange(MAX_SEQ_ROWS + 1))
    assert DecodeLayers(gguf).run(h, positions, meta, caches) is None  # a prompt chunk: prompt attention
    monkeypatch.setenv("RILL_DECODE_LAYERS", "0")
    assert why_not(gguf) == "RILL_DECODE_LAYERS=0" and DecodeLayers.of(gguf) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_drivers_geglu_is_torchs(dtype: torch.dtype) -> None:
    """GeGLU's GELU(gate) * up in the driver equals torch's two ops bit for bit: every bf16 value as
    a gate, or 2^16 random fp32 ones, in rows whose length leaves torch a scalar tail (libm's tanh
    there, torch's own vector tanh before it)."""
    lib = cpu_native.library()
    if lib is None or not cpu_native.geglu_exact():
        pytest.skip("no AVX2 or AVX-512 in this build, or this torch build exports no Sleef vector tanh")
    g = torch.Generator().manual_seed(0)
    gate = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 \
        else torch.randn(1 << 16, generator=g) * 4
    gate = gate.to(dtype)[~gate.float().isnan()]
    f = 2040  # torch's vector loop takes 64 bf16 or 32 fp32 at a time: a scalar tail
    gate = gate[: gate.numel() // f * f].view(-1, f)
    gu = torch.cat([gate, (torch.randn(gate.shape, generator=g) * 2).to(dtype)], dim=1).contiguous()
    got = torch.empty_like(gate)
    lib.gelu_mul(int(dtype == torch.bfloat16), gu.data_ptr(), got.data_ptr(), gate.shape[0], f)
    want = torch.nn.functional.gelu(gu[:, :f], approximate="tanh") * gu[:, f:]
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma3_layers_run_in_the_driver(gemma3_dir: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 (per-head q/k norms, norms of the attention and MLP outputs, sliding-window layers
    with their own RoPE table, GeGLU): decode steps as the per-op path computes them, bit for bit.
    (fp32 differed once: the per-op path normed its one kv head's k, a strided slice of the qkv
    output, with torch's ops instead of the native pass, and 8-bit activation rounding in the next
    layers amplified the last bit.)"""
    if not cpu_native.geglu_exact():
        pytest.skip("GeGLU runs in the driver only with torch's vector tanh (AVX2 or AVX-512)")
    model = blocks_model(gemma3_dir, dtype)
    assert why_not(model) is None and any(layer.window for layer in model.layers)
    caches = model.allocate_kv_cache(16, BLOCK)
    tables, prompts = [[0, 1, 2, 3], [4, 5, 6, 7]], [list(range(1000, 1040)), list(range(2000, 2042))]
    model._driver, model._driver_checked = None, True
    step(model, caches, tables, [0, 0], prompts)
    snapshot = [(k.clone(), v.clone()) for k, v in caches]
    want = step(model, caches, tables, [40, 42], [[7], [8]])
    restore(caches, snapshot)
    model._driver = DecodeLayers(model)
    monkeypatch.setattr(model, "_layers", lambda *a: pytest.fail("the driver declined a Gemma 3 decode step"))
    got = step(model, caches, tables, [40, 42], [[7], [8]])
    assert torch.equal(got, want), f"logits differ by {(got - want).abs().max().item()}"
