"""SmoothQuant for --quantization int8: activation outliers moved into the weights at load time.

W8A8 rounds each token's activations with one int8 step per row, so a channel far above the row's
RMS (one channel of SmolLM2's Q/K/V input is 15-23x it) sets a step that leaves every other
channel a handful of levels. Per input channel j of a linear layer, with

    s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha),

(X / s) @ (W * s).T equals X @ W.T, and X / s is far flatter. The division is folded into
whatever produced X, so it costs nothing at run time:
- qkv and gate_up (and the LM head): the RMSNorm weight before them;
- o: V's rows. Attention only mixes tokens, so output channel (q head h, d) is linear in V's
  channel (kv_head(h), d); s is therefore shared by the q heads of a GQA group;
- down: up's rows, since silu(gate) * up is linear in up.
max|X_j| comes from one pass of the float model over a built-in text at load (well under 2 s for
SmolLM2 on two cores). Each fold only changes its own layer's input, so one pass serves them all.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rill.kernels.ops import make_attention_metadata
from rill.services.worker.llama import LlamaModel
from rill.services.worker.llama_weights import LayerTensors
from rill.shared import envs
from rill.shared.config import ModelConfig

log = logging.getLogger("rill.worker")

KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
# Measured on SmolLM2, teacher-forced against fp32 over ~2700 chat and generated positions (0.3-0.8
# tried, per kind too; scripts/bench_quant.py --alphas shows the test chats): 0.5 is the best uniform
# value, and qkv at 0.6 (its input has the largest outlier) was better or equal in both dtypes and
# every calibration text tried. 0 for a kind leaves it unsmoothed.
DEFAULT_ALPHAS: dict[str, float] = {"qkv": 0.6, "o": 0.5, "gate_up": 0.5, "down": 0.5, "lm_head": 0.5}

# Varied ordinary text (prose, numbers, code, a list, another language) plus a chat exchange,
# so that both plain and chat-templated prompts (and their special tokens) set the maxima.
CALIBRATION_TEXT = (
    "The lighthouse keeper climbed the ninety-seven steps every evening at dusk. From the top he could see "
    "the fishing boats returning, their lamps swinging like fireflies over the dark water. In 1987 the station "
    "was automated, but he stayed on and wrote down the weather: wind north-east, 14 knots; light rain.\n\n"
    "Tomato soup (serves 4): 800 g tinned tomatoes, 1 onion, 2 cloves of garlic, 500 ml stock. Simmer for "
    "20 minutes and blend.\n\n"
    "def moving_average(values: list[float], window: int) -> list[float]:\n"
    "    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]\n\n"
    "Q: Why is the sky blue? A: Air scatters short (blue) wavelengths of sunlight far more than long (red) ones.\n"
    "Le marché ouvre à huit heures; on y trouve du pain, du fromage et des fleurs.\n"
    "Meeting notes, 3 March: budget approved (+12%), next review on 2024-04-15. Contact: team@example.org. "
    "Total: $4,250.00; 3 x 7 = 21."
)
CALIBRATION_CHAT = [
    {"role": "user", "content": "My tomato plants have yellow leaves at the bottom. What should I do?"},
    {"role": "assistant", "content": "Yellow lower leaves usually mean overwatering or a lack of nitrogen. "
                                     "Let the soil dry out between waterings, remove the yellow leaves, and feed "
                                     "the plants with a balanced fertiliser every two weeks."},
    {"role": "user", "content": "Thanks! How often should I water them in hot weather?"},
]
MAX_CALIBRATION_TOKENS = 1024


def parse_alphas(text: str) -> dict[str, float]:
    """"0.5" (every kind) or "qkv=0.6,down=0.3" (the kinds named; the rest keep their default)."""
    text = text.strip()
    if "=" not in text:
        return dict.fromkeys(KINDS, float(text))
    out = dict(DEFAULT_ALPHAS)
    for part in text.split(","):
        kind, _, value = part.partition("=")
        if kind.strip() not in KINDS:
            raise ValueError(f"RILL_SMOOTHQUANT_ALPHA: unknown layer kind {kind.strip()!r} (kinds: {', '.join(KINDS)})")
        out[kind.strip()] = float(value)
    return out


def resolve_alphas(alpha: float | Mapping[str, float] | None) -> dict[str, float]:
    """Per-kind alphas: given (a mapping names every kind it smooths), else from
    RILL_SMOOTHQUANT_ALPHA, else DEFAULT_ALPHAS."""
    if alpha is None:
        env = envs.RILL_SMOOTHQUANT_ALPHA
        return parse_alphas(env) if env else dict(DEFAULT_ALPHAS)
    if isinstance(alpha, Mapping):
        return {k: float(alpha.get(k, 0.0)) for k in KINDS}
    return dict.fromkeys(KINDS, float(alpha))


def calibration_ids(model_dir: Path, cfg: ModelConfig) -> list[list[int]]:
    """The calibration text and the chat exchange (through the model's chat template), tokenized
    with the `tokenizers` library (transformers takes seconds to import). A checkpoint without a
    tokenizer gets fixed pseudo-random ids instead."""
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.exists():
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (192, 96)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    seqs = [tok.encode(CALIBRATION_TEXT, add_special_tokens=True).ids]
    chat = _render_chat(model_dir)
    if chat is not None:
        seqs.append(tok.encode(chat, add_special_tokens=False).ids)  # the template writes its own
    return [s[:MAX_CALIBRATION_TOKENS] for s in seqs if s]


def _render_chat(model_dir: Path) -> str | None:
    """CALIBRATION_CHAT through the checkpoint's chat template (rendered as transformers does), or
    None when it has none or the template rejects it."""
    config: dict = {}
    if (model_dir / "tokenizer_config.json").exists():
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        return None

    def token(name: str) -> str:
        value = config.get(name) or ""
        return value.get("content", "") if isinstance(value, dict) else str(value)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt, time.gmtime(0))  # deterministic
        return env.from_string(template).render(messages=CALIBRATION_CHAT, add_generation_prompt=False,
                                                bos_token=token("bos_token"), eos_token=token("eos_token"))
    except Exception as exc:  # any template error only costs the chat part of the calibration
        log.warning("smoothquant: chat template not used for calibration: %s", exc)
        return None


class Probe:
    """An unquantized linear layer that records the absmax of each input channel it sees."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.absmax = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.absmax, x.abs().amax(0).float(), out=self.absmax)
        return F.linear(x, self.weight, self.bias)


@dataclass
class Stats:
    """Per-input-channel absmax of each quantized linear layer's input, fp32."""

    layers: list[dict[str, torch.Tensor]]  # per layer: "qkv", "o", "gate_up", "down"
    lm_head: torch.Tensor


def calibrate(cfg: ModelConfig, tensors: list[LayerTensors], embed: torch.Tensor, norm: torch.Tensor,
              seqs: list[list[int]]) -> Stats:
    """Run `seqs` (each from position 0, side by side in one step) through the float model."""
    layers = [t.prepare(lambda _, w, b: Probe(w, b)) for t in tensors]
    model = LlamaModel(cfg, embed, layers, norm, None, max(map(len, seqs)))
    block = 16
    per = [-(-len(s) // block) for s in seqs]
    starts = [sum(per[:i]) for i in range(len(seqs))]
    kv = model.allocate_kv_cache(sum(per), block)
    positions, meta = make_attention_metadata([list(range(s, s + n)) for s, n in zip(starts, per, strict=True)],
                                              [0] * len(seqs), [len(s) for s in seqs], block, embed.device)
    ids = torch.tensor([t for s in seqs for t in s], device=embed.device)
    with torch.inference_mode():
        final = model.final_hidden(ids, positions, meta, kv, torch.arange(len(ids), device=embed.device))
    return Stats([{k: getattr(layer, k).absmax for k in ("qkv", "o", "gate_up", "down")} for layer in layers],
                 final.abs().amax(0).float())


def factors(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = act^alpha / weight^(1 - alpha) per channel (fp32); 1 where either is zero, since a dead
    channel has nothing to balance."""
    a, w = act_max.float(), weight_max.float()
    s = a.clamp(min=1e-12).pow(alpha) / w.clamp(min=1e-12).pow(1 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


def _scaled(w: torch.Tensor, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> torch.Tensor:
    """w * rows[:, None] * cols as a new tensor (a 1-D w: w * cols), in fp32 and rounded once to
    w's dtype. Never in place: a tensor fresh from safetensors can be a copy-on-write file mapping,
    where writes fault page by page (measured 14x slower than writing a new tensor)."""
    out = w.float() * (rows[:, None] if rows is not None else cols)
    if rows is not None and cols is not None:
        out.mul_(cols)
    return out.to(w.dtype)


def _column_absmax(w: torch.Tensor) -> torch.Tensor:
    """max |w[:, j]| per column, fp32: two reductions, no |w| copy (3x faster than abs().amax(0))."""
    return torch.maximum(w.amax(0), w.amin(0).neg_()).float()


def _fold_input(act_max: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_w: torch.Tensor,
                rows: torch.Tensor | None, alpha: float
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(weight, bias, norm weight) of a linear layer fed by an RMSNorm: output rows scaled by `rows`
    first (an output-side fold), then the input channels smoothed against the norm weight."""
    if rows is not None:
        weight = _scaled(weight, rows=rows)
        bias = None if bias is None else _scaled(bias, cols=rows)
    if alpha:
        s = factors(act_max, _column_absmax(weight), alpha)  # the weight as it will be quantized
        weight, norm_w = _scaled(weight, cols=s), _scaled(norm_w, cols=1 / s)
    return weight, bias, norm_w


def fold(cfg: ModelConfig, tensors: list[LayerTensors], norm: torch.Tensor, lm_head: torch.Tensor,
         stats: Stats, alphas: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace `tensors`' weights by smoothed ones and return the smoothed (final norm, LM head).
    New tensors throughout, so a tied head's scaled copy leaves the embedding as it was."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    hkv, group, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    for t, st in zip(tensors, stats.layers, strict=True):
        # Output-side folds give row factors for qkv (V's rows) and gate_up (up's rows).
        qkv_rows = up_rows = None
        if alphas["o"]:
            # Channel (q head h, d) -> (kv head h // group, d): the largest over each group.
            act = st["o"].view(hkv, group, d).amax(1)
            wmax = _column_absmax(t.o).view(hkv, group, d).amax(1)
            s = factors(act, wmax, alphas["o"])  # [hkv, d]
            qkv_rows = torch.ones(t.qkv.shape[0], device=s.device)
            qkv_rows[q_size + kv_size:] = 1 / s.flatten()
            t.o = _scaled(t.o, cols=s[:, None, :].expand(hkv, group, d).flatten())
        if alphas["down"]:
            s = factors(st["down"], _column_absmax(t.down), alphas["down"])
            up_rows = torch.ones(t.gate_up.shape[0], device=s.device)
            up_rows[t.down.shape[1]:] = 1 / s
            t.down = _scaled(t.down, cols=s)
        t.qkv, t.qkv_bias, t.input_norm = _fold_input(st["qkv"], t.qkv, t.qkv_bias, t.input_norm, qkv_rows,
                                                      alphas["qkv"])
        t.gate_up, t.gate_up_bias, t.post_norm = _fold_input(st["gate_up"], t.gate_up, t.gate_up_bias, t.post_norm,
                                                             up_rows, alphas["gate_up"])
    if alphas["lm_head"]:
        s = factors(stats.lm_head, _column_absmax(lm_head), alphas["lm_head"])
        lm_head, norm = _scaled(lm_head, cols=s), _scaled(norm, cols=1 / s)
    return norm, lm_head


def smooth(model_dir: Path, cfg: ModelConfig, tensors: list[LayerTensors], embed: torch.Tensor,
           norm: torch.Tensor, lm_head: torch.Tensor, alpha: float | Mapping[str, float] | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrate and fold (see fold); alpha as for resolve_alphas. Returns (final norm, LM head)."""
    alphas = resolve_alphas(alpha)
    if not any(alphas.values()):
        return norm, lm_head
    t0 = time.perf_counter()
    seqs = calibration_ids(model_dir, cfg)
    stats = calibrate(cfg, tensors, embed, norm, seqs)
    out = fold(cfg, tensors, norm, lm_head, stats, alphas)
    log.info("smoothquant: alphas %s, calibrated on %d tokens in %.2f s", alphas, sum(map(len, seqs)),
             time.perf_counter() - t0)
    return out
