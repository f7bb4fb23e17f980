"""--quantization gguf: a .gguf model served from its own blocks (services/worker/gguf_weights.py).

The float model these are checked against is the same file dequantized (model_files.convert_gguf),
so the weights are equal and the only difference is the kernels' 8-bit rounding of activations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_quantization import CHATS, chat_ids, quality, run_rows

from rill.kernels import chooser, gguf_blocks, gguf_native
from rill.kernels.gguf_linear import QuantLinear
from rill.services.cli import build_parser, engine_args
from rill.services.worker.llama import LlamaModel
from rill.services.worker.memory import held_bytes, weight_bytes
from rill.shared.config import ModelConfig, resolve_quantization

# Teacher-forced over the texts of test_quantization.CHATS (126 positions), against the float model
# of the same file. Measured on an AMD EPYC (AVX-512 VNNI/BF16, no AMX): SmolLM2 Q4_1 top-1
# agreement 0.944, mean |delta logprob| of the float argmax 0.035; Gemma 3 270M Q4_K_M 0.929 and
# 0.051 (llama.cpp rounds activations the same way). A wrong row order or scale fails both by far
# (agreement near 0); the bounds leave room for another CPU's rounding.
MIN_TOP1_AGREEMENT = 0.9
MAX_MEAN_LOGPROB_DIFF = 0.08


def from_blocks(model_dir: str) -> LlamaModel:
    """The model with every linear layer on its blocks ("blocks" route at every batch size): the
    kernel table left empty (its incumbents serve the blocks), then each layer forced."""
    model = load_under(chooser.KernelTable(), model_dir)
    for lin in model.linears():
        if isinstance(lin, QuantLinear):
            lin.force("blocks")
    return model


@pytest.fixture(scope="module")
def smollm2_q4_0_dir() -> str:
    """SmolLM2 in Q4_0 (its Q4_1 file requantized by gguf-py), converted as `rill serve` would."""
    from gguf import GGMLQuantizationType
    from gguf_requantize import requantized

    from rill.shared.model_files import gguf_source, resolve_model

    src = gguf_source(None)  # the default model's file
    assert src is not None
    return str(resolve_model(str(requantized(src, "Q4_0", GGMLQuantizationType.Q4_0))))


@pytest.fixture(scope="module")
def smollm2_k_dir() -> str:
    """SmolLM2 with its down projections (1536 inputs: whole 256-value blocks) in Q5_K (even
    layers) and Q6_K (odd ones), the rest in Q4_1: the mix of a Q5_K_M / Q4_K_M download."""
    from gguf import GGMLQuantizationType
    from gguf_requantize import requantized

    from rill.shared.model_files import gguf_source, resolve_model

    def pick(name: str, k: int) -> GGMLQuantizationType | None:
        if "ffn_down" not in name or k % 256:
            return None
        return GGMLQuantizationType.Q6_K if int(name.split(".")[1]) % 2 else GGMLQuantizationType.Q5_K

    src = gguf_source(None)
    assert src is not None
    return str(resolve_model(str(requantized(src, "Q5_K_M", GGMLQuantizationType.Q4_1, pick))))


@pytest.fixture(scope="module", params=["smollm2", "smollm2_q4_0", "smollm2_k", "gemma3"])
def pair(request: pytest.FixtureRequest) -> tuple[str, LlamaModel, LlamaModel]:
    """(model dir, its float model, the same served from its GGUF blocks)."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    return model_dir, LlamaModel.load(model_dir, torch.float32), from_blocks(model_dir)


def test_every_linear_and_the_embedding_stay_in_the_files_blocks(pair: tuple[str, LlamaModel, LlamaModel]) -> None:
    """Gemma 3 270M Q4_K_M mixes Q5_0 (q, k, gate, up), Q8_0 (v, embedding), Q4_K and Q6_K: one
    fused QKV holds two formats. Both models tie their head to the embedding's blocks."""
    _, ref, model = pair
    assert all(isinstance(lin, QuantLinear) for lin in model.linears())
    for p in (p for lin in model.linears() for p in lin.parts):  # repacked where this CPU has the x16 GEMM
        assert (p.packed is not None) == gguf_native.x16_supported(p.qtype), gguf_blocks.name(p.qtype)
    assert model.embed.numel() == 0, "the float embedding should have been dropped for its blocks"
    vocab = ref.embed.shape[0]
    ids = torch.cat([torch.tensor([0, 5, vocab - 1, 1234]), torch.randint(0, vocab, (60,), generator=torch.Generator().manual_seed(0))])
    assert torch.equal(model.embed_lookup(ids), ref.embed[ids])
    # The lookup reads the tied head's blocks (repacked or not): one copy of them.
    assert weight_bytes(model) == held_bytes(model.norm, model.lm_head, *model.layers)
    held = sum(lin.nbytes for lin in model.linears())
    floats = 4 * sum(lin.out_features * lin.in_features for lin in model.linears())
    assert held < 0.3 * floats  # 4-6 bits a weight where fp32 has 32; the embedding 8.5


def test_served_from_its_blocks_agrees_with_the_float_model(pair: tuple[str, LlamaModel, LlamaModel]) -> None:
    from transformers import AutoTokenizer

    model_dir, ref, model = pair
    tok = AutoTokenizer.from_pretrained(model_dir)
    seqs = [tok(" ".join(text for _, text in chat))["input_ids"] for chat in CHATS]
    agreement, mean_diff, total = quality(ref, model, seqs)
    print(f"\n{model_dir}: GGUF blocks vs the float model over {total} positions: top-1 agreement "
          f"{agreement:.3f}, mean |delta logprob| {mean_diff:.3f}")
    assert total >= 100
    assert agreement >= MIN_TOP1_AGREEMENT and mean_diff <= MAX_MEAN_LOGPROB_DIFF


def test_what_shares_the_step_moves_a_prompts_logits_only_by_rounding(smollm2_dir: str) -> None:
    """Activations are rounded per row, so other rows in the step change a prompt's logits only
    through the order of the block GEMM's float sums (~4e-7 relative per GEMM, which the 8-bit
    rounding of the next layer's input can turn into a step): the greedy choice stays, the logits
    stay close. A scale shared across rows would move them by whole logits."""
    model = from_blocks(smollm2_dir)
    prompt = chat_ids(smollm2_dir)[0]
    loud = [int(t) for t in torch.randint(1000, 20000, (23,), generator=torch.Generator().manual_seed(1))]
    alone = run_rows(model, [prompt])
    shared = run_rows(model, [prompt, loud])[:len(prompt)]
    assert torch.equal(alone.argmax(-1), shared.argmax(-1))
    assert float((alone - shared).abs().mean()) < 0.01 and float((alone - shared).abs().max()) < 1.0


def test_auto_keeps_a_gguf_quantized_on_cpu_only(smollm2_dir: str, tiny_llama) -> None:
    assert build_parser().parse_args(["serve", smollm2_dir]).quantization == "auto"
    assert resolve_quantization("auto", smollm2_dir, "cpu") == "gguf"
    assert resolve_quantization("auto", smollm2_dir, "cuda") == "none"
    assert resolve_quantization("auto", smollm2_dir, "cpu", tp_size=2) == "none"
    assert resolve_quantization("auto", str(tiny_llama[0]), "cpu") == "none"
    assert engine_args(build_parser().parse_args(["serve", smollm2_dir]), smollm2_dir).quantization == "gguf"
    path = str(tiny_llama[0])
    with pytest.raises(SystemExit, match=r"--quantization gguf serves a \.gguf model's own blocks"):
        engine_args(build_parser().parse_args(["serve", path, "--quantization", "gguf"]), path)


def all_float_table(model_dir: str) -> tuple[chooser.KernelTable, list[tuple[int, int, int]], tuple[int, int, int]]:
    """(a table where every bucket of every fp32 part measured fastest from a float copy, the
    parts, the head): blocks 2 µs, dequant 3, float 1."""
    return gguf_table(model_dir, lambda bucket: {"blocks": 2.0, "dequant": 3.0, "float": 1.0})


def gguf_table(model_dir: str, us_at: Callable[[int], dict[str, float]]
               ) -> tuple[chooser.KernelTable, list[tuple[int, int, int]], tuple[int, int, int]]:
    """(a table where every fp32 part and the head measured `us_at(bucket)` µs per route, each
    bucket choosing the fastest; the parts, one per layer; the head)."""
    from rill.kernels import gguf_linear
    from rill.services.worker.gguf_weights import GGUFSource

    parts, head = GGUFSource.of(Path(model_dir), ModelConfig.from_dir(model_dir)).part_shapes(tied=True)
    assert head is not None
    table = chooser.KernelTable()
    for shape, logits in [*((p, False) for p in parts), (head, True)]:
        for bucket in chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS:
            key = chooser.KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(*shape, torch.float32, logits), bucket)
            us = us_at(bucket)
            table.entries[key] = {"choice": min(us, key=us.__getitem__), "us": us, "dropped": []}
    return table, parts, head


def load_under(table: chooser.KernelTable, model_dir: str, quantization: str = "gguf") -> LlamaModel:
    """The fp32 model built with `table` installed (the one installed before is restored)."""
    saved = chooser.installed()
    chooser.install(table)
    try:
        return LlamaModel.load(model_dir, torch.float32, quantization=quantization)
    finally:
        chooser.install(saved)


def test_layers_measured_faster_as_floats_are_the_float_models(smollm2_dir: str) -> None:
    """Where this machine's table says a float copy wins at every batch size, the layer is the
    float model's own (one fused GEMM, no blocks held) and the logits equal the float model's."""
    table, _, _ = all_float_table(smollm2_dir)
    model, ref = load_under(table, smollm2_dir), load_under(table, smollm2_dir, "none")
    assert not any(isinstance(lin, QuantLinear) for lin in model.linears())
    assert model.embed.numel() == ref.embed.numel(), "a tied float head keeps the float table"
    prompt = chat_ids(smollm2_dir)[1]
    assert torch.equal(run_rows(model, [prompt]), run_rows(ref, [prompt]))


@pytest.mark.skipif(not gguf_native.format_supported(gguf_blocks.Q4_1), reason="no native GGUF GEMM in this build")
def test_batch_invariant_serves_the_blocks_and_rows_alone(smollm2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RILL_BATCH_INVARIANT=1: however the table measured the routes (here: float copies at every
    size), every layer multiplies on its blocks, and a prompt's logits are the same bits whatever
    shares its step (what makes a seeded or greedy request's text independent of the batch)."""
    table, _, _ = all_float_table(smollm2_dir)
    monkeypatch.setenv("RILL_BATCH_INVARIANT", "1")
    model = load_under(table, smollm2_dir)
    assert all(isinstance(lin, QuantLinear) and lin.float_copy_bytes == 0 for lin in model.linears())
    prompt = chat_ids(smollm2_dir)[0]
    loud = [int(t) for t in torch.randint(1000, 20000, (300,), generator=torch.Generator().manual_seed(2))]
    alone = run_rows(model, [prompt])
    assert torch.equal(alone, run_rows(model, [prompt, loud])[:len(prompt)])
    assert torch.equal(alone, run_rows(model, [loud, prompt])[-len(prompt):])
    # A prompt short enough for the few-rows driver alone, and a prompt whose last token runs alone
    # (a prefix-cache hit, or a chunk of one): each row's bits still do not depend on the step.
    short = prompt[:12]
    assert torch.equal(run_rows(model, [short]), run_rows(model, [short, loud])[:12])
    assert torch.equal(last_row_in_chunks(model, loud, [len(loud)]), last_row_in_chunks(model, loud, [len(loud) - 1, 1]))
    assert torch.equal(last_row_in_chunks(model, loud, [len(loud)]), last_row_in_chunks(model, loud, [200, 90, 10]))


def last_row_in_chunks(model: LlamaModel, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """fp32 logits of the prompt's last row, its prompt run in steps of `chunks` tokens."""
    return chunk_logits(model, prompt, chunks, last_only=True)[-1:]


def chunk_logits(model: LlamaModel, prompt: list[int], chunks: list[int], last_only: bool = False) -> torch.Tensor:
    """fp32 logits of the prompt run in steps of `chunks` tokens: of every row, or of each step's last."""
    from rill.kernels.ops import make_attention_metadata

    blocks = list(range(-(-len(prompt) // 16)))
    kv = model.allocate_kv_cache(len(blocks), 16)
    done, rows = 0, []
    for n in chunks:
        positions, meta = make_attention_metadata([blocks], [done], [n], 16)
        with torch.inference_mode():
            rows.append(model.forward(torch.tensor(prompt[done:done + n]), positions, meta, kv,
                                      torch.tensor([n - 1]) if last_only else torch.arange(n)))
        done += n
    return torch.cat(rows)


@pytest.mark.skipif(not gguf_native.format_supported(gguf_blocks.Q4_1), reason="no native GGUF GEMM in this build")
@pytest.mark.parametrize("blocks_us", [1.05, 2.0])
def test_verify_rows_are_decode_rows_where_the_blocks_are_pinned(smollm2_dir: str, blocks_us: float,
                                                                   native_silu: None) -> None:
    """A table where the float copies win at one row: by 5% (cpu_tuning.settle_decode_rows pins the
    blocks up to DECODE_ROWS rows), the 9 rows of a verify step have the bits of 9 one-row decode
    steps, so drafts accept what decoding gives; by 2x (left to speed), they do not."""
    from rill.kernels import cpu_tuning
    from rill.services.worker.invariance import decode_rows_agree

    table, parts, head = gguf_table(smollm2_dir, lambda bucket: {"blocks": blocks_us, "dequant": 3.0, "float": 1.0}
                                    if bucket == 1 else {"blocks": 1.0, "dequant": 3.0, "float": 2.0})
    settled = cpu_tuning.settle_decode_rows(table, parts, head, torch.float32)
    assert settled is not None and settled[0] == (chooser.DECODE_ROWS if blocks_us < 2 else 0)
    model = load_under(table, smollm2_dir)  # then native_silu's table again: SiLU's route is read at each step
    prompt = [int(t) for t in torch.randint(1000, 20000, (100,), generator=torch.Generator().manual_seed(3))]
    verified = chunk_logits(model, prompt, [91, 9])[91:]
    decoded = chunk_logits(model, prompt, [91] + [1] * 9)[91:]
    assert torch.equal(verified, decoded) == (blocks_us < 2)
    rows, gaps = decode_rows_agree(model, "cpu")  # what the worker says at start
    assert (rows, gaps) == (chooser.DECODE_ROWS, []) if blocks_us < 2 else rows == 0 and "linear layers" in gaps[0]
    # torch's SiLU measured faster at every size: the driver serves no step, so no size agrees.
    chooser.install(chooser.KernelTable({k: {**e, "choice": "torch"} for k, e in chooser.installed().entries.items()}))
    assert decode_rows_agree(model, "cpu")[0] == 0


def test_float_copies_cut_to_the_budget_serve_from_the_blocks(smollm2_dir: str) -> None:
    """A table where every bucket of every layer measured fastest from a float copy, cut to a
    budget of 0 bytes: every layer keeps its blocks and no copy, and still agrees with the float model."""
    from transformers import AutoTokenizer

    from rill.kernels import float_copies

    table, parts, head = all_float_table(smollm2_dir)
    fit = float_copies.fit(table, parts, head, torch.float32, 0)
    assert fit.kept == 0 and fit.dropped == len(set(parts)) + 1
    assert fit.wanted == 4 * sum(n * k for n, k, _ in [*parts, head])
    model = load_under(fit.table, smollm2_dir)
    assert all(isinstance(lin, QuantLinear) and lin.float_copy_bytes == 0 for lin in model.linears())
    # Each bucket went to the next-fastest route measured (blocks 2 us, dequant 3).
    assert all(r is not None and set(r.choices) == {"blocks"} for lin in model.linears() for r in lin.routes)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    seqs = [tok(" ".join(text for _, text in chat))["input_ids"] for chat in CHATS]
    agreement, mean_diff, _ = quality(LlamaModel.load(smollm2_dir, torch.float32), model, seqs)
    assert agreement >= MIN_TOP1_AGREEMENT and mean_diff <= MAX_MEAN_LOGPROB_DIFF


def test_batch_invariance_names_what_it_cannot_pin(smollm2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RILL_BATCH_INVARIANT=1 pins GGUF layers on their blocks and the attention rows; the worker
    names whatever else keeps a kernel chosen by the step's shape, rather than promise in silence."""
    from rill.services.worker.invariance import invariance_gaps

    monkeypatch.setenv("RILL_BATCH_INVARIANT", "1")
    gguf = LlamaModel.load(smollm2_dir, torch.float32, quantization="gguf")
    gaps = invariance_gaps(gguf, "cpu")
    if gguf_native.format_supported(gguf_blocks.Q4_1) and gguf_native.format_supported(gguf_blocks.Q8_0):
        assert gaps == []
    else:
        assert any("no native GEMM" in gap for gap in gaps), gaps
    assert invariance_gaps(gguf, "cuda") == ["the cuda kernels (the mode pins CPU kernels only)"]
    plain = LlamaModel.load(smollm2_dir, torch.float32)
    layers = [lin for lin in plain.linears() if lin is not None]
    assert invariance_gaps(plain, "cpu")[0] == f"{len(layers)} float linear layers (GEMM kernel chosen per batch size)"
