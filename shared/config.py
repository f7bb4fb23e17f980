"""Model and engine configuration shared by every service, and the KV-cache sizing rule."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rill.shared.kinds import EngineRole

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --quantization: none keeps every GEMM in the model dtype; int8 is W8A8 dynamic quantization of the
# linear layers (CPU only, see kernels/torch_ops.Int8Linear); gguf keeps a .gguf model's own
# quantized blocks (services/worker/gguf_weights.py: the CPU block kernels, or on CUDA the Triton
# GEMM of kernels/triton_gguf.py); auto is gguf for a .gguf model on CPU, else none (on an H200
# the Triton GEMM took 2.4x cuBLAS's time on bf16 weights at one row: CUDA takes it only when asked,
# for the memory; scripts/benchmarks.md).
QUANTIZATIONS = ("auto", "none", "int8", "gguf")


def resolve_quantization(requested: str, model_dir: str, device: str, tp_size: int = 1) -> str:
    """--quantization as it will run (see QUANTIZATIONS); auto stays float where the GGUF blocks
    cannot run (CUDA, or sharded over tensor-parallel ranks)."""
    from rill.shared.model_files import converted_from

    if requested != "auto":
        return requested
    gguf = converted_from(model_dir) is not None
    return "gguf" if gguf and device != "cuda" and tp_size == 1 else "none"


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Llama-family config.json that the engine needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    original_max_position_embeddings: int | None = None  # pretraining context of a scaled RoPE (Phi-3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma), else head_dim's
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" / "sliding_attention" (Gemma 3)
    rope_theta_local: float | None = None  # RoPE base of the sliding-attention layers (Gemma 3)
    # Per layer, whether it applies RoPE (SmolLM3's no_rope_layers: 0 is a NoPE layer); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of each head's dims RoPE turns (Phi-4-mini: 0.75)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # attention scores = cap * tanh(scores / cap) (Gemma 2)
    moe_intermediate_size: int | None = None  # each expert's MLP width, where not intermediate_size (Qwen3-MoE)
    # Granite's scalars (None: Llama's behaviour): the embedding's output is multiplied by the first,
    # the attention scale is the second (not head_dim ** -0.5), attention and MLP outputs are
    # multiplied by the third before their residual add, and logits divided by the last.
    embedding_multiplier: float | None = None
    attention_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 folds rope settings into `rope_parameters`, per layer type where the
        # types differ (Gemma 3: full-attention layers scaled, sliding ones on their own base).
        params = cfg.get("rope_parameters")
        rope_theta_local = cfg.get("rope_local_base_freq")
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            local = params.get("sliding_attention") or {}
            rope_theta_local = rope_theta_local or local.get("rope_theta")
            params = params["full_attention"]
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            original_max_position_embeddings=cfg.get("original_max_position_embeddings"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=hidden_act_of(cfg),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            layer_types=tuple(cfg.get("layer_types") or ()),
            rope_theta_local=float(rope_theta_local) if rope_theta_local else None,
            rope_layers=rope_layers_of(cfg),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor") or
                                        (params.get("partial_rotary_factor") if isinstance(params, dict) else None)
                                        or 1.0),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            **{k: float(cfg[k]) for k in GRANITE_SCALARS if cfg.get(k) is not None},
        )

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE turns (transformers' rule); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_rope(self, i: int) -> str:
        """Layer i's RoPE table: "global", "local" (a sliding layer's own base, Gemma 3) or
        "none" (a NoPE layer, SmolLM3)."""
        if self.rope_layers and not self.rope_layers[i]:
            return "none"
        sliding = i < len(self.layer_types) and self.layer_types[i] == "sliding_attention"
        return "local" if self.rope_theta_local is not None and sliding else "global"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: str) -> int:
        """layers × 2 (K and V) × kv_heads × head_dim × dtype bytes."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]


def kv_cache_blocks(model: ModelConfig, dtype: str, block_size: int, memory_bytes: int,
                    draft: ModelConfig | None = None) -> int:
    """How many blocks of `block_size` tokens fit in `memory_bytes` of KV cache (a speculative
    `draft` model's KV in the same blocks sharing it)."""
    per_token = model.kv_bytes_per_token(dtype) + (draft.kv_bytes_per_token(dtype) if draft else 0)
    return memory_bytes // (per_token * block_size)


def fitted_max_model_len(max_model_len: int, cache_tokens: int, fit: bool) -> int:
    """The context one engine serves: `max_model_len`, or with `fit` (the model's own length, no
    --max-model-len given) at most what the KV cache holds, as vLLM's `--max-model-len auto`
    does: a model's 128k context must not leave every request that fills it refused. A length
    asked for that the cache cannot hold is refused (ValueError): such a request could never run."""
    if max_model_len <= cache_tokens or fit:
        return min(max_model_len, cache_tokens)
    raise ValueError(f"--max-model-len {max_model_len} needs {max_model_len} tokens of KV cache but the cache "
                     f"holds {cache_tokens}: lower --max-model-len to at most {cache_tokens} or raise "
                     "--kv-cache-memory (CUDA: --gpu-memory-utilization)")


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# A request's prediction (OpenAI's predicted outputs): drafts per step from it, and the longest
# suffix of its output looked for in it (services/scheduler/speculation.py).
PREDICTION_DRAFTS = 8
PREDICTION_NGRAM = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config. "ngram": k drafts from the longest suffix n-gram
    (prompt_lookup_max down to prompt_lookup_min tokens) seen before (scheduler/speculation.py);
    "draft_model": k drafts of `model`, a smaller checkpoint of the same vocabulary
    (worker/draft_model.py)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"
    model: str = ""
    # No drafts in a step while the engine runs at least this many requests (vLLM's field): a
    # large batch already keeps the cores busy, and verifying drafts there costs more than it saves.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming the field at fault."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method", "draft_model" if "model" in raw else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config method {method!r} is not supported (supported: "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        known = {"method", "num_speculative_tokens", "disable_by_batch_size"} | (
            {"model"} if method == "draft_model" else {"prompt_lookup_max", "prompt_lookup_min"})
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r} for method {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        if method == "draft_model" and not (isinstance(raw.get("model"), str) and raw["model"]):
            raise ValueError("--speculative-config method 'draft_model' needs model: a checkpoint folder or .gguf")
        fields = {k: raw[k] for k in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                                      "disable_by_batch_size") if k in raw}
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config {name} must be a positive integer, got {value!r}")
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields["prompt_lookup_min"] = min(cls.prompt_lookup_min, fields["prompt_lookup_max"])
        if "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
            fields["prompt_lookup_max"] = max(cls.prompt_lookup_max, fields["prompt_lookup_min"])
        cfg = cls(method=method, model=raw.get("model", ""), **fields)
        if cfg.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("--speculative-config prompt_lookup_min must not exceed prompt_lookup_max")
        return cfg


@dataclass
class EngineArgs:
    """The `serve` flags that the engine services share."""

    model_dir: str = ""
    served_model_name: str = ""
    engine_id: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    fit_context: bool = True  # max_model_len is the model's (no --max-model-len): lower it to the KV cache
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the worker's measured one (CPU) or 2048 (CUDA)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: CPU default below
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    quantization: str = "none"  # "int8": W8A8 linear layers (CPU only); norms, embedding, KV stay in dtype
    device: str = "auto"
    tensor_parallel_size: int = 1  # worker ranks of the engine (services/worker/tensor_parallel.py)
    tp_rank: int = 0  # this worker's rank
    tp_address: str = ""  # HOST:PORT where rank 0 hosts the group's rendezvous
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    role: EngineRole = "both"  # colocated, or one side of a hand-off: see services/scheduler/disagg.py
    async_scheduling: bool = True  # build step N+1 while N runs (colocated engines; scheduler/service.py)
    speculative_config: str = ""  # JSON (SpeculativeConfig); empty: no speculation

    def step_token_budget(self, device: str, measured: int = 0) -> int:
        """max_num_batched_tokens, else what the worker measured, else the default on `device`."""
        return self.max_num_batched_tokens or measured or default_max_num_batched_tokens(device)


@dataclass(frozen=True)
class StepCost:
    """What a CPU worker measured of its prompt steps (services/worker/step_budget.py): seconds
    a prompt token takes at a prompt's start, the share of that a token of context adds (a chunk
    deep in a prompt reads the whole prefix), and the step-time target measured against."""

    token_s: float
    context: float
    target_s: float

    def chunk(self, n: int, context: int, budget: int) -> int:
        """At most `n` prompt tokens after `context` others: as many as a step within the target
        holds (or within a budget-sized chunk's time at a prompt's start, where that is longer),
        never under a quarter of the budget: shorter chunks would spend more in per-step work
        than they spare the streams that share the step."""
        bound = max(self.target_s, budget * self.token_s)
        fits = bound / (self.token_s * (1 + self.context * context))
        return min(n, max(budget // 4, int(fits)))

    def wire(self) -> list[float]:
        return [self.token_s, self.context, self.target_s]

    def __str__(self) -> str:
        return (f"{self.token_s * 1e3:.3f} ms a prompt token, +{self.context:.1e} of that per token of context, "
                f"target {self.target_s * 1e3:.0f} ms")

    @classmethod
    def of(cls, wire: list[float]) -> StepCost | None:
        return cls(*wire) if len(wire) == 3 and wire[0] > 0 else None


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~14k SmolLM2 tokens in fp32, ~28k in bf16


def default_max_num_batched_tokens(device: str) -> int:
    """A step's token budget when none is given and the worker announced none. A CPU worker
    measures its own (services/worker/step_budget.py); 512 stands in for one that did not (a CPU
    prompt token costs milliseconds: 2048 would stall every running stream for seconds). A GPU
    runs 2048 tokens in milliseconds."""
    return 2048 if device == "cuda" else 512


def parse_size(text: str | int | None) -> int | None:
    """'512MiB', '2GiB', '1e9' or a plain byte count."""
    if text is None or isinstance(text, int):
        return text
    t = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def detok_context_len(stop: list[str]) -> int:
    """Output tokens before the new ones that the scheduler sends as decode context.

    Enough to re-decode the last few characters (a multi-byte character spans up to 4 byte
    tokens) and to see any partial stop string held back at the previous step.
    """
    return 8 + 4 * max((len(s) for s in stop), default=0)


GRANITE_SCALARS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def hidden_act_of(cfg: dict[str, Any]) -> str:
    """The MLP's activation as transformers reads it: a Gemma (1) config's legacy "gelu" means the
    tanh approximation, as the checkpoints were trained."""
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    return "gelu_pytorch_tanh" if act == "gelu" and cfg.get("model_type") == "gemma" else act


def rope_layers_of(cfg: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's NoPE layers, as transformers reads them: `no_rope_layers` (1 = RoPE), else every
    `no_rope_layer_interval`-th layer without."""
    flags = cfg.get("no_rope_layers")
    if flags is None and cfg.get("model_type") == "smollm3":
        every = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % every != 0) for i in range(int(cfg["num_hidden_layers"]))]
    return tuple(bool(f) for f in flags or ())
