"""The model families Rill serves, keyed by `config.architectures`, and the checks that refuse
everything else at start with one line naming the problem.

Each family states, side by side, how its checkpoint differs from Llama's: extra per-layer
tensors and config values it cannot serve yet. Loading is strict: a checkpoint must hold exactly
the tensors `expected_tensors` lists (a tensor left unused means a feature the forward would
silently skip), and every config value the forward does not implement is refused by name.
`check_checkpoint` runs these checks from the config and the safetensors headers alone, so
`rill serve` refuses a model before it starts any process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rill.shared.config import GRANITE_SCALARS, ModelConfig, rope_layers_of

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")  # what rope.inv_frequencies implements
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU, GeGLU


class UnsupportedModel(ValueError):
    """A checkpoint Rill would serve wrongly; the message is one line naming why."""


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family names its sparse MLP blocks in hub checkpoints:
    `{block}.gate.weight` (the router, [E, H]) and `{block}.experts.{e}.{gate|up|down}.weight`.
    transformers (5.x) keeps the experts fused in memory, `mlp.experts.gate_up_proj` [E, 2F, H] and
    `mlp.experts.down_proj` [E, H, F] beside `mlp.gate.weight`; a checkpoint stored that way is read
    too (fused_expert_names), layer by layer."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # each expert's SwiGLU projections
    up: str
    down: str
    # Qwen3-MoE: config.mlp_only_layers and decoder_sparse_step leave some layers dense (a plain
    # MLP of intermediate_size); experts are moe_intermediate_size wide. Mixtral: every layer
    # sparse, experts intermediate_size wide.
    dense_layers: bool = False
    renormalise_key: str | None = None  # config key switching top-k renormalisation; None: always
    round_weights: bool = False  # routing weights rounded to the model dtype before use (Qwen3-MoE)

    def expert_names(self, i: int, num_experts: int) -> list[str]:
        p = f"model.layers.{i}.{self.block}."
        return [f"{p}gate.weight", *(f"{p}experts.{e}.{n}.weight" for e in range(num_experts)
                                     for n in (self.gate, self.up, self.down))]


def fused_expert_names(i: int) -> list[str]:
    """Layer i's router and fused experts as transformers names them in memory (see Experts)."""
    p = f"model.layers.{i}.mlp."
    return [f"{p}gate.weight", f"{p}experts.gate_up_proj", f"{p}experts.down_proj"]


def num_experts(cfg: dict[str, Any]) -> int:
    """Experts per sparse layer: hub configs say num_experts (Qwen3-MoE) or num_local_experts
    (Mixtral); transformers saves the latter for both."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def sparse_layers(cfg: dict[str, Any], fam: Family) -> list[bool]:
    """Which layers have a mixture-of-experts MLP, as transformers decides."""
    n = int(cfg["num_hidden_layers"])
    if fam.experts is None:
        return [False] * n
    if not fam.experts.dense_layers:
        return [True] * n
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return [i not in dense and num_experts(cfg) > 0 and (i + 1) % step == 0 for i in range(n)]


def renormalises(cfg: dict[str, Any], fam: Family) -> bool:
    """Whether the top-k routing weights are rescaled to sum to 1."""
    key = fam.experts.renormalise_key if fam.experts else None
    return True if key is None else bool(cfg.get(key, False))


def check_quantization(fam: Family, quantization: str) -> None:
    """Refuse what the quantized paths cannot serve: int8 (SmoothQuant) has no expert GEMMs."""
    if fam.experts is not None and quantization not in ("none", "auto", None):
        raise UnsupportedModel(f"{fam.name}: --quantization {quantization} is not supported for mixture-of-experts "
                               f"models (the experts have no {quantization} path); serve with --quantization none")
    if not fam.pre_norms and quantization not in ("none", "auto", None):
        raise UnsupportedModel(f"{fam.name}: --quantization {quantization} folds its scales into the norms before "
                               "attention and MLP, which this family has not; serve with --quantization none")


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...] = ()  # config.model_type, for configs without `architectures`
    qk_norm: bool = False  # RMSNorm of q and k before RoPE: over each head (Qwen3, Gemma 3) or all (OLMo 2)
    window_key: str | None = None  # config key of a sliding-window size
    window_switch: str | None = None  # config key that turns the window on (else it is on when set)
    # Which layers slide, as transformers decides: "all" (Mistral ignores layer_types), "types"
    # (config.layer_types, else every `sliding_window_pattern`-th layer is global, by default
    # every `window_pattern`-th: Gemma 3's 6, Gemma 2's 2), "upper" (config.layer_types, else
    # layers from max_window_layers on: Qwen2/3), "nope" (config.layer_types, else the layers
    # without RoPE: SmolLM3).
    window_layers: str = "all"
    window_pattern: int = 6
    # Gemma: norms scale by (1 + w); the embedding is scaled by sqrt(hidden).
    gemma: bool = False
    # Gemma 2/3, OLMo 2: attention and MLP outputs are normed before their residual add
    # (post_attention_layernorm is that norm, and pre_feedforward_layernorm the MLP's input norm).
    sandwich: bool = False
    pre_norms: bool = True  # false: no norm before attention or MLP, only after (OLMo 2)
    # Phi-3: q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (the runner's own layout).
    fused: bool = False
    partial_rotary: bool = False  # honours partial_rotary_factor (Phi-4-mini); others are refused it
    experts: Experts | None = None  # a mixture-of-experts family: its sparse MLP blocks

    def attn_names(self, i: int) -> list[str]:
        """Layer i's projections into q, k and v (one, fused, or three), then its output one."""
        p = f"model.layers.{i}.self_attn."
        return [f"{p}qkv_proj", f"{p}o_proj"] if self.fused else [f"{p}{n}_proj" for n in "qkvo"]

    def mlp_names(self, i: int) -> list[str]:
        """Layer i's gate and up projections (one, fused, or two), then down."""
        p = f"model.layers.{i}.mlp."
        return [f"{p}gate_up_proj", f"{p}down_proj"] if self.fused else [f"{p}{n}_proj" for n in ("gate", "up", "down")]

    def layer_tensors(self, i: int, cfg: dict[str, Any]) -> list[str]:
        """Layer i's tensors (without the optional biases, see expected_tensors)."""
        p = f"model.layers.{i}."
        names = [f"{p}post_attention_layernorm.weight",
                 *(f"{n}.weight" for n in self.attn_names(i)), *(f"{n}.weight" for n in self.mlp_names(i))]
        if self.pre_norms:
            names.append(f"{p}input_layernorm.weight")
        if self.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if self.sandwich:
            names.append(f"{p}post_feedforward_layernorm.weight")
        if self.sandwich and self.pre_norms:
            names.append(f"{p}pre_feedforward_layernorm.weight")
        return names


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),  # Llama 1/2/3.x, SmolLM, TinyLlama
    Family("mistral", ("MistralForCausalLM",), ("mistral",), window_key="sliding_window"),
    # q/k/v biases: optional tensors, as for every family.
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), window_key="sliding_window",
           window_switch="use_sliding_window", window_layers="upper"),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True, window_key="sliding_window",
           window_switch="use_sliding_window", window_layers="upper"),
    # Gemma (1): Llama's layer with (1 + w) norms, GeGLU and a scaled embedding.
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), gemma=True),
    # Gemma 2: GeGLU, query_pre_attn_scalar, attention logit soft-capping, every other layer
    # sliding (the first one included), no q/k norms.
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), window_key="sliding_window", gemma=True, sandwich=True,
           window_layers="types", window_pattern=2),
    # Gemma 3 (text): GeGLU, query_pre_attn_scalar, sliding layers on their own RoPE base.
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), qk_norm=True, window_key="sliding_window",
           gemma=True, sandwich=True, window_layers="types"),
    # SmolLM3: Llama with every no_rope_layer_interval-th layer (no_rope_layers) skipping RoPE;
    # optional sliding layers named by layer_types.
    Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), window_key="sliding_window",
           window_switch="use_sliding_window", window_layers="nope"),
    # OLMo 2: norms after attention and MLP instead of before, q/k norms over the whole projection.
    Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), qk_norm=True, sandwich=True, pre_norms=False),
    # OLMo 3: OLMo 2 with three sliding-window layers to one global (layer_types), whose RoPE may be scaled.
    Family("olmo3", ("Olmo3ForCausalLM",), ("olmo3",), qk_norm=True, sandwich=True, pre_norms=False,
           window_key="sliding_window", window_layers="types", window_pattern=4),
    # Granite (3.x): Llama with four scalars (ModelConfig: embedding, attention, residual, logits).
    Family("granite", ("GraniteForCausalLM",), ("granite",)),
    # Phi-3 / Phi-3.5 / Phi-4 mini: fused projections, every layer within `sliding_window` (as
    # Mistral), RoPE over the first partial_rotary_factor of each head (Phi-4-mini).
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), window_key="sliding_window", fused=True, partial_rotary=True),
    # Qwen3-MoE: Qwen3's attention, experts in every decoder_sparse_step-th layer not in mlp_only_layers.
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qk_norm=True, window_key="sliding_window",
           window_switch="use_sliding_window",
           experts=Experts("mlp", "gate_proj", "up_proj", "down_proj", dense_layers=True,
                           renormalise_key="norm_topk_prob", round_weights=True)),
    # Mixtral: Mistral's attention (a window over every layer when set), experts in every layer.
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), window_key="sliding_window",
           experts=Experts("block_sparse_moe", "w1", "w3", "w2")),
)
_BY_ARCH = {arch: f for f in FAMILIES for arch in f.architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_of(cfg: dict[str, Any]) -> Family:
    """The family of a config.json's `architectures`, else of its `model_type` (a GGUF converted
    by transformers has only that); a config with neither is taken as Llama."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    if archs:
        supported = ", ".join(sorted(_BY_ARCH))
        raise UnsupportedModel(f"architecture {archs[0]} is not supported (supported: {supported})")
    model_type = cfg.get("model_type", "llama")
    if model_type not in _BY_TYPE:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_BY_TYPE))})")
    return _BY_TYPE[model_type]


def layer_windows(cfg: dict[str, Any], fam: Family) -> list[int | None]:
    """Each layer's sliding window (a query at p sees keys p - window + 1 .. p), None for a
    full-attention layer, assigned as transformers assigns them for the family."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get(fam.window_key) if fam.window_key else None
    if window is None or (fam.window_switch is not None and not cfg.get(fam.window_switch)):
        return [None] * n
    types = cfg.get("layer_types")
    if fam.window_layers == "all":
        return [int(window)] * n
    if not types and fam.window_layers == "nope":
        rope = rope_layers_of(cfg) or (True,) * n
        types = ["full_attention" if r else "sliding_attention" for r in rope]
    elif not types and fam.window_layers == "types":
        pattern = int(cfg.get("sliding_window_pattern", fam.window_pattern))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif not types:  # "upper"
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if len(types) != n:
        raise UnsupportedModel(f"{fam.name}: layer_types names {len(types)} layers, the model has {n}")
    return [int(window) if t == "sliding_attention" else None for t in types]


def check_config(cfg: dict[str, Any], max_model_len: int | None = None) -> Family:
    """The family, after refusing every config value its forward would get wrong.
    (`max_model_len` no longer matters: sliding windows are served at any context.)"""
    del max_model_len
    fam = family_of(cfg)
    parsed = ModelConfig.from_dict(cfg)
    act = parsed.hidden_act
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{fam.name}: activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    cap = cfg.get("attn_logit_softcapping")
    if cap is not None and not float(cap) > 0:
        raise UnsupportedModel(f"{fam.name}: attention logit soft-capping {cap} must be positive")
    scaling = parsed.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if fam.name == "phi3" and kind in ("su", "yarn"):  # transformers reads these as longrope
        raise UnsupportedModel(f"{fam.name}: RoPE scaling type {kind!r} (longrope under an old name) is not "
                               "supported; name it 'longrope'")
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{fam.name}: RoPE scaling type {kind!r} is not supported "
                               f"(supported: {', '.join(ROPE_TYPES)})")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{fam.name}: bidirectional attention (an embedding model) is not supported")
    if any(w is not None and w < 1 for w in layer_windows(cfg, fam)):
        raise UnsupportedModel(f"{fam.name}: sliding window {cfg.get(fam.window_key)} must be at least 1")
    for key in GRANITE_SCALARS:
        if getattr(parsed, key) is not None and not 0 < getattr(parsed, key) < float("inf"):
            raise UnsupportedModel(f"{fam.name}: {key} {getattr(parsed, key)} must be positive and finite")
    if parsed.rotary_dim != parsed.head_dim and not fam.partial_rotary:
        raise UnsupportedModel(f"{fam.name}: partial rotary embeddings (partial_rotary_factor "
                               f"{parsed.partial_rotary_factor}) are not supported")
    if not 0 < parsed.rotary_dim <= parsed.head_dim or parsed.rotary_dim % 2:
        raise UnsupportedModel(f"{fam.name}: partial_rotary_factor {parsed.partial_rotary_factor} turns "
                               f"{parsed.rotary_dim} of {parsed.head_dim} head dims; RoPE needs a positive even number")
    if parsed.rope_layers and len(parsed.rope_layers) != parsed.num_hidden_layers:
        raise UnsupportedModel(f"{fam.name}: no_rope_layers names {len(parsed.rope_layers)} layers, "
                               f"the model has {parsed.num_hidden_layers}")
    if parsed.head_dim % 2:
        raise UnsupportedModel(f"{fam.name}: head_dim {parsed.head_dim} is odd; RoPE needs pairs")
    if fam.experts is not None:
        _check_experts(cfg, fam, act)
    return fam


def _check_experts(cfg: dict[str, Any], fam: Family, act: str) -> None:
    n, k = num_experts(cfg), int(cfg.get("num_experts_per_tok") or 0)
    if any(sparse_layers(cfg, fam)) and not 1 <= k <= n:
        raise UnsupportedModel(f"{fam.name}: num_experts_per_tok {k} must be between 1 and the {n} experts")
    if act != "silu":
        raise UnsupportedModel(f"{fam.name}: experts with activation {act!r} are not supported (only SwiGLU)")


def expected_tensors(cfg: dict[str, Any], fam: Family,
                     names: set[str] | frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
    """(tensors the checkpoint must hold, optional ones the forward uses when present). `names`
    (the checkpoint's) picks each sparse layer's expert layout: fused where it holds that one."""
    parsed = ModelConfig.from_dict(cfg)
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    # An absent LM head is tied to the embedding; a tied checkpoint may still store its copy.
    optional = {"lm_head.weight"}
    for i in range(parsed.num_hidden_layers):
        required.update(fam.layer_tensors(i, cfg))
        optional.update(f"{n}.bias" for n in (*fam.attn_names(i), *fam.mlp_names(i)))
    for i, sparse in enumerate(sparse_layers(cfg, fam)):
        if sparse:  # the router and experts replace the dense MLP (which has no biases to allow)
            required.difference_update(f"{n}.weight" for n in fam.mlp_names(i))
            optional.difference_update(f"{n}.bias" for n in fam.mlp_names(i))
            fused = fused_expert_names(i)
            required.update(fused if fused[1] in names else fam.experts.expert_names(i, num_experts(cfg)))
    return required, optional


# Stored by transformers beside the weights but not weights (rotary tables of old checkpoints).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_tensors(names: set[str], cfg: dict[str, Any], fam: Family) -> None:
    """Refuse a checkpoint missing a tensor the forward needs, or holding one it would not use."""
    required, optional = expected_tensors(cfg, fam, names)
    missing = sorted(required - names)
    if missing:
        raise UnsupportedModel(f"{fam.name}: the checkpoint lacks {missing[0]}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unused = sorted(n for n in names - required - optional if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise UnsupportedModel(f"{fam.name}: tensor {unused[0]} would be left unused"
                               + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                               + "; this checkpoint needs a feature Rill does not implement")


def tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name in a folder's safetensors files, from their headers (an 8-byte length,
    then JSON): safetensors' own reader would import torch into every process that only checks
    a checkpoint, tokenizer and detokenizer replicas included."""
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        names.update(k for k in header if k != "__metadata__")
    return names


def check_checkpoint(model_dir: str | Path, max_model_len: int | None = None, quantization: str = "none") -> Family:
    """Everything `rill serve` checks before starting: config values, tensor names, and whether
    the family can take `quantization`."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    fam = check_config(cfg, max_model_len)
    check_quantization(fam, quantization)
    check_tensors(tensor_names(model_dir), cfg, fam)
    return fam


# GGUF `general.architecture` names (llama.cpp's) that are not the transformers model_type.
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


# GGUF architectures of a served family that transformers' reader cannot read or would turn into a
# wrong config.
_GGUF_MISREAD = {
    # llama.cpp keeps no norm_topk_prob (its graph always renormalises) and transformers maps no
    # expert width, so both would come back as Qwen3MoeConfig's defaults.
    "qwen3moe": "a Qwen3-MoE GGUF carries neither norm_topk_prob nor moe_intermediate_size; serve its "
                "safetensors checkpoint",
    "smollm3": "transformers reads no SmolLM3 GGUF; serve its safetensors checkpoint",
    "granite": "transformers reads no Granite GGUF; serve its safetensors checkpoint",
    "gemma": "transformers reads no Gemma (1) GGUF; serve its safetensors checkpoint",
    "olmo2": "transformers reads no OLMo 2 GGUF; serve its safetensors checkpoint",
    "olmo3": "transformers reads no OLMo 3 GGUF; serve its safetensors checkpoint",
}


def family_of_gguf(architecture: str) -> Family:
    """The family of a GGUF's `general.architecture`, checked before the file is converted."""
    if architecture in _GGUF_MISREAD:
        raise UnsupportedModel(f"GGUF architecture {architecture!r} is not supported: {_GGUF_MISREAD[architecture]}")
    fam = _BY_TYPE.get(_GGUF_MODEL_TYPES.get(architecture, architecture))
    if fam is None:
        back = {t: a for a, t in _GGUF_MODEL_TYPES.items()}
        supported = ", ".join(sorted(a for a in (back.get(t, t) for t in _BY_TYPE) if a not in _GGUF_MISREAD))
        raise UnsupportedModel(f"GGUF architecture {architecture!r} is not supported (supported: {supported})")
    return fam


def supported_table() -> str:
    """The supported families as a Markdown table (for the README)."""
    rows = ["| family | architectures | differences over Llama |", "|---|---|---|"]
    notes = {"llama": "RoPE default, linear, dynamic, llama3, yarn, longrope; optional biases; tied or "
                      "separate LM head",
             "mistral": "as Llama; sliding-window attention, KV blocks behind the window released",
             "qwen2": "q/k/v biases; sliding window as Mistral",
             "qwen3": "RMSNorm per head on q and k before RoPE",
             "gemma": "(1 + w) norms, GeGLU, scaled embedding",
             "gemma2": "(1 + w) norms around attention and MLP, GeGLU, scaled embedding, "
                       "query_pre_attn_scalar, attention and final logit soft-capping; every other layer "
                       "sliding-window",
             "gemma3": "(1 + w) norms around attention and MLP, GeGLU, scaled embedding, q/k norms, "
                       "query_pre_attn_scalar, local RoPE base; sliding-window layers alternating with "
                       "global ones",
             "olmo2": "norms after attention and MLP, none before; q/k norms over the whole projection",
             "olmo3": "as OLMo 2; sliding-window layers around every fourth, global one",
             "granite": "embedding, attention-scale, residual and logit multipliers (folded into the weights "
                        "where they can be)",
             "smollm3": "no RoPE in every fourth layer (no_rope_layers); optional sliding-window layers",
             "phi3": "fused qkv and gate_up weights; sliding window as Mistral; longrope; partial rotary (Phi-4-mini)",
             "qwen3_moe": "Qwen3 attention; top-k experts (SwiGLU) as grouped GEMMs, optional renormalisation, "
                          "dense layers by mlp_only_layers / decoder_sparse_step; no int8",
             "mixtral": "Mistral attention; top-k experts (SwiGLU) as grouped GEMMs, renormalised; no int8"}
    for f in FAMILIES:
        rows.append(f"| {f.name} | {', '.join(f.architectures)} | {notes[f.name]} |")
    return "\n".join(rows)
