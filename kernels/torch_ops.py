"""Plain-torch implementations of the kernel interface in `ops.py`, tuned for CPU: the KV write,
RMSNorm, RoPE, activations and the linear layers (float and int8); paged attention is in
`torch_attention` and re-exported here, as the interface wants it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rill.kernels import chooser, cpu_native, moe
from rill.kernels.torch_attention import paged_attention  # noqa: F401 (ops dispatches through this module)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is None and x.dim() == 2 and x.stride(-1) == 1 and not x.is_contiguous():
        # Rows of a wider tensor (one kv head's k, sliced from the fused qkv output): normed from
        # a copy by the native pass, as every other row is, not by the ops below (other bits).
        x = x.contiguous()
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


SILU_OP = "silu_mul"
_silu_routes: dict[tuple[int, torch.dtype], chooser.Route] = {}
_silu_table: chooser.KernelTable | None = None


def silu_key(f: int, dtype: torch.dtype) -> tuple[object, ...]:
    return (f, str(dtype).removeprefix("torch."))


def silu_incumbent() -> str:
    """The chooser's incumbent for SiLU(gate) * up: native where its 16-lane path is built."""
    return "native" if cpu_native.silu_mul_vec16() else "torch"


def silu_route(f: int, dtype: torch.dtype) -> chooser.Route:
    """Native (one pass, cpu_elementwise.c) or torch's three ops for SiLU(gate) * up of width f,
    per row bucket, as measured on this machine (cpu_tuning.silu_probe)."""
    global _silu_table
    table = chooser.installed()
    if table is not _silu_table:
        _silu_routes.clear()
        _silu_table = table
    route = _silu_routes.get((f, dtype))
    if route is None:
        route = _silu_routes[(f, dtype)] = table.route(SILU_OP, silu_key(f, dtype), chooser.ROW_BUCKETS,
                                                        [silu_incumbent()] * len(chooser.ROW_BUCKETS))
    return route


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in torch's ops, [..., 2F] -> [..., F]: the chooser's other candidate."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if cpu_native.silu_mul_supported(x) and silu_route(x.shape[1] // 2, x.dtype).pick(x.shape[0]) == "native":
        return cpu_native.silu_and_mul(x)
    return silu_mul_torch(x)


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


def _route(weight: torch.Tensor, bias: torch.Tensor | None, logits: bool,
           rows: tuple[int, ...] | None) -> tuple[chooser.Route, bool, bool]:
    """A Linear's installed route, and whether it keeps the small GEMM's copy and an fp32 one."""
    names = gemm_candidates(weight, bias)
    buckets = chooser.LOGIT_BUCKETS if logits else chooser.ROW_BUCKETS
    route = chooser.installed().route("gemm", gemm_shape(weight, logits), buckets,
                                      [gemm_incumbent(names, b, logits) if names else "aten" for b in buckets])
    return route, "small" in names and route.uses("small", rows), "f32" in names and route.uses("f32", rows)


def copy_bytes(n: int, k: int, dtype: torch.dtype, logits: bool = False, rows: tuple[int, ...] | None = None) -> int:
    """Bytes the weight copies of a CPU Linear of an [n, k] `dtype` weight would take, as the
    installed choices stand (the weight or its oneDNN-packed twin, plus the chosen extras)."""
    _, small, f32 = _route(torch.empty((1, k), dtype=dtype).expand(n, k), None, logits, rows)
    return n * k * (dtype.itemsize + (2 if small else 0) + (4 if f32 else 0))


class Linear:
    """y = x @ W.T + b. On CPU the weight is pre-packed once into oneDNN's blocked layout, which
    skips a per-call weight reorder (faster GEMMs at decode batch sizes); when
    that private op is missing or disagrees with F.linear, plain F.linear is used. A bf16 weight
    can also run on the native small GEMM (AVX512-BF16 CPUs, cpu_small_gemm.c, up to
    `small_gemm_rows()` rows) or as an fp32 GEMM: which one serves a call of m rows is the
    measured choice of m's row bucket (chooser.py; `logits`: this layer is called through
    `float_out`, the LM head). Those two need their own copies of the weight, kept only when
    some bucket chose them (`rows`: the buckets it will be called for, when another layer serves
    the rest: a GGUF layer's blocks). The route is settled when the layer is built."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, logits: bool = False,
                 rows: tuple[int, ...] | None = None) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.route, use_small, use_f32 = _route(weight, bias, logits, rows)
        self.rows = rows
        self.small = cpu_native.small_gemm_pack(weight) if use_small else None
        self.small_rows = small_gemm_limit(logits) if use_small else 0
        self.f32: torch.Tensor | None = None
        self.f32_bias = None if bias is None else bias.float()
        if use_f32:
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
    output channel; x per row at every call. On a CPU with VNNI, oneDNN's int8 GEMM runs several
    times faster than its bf16 one (scripts/benchmarks.md), at a small relative error per output
    for well-spread rows, more where one channel dominates a row.

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
