"""Sliding-window models: Mistral and Gemma 3 with windows shorter than the prompt match
transformers (logits, greedy tokens through the scheduler and model runner, the Triton path
under the interpreter), and a model whose every layer slides gives the blocks behind its window
back to the pool as it generates. Kernel-level cases: tests/test_window_kernels.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from family_cases import build  # noqa: E402
from test_model_parity import TOL, check_prefill_then_decode  # noqa: E402
from test_scheduler_engine import drive, greedy  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM  # noqa: E402

from rill.kernels import ops  # noqa: E402
from rill.services.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from rill.services.worker import families  # noqa: E402
from rill.services.worker.llama import LlamaModel  # noqa: E402
from rill.services.worker.model_runner import ModelRunner  # noqa: E402

BS = 4

# ------------------------------------------------------------------------------------- models

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)
MODELS = {
    # Every layer slides: its KV behind the window is released.
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=8)),
    # Sliding layers around a global one, each kind on its own RoPE base.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    cls, cfg_cls, extra = MODELS[request.param]
    torch.manual_seed(0)
    ref = cls(cfg_cls(**{**TINY, **extra})).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, path, ref


def test_layer_windows_follow_transformers() -> None:
    cfg = dict(num_hidden_layers=4, sliding_window=8)
    assert families.layer_windows({**cfg, "architectures": ["MistralForCausalLM"]},
                                  families.family_of({"architectures": ["MistralForCausalLM"]})) == [8] * 4
    gemma = families.family_of({"architectures": ["Gemma3ForCausalLM"]})
    assert families.layer_windows({**cfg, "sliding_window_pattern": 2}, gemma) == [8, None, 8, None]
    assert families.layer_windows(cfg, gemma) == [8, 8, 8, 8]  # every 6th is global
    gemma2 = families.family_of({"architectures": ["Gemma2ForCausalLM"]})
    assert families.layer_windows(cfg, gemma2) == [8, None, 8, None]
    qwen2 = families.family_of({"architectures": ["Qwen2ForCausalLM"]})
    assert families.layer_windows({**cfg, "use_sliding_window": False}, qwen2) == [None] * 4
    assert families.layer_windows({**cfg, "use_sliding_window": True, "max_window_layers": 3}, qwen2) \
        == [None, None, None, 8]


def test_short_window_served_at_full_context_and_matches_transformers(tiny) -> None:
    """Logits of a 37-token prompt (4+ windows) and 12 decode steps, block size 4."""
    name, path, ref = tiny
    assert families.check_checkpoint(path).name == name  # no --max-model-len needed any more
    model = LlamaModel.load(path, torch.float32, "cpu")
    assert [layer.window for layer in model.layers] == families.layer_windows(ref.config.to_dict(),
                                                                              families.family_of({"model_type": ref.config.model_type}))
    assert model.sliding_window == (8 if name == "mistral" else None)
    prompt = [int(t) for t in torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(1))]
    worst = check_prefill_then_decode(model, ref, prompt, block_size=BS, steps=12)
    assert worst < TOL, f"{name}: max |logit diff| {worst}"


def test_greedy_engine_matches_generate_and_releases_blocks(tiny) -> None:
    """Scheduler + model runner in-process, a small chunk budget (prompts split across steps,
    with plans one step ahead as the service runs them): greedy tokens equal transformers'
    generate; with every layer sliding, the blocks behind the window go back to the pool as the
    generation runs, and a second pass over the same prompts (prefix-cache hits on blocks that
    were released but not yet handed out) changes nothing."""
    name, path, ref = tiny
    runner = ModelRunner(str(path), dtype="float32", device="cpu", num_blocks=96, block_size=BS)
    window = runner.model.sliding_window
    assert window == (8 if name == "mistral" else None)
    kv = KVCacheManager(96, BS, enable_prefix_caching=True, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12, max_model_len=256), kv)
    gen = torch.Generator().manual_seed(2)
    prompts = [[int(t) for t in torch.randint(3, 300, (n,), generator=gen)] for n in (29, 17, 40)]
    want = {}
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            out = ref.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
            want[f"r{i}"] = out[0, len(p):].tolist()
    held: list[int] = []
    original_update = sched.update

    def update(result):  # the blocks requests hold after each step
        outcome = original_update(result)
        held.append(max((len(kv.tables[r]) - kv.num_released.get(r, 0) for r in kv.tables), default=0))
        return outcome

    sched.update = update  # type: ignore[method-assign]
    for attempt in range(2):
        msgs = [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts)]
        for m in msgs:
            m.eos_token_ids = []  # generate ran past any EOS too
        run = drive(runner, sched, msgs, depth=2)
        for rid, tokens in want.items():
            assert run.outputs[rid] == tokens, f"{name} pass {attempt}: {rid}"
        assert kv.num_free_blocks == kv.num_blocks
        kv.check_invariants()
    if window is None:  # a global layer reads the whole context: nothing is released
        assert kv.released_total == 0
    else:
        assert kv.released_total > 0
        # The longest sequence is 64 tokens = 16 blocks; a request never held more than its
        # window, a step in flight and the next one (a budget of 12 each) and partial blocks.
        assert max(held) <= -(-(window + 2 * 12) // BS) + 2 < 16
        assert kv.hits > 0


def _steps(model: LlamaModel, backend: str) -> list[torch.Tensor]:
    """Two prompts (one past a 4-token window), then a mixed step (a decode, a prompt's last
    chunk, a new prompt), then a decode step: each step's last-row logits. Block size 4."""
    ops.set_backend(backend)
    try:
        kv = model.allocate_kv_cache(16, 4)
        blocks = [[9, 2, 14, 5], [0, 11, 7, 3], [12, 6, 1, 15]]
        steps = [([0, 1], [0, 0], [9, 1]), ([0, 1, 2], [9, 1, 0], [1, 2, 3]), ([0, 1, 2], [10, 3, 3], [1, 1, 1])]
        logits = []
        for seqs, computed, qlens in steps:
            positions, meta = ops.make_attention_metadata([blocks[s] for s in seqs], computed, qlens, 4)
            ids = torch.tensor([(7 * p + 3 * s) % 300 for s, c, n in zip(seqs, computed, qlens, strict=True)
                                for p in range(c, c + n)])
            last = torch.tensor(meta.query_start_loc_host[1:]) - 1
            with torch.inference_mode():
                logits.append(model.forward(ids, positions, meta, kv, last))
        return logits
    finally:
        ops.set_backend(None)


@pytest.mark.parametrize("name", [f.name for f in families.FAMILIES])
def test_model_steps_triton_equal_torch_per_family(tmp_path: Path, name: str) -> None:
    """Whole model steps of every family through the Triton kernels under the interpreter equal
    the torch path's, windowed layers included (tiny: two layers, a 4-token window)."""
    build(name, tmp_path, vocab_size=300, initializer_range=0.1, num_hidden_layers=2, sliding_window=4)
    model = LlamaModel.load(tmp_path, torch.float32, "cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    if any(families.layer_windows(cfg, families.check_checkpoint(tmp_path))):  # the config slides a layer
        assert 4 in [layer.window for layer in model.layers], name
    want = _steps(model, "torch")
    got = _steps(model, "triton")
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        assert scale > 1.0  # logits that differ by whole units, so the tolerance means something
        assert (a - b).abs().max().item() <= 1e-4 * scale, name
