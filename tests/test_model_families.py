"""Model families: each served family matches transformers' own model class on a tiny random
config; every checkpoint Rill would serve wrongly is refused at load with one line naming why,
and `rill serve` exits non-zero on it before starting anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_parity import TOL, check_prefill_then_decode
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rill.services.worker import families
from rill.services.worker.llama import LlamaModel
from rill.shared.broker import free_port

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)

# head_dim 16: 8 factors each, distinct so that short and long differ everywhere.
LONGROPE = dict(sliding_window=None, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.05 * i for i in range(8)],
    long_factor=[1.5 + 0.6 * i for i in range(8)]))

CASES = {
    # Qwen2: q/k/v biases (and no o bias), its RoPE base.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(rope_theta=1e6)),
    # Qwen2.5 long-context configs: YaRN (interpolated low frequencies, attention temperature).
    "qwen2-yarn": (Qwen2ForCausalLM, Qwen2Config, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64))),
    # Qwen3: per-head q/k RMSNorm, a head_dim that is not hidden / heads.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32, attention_bias=False)),
    # Mistral without a window (v0.2 onwards); a window as long as the context changes nothing.
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
    "mistral-long-window": (MistralForCausalLM, MistralConfig, dict(sliding_window=256)),
    # Gemma 3: (1 + w) norms around attention and MLP, GeGLU, scaled embedding, q/k norms, a
    # query_pre_attn_scalar that is not head_dim, sliding layers on their own RoPE base (a window
    # as long as the context), final logit soft-capping, tied head.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=256, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True)),
    # Gemma 2: as Gemma 3 without q/k norms or a local RoPE base, plus attention logit
    # soft-capping (a cap low enough to bite at this scale); layers 0 and 2 slide, over a window
    # shorter than the prompt.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=1.5,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, a window over every layer.
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(sliding_window=16, pad_token_id=0)),
    # Phi-3 128k-style LongRoPE: the prompt starts past original_max_position_embeddings, so
    # transformers takes the long factors throughout, as Rill does serving more than it.
    "phi3-longrope": (Phi3ForCausalLM, Phi3Config, dict(pad_token_id=0, **LONGROPE, original_max_position_embeddings=16)),
    # Dynamic NTK within the original context: the plain base, as transformers computes it there.
    "llama-dynamic": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=4.0))),
}


def build(tmp: Path, name: str, seed: int = 0, **overrides):
    cls, cfg_cls, extra = CASES[name]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**TINY, **extra, **overrides})).eval()
    model.save_pretrained(tmp)
    return tmp, model


@pytest.mark.parametrize("name", list(CASES))
def test_family_matches_transformers(tmp_path: Path, name: str) -> None:
    path, ref = build(tmp_path, name)
    model = LlamaModel.load(path, torch.float32, "cpu")
    prompt = [int(t) for t in torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(1))]
    worst = check_prefill_then_decode(model, ref, prompt, block_size=8, steps=12)
    assert worst < TOL, f"{name}: max |logit diff| {worst}"
    if name == "qwen2":  # the biases are really there and used
        assert model.layers[0].qkv.bias is not None or getattr(model.layers[0].qkv, "f32_bias", None) is not None


def test_longrope_short_factors_within_the_original_context(tmp_path: Path) -> None:
    """Served no longer than original_max_position_embeddings, LongRoPE takes the short factors,
    as transformers does for every sequence within it (test_scaled_rope_tables for the rule)."""
    path, ref = build(tmp_path, "phi3-longrope", original_max_position_embeddings=64)
    model = LlamaModel.load(path, torch.float32, "cpu", max_positions=64)
    prompt = [int(t) for t in torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2))]
    assert check_prefill_then_decode(model, ref, prompt, block_size=8, steps=8) < TOL


@pytest.mark.parametrize("kind,served", [("dynamic", 256), ("dynamic", 1000), ("longrope", 16), ("longrope", 256)])
def test_scaled_rope_tables(kind: str, served: int) -> None:
    """A table served for `served` positions holds transformers' frequencies and attention factor
    for a sequence of that length: dynamic NTK's base grows past max_position_embeddings (256),
    LongRoPE switches to its long factors past original_max_position_embeddings (16)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rill.services.worker.llama import inv_frequencies, rope_attention_factor
    from rill.shared.config import ModelConfig

    _, cfg_cls, extra = CASES["llama-dynamic" if kind == "dynamic" else "phi3-longrope"]
    hf = cfg_cls(**{**TINY, **extra})
    want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=served)
    cfg = ModelConfig.from_dict(hf.to_dict())
    torch.testing.assert_close(inv_frequencies(cfg, served), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-9)
    if served > 256 or (kind == "longrope" and served > 16):  # the scaled regime really differs
        assert not torch.allclose(inv_frequencies(cfg, 16), want)


def test_phi3_longrope_under_an_old_name_is_refused() -> None:
    """transformers reads a Phi-3 config's "su" or "yarn" as LongRoPE; served as YaRN it would be wrong."""
    _, cfg_cls, extra = CASES["phi3-longrope"]
    cfg = cfg_cls(**{**TINY, **extra}).to_dict()
    cfg["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(families.UnsupportedModel, match="'yarn' \\(longrope under an old name\\)"):
        families.check_config(cfg)


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, add: dict[str, torch.Tensor] | None = None, drop: str | None = None) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update(add or {})
    if drop:
        del tensors[drop]
    save_file(tensors, str(file), metadata={"format": "pt"})


REFUSALS = [
    ("unknown architecture", lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]),
     "architecture GPT2LMHeadModel is not supported"),
    ("extra tensor", lambda p: _edit_tensors(p, add={"model.layers.0.mlp.gate.weight": torch.zeros(4, 64)}),
     "tensor model.layers.0.mlp.gate.weight would be left unused"),
    ("missing tensor", lambda p: _edit_tensors(p, drop="model.layers.1.self_attn.k_proj.weight"),
     "lacks model.layers.1.self_attn.k_proj.weight"),
    ("rope type", lambda p: _edit_config(p, rope_scaling={"rope_type": "proportional", "factor": 2.0}),
     "RoPE scaling type 'proportional' is not supported"),
    ("activation", lambda p: _edit_config(p, hidden_act="gelu"), "activation 'gelu' is not supported"),
    ("bidirectional", lambda p: _edit_config(p, use_bidirectional_attention=True),
     "bidirectional attention (an embedding model) is not supported"),
]


@pytest.mark.parametrize("what,edit,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_at_load_with_one_line(tmp_path: Path, what: str, edit, message: str) -> None:
    path, _ = build(tmp_path, "qwen2")
    _edit_config(path, architectures=["LlamaForCausalLM"])  # a plain Llama checkpoint (Qwen2's tensors fit)
    edit(path)
    for check in (lambda: families.check_checkpoint(path), lambda: LlamaModel.load(path, torch.float32, "cpu")):
        with pytest.raises(families.UnsupportedModel) as err:
            check()
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_short_window_is_served_at_full_context(tmp_path: Path) -> None:
    """A window shorter than the model's context needs no --max-model-len (the kernels mask it;
    tests/test_sliding_window.py checks the outputs)."""
    path, _ = build(tmp_path, "mistral")
    _edit_config(path, sliding_window=64)
    assert families.check_checkpoint(path).name == "mistral"
    assert [layer.window for layer in LlamaModel.load(path, torch.float32, "cpu").layers] == [64] * 3


def test_qwen3_without_its_norms_is_not_served_as_llama(tmp_path: Path) -> None:
    """Loaded as Llama, a Qwen3 checkpoint's q/k norms would be skipped: refused, not garbage."""
    path, _ = build(tmp_path, "qwen3")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(families.UnsupportedModel, match=r"self_attn\.k_norm\.weight would be left unused"):
        families.check_checkpoint(path)


def test_rill_serve_exits_non_zero_before_starting(tmp_path: Path) -> None:
    path, _ = build(tmp_path, "qwen2")
    _edit_config(path, architectures=["FancyNewForCausalLM"])
    proc = subprocess.run([sys.executable, "-m", "rill.services.cli", "serve", str(path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "architecture FancyNewForCausalLM is not supported" in last and last.startswith("rill: ")


def test_supported_table_names_every_family_and_is_the_readmes() -> None:
    table = families.supported_table()
    for fam in families.FAMILIES:
        assert f"| {fam.name} |" in table and all(a in table for a in fam.architectures)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert table in readme, "README's family table is stale: paste families.supported_table()"


def test_gemma3_270m_matches_transformers(gemma3_dir: str) -> None:
    """The second real model: 5 prompts (one Chinese) x 32 greedy tokens through the model runner
    equal transformers' generate on the same dequantized weights (fp32). Its sliding window (512)
    no longer bounds the served context (test_gemma3_270m_past_its_window)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rill.services.worker.model_runner import ModelRunner
    from rill.shared.schema import NewRequestData, SamplingParams, StepPlan

    assert families.check_checkpoint(gemma3_dir).name == "gemma3"
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ref = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    runner = ModelRunner(gemma3_dir, dtype="float32", device="cpu", num_blocks=256, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "请用一句话介绍你自己。", "Once upon a time,",
               "1, 2, 3, 4,"]
    ids = [tok(p)["input_ids"] for p in prompts]
    rids = [f"g{i}" for i in range(len(prompts))]
    new = [NewRequestData(request_id=r, token_ids=t, params=SamplingParams(temperature=0.0, max_tokens=32),
                          block_ids=list(range(16 * i, 16 * i + 16)))
           for i, (r, t) in enumerate(zip(rids, ids, strict=True))]
    out: dict[str, list[int]] = {r: [] for r in rids}
    plan = StepPlan(step_id=0, new_requests=new, cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=rids, num_scheduled_tokens=[len(t) for t in ids])
    for step in range(32):  # one batch: the prompts together, then every row decodes together
        result = runner.execute(plan)
        assert not result.error
        for r, t in zip(result.request_ids, result.token_ids, strict=True):
            out[r].append(t)
        plan = StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                        scheduled_request_ids=rids, num_scheduled_tokens=[1] * len(rids))
    for r, prompt in zip(rids, ids, strict=True):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert out[r] == want, (tok.decode(prompt), tok.decode(out[r]), tok.decode(want))


def test_gemma3_270m_past_its_window(gemma3_dir: str) -> None:
    """A prompt longer than Gemma 3 270M's 512-token window (served at the model's full context):
    greedy tokens equal transformers' generate, so the sliding layers mask what the global ones
    still see. (~1 min on a 2-core CPU: one 600-token prompt through both models.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rill.services.worker.model_runner import ModelRunner
    from rill.shared.schema import NewRequestData, SamplingParams, StepPlan

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    text = " ".join(f"Item {i}: the {('red', 'blue', 'green', 'small')[i % 4]} box holds {i * 7 % 13} stones."
                    for i in range(45)) + " Summary: the box with the most stones is"
    ids = tok(text)["input_ids"]
    assert len(ids) > 512 + 64
    runner = ModelRunner(gemma3_dir, dtype="float32", device="cpu", num_blocks=48, block_size=16)
    assert runner.max_model_len > 512 and {layer.window for layer in runner.model.layers} == {512, None}
    steps = 8
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(
        request_id="long", token_ids=ids, params=SamplingParams(temperature=0.0, max_tokens=steps),
        block_ids=list(range(-(-(len(ids) + steps) // 16))))], cached_request_ids=[], cached_new_block_ids=[],
        scheduled_request_ids=["long"], num_scheduled_tokens=[len(ids)])
    out: list[int] = []
    for step in range(steps):
        result = runner.execute(plan)
        assert not result.error
        out += result.token_ids
        plan = StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                        scheduled_request_ids=["long"], num_scheduled_tokens=[1])
    del runner
    ref = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)[0, len(ids):].tolist()
    assert out == want, (tok.decode(out), tok.decode(want))
