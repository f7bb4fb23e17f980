"""Plain-torch implementations of the kernel interface in `ops.py`, tuned for CPU.

Attention splits a mixed step in two: every single-token (decode) row is done together, by the
native kernel that reads the paged KV in place (cpu_native) when it is available, else by
gathers + batched matmuls over rows grouped by length; the multi-token (prefill chunk) rows
likewise go to one call of the native prefill kernel, else each chunk runs through SDPA on its
own. Softmax always runs in fp32.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rill.kernels import chooser, cpu_native, moe
from rill.shared import envs

if TYPE_CHECKING:
    from rill.kernels.ops import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if cpu_native.rms_norm_supported(x, weight, residual):
        return cpu_native.rms_norm(x, weight, eps, residual)  # one pass instead of six ops
    if residual is not None:
        x = x + residual  # in the model dtype, as HF adds its residuals
    # Statistics in fp32, cast back before the weight multiply (HF Llama's rounding order).
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _rope_tables(positions, cos_sin_cache)
    qk = _adjacent_heads(q, k)
    if qk is not None:  # q and k are neighbouring slices of the fused qkv output: one pass
        out = _rotate(qk, cos, sin)
        return out[:, :q.shape[1]], out[:, q.shape[1]:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cpu_native.rope_kv_supported(q, k, v, positions, cos_sin_cache, k_cache, slot_mapping):
        # One pass instead of ~10 ops, same rounding (cpu_elementwise.c).
        return cpu_native.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


# One step's cos/sin rows, reused by every layer (the model passes the same positions tensor).
_rope_memo: dict[str, object] = {}


def _rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] fp32 tables so that rope(x) = x * cos + roll(x, D/2) * sin (sin's first half negated)."""
    m = _rope_memo
    try:
        version = positions._version
    except RuntimeError:  # an inference-mode tensor has no version counter: never reuse its tables
        version = None
    if version is not None and m.get("positions") is positions and m.get("version") == version \
            and m.get("cache") is cos_sin_cache:
        return m["tables"]  # type: ignore[return-value]
    cs = cos_sin_cache.index_select(0, positions)[:, None, :]
    half = cs.shape[-1] // 2
    cos, sin = cs[..., :half], cs[..., half:]
    tables = (torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
    m.update(positions=positions, version=version, cache=cos_sin_cache, tables=tables)
    return tables


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # NeoX pairs (i, i + D/2), rotated in fp32 and stored in the input dtype.
    xf = x.float()
    return (xf * cos + xf.roll(cos.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A [T, Hq + Hkv, D] view over q and k when k's heads directly follow q's in memory."""
    if (q.dim() != 3 or q.stride() != k.stride() or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or q.dtype != k.dtype or q.stride(2) != 1 or q.stride(1) != q.shape[2]
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if cpu_native.silu_mul_supported(x):
        return cpu_native.silu_and_mul(x)  # one pass instead of three ops (cpu_elementwise.c)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2F] holding [gate | up] -> GELU_tanh(gate) * up (GeGLU, Gemma's MLP), [T, F]."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


LOGITS_SMALL_ROWS = 128  # see Linear


def gemm_candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> list[str]:
    """The implementations a Linear of this weight can run (chooser.py): oneDNN on its pre-packed
    weight; for bf16, oneDNN's fp32 GEMM on an fp32 copy of the weight (`f32`: on CPUs whose
    bf16 units are slower than their fp32 FMAs, e.g. Intel Xeons without AMX) and, on an
    AVX512-BF16 CPU, the native small GEMM."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return []
    names = ["onednn"]
    if weight.dtype == torch.bfloat16:
        names.append("f32")
    if cpu_native.small_gemm_weight_ok(weight, bias):
        names.append("small")
    return names


def small_gemm_limit(logits: bool) -> int:
    """The most rows a Linear sends to the small GEMM: its own limit; for logits at most
    LOGITS_SMALL_ROWS, where oneDNN's blocking over a vocabulary-wide output won on the CPUs it was
    first tuned on (those rows are not measured: the LM head sees sampled rows only)."""
    return min(cpu_native.small_gemm_rows(), LOGITS_SMALL_ROWS) if logits else cpu_native.small_gemm_rows()


def gemm_incumbent(names: list[str], bucket: int, logits: bool) -> str:
    """What a Linear runs at `bucket` rows without a measured choice: the small GEMM wherever it
    can (small_gemm_limit), else oneDNN."""
    return "small" if "small" in names and bucket <= small_gemm_limit(logits) else names[0]


class Linear:
    """y = x @ W.T + b. On CPU the weight is pre-packed once into oneDNN's blocked layout, which
    skips a per-call weight reorder (measured 10-60% faster GEMMs at decode batch sizes); when
    that private op is missing or disagrees with F.linear, plain F.linear is used. A bf16 weight
    can also run on the native small GEMM (AVX512-BF16 CPUs, cpu_small_gemm.c, up to
    `small_gemm_rows()` rows) or as an fp32 GEMM: which one serves a call of m rows is the
    measured choice of m's row bucket (chooser.py; `logits`: this layer is called through
    `float_out`, the LM head). Those two need their own copies of the weight, kept only when
    some bucket chose them. The route is settled when the layer is built."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, logits: bool = False) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        names = gemm_candidates(weight, bias)
        buckets = chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS
        self.route = chooser.installed().route(
            "gemm", gemm_shape(weight, logits), buckets,
            [gemm_incumbent(names, b, logits) if names else "aten" for b in buckets])
        use_small = "small" in names and self.route.uses("small")
        self.small = cpu_native.small_gemm_pack(weight) if use_small else None
        self.small_rows = small_gemm_limit(logits) if use_small else 0
        self.f32: torch.Tensor | None = None
        self.f32_bias = None if bias is None else bias.float()
        if "f32" in names and self.route.uses("f32"):
            self.f32 = _prepack(weight.float(), self.f32_bias)
        self.packed = _prepack(weight, bias) if weight.device.type == "cpu" else None
        if self.packed is not None:
            self.weight = None  # the packed copy replaces it

    @property
    def nbytes(self) -> int:
        """Bytes of the weight copies this layer keeps (the plain weight where it was not packed,
        the oneDNN-packed one, the small GEMM's and the fp32 copy where chosen); bias not counted."""
        return sum(t.nbytes for t in (self.weight, self.packed, self.small, self.f32) if t is not None)

    def _pick(self, x: torch.Tensor) -> str:
        if x.dim() != 2:
            return "onednn"
        name = self.route.pick(x.shape[0])
        if name == "small" and (self.small is None or x.shape[0] > self.small_rows):
            name = "f32"  # past the small GEMM's rows (a long prompt chunk, many logits)
        if name == "f32" and self.f32 is None:
            name = "onednn"
        return name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        name = self._pick(x)
        if name == "small":
            return cpu_native.small_gemm(x, self.small, self.out_features, self.bias)
        if name == "f32":
            return self._f32(x).to(x.dtype)
        return self._large(x)

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _f32(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float(), self.f32, self.f32_bias, "none", [], "")

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) in fp32 (logits): the small GEMM and the fp32 GEMM hand over their fp32 sums
        directly, skipping the rounding to bf16 and the widening pass over [rows, vocab] after it."""
        name = self._pick(x)
        if name == "small":
            return cpu_native.small_gemm(x, self.small, self.out_features, self.bias, torch.float32)
        if name == "f32":
            return self._f32(x)
        return self._large(x).float()


def gemm_shape(weight: torch.Tensor, logits: bool = False) -> tuple[object, ...]:
    """A Linear's key in the kernel table (see gemm_key)."""
    return gemm_key(*weight.shape, weight.dtype, logits)


def gemm_key(n: int, k: int, dtype: torch.dtype, logits: bool = False) -> tuple[object, ...]:
    """out x in features, dtype, and whether the layer makes logits."""
    return (n, k, str(dtype).removeprefix("torch."), *(("logits",) if logits else ()))


def make_experts(gate_up: torch.Tensor, down: torch.Tensor) -> moe.GroupedExperts:
    """`ops.make_experts`: one GEMM pair per expert over its gathered tokens (moe.py)."""
    return moe.GroupedExperts(gate_up, down, lambda w: Linear(w, None), silu_and_mul)


def _prepack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available() or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "").float()
        want = F.linear(probe, weight, bias).float()
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * (1 + want.abs().max().item())):
            return None
        return packed
    except (RuntimeError, AttributeError):
        return None


_INT8_MAX = 127
_MIN_ABSMAX = 1e-8  # an all-zero row or channel still gets a finite, non-zero scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q [M, K] int8, scale [M, 1] fp32) with x ~= q * scale.

    Few passes on purpose (this runs before every GEMM): one fp32 copy, divided and rounded in
    place, since per-op overhead dominates at decode batch sizes."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_(min=_MIN_ABSMAX).div_(_INT8_MAX)
    xf = xf.div_(scale) if xf is not x else xf / scale  # never write into the caller's fp32 tensor
    return xf.round_().to(torch.int8), scale


class Int8Linear:
    """y = x @ W.T + b with W8A8 dynamic quantization (CPU): W is quantized once, symmetric per
    output channel; x per row at every call. On a CPU with VNNI but no AMX, oneDNN's int8 GEMM ran
    3-7x faster than its bf16 one (the whole layer, quantization included, 2-4x), at ~1% relative
    error per output for well-spread rows, more where one channel dominates a row.

    y = (int32 accumulator) * row_scale * channel_scale (+ b), computed in fp32, returned in x's
    dtype. The weight is kept [N, K] and handed to `torch._int_mm` as its transposed view, the
    layout that measured fastest. Where `torch._int_mm` is missing or wrong for this shape
    (_int_mm_exact), or where the measured choice of a row bucket says so (chooser.py: a CPU
    without int8 dot products), the int8 values are multiplied in fp32 instead: the same
    quantization, another GEMM, and an fp32 copy of the weight kept for it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, logits: bool = False) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"--quantization int8 is CPU-only: the {weight.device.type} (Triton/cuBLAS) backend "
                             "has no int8 GEMM; serve with --quantization none")
        self.out_features, self.in_features = weight.shape
        wf = weight.to(torch.float32, copy=True)  # a copy: a tied embedding shares this weight
        self.scale = wf.abs().amax(dim=1).clamp_(min=_MIN_ABSMAX).div_(_INT8_MAX)  # [N] fp32
        self.qweight = wf.div_(self.scale[:, None]).round_().to(torch.int8).contiguous()  # [N, K]
        self.bias = None if bias is None else bias.float()
        exact = _int_mm_exact(self.qweight)
        buckets = chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS
        self.route = chooser.installed().route("gemm_int8", gemm_shape(weight, logits), buckets,
                                               ["int_mm" if exact else "fp32"] * len(buckets))
        if not exact:
            self.route = chooser.Route(self.route.buckets, ("fp32",) * len(buckets))
        self.qweight_f32 = self.qweight.float() if self.route.uses("fp32") else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        # The native quantise / dequantise passes (cpu_quant.c) compute exactly what the torch
        # code below does, in one call each instead of ~12 small ops.
        native = x2.stride(-1) == 1 and cpu_native.quant_supported(x2)
        q, row_scale = cpu_native.quantize_rows(x2, _MIN_ABSMAX) if native else quantize_rows(x2)
        if self.qweight_f32 is None or self.route.pick(x2.shape[0]) == "int_mm":
            acc = torch._int_mm(q, self.qweight.t())
            if native:
                return cpu_native.dequantize(acc, row_scale, self.scale, self.bias, x.dtype) \
                    .reshape(*lead, self.out_features)
            acc = acc.float()
        else:
            acc = q.float() @ self.qweight_f32.t()
        y = acc.mul_(row_scale).mul_(self.scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) in fp32 (logits)."""
        return self(x).float()


def _int_mm_exact(qweight: torch.Tensor) -> bool:
    """Whether `torch._int_mm` gives exact int32 results against this weight at a single row and
    at an odd number of rows. It is missing from some builds, and on CPU (torch 2.13) it silently
    returns wrong values when K == 1 (a [1, N] view whose strides read as both layouts)."""
    if not hasattr(torch, "_int_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        for rows in (1, 3):
            probe = torch.randint(-_INT8_MAX, _INT8_MAX + 1, (rows, qweight.shape[1]), generator=gen,
                                  dtype=torch.int8)
            got = torch._int_mm(probe, qweight.t())
            if not torch.equal(got, probe.int() @ qweight.int().t()):  # integer matmul: exact
                return False
    except RuntimeError:
        return False
    return True


# ------------------------------------------------------------------------------------ attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    # One plan per window size (Gemma 3 alternates two); full attention's keeps the plain key.
    key = ("torch_plan", window) if window else "torch_plan"
    plan = meta.aux.get(key)
    if plan is None:  # built on the first layer of its window, reused by the others
        plan = meta.aux[key] = _AttentionPlan(meta, q.shape[1], k_cache.shape[2], k_cache.shape[1], q.device,
                                              *attention_kernels(meta, q, k_cache), window=window)
    return attend(plan, q, k_cache, v_cache, scale, k_new, v_new, softcap)


def attention_shape(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[object, ...]:
    """Attention's key in the kernel table (see attention_key)."""
    return attention_key(q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])


def attention_key(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> tuple[object, ...]:
    """dtype, query heads, KV heads, head size."""
    return (str(dtype).removeprefix("torch."), heads, kv_heads, head_dim)


def prefill_candidates(q: torch.Tensor, k_cache: torch.Tensor) -> list[str]:
    """Prompt-chunk attention implementations for these tensors, the flag-based pick first:
    native kernels (AMX tiles, AVX512-BF16 dot products, fp32 FMAs) where they apply, and SDPA."""
    if not cpu_native.prefill_supported(q, k_cache):
        return ["sdpa"]
    names = []
    if q.dtype == torch.bfloat16:
        if q.shape[2] % 32 == 0 and cpu_native.amx_prefill_available():
            names.append("amx")
        if cpu_native.dot_prefill_available():
            names.append("dot")
    return [*names, "vector", "sdpa"]


def decode_candidates(q: torch.Tensor, k_cache: torch.Tensor) -> list[str]:
    """Decode attention implementations: the native kernel (with its register-only fast path where
    the shape allows), its generic loop, and torch's gathers + batched matmuls."""
    return ["native", "generic", "torch"] if cpu_native.decode_supported(q, k_cache) else ["torch"]


def attention_kernels(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[str, str]:
    """(decode, prefill) implementations for this step: the measured choice (chooser.py; prompt
    chunks by the longest context among them) where it is one this step can run, else the
    flag-based pick. RILL_PREFILL_KERNEL=amx|dot|vector forces the native prefill kernel."""
    table, shape = chooser.installed(), attention_shape(q, k_cache)
    decode_names = decode_candidates(q, k_cache)
    decode = table.choice("decode", shape, 0) or decode_names[0]
    prefill_names = prefill_candidates(q, k_cache)
    qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
    longest = max((seq_lens[i] for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] > 1), default=0)
    bucket = chooser.CONTEXT_BUCKETS[min(bisect.bisect_left(chooser.CONTEXT_BUCKETS, longest),
                                         len(chooser.CONTEXT_BUCKETS) - 1)]
    prefill = table.choice("prefill", shape, bucket) or prefill_names[0]
    forced = envs.RILL_PREFILL_KERNEL
    if forced in ("amx", "dot", "vector") and "vector" in prefill_names:
        prefill = forced
    return (decode if decode in decode_names else decode_names[0],
            prefill if prefill in prefill_names else prefill_names[0])


def attend(plan: _AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Attention of every row of a step, by the implementations its plan chose; `softcap`: scores
    s become softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.native is not None:
        n = plan.native
        cpu_native.paged_decode(q, k_cache, v_cache, n.block_tables, n.seq_lens, n.rows, out, n.max_len, scale,
                                generic_only=plan.decode_kernel == "generic", window=plan.window, softcap=softcap)
    if plan.native_prefill is not None:
        p = plan.native_prefill
        cpu_native.paged_prefill(q, k_cache, v_cache, p.block_tables, p.q_starts, p.q_lens, p.ctx_lens, out, scale,
                                 kernel=plan.prefill_kernel, window=plan.window, softcap=softcap)
    for group in plan.decode_groups:
        out.index_copy_(0, group.rows, _decode(q.index_select(0, group.rows), k_cache, v_cache, group, scale,
                                               softcap))
    for start, end, ctx_len, key_start, blocks in plan.prefills:
        if ctx_len == 0 and k_new is not None and v_new is not None:
            k, v = k_new[start:end], v_new[start:end]
        else:
            # The gathered blocks start at key_start (a window's first block); the sequence ends
            # ctx_len + (end - start) - key_start keys in.
            keys = ctx_len + end - start - key_start
            k = _gather(k_cache, blocks)[:keys]
            v = _gather(v_cache, blocks)[:keys]
        out[start:end] = _prefill(q[start:end], k, v, ctx_len, scale, key_start, plan.window, softcap)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' rows, contiguous: [len(blocks) * block_size, kv_heads, head_dim]."""
    return cache.index_select(0, blocks).flatten(0, 1)


# A decode group costs a handful of op launches per layer on top of its KV traffic; in units of
# one (row, block) of padded KV, that overhead is worth about this many:
_GROUP_OVERHEAD_BLOCKS = 48


def split_by_length(nblocks: list[int], overhead: int = _GROUP_OVERHEAD_BLOCKS) -> list[list[int]]:
    """Groups of row indices, each padded to its longest row's block count, chosen to minimise
    padded (row, block) pairs plus `overhead` per group: rows of very different lengths then no
    longer all pay for the longest one. Exact DP over the rows sorted by length (O(n^2), n <= a
    few hundred, once per step)."""
    order = sorted(range(len(nblocks)), key=lambda i: nblocks[i])
    lens = [nblocks[i] for i in order]
    n = len(lens)
    best = [0] + [0] * n  # best[j]: cost of grouping the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        # The group ending at row j-1 (the longest so far) pads every member to lens[j-1].
        best[j], cut[j] = min((best[i] + (j - i) * lens[j - 1] + overhead, i) for i in range(j))
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def first_window_block(first_query: int, window: int | None, block_size: int) -> int:
    """The first block a query at `first_query` (or later) reads: its window's, else block 0."""
    return max(0, first_query - window + 1) // block_size if window else 0


class _DecodeGroup:
    """Single-token rows of similar lengths: their KV gathered and padded together, with the mask
    that drops positions past each row's end (or before its sliding window) and (query head, kv
    head) pairs of other groups. With a window each row's blocks start at its window's first one,
    so table entries before it (blocks already released) are never read."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int], num_heads: int, num_kv_heads: int,
                 block_size: int, device: torch.device, window: int | None = None) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        idx = torch.tensor(seqs, dtype=torch.int64)
        lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int64)
        first = torch.tensor([first_window_block(seq_lens[i] - 1, window, block_size) for i in seqs])
        count = -(-lens // block_size) - first
        nblocks = int(count.max())
        self.rows = torch.tensor([qsl[i] for i in seqs], dtype=torch.int64, device=device)
        tables = meta.block_tables.index_select(0, idx.to(meta.block_tables.device)).to(torch.int64)
        # Row i reads blocks first[i] .. first[i] + count[i] - 1, then pads with block 0 (masked).
        cols = first[:, None] + torch.arange(nblocks)[None, :]
        used = (torch.arange(nblocks)[None, :] < count[:, None]).to(tables.device)
        picked = tables.gather(1, cols.clamp(max=tables.shape[1] - 1).to(tables.device))
        self.blocks = torch.where(used, picked, 0).flatten().to(device)
        self.num = len(seqs)
        padded = nblocks * block_size
        # Scores are taken against every (position, kv head) pair of a sequence in one bmm over a
        # contiguous [padded * kv_heads, head_dim] view, so no per-head copy of the gathered KV is
        # needed; the mask then drops positions past the sequence's end and the pairs whose kv head
        # is not the query head's group. That trades kv_heads x more (cheap) FLOPs for one fewer
        # pass over memory, which wins for the few-kv-head models a CPU serves.
        group = num_heads // num_kv_heads
        pos = first[:, None] * block_size + torch.arange(padded)[None, :]  # [n, padded]
        past_end = pos >= lens[:, None]
        if window:
            past_end |= pos < lens[:, None] - window
        other_head = (torch.arange(num_heads)[:, None] // group) != torch.arange(num_kv_heads)[None, :]
        masked = past_end[:, None, :, None] | other_head[None, :, None, :]  # [n, H, padded, Hkv]
        self.mask = torch.zeros(masked.shape, dtype=torch.float32) \
            .masked_fill_(masked, float("-inf")).view(len(seqs), num_heads, padded * num_kv_heads).to(device)


def _native_tables(meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
    """The block-table rows of `seqs`, int32 and contiguous, as the native kernels read them."""
    idx = torch.tensor(seqs, dtype=torch.int64)
    return meta.block_tables.index_select(0, idx).to(torch.int32).contiguous()


class _NativeDecode:
    """The single-token rows' block tables, lengths and q rows, for the native kernel."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int]) -> None:
        self.block_tables = _native_tables(meta, seqs)
        self.seq_lens = torch.tensor([meta.seq_lens_host[i] for i in seqs], dtype=torch.int32)
        self.rows = torch.tensor([meta.query_start_loc_host[i] for i in seqs], dtype=torch.int64)
        self.max_len = max(meta.seq_lens_host[i] for i in seqs)


class _NativePrefill:
    """The multi-token rows' block tables, query starts, lengths and context lengths, for the
    native prefill kernel."""

    def __init__(self, meta: AttentionMetadata, seqs: list[int]) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        self.block_tables = _native_tables(meta, seqs)
        self.q_starts = torch.tensor([qsl[i] for i in seqs], dtype=torch.int32)
        self.q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in seqs], dtype=torch.int32)
        self.ctx_lens = torch.tensor([seq_lens[i] - (qsl[i + 1] - qsl[i]) for i in seqs], dtype=torch.int32)


class _AttentionPlan:
    """Index tensors and masks for one step, shared by every layer. `decode_kernel`: native,
    generic or torch; `prefill_kernel`: amx, dot, vector (native) or sdpa (see attention_kernels)."""

    def __init__(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int, block_size: int,
                 device: torch.device, decode_kernel: str = "torch", prefill_kernel: str = "sdpa",
                 window: int | None = None) -> None:
        qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
        self.decode_kernel, self.prefill_kernel = decode_kernel, prefill_kernel
        self.window = window or None  # sliding-window size of the layers this plan serves
        decodes = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        prefills = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] > 1]
        # Multi-token rows: one call of the native kernel, which reads the paged KV in place;
        # else SDPA per row over its keys (gathered when it has context).
        native_prefill = prefill_kernel != "sdpa"
        self.native_prefill = _NativePrefill(meta, prefills) if native_prefill and prefills else None
        self.prefills: list[tuple[int, int, int, int, torch.Tensor]] = []
        if self.native_prefill is None:
            for i in prefills:
                start, end = qsl[i], qsl[i + 1]
                ctx_len = seq_lens[i] - (end - start)
                first = first_window_block(ctx_len, self.window, block_size)
                blocks = meta.block_tables[i, first:-(-seq_lens[i] // block_size)].to(torch.int64)
                self.prefills.append((start, end, ctx_len, first * block_size, blocks))
        # Single-token rows: one call of the native kernel, else length groups in plain torch.
        self.native = _NativeDecode(meta, decodes) if decode_kernel != "torch" and decodes else None
        if self.native is not None:
            decodes = []
        groups = split_by_length([-(-seq_lens[i] // block_size)
                                  - first_window_block(seq_lens[i] - 1, self.window, block_size)
                                  for i in decodes]) if decodes else []
        self.decode_groups = [_DecodeGroup(meta, [decodes[j] for j in g], num_heads, num_kv_heads, block_size,
                                           device, self.window) for g in groups]


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap) in place (fp32 scores), or the scores as they are."""
    return scores if not softcap else scores.div_(softcap).tanh_().mul_(softcap)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    head_dim = q.shape[-1]
    k = k_cache.index_select(0, group.blocks).view(group.num, -1, head_dim)  # [n, padded*Hkv, D]
    v = v_cache.index_select(0, group.blocks).view(group.num, -1, head_dim)
    scores = soft_cap(torch.bmm(q, k.transpose(1, 2)).float().mul_(scale), softcap).add_(group.mask)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, v)  # [n, H, D]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float,
             key_start: int = 0, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [n, H, D] at positions ctx_len..ctx_len+n-1 over k, v [ctx_len+n-key_start, Hkv, D]
    (the keys from position key_start on); `window`: a query at p sees keys p - window + 1 .. p."""
    n = q.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if softcap:
        # SDPA has no soft-cap: scores, cap, mask and softmax spelled out (fp32, as in _decode).
        group = q.shape[1] // k.shape[1]
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        scores = soft_cap(torch.matmul(qt, kt.transpose(-1, -2)).float().mul_(scale), softcap)
        keys = key_start + torch.arange(k.shape[0], device=q.device)
        query_pos = (ctx_len + torch.arange(n, device=q.device))[:, None]
        hidden = keys[None, :] > query_pos
        if window:
            hidden |= keys[None, :] <= query_pos - window
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(probs, vt)[0].transpose(0, 1)
    if ctx_len == 0 and key_start == 0 and not window:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position ctx_len + i and sees keys up to ctx_len + i.
        keys = key_start + torch.arange(k.shape[0], device=q.device)
        query_pos = (ctx_len + torch.arange(n, device=q.device))[:, None]
        mask = keys[None, :] <= query_pos
        if window:
            mask &= keys[None, :] > query_pos - window
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
