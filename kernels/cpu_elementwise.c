// Element-wise passes of a Llama layer, one pass each: the residual add + RMSNorm between the
// GEMMs (torch_ops.rms_norm calls it when the library is there), and RoPE + KV-cache write (below).
//
// In torch it is six ops, each a pass over memory and a dispatch; here it is one pass (about
// twice as fast, scripts/benchmarks.md). Rounding follows the torch code: the
// residual sum and the normalised row are rounded to the model dtype before the weight multiply
// (HF Llama's order). The sum of squares runs in a different order than torch's, so results
// agree to float rounding, not bit for bit. SiLU(gate) * up is here too: 16 lanes at a time with
// AVX512-BF16, elsewhere a loop the compiler vectorises; the kernel chooser measures it against
// torch's ops per row count (cpu_tuning.silu_probe).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

// Rows of at most this many elements in all stay on the calling thread (decode batches): a
// parallel region costs more than the work there.
#define SERIAL_ELEMENTS 65536

// out[m, :] = weight * round(s * rsqrt(mean(s^2) + eps)), s = x[m, :] (+ residual[m, :], rounded
// to T and stored to sum[m, :]). Statistics in fp32; 16 columns at a time, then one by one.
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, V)                                                   \
  static inline void NAME##_row(const T* x, const T* res, const T* w, T* out, T* sum, int64_t k,   \
                                float eps) {                                                       \
    f32x16 ss16 = {0};                                                                             \
    float ss = 0.f;                                                                                \
    int64_t j = 0;                                                                                 \
    if (res) {                                                                                     \
      for (; RILL_VEC16 && j + 16 <= k; j += 16) {                                                 \
        const f32x16 s = V##_store16(sum + j, V##_load16(x + j) + V##_load16(res + j));            \
        ss16 += s * s;                                                                             \
      }                                                                                            \
      _Pragma("omp simd reduction(+:ss)")                                                          \
      for (int64_t t = j; t < k; ++t) {                                                            \
        const T s = STORE(LOAD(x[t]) + LOAD(res[t]));                                              \
        sum[t] = s;                                                                                \
        ss += LOAD(s) * LOAD(s);                                                                   \
      }                                                                                            \
      x = sum;                                                                                     \
    } else {                                                                                       \
      for (; RILL_VEC16 && j + 16 <= k; j += 16) {                                                 \
        const f32x16 s = V##_load16(x + j);                                                        \
        ss16 += s * s;                                                                             \
      }                                                                                            \
      _Pragma("omp simd reduction(+:ss)")                                                          \
      for (int64_t t = j; t < k; ++t) ss += LOAD(x[t]) * LOAD(x[t]);                               \
    }                                                                                              \
    const float inv = 1.f / sqrtf((f32x16_sum(ss16) + ss) / (float)k + eps);                       \
    for (j = 0; RILL_VEC16 && j + 16 <= k; j += 16)                                                \
      V##_store16(out + j, V##_load16(w + j) * V##_round16(V##_load16(x + j) * inv));              \
    _Pragma("omp simd")                                                                            \
    for (int64_t t = j; t < k; ++t) out[t] = STORE(LOAD(w[t]) * LOAD(STORE(LOAD(x[t]) * inv)));    \
  }                                                                                                \
  void NAME(const T* x, const T* res, const T* w, T* out, T* sum, int64_t m, int64_t k, float eps) { \
    if (m * k <= SERIAL_ELEMENTS) {                                                                \
      for (int64_t i = 0; i < m; ++i)                                                              \
        NAME##_row(x + i * k, res ? res + i * k : 0, w, out + i * k, sum ? sum + i * k : 0, k, eps); \
      return;                                                                                      \
    }                                                                                              \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int64_t i = 0; i < m; ++i)                                                                \
      NAME##_row(x + i * k, res ? res + i * k : 0, w, out + i * k, sum ? sum + i * k : 0, k, eps); \
  }

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE, f32)

// NeoX RoPE on q and k plus the KV-cache write, one pass (torch_ops.rope_and_write_kv calls it).
//
// In torch this is ~10 ops per layer (upcast, roll, two multiplies, add, downcast, two
// index_copy_), each a pass over memory. Rounding follows the
// torch code exactly: the pair (x_i, x_{i+D/2}) is rotated in fp32 as x*cos + partner*(+/-sin),
// two separate multiplies and an add (contraction off), and rounded once to T; so results are
// bit-identical (with AVX512-BF16, short of denormals, which it flushes to zero: cpu_bf16.h).
// q, k, v rows may be strided, each its own way (slices of the fused qkv output; q and k normed
// per head apart from it, v still a slice); q_out [T, Hq, D]
// and k_out [T, Hkv, D] are contiguous; the caches are [slots, Hkv, D] and slots < 0 are skipped.
#define DEFINE_ROPE_KV(NAME, T, LOAD, STORE, V)                                                    \
  __attribute__((optimize("fp-contract=off"))) static inline void NAME##_head(                     \
      const T* x, T* out, const float* cs, int64_t half) {                                         \
    const float* cosv = cs;                                                                        \
    const float* sinv = cs + half;                                                                 \
    int64_t i = 0;                                                                                 \
    for (; RILL_VEC16 && i + 16 <= half; i += 16) {                                                \
      const f32x16 a = V##_load16(x + i), b = V##_load16(x + i + half);                            \
      const f32x16 c = f32_load16(cosv + i), sn = f32_load16(sinv + i);                            \
      V##_store16(out + i, a * c + b * -sn);                                                       \
      V##_store16(out + i + half, b * c + a * sn);                                                 \
    }                                                                                              \
    _Pragma("omp simd")                                                                            \
    for (int64_t t = i; t < half; ++t) {                                                           \
      const float a = LOAD(x[t]), b = LOAD(x[t + half]);                                           \
      out[t] = STORE(a * cosv[t] + b * -sinv[t]);                                                  \
      out[t + half] = STORE(b * cosv[t] + a * sinv[t]);                                            \
    }                                                                                              \
  }                                                                                                \
  static inline void NAME##_token(const T* q, const T* k, const T* v, int64_t pos, int64_t slot,    \
                                  const float* cos_sin, T* q_out, T* k_out, T* k_cache,            \
                                  T* v_cache, int64_t hq, int64_t hkv, int64_t d) {                \
    const float* cs = cos_sin + pos * d;                                                           \
    for (int64_t h = 0; h < hq; ++h) NAME##_head(q + h * d, q_out + h * d, cs, d / 2);             \
    for (int64_t h = 0; h < hkv; ++h) NAME##_head(k + h * d, k_out + h * d, cs, d / 2);            \
    if (slot < 0) return;                                                                          \
    memcpy(k_cache + slot * hkv * d, k_out, (size_t)(hkv * d) * sizeof(T));                        \
    for (int64_t h = 0; h < hkv; ++h)                                                              \
      memcpy(v_cache + (slot * hkv + h) * d, v + h * d, (size_t)d * sizeof(T));                    \
  }                                                                                                \
  void NAME(const T* q, const T* k, const T* v, int64_t q_stride, int64_t k_stride, int64_t v_stride, \
            const int64_t* positions, const int64_t* slots, const float* cos_sin, T* q_out,        \
            T* k_out, T* k_cache, T* v_cache, int64_t t, int64_t hq, int64_t hkv, int64_t d) {     \
    if (t * (hq + hkv) * d <= SERIAL_ELEMENTS) {                                                   \
      for (int64_t i = 0; i < t; ++i)                                                              \
        NAME##_token(q + i * q_stride, k + i * k_stride, v + i * v_stride, positions[i], slots[i], \
                     cos_sin, q_out + i * hq * d, k_out + i * hkv * d, k_cache, v_cache, hq, hkv, d); \
      return;                                                                                      \
    }                                                                                              \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int64_t i = 0; i < t; ++i)                                                                \
      NAME##_token(q + i * q_stride, k + i * k_stride, v + i * v_stride, positions[i], slots[i],   \
                   cos_sin, q_out + i * hq * d, k_out + i * hkv * d, k_cache, v_cache, hq, hkv, d); \
  }

DEFINE_ROPE_KV(rope_write_kv_bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16)
DEFINE_ROPE_KV(rope_write_kv_f32, float, F32_LOAD, F32_STORE, f32)

// SwiGLU's SiLU(gate) * up over rows [gate | up] of 2F values -> [F]: torch_ops.silu_and_mul.
// Rounding follows torch's two ops: SiLU in fp32 rounded to T, then the product rounded to T.
// sigmoid(g) = 1 / (1 + e^-g) from e = exp(-|g|) <= 1 (no overflow): 1 / (1 + e) for g >= 0,
// e / (1 + e) below. Its exp is exp_neg's polynomial, not libm's, so a value can differ from
// torch's by one rounding step of T. In torch it is three ops and two passes; here one.
#if RILL_VEC16
static inline f32x16 sigmoid16(f32x16 g) {
  const __m512 gv = (__m512)g, one = _mm512_set1_ps(1.f);
  const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
  const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
  return (f32x16)_mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e));
}
#endif

static inline float sigmoid1(float g) {
  const float e = exp_neg(-fabsf(g));
  return (g >= 0.f ? 1.f : e) / (1.f + e);
}

#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, V)                                                   \
  static inline void NAME##_row(const T* gu, T* out, int64_t f) {                                  \
    int64_t j = 0;                                                                                 \
    for (; RILL_VEC16 && j + 16 <= f; j += 16) {                                                   \
      const f32x16 g = V##_load16(gu + j);                                                         \
      V##_store16(out + j, V##_round16(g * sigmoid16(g)) * V##_load16(gu + f + j));                \
    }                                                                                              \
    _Pragma("omp simd")                                                                            \
    for (int64_t t = j; t < f; ++t) {                                                              \
      const float g = LOAD(gu[t]);                                                                 \
      out[t] = STORE(LOAD(STORE(g * sigmoid1(g))) * LOAD(gu[f + t]));                              \
    }                                                                                              \
  }                                                                                                \
  void NAME(const T* gu, T* out, int64_t m, int64_t f) {                                           \
    if (m * f <= SERIAL_ELEMENTS) {                                                                \
      for (int64_t i = 0; i < m; ++i) NAME##_row(gu + i * 2 * f, out + i * f, f);                  \
      return;                                                                                      \
    }                                                                                              \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int64_t i = 0; i < m; ++i) NAME##_row(gu + i * 2 * f, out + i * f, f);                    \
  }

#if !RILL_VEC16
static inline f32x16 sigmoid16(f32x16 g) { return g; }  // only so that the never-taken vector loop compiles
#endif
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, F32_LOAD, F32_STORE, f32)
int silu_mul_vec16(void) { return RILL_VEC16; }  // the incumbent: native where its 16-lane path is built
