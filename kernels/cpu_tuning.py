"""What the kernel chooser (chooser.py) times for one model on this machine: every op that has
more than one CPU implementation, on the model's own shapes, at each bucket where the choice
may differ. `tune_model` measures what the cache lacks and installs the table; `tune_gguf` does
the same for the GGUF block-quantized layers (gguf_linear.QuantLinear) of a GGUF model.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rill.kernels import (
    chooser,
    cpu_native,
    gguf_blocks,
    gguf_linear,
    gguf_native,
    torch_attention,
    torch_ops,
)
from rill.kernels.chooser import KernelTable, Probe
from rill.kernels.ops import make_attention_metadata

log = logging.getLogger("rill.kernels")

BLOCK_SIZE = 16
PREFILL_CHUNK = 512  # a typical CPU prompt chunk (the budget is measured per machine: worker/step_budget.py)
DECODE_BATCH, DECODE_CONTEXT = 32, 512
# What a decode step's rows agreeing bit for bit, whatever shares the step, is worth: this share of
# a decode-sized bucket's GEMM time (settle_decode_rows).
DECODE_PIN_PRICE = 0.10


@dataclass(frozen=True)
class ModelShapes:
    """The shapes a Llama-style model's step runs: each linear layer's (out, in) features, the LM
    head's, and the attention heads."""

    linears: tuple[tuple[int, int], ...]
    logits: tuple[int, int]
    heads: int
    kv_heads: int
    head_dim: int
    silu_widths: tuple[int, ...] = ()  # F of each SiLU(gate) * up the model runs (SwiGLU MLPs, experts)

    @classmethod
    def of(cls, cfg) -> ModelShapes:  # cfg: shared.config.ModelConfig (duck-typed: kernels import no services)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        h, f = cfg.hidden_size, cfg.intermediate_size
        e = getattr(cfg, "moe_intermediate_size", None)  # experts narrower than the dense MLP (Qwen3-MoE)
        experts = ((2 * e, h), (h, e)) if e and e != f else ()
        silu = (f, *((e,) if e and e != f else ())) if cfg.hidden_act == "silu" else ()
        return cls(linears=((q + 2 * kv, h), (h, q), (2 * f, h), (h, f), *experts), logits=(cfg.vocab_size, h),
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   silu_widths=silu)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@functools.lru_cache(maxsize=2)
def _gemm_weights(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[str], dict[str, torch.Tensor]]:
    """A random weight, the GEMM candidates for it and each one's prepared copy: built once per
    shape for all its row buckets (an LM head's copies take longer to make than to time)."""
    weight = (torch.randn(n, k, generator=_gen()) * k ** -0.5).to(dtype)
    names = torch_ops.gemm_candidates(weight, None)
    prepared = {"onednn": torch_ops._prepack(weight, None)}
    if "small" in names:
        prepared["small"] = cpu_native.small_gemm_pack(weight)
    if "f32" in names:
        prepared["f32"] = torch_ops._prepack(weight.float(), None)
    names = [m for m in names if prepared.get(m) is not None]
    return weight, names, prepared


def gemm_probe(n: int, k: int, dtype: torch.dtype, rows: int, logits: bool) -> Probe | None:
    """Float GEMM candidates of one weight at `rows` rows; None when there is nothing to choose."""
    weight, names, w = _gemm_weights(n, k, dtype)
    if len(names) < 2 or "onednn" not in names:
        return None
    x = torch.randn(rows, k, generator=_gen()).to(dtype)
    out_dtype = torch.float32 if logits else dtype
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w["onednn"], None, "none", [], "").to(out_dtype),
        "small": lambda: cpu_native.small_gemm(x, w["small"], n, None, out_dtype),
        "f32": lambda: torch.ops.mkldnn._linear_pointwise(x.float(), w["f32"], None, "none", [], "").to(out_dtype),
    }
    first = torch_ops.gemm_incumbent(names, rows, logits)
    order = [first, *(m for m in names if m != first)]
    return Probe("gemm", torch_ops.gemm_shape(weight, logits), rows, {m: impls[m] for m in order})


@functools.lru_cache(maxsize=2)
def _int8_layer(n: int, k: int, dtype: torch.dtype, logits: bool) -> torch_ops.Int8Linear | None:
    """A random int8 layer with both GEMMs' weights, once per shape; None without a usable
    `torch._int_mm` (then only the fp32 GEMM can serve: nothing to choose)."""
    weight = (torch.randn(n, k, generator=_gen()) * k ** -0.5).to(dtype)
    lin = torch_ops.Int8Linear(weight, None, logits)
    if not torch_ops._int_mm_exact(lin.qweight):
        return None
    lin.qweight_f32 = lin.qweight.float()
    return lin


def int8_probe(n: int, k: int, dtype: torch.dtype, rows: int, logits: bool) -> Probe | None:
    """int8 GEMM candidates (oneDNN's s8 GEMM, or the int8 values in fp32) of one weight."""
    lin = _int8_layer(n, k, dtype, logits)
    if lin is None:
        return None
    x = torch.randn(rows, k, generator=_gen()).to(dtype)
    forced = {name: chooser.Route((rows,), (name,)) for name in ("int_mm", "fp32")}

    def run(name: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            lin.route = forced[name]
            return lin(x)
        return call

    return Probe("gemm_int8", torch_ops.gemm_key(n, k, dtype, logits), rows, {m: run(m) for m in forced})


def _paged(seq_lens: list[int], query_lens: list[int], shapes: ModelShapes, dtype: torch.dtype):
    """Random q and a paged cache holding `seq_lens` tokens per sequence, with its metadata."""
    g = _gen()
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(sum(blocks), generator=g).tolist()
    tables, at = [], 0
    for b in blocks:
        tables.append(ids[at:at + b])
        at += b
    cache_shape = (sum(blocks), BLOCK_SIZE, shapes.kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    _, meta = make_attention_metadata(tables, [s - q for s, q in zip(seq_lens, query_lens, strict=True)],
                                      query_lens, BLOCK_SIZE)
    q = torch.randn(sum(query_lens), shapes.heads, shapes.head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def _attention_probe(op: str, bucket: int, names: list[str], q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta, shapes: ModelShapes, fresh: bool = False) -> Probe | None:
    if len(names) < 2:
        return None
    scale = shapes.head_dim ** -0.5
    # A fresh prompt's keys are handed to attention beside the cache, as the model does.
    k_new = k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] if fresh else None
    v_new = v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] if fresh else None

    def run(name: str) -> Callable[[], torch.Tensor]:
        kernels = (name, "sdpa") if op == "decode" else ("native", name)
        plan = torch_attention._AttentionPlan(meta, shapes.heads, shapes.kv_heads, BLOCK_SIZE, q.device, *kernels)
        return lambda: torch_attention.attend(plan, q, k_cache, v_cache, scale, k_new, v_new)

    return Probe(op, torch_attention.attention_shape(q, k_cache), bucket, {m: run(m) for m in names})


def prefill_probe(shapes: ModelShapes, dtype: torch.dtype, bucket: int) -> Probe | None:
    """One prompt chunk of PREFILL_CHUNK tokens whose context reaches a quarter of the bucket (at
    least the chunk itself): a fresh short prompt for the first bucket, a long prompt's later chunk after."""
    seq = max(PREFILL_CHUNK, bucket // 4)
    q, k_cache, v_cache, meta = _paged([seq], [PREFILL_CHUNK], shapes, dtype)
    return _attention_probe("prefill", bucket, torch_attention.prefill_candidates(q, k_cache), q, k_cache, v_cache, meta,
                            shapes, fresh=seq == PREFILL_CHUNK)


def decode_probe(shapes: ModelShapes, dtype: torch.dtype) -> Probe | None:
    q, k_cache, v_cache, meta = _paged([DECODE_CONTEXT] * DECODE_BATCH, [1] * DECODE_BATCH, shapes, dtype)
    return _attention_probe("decode", 0, torch_attention.decode_candidates(q, k_cache), q, k_cache, v_cache, meta, shapes)


def silu_probe(f: int, dtype: torch.dtype, rows: int) -> Probe | None:
    """SiLU(gate) * up of width f over `rows` rows: the native pass against torch's three ops."""
    if cpu_native.library() is None:
        return None
    x = (torch.randn(rows, 2 * f, generator=_gen()) * 4).to(dtype)
    impls = {"native": lambda: cpu_native.silu_and_mul(x), "torch": lambda: torch_ops.silu_mul_torch(x)}
    first = torch_ops.silu_incumbent()
    return Probe(torch_ops.SILU_OP, torch_ops.silu_key(f, dtype), rows,
                 {n: impls[n] for n in sorted(impls, key=lambda n: n != first)})


def model_probes(shapes: ModelShapes, dtype: torch.dtype, quantization: str = "none") \
        -> list[Callable[[], Probe | None]]:
    """Every probe of one model, each built only when measured (a cached entry costs nothing)."""
    # SiLU * up first: cheap, and it decides whether the layer driver runs at all (decode_layers.py),
    # so a start that runs out of its time budget (chooser.TOTAL_S) has it measured.
    makers: list[Callable[[], Probe | None]] = [lambda f=f, rows=rows: silu_probe(f, dtype, rows)
                                                for f in shapes.silu_widths for rows in chooser.ROW_BUCKETS]
    gemm = int8_probe if quantization == "int8" else gemm_probe
    for (n, k), logits in [*((s, False) for s in shapes.linears), (shapes.logits, True)]:
        for rows in chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS:
            makers.append(lambda n=n, k=k, rows=rows, logits=logits: gemm(n, k, dtype, rows, logits))
    for bucket in chooser.CONTEXT_BUCKETS:
        makers.append(lambda bucket=bucket: prefill_probe(shapes, dtype, bucket))
    makers.append(lambda: decode_probe(shapes, dtype))
    return makers


def entry_keys(shapes: ModelShapes, dtype: torch.dtype, quantization: str = "none") -> list[str]:
    """The table keys of model_probes, in the same order (without building any probe)."""
    op = "gemm_int8" if quantization == "int8" else "gemm"
    keys = [KernelTable.key(torch_ops.SILU_OP, torch_ops.silu_key(f, dtype), rows)
            for f in shapes.silu_widths for rows in chooser.ROW_BUCKETS]
    for (n, k), logits in [*((s, False) for s in shapes.linears), (shapes.logits, True)]:
        shape = torch_ops.gemm_key(n, k, dtype, logits)
        for rows in chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS:
            keys.append(KernelTable.key(op, shape, rows))
    attn = torch_attention.attention_key(dtype, shapes.heads, shapes.kv_heads, shapes.head_dim)
    keys += [KernelTable.key("prefill", attn, b) for b in chooser.CONTEXT_BUCKETS]
    keys.append(KernelTable.key("decode", attn, 0))
    return keys


def tune_model(shapes: ModelShapes, dtype: torch.dtype, quantization: str = "none",
               remeasure: bool = False) -> tuple[KernelTable, list[str]]:
    """Measure what the cache lacks for this model (once per machine key), install the table and
    return it with this model's keys."""
    if not cpu_native.enabled():
        return KernelTable(), []
    keys = entry_keys(shapes, dtype, quantization)
    try:
        table, _ = chooser.tune(model_probes(shapes, dtype, quantization), keys, remeasure=remeasure)
    finally:
        _gemm_weights.cache_clear()
        _int8_layer.cache_clear()
    chooser.install(table)
    return table, keys


# ------------------------------------------------------------------------------ GGUF layers

GgufShape = tuple[int, int, int]  # (out features n, in features k, ggml type id) of one weight part


WAKE_N = 64  # output features of the small layer a cold probe runs first (Probe.primes)


@functools.cache  # every shape of one tune_gguf (measured bucket by bucket over them)
def _gguf_layers(n: int, k: int, qtype: int, dtype: torch.dtype, logits: bool) \
        -> tuple[gguf_linear.QuantLinear, gguf_linear.QuantLinear] | None:
    """A random one-part QuantLinear switched between "blocks" and "dequant", and one on the same
    blocks forced to "float" (its float copy a torch_ops.Linear built as the installed table's
    "gemm" entries say, as it would serve), once per shape for all its row buckets; None where the
    native library cannot run the block routes (nothing to choose)."""
    if not (gguf_native.format_supported(qtype) and gguf_native.dequant_supported(qtype)):
        return None
    raw = gguf_blocks.random_blocks(qtype, n, k, scale=0.01)
    # The rows only where serving keeps them too: elsewhere "dequant" reads the x16 copy, as it serves.
    blocks = gguf_linear.QuantLinear([(qtype, raw)], k, None, dtype, logits,
                                     keep_rows=qtype in gguf_blocks.X16_KEEPS_ROWS)
    blocks.force("blocks")  # drops a float copy the table may have asked for
    floats = gguf_linear.QuantLinear([(qtype, raw)], k, None, dtype, logits, keep_rows=True)
    floats.force("float")
    return blocks, floats


def gguf_probe(n: int, k: int, qtype: int, dtype: torch.dtype, rows: int, logits: bool) -> Probe | None:
    """QuantLinear's three routes ("blocks", "dequant", "float") on one part shape at `rows` rows,
    the unmeasured choice of that bucket first. "float" runs the float copy's Linear with the
    routes of the installed "gemm" entries: tune_gguf measures those first."""
    layers = _gguf_layers(n, k, qtype, dtype, logits)
    small = _gguf_layers(WAKE_N if n != WAKE_N else 2 * WAKE_N, k, qtype, dtype, logits)
    if layers is None or small is None:
        return None
    x = torch.randn(rows, k, generator=_gen()).to(dtype)

    def run(name: str, layers: tuple[gguf_linear.QuantLinear, gguf_linear.QuantLinear]) -> Callable[[], torch.Tensor]:
        lin = layers[1] if name == "float" else layers[0]

        def call() -> torch.Tensor:
            if name != "float":
                lin.force(name)  # a route switch only: this layer keeps no float copy
            return lin.float_out(x) if logits else lin(x)
        return call

    first = gguf_linear.incumbent(rows, qtype)
    order = [first, *(r for r in gguf_linear.ROUTES if r != first)]
    return Probe(gguf_linear.OP, gguf_linear.gguf_key(n, k, qtype, dtype, logits), rows,
                 {m: run(m, layers) for m in order}, cold=True, primes={m: run(m, small) for m in order})


def _gguf_cases(shapes: list[GgufShape], logits: GgufShape | None) -> list[tuple[GgufShape, bool, int]]:
    cases = [(s, False, rows) for s in dict.fromkeys(shapes) for rows in chooser.ROW_BUCKETS]
    if logits is not None:
        cases += [(logits, True, rows) for rows in chooser.LOGIT_BUCKETS]
    # Bucket by bucket over every part, the head included: a start out of its time budget
    # (chooser.TOTAL_S) leaves the widest, prompt-sized buckets to the next one, and the decode-row
    # pin, which needs every part timed at a bucket (settle_decode_rows), reaches as far as it will.
    return sorted(cases, key=lambda case: case[2])


def tune_gguf(shapes: list[GgufShape], dtype: torch.dtype, logits: GgufShape | None = None,
              remeasure: bool = False) -> tuple[KernelTable, list[str]]:
    """Measure QuantLinear's route per part shape and row bucket where the cache lacks it (once per
    machine key), install the table (with every entry cached before, e.g. tune_model's) and
    return it with these keys. `shapes`: each weight part's (n, k, qtype) (a fused QKV of two
    formats is two parts); `logits`: the LM head's, when it is a QuantLinear. Build the layers after.

    First the "gemm" entries of each part's float copy (the float route's torch_ops.Linear, in
    `dtype`) are measured and installed, so that the "float" candidate is timed as it would serve;
    the returned keys are the "gguf_gemm" ones."""
    if not cpu_native.enabled():
        return KernelTable(), []
    cases = _gguf_cases(shapes, logits)
    # The float copies' GEMMs shape by shape: _gemm_weights holds two shapes, not a model's.
    floats = sorted(dict.fromkeys((n, k, lg, rows) for (n, k, _), lg, rows in cases), key=lambda f: f[:3])
    gemm_keys = [KernelTable.key("gemm", torch_ops.gemm_key(n, k, dtype, lg), rows) for n, k, lg, rows in floats]
    gemm_makers = [lambda n=n, k=k, lg=lg, rows=rows: gemm_probe(n, k, dtype, rows, lg) for n, k, lg, rows in floats]
    keys = [KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(n, k, q, dtype, lg), rows)
            for (n, k, q), lg, rows in cases]
    makers = [lambda n=n, k=k, q=q, lg=lg, rows=rows: gguf_probe(n, k, q, dtype, rows, lg)
              for (n, k, q), lg, rows in cases]
    try:
        table, _ = chooser.tune(gemm_makers, gemm_keys, remeasure=remeasure)
        chooser.install(table)
        _gemm_weights.cache_clear()
        table, _ = chooser.tune(makers, keys, remeasure=remeasure)
    finally:
        _gemm_weights.cache_clear()
        _gguf_layers.cache_clear()
    settle_lone_floats(table, cases, dtype)
    if (settled := settle_decode_rows(table, shapes, logits, dtype)) is not None:
        unpriced = [b for b in chooser.DECODE_BUCKETS if b > max(settled[1])]
        log.info("gguf decode steps: on the blocks up to %d rows (their GEMM time over the fastest routes' "
                 "at %s; %+.0f%% allowed%s)", settled[0],
                 ", ".join(f"{b} rows {100 * p:+.0f}%" for b, p in settled[1].items()), 100 * DECODE_PIN_PRICE,
                 f"; {', '.join(map(str, unpriced))} rows not measured yet" if unpriced else "")
    chooser.install(table)
    return table, keys


def settle_lone_floats(table: KernelTable, cases: list[tuple[GgufShape, bool, int]], dtype: torch.dtype) -> None:
    """A part whose blocks won at the buckets on both sides of a "float" one keeps its blocks there
    too: a route's time grows smoothly with the rows, so a lone win is the measurement's noise, and
    it would keep a float copy of the part (2-4x the blocks' bytes) for that one bucket alone."""
    by_part: dict[tuple[GgufShape, bool], list[int]] = {}
    for shape, logits, rows in cases:
        by_part.setdefault((shape, logits), []).append(rows)
    for ((n, k, q), logits), buckets in by_part.items():
        keys = [KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(n, k, q, dtype, logits), b) for b in buckets]
        choices = [table.entries.get(key, {}).get("choice") for key in keys]
        for i in range(1, len(keys) - 1):
            if choices[i] == "float" and choices[i - 1] == choices[i + 1] == "blocks":
                table.entries[keys[i]] = {**table.entries[keys[i]], "choice": "blocks", "settled": "lone float"}


def settle_decode_rows(table: KernelTable, shapes: list[GgufShape], logits: GgufShape | None,
                       dtype: torch.dtype) -> tuple[int, dict[int, float]] | None:
    """Every part on its blocks at the buckets from 1 row up to the first where that costs more
    than DECODE_PIN_PRICE over the measured choices (summed over the model's parts, each as often
    as the model has it, and the head), chooser.DECODE_ROWS at most. Only the blocks GEMMs give a
    row the same bits whatever rows share the call, and a GGUF model's 8-bit rounding of each
    activation row turns a last-bit difference into another greedy text within tens of tokens:
    pinned, the verify rows of a speculative or predicted step are computed as decoding computes
    them (and so accept what it gives), and a decode row as in a decode step of another pinned
    size. The pin also stops before a bucket where some part's blocks were not timed (a first start
    out of time, e.g. a big LM head's widest buckets): its price is unknown. Returns (the most rows
    pinned, 0 for none; each priced bucket's price); None where not even 1 row could be priced."""
    parts = [(shape, False, n) for shape, n in Counter(shapes).items()] + ([(logits, True, 1)] if logits else [])
    prices: dict[int, float] = {}
    keys: dict[int, list[str]] = {}
    for bucket in chooser.DECODE_BUCKETS:
        if (priced := _pin_price(table, parts, dtype, bucket)) is None:
            break
        prices[bucket], keys[bucket] = priced
    if not prices:
        return None
    pinned = 0
    for bucket, price in prices.items():
        if price > DECODE_PIN_PRICE:
            break
        pinned = bucket
        for key in keys[bucket]:
            if table.entries[key]["choice"] != "blocks":
                table.entries[key] = {**table.entries[key], "choice": "blocks", "settled": "decode rows"}
    return pinned, prices


def _pin_price(table: KernelTable, parts: list[tuple[GgufShape, bool, int]], dtype: torch.dtype,
               bucket: int) -> tuple[float, list[str]] | None:
    """(the blocks' GEMM time at `bucket` over the measured choices', the parts' keys); None where
    some part's blocks or choice were not timed there."""
    chosen = blocks = 0.0
    keys = []
    for (n, k, q), lg, count in parts:
        key = KernelTable.key(gguf_linear.OP, gguf_linear.gguf_key(n, k, q, dtype, lg), bucket)
        entry = table.entries.get(key, {})
        us = entry.get("us", {})
        if "blocks" not in us or entry.get("choice") not in us:
            return None
        chosen, blocks = chosen + count * us[entry["choice"]], blocks + count * us["blocks"]
        keys.append(key)
    return blocks / max(chosen, 1e-9) - 1, keys
