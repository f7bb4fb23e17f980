"""Our Llama forward over the paged KV cache against transformers' LlamaForCausalLM (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from family_cases import BASE
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rill.kernels import ops
from rill.services.worker.llama import LlamaModel
from rill.services.worker.rope import cos_sin_cache
from rill.shared.config import ModelConfig

TOL = 1e-3

TINY_VARIANTS = {
    "gqa-tied": dict(tie_word_embeddings=True),
    "llama3-rope-untied": dict(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
    "bias": dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, num_hidden_layers=2),
}


def tiny_llama(tmp: Path, seed: int = 0, **overrides) -> tuple[Path, LlamaForCausalLM]:
    """A random GQA Llama saved as a checkpoint folder, with weights large enough that logits
    differ by whole units (so a 1e-3 tolerance means something)."""
    torch.manual_seed(seed)
    kw: dict = dict(vocab_size=300, **BASE, initializer_range=0.1)  # the families' tiny shape
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    model.save_pretrained(tmp)
    return tmp, model


class PagedSequence:
    """One sequence run through our model with a shuffled, non-contiguous block table."""

    def __init__(self, model: LlamaModel, kv, block_ids: list[int], block_size: int) -> None:
        self.model, self.kv, self.blocks, self.bs = model, kv, block_ids, block_size
        self.num_computed = 0

    def run(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every row of `tokens`, which continue the sequence."""
        positions, meta = ops.make_attention_metadata([self.blocks], [self.num_computed], [len(tokens)], self.bs)
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(tokens), positions, meta, self.kv,
                                        torch.arange(len(tokens)))
        self.num_computed += len(tokens)
        return logits


def shuffled_blocks(num_blocks: int, n: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(num_blocks), n)


def check_prefill_then_decode(model: LlamaModel, ref: LlamaForCausalLM, prompt: list[int], block_size: int,
                              steps: int, seed: int = 0) -> float:
    """Prefill then greedy decode, feeding transformers' own token each step; return the worst diff.

    The reference recomputes the whole sequence each step instead of decoding from its own cache:
    transformers 5.17's DynamicCache decodes past a sliding window wrongly (3.9 off its uncached
    logits on test_sliding_window's Mistral), and the uncached forward is the definition anyway."""
    num_blocks = 64
    kv = model.allocate_kv_cache(num_blocks, block_size)
    need = -(-(len(prompt) + steps) // block_size)
    seq = PagedSequence(model, kv, shuffled_blocks(num_blocks, need, seed), block_size)
    assert sorted(seq.blocks) != seq.blocks  # really out of order
    tokens = list(prompt)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]
        ours = seq.run(prompt)
        assert ours.shape == (len(prompt), ref.config.vocab_size)
        worst = (ours - want).abs().max().item()
        for _ in range(steps):
            tokens.append(int(want[-1].argmax()))
            want = ref(torch.tensor([tokens])).logits[0]
            ours = seq.run(tokens[-1:])
            worst = max(worst, (ours[0] - want[-1]).abs().max().item())
    return worst


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_llama_matches_transformers(tmp_path: Path, variant: str) -> None:
    path, ref = tiny_llama(tmp_path, **TINY_VARIANTS[variant])
    model = LlamaModel.load(path, torch.float32, "cpu")
    if variant.startswith("llama3"):
        assert model.cfg.rope_scaling and model.cfg.rope_scaling["rope_type"] == "llama3"
        assert not model.tied
    if variant == "gqa-tied":
        assert model.tied
    prompt = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        spread = ref(torch.tensor([prompt])).logits.std().item()
    assert spread > 0.3, "logits too flat for the tolerance to mean anything"
    worst = check_prefill_then_decode(model, ref, prompt, block_size=4, steps=20)
    assert worst <= TOL, f"{variant}: max abs logit diff {worst}"


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, LlamaForCausalLM]:
    from rill.shared.model_files import resolve_model

    path = resolve_model()
    return path, LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def smollm2_prompt(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (41,), generator=torch.Generator().manual_seed(2)).tolist()


def test_smollm2_matches_transformers(smollm2) -> None:
    path, ref = smollm2
    model = LlamaModel.load(path, torch.float32, "cpu", max_positions=512)
    worst = check_prefill_then_decode(model, ref, smollm2_prompt(ref.config.vocab_size), block_size=16,
                                      steps=20, seed=3)
    assert worst <= TOL, f"SmolLM2: max abs logit diff {worst}"


def test_smollm2_bf16_error_no_worse_than_transformers_bf16(smollm2) -> None:
    """The serving dtype: our bf16 logits stray from the fp32 reference no more than
    transformers' own bf16 model does (prefill + decode through the paged cache)."""
    path, ref = smollm2
    prompt = smollm2_prompt(ref.config.vocab_size)
    ours = check_prefill_then_decode(LlamaModel.load(path, torch.bfloat16, "cpu", max_positions=512), ref,
                                     prompt, block_size=16, steps=6, seed=3)
    ref_bf16 = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32_cache, bf16_cache = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
    theirs = 0.0
    with torch.no_grad():
        tokens = [prompt]
        for _ in range(7):
            want = ref(torch.tensor(tokens), cache=fp32_cache, use_cache=True).logits[0]
            got = ref_bf16(torch.tensor(tokens), cache=bf16_cache, use_cache=True).logits[0].float()
            theirs = max(theirs, (got - want).abs().max().item())
            tokens = [[int(want[-1].argmax())]]
    assert ours <= 1.25 * theirs + 0.05, f"bf16 max abs diff: ours {ours}, transformers bf16 {theirs}"


def test_mixed_batch_matches_each_alone(tmp_path: Path) -> None:
    """A chunked prefill (2 chunks) sharing steps with a decoding sequence gives the same logits
    as each sequence run alone."""
    path, _ = tiny_llama(tmp_path)
    model = LlamaModel.load(path, torch.float32, "cpu")
    bs = 4
    gen = torch.Generator().manual_seed(5)
    prompt_a = torch.randint(0, 300, (11,), generator=gen).tolist()  # prefilled in chunks of 6 + 5
    prompt_b = torch.randint(0, 300, (7,), generator=gen).tolist()  # decodes while A prefills
    decode_b = torch.randint(0, 300, (3,), generator=gen).tolist()
    tail_a = torch.randint(0, 300, (2,), generator=gen).tolist()

    # Alone: each sequence in its own cache.
    alone_a = PagedSequence(model, model.allocate_kv_cache(32, bs), shuffled_blocks(32, 5, 1), bs)
    ref_a = [alone_a.run(prompt_a)] + [alone_a.run([t]) for t in tail_a]
    alone_b = PagedSequence(model, model.allocate_kv_cache(32, bs), shuffled_blocks(32, 4, 2), bs)
    ref_b = [alone_b.run(prompt_b)] + [alone_b.run([t]) for t in decode_b]

    # Together: one shared cache, disjoint shuffled blocks.
    kv = model.allocate_kv_cache(32, bs)
    blocks = shuffled_blocks(32, 9, 3)
    blocks_a, blocks_b = blocks[:5], blocks[5:]

    def step(items: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """items: (block ids, num computed, tokens) per sequence -> logits of every row, per sequence."""
        positions, meta = ops.make_attention_metadata([b for b, _, _ in items], [c for _, c, _ in items],
                                                      [len(t) for _, _, t in items], bs)
        ids = torch.tensor([tok for _, _, t in items for tok in t])
        with torch.inference_mode():
            logits = model.forward(ids, positions, meta, kv, torch.arange(len(ids)))
        return list(logits.split([len(t) for _, _, t in items]))

    (b_prefill,) = step([(blocks_b, 0, prompt_b)])
    a1, b1 = step([(blocks_a, 0, prompt_a[:6]), (blocks_b, 7, decode_b[:1])])
    b2, a2 = step([(blocks_b, 8, decode_b[1:2]), (blocks_a, 6, prompt_a[6:])])  # order within a step is free
    a3, b3 = step([(blocks_a, 11, tail_a[:1]), (blocks_b, 9, decode_b[2:])])
    a4, = step([(blocks_a, 12, tail_a[1:])])

    def close(x: torch.Tensor, y: torch.Tensor) -> None:
        assert x.shape == y.shape
        assert (x - y).abs().max().item() <= 1e-4

    close(b_prefill, ref_b[0])
    close(torch.cat([a1, a2]), ref_a[0])
    close(a3, ref_a[1])
    close(a4, ref_a[2])
    for ours, alone in zip((b1, b2, b3), ref_b[1:], strict=True):
        close(ours, alone)


# ------------------------------------------------------------------------- the attention op itself


def dense_reference(q: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor, ctx_len: int,
                    scale: float) -> torch.Tensor:
    """fp32 causal attention of q [n, H, D] at positions ctx_len.. over k, v [ctx_len + n, Hkv, D]."""
    n, heads, _ = q.shape
    group = heads // k_seq.shape[1]
    k = k_seq.float().repeat_interleave(group, dim=1)
    v = v_seq.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= (ctx_len + torch.arange(n))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_paged_attention_mixed_batch_against_dense(dtype: torch.dtype, tol: float) -> None:
    """Decodes of ragged lengths (1, block-1, block, block+1, long) and prefill chunks with and
    without cached context, in one step, against a dense per-sequence reference."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, bs, num_blocks = 6, 2, 32, 8, 128
    # (context already cached, query tokens this step)
    shapes = [(0, 1), (6, 1), (7, 1), (8, 1), (40, 13), (0, 17), (70, 1), (9, 2)]
    k_cache = torch.zeros(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    for ctx, n in shapes:
        nblk = -(-(ctx + n) // bs)
        tables.append([perm.pop() for _ in range(nblk)])
        full_k.append(torch.randn(ctx + n, kv_heads, head_dim, generator=gen).to(dtype))
        full_v.append(torch.randn(ctx + n, kv_heads, head_dim, generator=gen).to(dtype))
    # The cached context goes in first, as earlier steps would have written it.
    for (ctx, _), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        if ctx:
            _, m = ops.make_attention_metadata([table], [0], [ctx], bs)
            ops.write_kv(k[:ctx], v[:ctx], k_cache, v_cache, m.slot_mapping)
    _, meta = ops.make_attention_metadata(tables, [c for c, _ in shapes], [n for _, n in shapes], bs)
    k_new = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v, strict=True)])
    q = torch.randn(k_new.shape[0], heads, head_dim, generator=gen).to(dtype)
    ops.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim ** -0.5
    for hint in (False, True):  # with and without this step's K/V passed alongside
        out = ops.paged_attention(q, k_cache, v_cache, meta, scale,
                                  k_new if hint else None, v_new if hint else None)
        qsl = meta.query_start_loc_host
        for i, (ctx, _) in enumerate(shapes):
            want = dense_reference(q[qsl[i]:qsl[i + 1]], full_k[i], full_v[i], ctx, scale)
            got = out[qsl[i]:qsl[i + 1]].float()
            assert (got - want).abs().max().item() <= tol, f"sequence {i} {shapes[i]} (hint={hint})"


def test_write_kv_places_tokens_at_block_table_slots() -> None:
    bs, kv_heads, head_dim = 4, 2, 8
    k_cache = torch.zeros(16, bs, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = [9, 2, 14]
    positions, meta = ops.make_attention_metadata([table], [3], [6], bs)  # positions 3..8
    assert positions.tolist() == list(range(3, 9))
    k = torch.randn(6, kv_heads, head_dim)
    v = torch.randn(6, kv_heads, head_dim)
    ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    for i, p in enumerate(range(3, 9)):
        assert torch.equal(k_cache[table[p // bs], p % bs], k[i])
        assert torch.equal(v_cache[table[p // bs], p % bs], v[i])


def test_rms_norm_fused_residual() -> None:
    x, res, w = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    normed, new_res = ops.rms_norm(x, w, 1e-6, residual=res)
    assert torch.allclose(new_res, x + res)
    s = x + res
    assert torch.allclose(normed, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)


def test_rope_scaling_read_from_transformers5_config(tmp_path: Path) -> None:
    path, _ = tiny_llama(tmp_path, **TINY_VARIANTS["llama3-rope-untied"])
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("fused", [True, False])
def test_apply_rotary_matches_rotate_half_formula(fused: bool) -> None:
    """NeoX RoPE on q/k given as neighbouring slices of one qkv buffer (the model's case) or as
    separate tensors; consecutive calls with new positions must not reuse stale tables."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 4, 2, 16
    cfg = ModelConfig.from_dict(dict(vocab_size=8, hidden_size=heads * d, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=heads,
                                     num_key_value_heads=kv_heads, max_position_embeddings=64))
    cache = cos_sin_cache(cfg, 64, "cpu")
    for positions in (torch.tensor([0, 5, 63, 7]), torch.tensor([1, 2, 3, 4])):
        qkv = torch.randn(4, (heads + 2 * kv_heads) * d, generator=gen)
        q = qkv[:, :heads * d].view(4, heads, d)
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(4, kv_heads, d)
        if not fused:
            q, k = q.clone(), k.clone()
        rq, rk = ops.apply_rotary(q, k, positions, cache)
        angles = positions[:, None].float() * (1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]

        def rotate_half(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)

        assert torch.allclose(rq, q * cos + rotate_half(q) * sin, atol=1e-5)
        assert torch.allclose(rk, k * cos + rotate_half(k) * sin, atol=1e-5)
