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
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from rill.services.cli import build_parser, engine_args
from rill.services.worker import families
from rill.services.worker.llama import LlamaModel
from rill.shared.broker import free_port
from rill.shared.config import ModelConfig

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
    # OLMo 2: norms after attention and MLP, none before, q/k norms over all heads; its RoPE base.
    "olmo2": (Olmo2ForCausalLM, Olmo2Config, dict(rope_theta=5e5)),
    # OLMo 3: layers 0 and 1 slide over a window shorter than the prompt, layer 2 is global with
    # YaRN-scaled RoPE, the sliding ones on the plain base.
    "olmo3": (Olmo3ForCausalLM, Olmo3Config, dict(sliding_window=16, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention"], rope_parameters={
        "full_attention": dict(rope_type="yarn", rope_theta=5e5, factor=4.0, original_max_position_embeddings=64),
        "sliding_attention": dict(rope_type="default", rope_theta=5e5)})),
    # Gemma (1): Llama's layer with (1 + w) norms, GeGLU, a scaled embedding and a tied head.
    "gemma": (GemmaForCausalLM, GemmaConfig, dict(head_dim=32, tie_word_embeddings=True)),
    # Gemma 2: as Gemma 3 without q/k norms or a local RoPE base, plus attention logit
    # soft-capping (a cap low enough to bite at this scale); layers 0 and 2 slide, over a window
    # shorter than the prompt.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=1.5,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, a window over every layer.
    # Granite's scalars, a tied head (logits divided after it), biases-free as Granite 3.
    "granite": (GraniteForCausalLM, GraniteConfig, dict(embedding_multiplier=6.0, attention_multiplier=0.2,
                                                        residual_multiplier=0.4, logits_scaling=3.0,
                                                        tie_word_embeddings=True)),
    # Layers 1 and 3 without RoPE, and sliding (the 37-token prompt passes their window).
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config, dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                        use_sliding_window=True, sliding_window=16, pad_token_id=0,
                                                        bos_token_id=1, eos_token_id=2)),
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(sliding_window=16, pad_token_id=0)),
    # Phi-4-mini: RoPE turns the first 12 of each head's 16 dims (partial_rotary_factor), with
    # LongRoPE's long factors (6: one per turned pair).
    "phi4-mini": (Phi3ForCausalLM, Phi3Config, dict(pad_token_id=0, sliding_window=None, partial_rotary_factor=0.75,
                                                    original_max_position_embeddings=16, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
        short_factor=[1.0 + 0.05 * i for i in range(6)], long_factor=[1.5 + 0.6 * i for i in range(6)]))),
    # Phi-3 128k-style LongRoPE: the prompt starts past original_max_position_embeddings, so
    # transformers takes the long factors throughout, as Rill does serving more than it.
    "phi3-longrope": (Phi3ForCausalLM, Phi3Config, dict(pad_token_id=0, **LONGROPE, original_max_position_embeddings=16)),
    # Dynamic NTK within the original context: the plain base, as transformers computes it there.
    "llama-dynamic": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=4.0))),
    # Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense (mlp_only_layers), q/k norms.
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    # Mixtral: top-2 of 4 experts in every layer, a window shorter than the prompt.
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                                        intermediate_size=32, sliding_window=16)),
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

    from rill.services.worker.rope import inv_frequencies, rope_attention_factor
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


def test_gemma_legacy_gelu_is_the_tanh_approximation() -> None:
    """Gemma (1) configs say "gelu"; transformers reads the tanh approximation they were trained
    with, and so does Rill (any other family's "gelu" stays refused: REFUSALS)."""
    assert GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"  # transformers' reading
    cfg = {**GemmaConfig(**TINY, head_dim=32).to_dict(), "hidden_act": "gelu"}
    assert families.check_config(cfg).name == "gemma"
    assert ModelConfig.from_dict(cfg).hidden_act == "gelu_pytorch_tanh"


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
    # transformers' Llama turns every dim whatever the factor says: a checkpoint that asks for
    # fewer was made for another architecture.
    ("partial rotary", lambda p: _edit_config(p, partial_rotary_factor=0.5),
     "partial rotary embeddings (partial_rotary_factor 0.5) are not supported"),
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


def _fuse_experts(path: Path) -> None:
    """Rewrite a Qwen3-MoE checkpoint's per-expert tensors as transformers' fused 3-D ones."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for i in range(3):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in tensors:
            continue  # the dense layer
        e = 0
        gate_up, down = [], []
        while f"{p}{e}.gate_proj.weight" in tensors:
            gate_up.append(torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")]))
            down.append(tensors.pop(f"{p}{e}.down_proj.weight"))
            e += 1
        tensors[f"{p}gate_up_proj"], tensors[f"{p}down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_moe_fused_expert_layout_matches_transformers(tmp_path: Path) -> None:
    """Experts stored as transformers holds them in memory ([E, 2F, H] and [E, H, F]) serve the
    same model as the hub's one tensor per expert."""
    path, ref = build(tmp_path, "qwen3-moe")
    _fuse_experts(path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in families.tensor_names(path)
    model = LlamaModel.load(path, torch.float32, "cpu")
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    prompt = [int(t) for t in torch.randint(3, 300, (21,), generator=torch.Generator().manual_seed(2))]
    assert check_prefill_then_decode(model, ref, prompt, block_size=8, steps=2) < TOL


def test_moe_bf16_error_no_worse_than_transformers_bf16(tmp_path: Path) -> None:
    """bf16 on CPU (the serving dtype): our logits stray from the fp32 reference no more than
    transformers' own bf16 Qwen3-MoE does, routing included."""
    path, ref = build(tmp_path, "qwen3-moe")
    prompt = [int(t) for t in torch.randint(3, 300, (21,), generator=torch.Generator().manual_seed(2))]
    ours = check_prefill_then_decode(LlamaModel.load(path, torch.bfloat16, "cpu"), ref, prompt, block_size=8, steps=3)
    ref_bf16 = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32_cache, bf16_cache = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
    theirs = 0.0
    with torch.no_grad():
        tokens = [prompt]
        for _ in range(4):
            want = ref(torch.tensor(tokens), cache=fp32_cache, use_cache=True).logits[0]
            got = ref_bf16(torch.tensor(tokens), cache=bf16_cache, use_cache=True).logits[0].float()
            theirs = max(theirs, (got - want).abs().max().item())
            tokens = [[int(want[-1].argmax())]]
    assert ours <= 1.25 * theirs + 0.05, f"bf16 max abs diff: ours {ours}, transformers bf16 {theirs}"


def test_moe_engine_matches_generate(tmp_path: Path) -> None:
    """Mixtral (experts in every layer, a window of 16) through the scheduler and model runner
    with a small chunk budget and plans one step ahead, twice (the second pass hits the prefix
    cache): greedy tokens equal transformers' generate, and blocks behind the window are released."""
    from test_scheduler_engine import drive, greedy

    from rill.services.scheduler.kv_cache_manager import KVCacheManager
    from rill.services.scheduler.scheduler import Scheduler, SchedulerConfig
    from rill.services.worker.model_runner import ModelRunner

    path, ref = build(tmp_path, "mixtral")
    runner = ModelRunner(str(path), dtype="float32", device="cpu", num_blocks=64, block_size=4)
    kv = KVCacheManager(64, 4, enable_prefix_caching=True, sliding_window=runner.model.sliding_window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12, max_model_len=256), kv)
    gen = torch.Generator().manual_seed(2)
    prompts = [[int(t) for t in torch.randint(3, 300, (n,), generator=gen)] for n in (29, 17, 40)]
    with torch.inference_mode():
        want = {f"r{i}": ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                      min_new_tokens=16)[0, len(p):].tolist() for i, p in enumerate(prompts)}
    for attempt in range(2):
        msgs = [greedy(f"r{i}", p, 16) for i, p in enumerate(prompts)]
        for m in msgs:
            m.eos_token_ids = []  # generate ran past any EOS too
        assert drive(runner, sched, msgs, depth=2).outputs == want, f"pass {attempt}"
    assert kv.released_total > 0 and kv.hits > 0


MOE_REFUSALS = [
    ("missing expert", lambda p: _edit_tensors(p, drop="model.layers.2.mlp.experts.5.up_proj.weight"),
     "lacks model.layers.2.mlp.experts.5.up_proj.weight"),
    ("dense layer made sparse", lambda p: _edit_config(p, mlp_only_layers=[]),
     "lacks model.layers.1.mlp.experts.0.down_proj.weight"),
    ("per-expert beside fused", lambda p: (_fuse_experts(p), _edit_tensors(
        p, add={"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(32, 64)})),
     "tensor model.layers.0.mlp.experts.0.up_proj.weight would be left unused"),
    ("top-k past the experts", lambda p: _edit_config(p, num_experts_per_tok=9),
     "num_experts_per_tok 9 must be between 1 and the 8 experts"),
]


@pytest.mark.parametrize("what,edit,message", MOE_REFUSALS, ids=[r[0] for r in MOE_REFUSALS])
def test_moe_checkpoint_refused_with_one_line(tmp_path: Path, what: str, edit, message: str) -> None:
    path, _ = build(tmp_path, "qwen3-moe")
    edit(path)
    for check in (lambda: families.check_checkpoint(path), lambda: LlamaModel.load(path, torch.float32, "cpu")):
        with pytest.raises(families.UnsupportedModel) as err:
            check()
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name,why", [("qwen3-moe", "is not supported for mixture"),
                                      ("olmo2", "folds its scales into the norms before")])
def test_refused_with_int8(tmp_path: Path, name: str, why: str) -> None:
    """The experts have no int8 GEMMs, and SmoothQuant's scales go into norms OLMo 2 has not:
    --quantization int8 is refused by name, not half-applied."""
    path, _ = build(tmp_path, name)
    for check in (lambda: families.check_checkpoint(path, quantization="int8"),
                  lambda: LlamaModel.load(path, torch.float32, "cpu", quantization="int8")):
        with pytest.raises(families.UnsupportedModel, match=f"--quantization int8 {why}"):
            check()
    with pytest.raises(SystemExit, match=rf"^rill: .*--quantization int8 {why}"):
        engine_args(build_parser().parse_args(["serve", str(path), "--quantization", "int8"]), str(path))


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
    """The second real model: 3 prompts (one Chinese) x 24 greedy tokens through the model runner
    equal transformers' generate on the same dequantized weights (fp32). Its sliding window (512)
    no longer bounds the served context (test_gemma3_270m_past_its_window)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rill.services.worker.model_runner import ModelRunner
    from rill.shared.request_params import SamplingParams
    from rill.shared.schema import NewRequestData, StepPlan

    assert families.check_checkpoint(gemma3_dir).name == "gemma3"
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ref = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    runner = ModelRunner(gemma3_dir, dtype="float32", device="cpu", num_blocks=256, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "请用一句话介绍你自己。"]
    ids = [tok(p)["input_ids"] for p in prompts]
    rids = [f"g{i}" for i in range(len(prompts))]
    new = [NewRequestData(request_id=r, token_ids=t, params=SamplingParams(temperature=0.0, max_tokens=24),
                          block_ids=list(range(16 * i, 16 * i + 16)))
           for i, (r, t) in enumerate(zip(rids, ids, strict=True))]
    out: dict[str, list[int]] = {r: [] for r in rids}
    plan = StepPlan(step_id=0, new_requests=new, cached_request_ids=[], cached_new_block_ids=[],
                    scheduled_request_ids=rids, num_scheduled_tokens=[len(t) for t in ids])
    for step in range(24):  # one batch: the prompts together, then every row decodes together
        result = runner.execute(plan)
        assert not result.error
        for r, t in zip(result.request_ids, result.token_ids, strict=True):
            out[r].append(t)
        plan = StepPlan(step_id=step + 1, new_requests=[], cached_request_ids=[], cached_new_block_ids=[],
                        scheduled_request_ids=rids, num_scheduled_tokens=[1] * len(rids))
    for r, prompt in zip(rids, ids, strict=True):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert out[r] == want, (tok.decode(prompt), tok.decode(out[r]), tok.decode(want))


def test_gemma3_270m_past_its_window(gemma3_dir: str) -> None:
    """A prompt longer than Gemma 3 270M's 512-token window (served at the model's full context):
    greedy tokens equal transformers' generate, so the sliding layers mask what the global ones
    still see. (~1 min on a 2-core CPU: one 600-token prompt through both models.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rill.services.worker.model_runner import ModelRunner
    from rill.shared.request_params import SamplingParams
    from rill.shared.schema import NewRequestData, StepPlan

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
