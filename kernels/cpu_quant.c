// The element-wise halves of a W8A8 int8 linear layer (torch_ops.Int8Linear), one pass each.
//
// In plain torch, quantising a [M, K] activation takes ~8 ops and dequantising the int32 GEMM
// output ~4 more; at decode batch sizes each op costs more in launch overhead than in work, so
// together they took as long as the int8 GEMMs themselves. The arithmetic is the same as the
// torch fallback's, operation for operation, so both give identical results.

#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

// q[m, :] = round_half_even(x[m, :] / s[m]) with s[m] = max(|x[m, :]|, min_absmax) / 127.
// Small inputs (decode batches) stay on the calling thread: a parallel region costs more there.
#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                            \
  static inline void NAME##_row(const T* row, int8_t* out, float* scale, int64_t k,               \
                                float min_absmax) {                                               \
    float amax = 0.f;                                                                             \
    _Pragma("omp simd reduction(max:amax)")                                                       \
    for (int64_t j = 0; j < k; ++j) {                                                             \
      const float a = fabsf(LOAD(row[j]));                                                        \
      amax = a > amax ? a : amax;                                                                 \
    }                                                                                             \
    const float s = (amax > min_absmax ? amax : min_absmax) / 127.f;                              \
    *scale = s;                                                                                   \
    _Pragma("omp simd")                                                                           \
    for (int64_t j = 0; j < k; ++j) out[j] = (int8_t)nearbyintf(LOAD(row[j]) / s);                \
  }                                                                                               \
  void NAME(const T* x, int64_t x_stride, int8_t* q, float* scale, int64_t m, int64_t k,          \
            float min_absmax) {                                                                   \
    if (m * k < 65536) {                                                                          \
      for (int64_t i = 0; i < m; ++i) NAME##_row(x + i * x_stride, q + i * k, scale + i, k, min_absmax); \
      return;                                                                                     \
    }                                                                                             \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t i = 0; i < m; ++i) NAME##_row(x + i * x_stride, q + i * k, scale + i, k, min_absmax); \
  }

// y[m, n] = acc[m, n] * row_scale[m] * col_scale[n] (+ bias[n]), rounded once to T. Contraction
// into an FMA is off so the result matches torch's separate multiplies and add bit for bit.
#define DEFINE_DEQUANTIZE(NAME, T, STORE)                                                         \
  __attribute__((optimize("fp-contract=off"))) static inline void NAME##_row(                     \
      const int32_t* a, float rs, const float* col_scale, const float* bias, T* out, int64_t n) {  \
    if (bias) {                                                                                   \
      _Pragma("omp simd")                                                                         \
      for (int64_t j = 0; j < n; ++j) out[j] = STORE((float)a[j] * rs * col_scale[j] + bias[j]);   \
    } else {                                                                                      \
      _Pragma("omp simd")                                                                         \
      for (int64_t j = 0; j < n; ++j) out[j] = STORE((float)a[j] * rs * col_scale[j]);            \
    }                                                                                             \
  }                                                                                               \
  void NAME(const int32_t* acc, const float* row_scale, const float* col_scale, const float* bias, \
            T* y, int64_t m, int64_t n) {                                                         \
    if (m * n < 65536) {                                                                          \
      for (int64_t i = 0; i < m; ++i) NAME##_row(acc + i * n, row_scale[i], col_scale, bias, y + i * n, n); \
      return;                                                                                     \
    }                                                                                             \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t i = 0; i < m; ++i) NAME##_row(acc + i * n, row_scale[i], col_scale, bias, y + i * n, n); \
  }

DEFINE_QUANTIZE(quantize_rows_bf16, uint16_t, bf16_to_f32)
DEFINE_QUANTIZE(quantize_rows_f32, float, F32_LOAD)
DEFINE_DEQUANTIZE(dequantize_bf16, uint16_t, f32_to_bf16)
DEFINE_DEQUANTIZE(dequantize_f32, float, F32_STORE)
