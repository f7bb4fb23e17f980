// The element-wise halves of a W8A8 int8 linear layer (torch_ops.Int8Linear), one pass each.
//
// In plain torch, quantising a [M, K] activation takes ~8 ops and dequantising the int32 GEMM
// output ~4 more; at decode batch sizes each op costs more in launch overhead than in work, so
// together they took as long as the int8 GEMMs themselves. The arithmetic is the same as the
// torch fallback's, operation for operation, so both give identical results.

#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

// q[m, :] = round_half_even(x[m, :] / s[m]) with s[m] = max(|x[m, :]|, min_absmax) / 127.
#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                            \
  void NAME(const T* x, int64_t x_stride, int8_t* q, float* scale, int64_t m, int64_t k,          \
            float min_absmax) {                                                                   \
    _Pragma("omp parallel for schedule(static) if (m * k >= 65536)")                              \
    for (int64_t i = 0; i < m; ++i) {                                                             \
      const T* row = x + i * x_stride;                                                            \
      float amax = 0.f;                                                                           \
      _Pragma("omp simd reduction(max:amax)")                                                     \
      for (int64_t j = 0; j < k; ++j) amax = fmaxf(amax, fabsf(LOAD(row[j])));                    \
      const float s = fmaxf(amax, min_absmax) / 127.f;                                            \
      scale[i] = s;                                                                               \
      int8_t* out = q + i * k;                                                                    \
      _Pragma("omp simd")                                                                         \
      for (int64_t j = 0; j < k; ++j) out[j] = (int8_t)nearbyintf(LOAD(row[j]) / s);              \
    }                                                                                             \
  }

// y[m, n] = acc[m, n] * row_scale[m] * col_scale[n] (+ bias[n]), rounded once to T. Contraction
// into an FMA is off so the result matches torch's separate multiplies and add bit for bit.
#define DEFINE_DEQUANTIZE(NAME, T, STORE)                                                         \
  __attribute__((optimize("fp-contract=off"))) void NAME(                                         \
      const int32_t* acc, const float* row_scale, const float* col_scale, const float* bias, T* y, \
      int64_t m, int64_t n) {                                                                     \
    _Pragma("omp parallel for schedule(static) if (m * n >= 65536)")                              \
    for (int64_t i = 0; i < m; ++i) {                                                             \
      const int32_t* a = acc + i * n;                                                             \
      const float rs = row_scale[i];                                                              \
      T* out = y + i * n;                                                                         \
      if (bias) {                                                                                 \
        _Pragma("omp simd")                                                                       \
        for (int64_t j = 0; j < n; ++j) out[j] = STORE((float)a[j] * rs * col_scale[j] + bias[j]); \
      } else {                                                                                    \
        _Pragma("omp simd")                                                                       \
        for (int64_t j = 0; j < n; ++j) out[j] = STORE((float)a[j] * rs * col_scale[j]);          \
      }                                                                                           \
    }                                                                                             \
  }

DEFINE_QUANTIZE(quantize_rows_bf16, uint16_t, bf16_to_f32)
DEFINE_QUANTIZE(quantize_rows_f32, float, F32_LOAD)
DEFINE_DEQUANTIZE(dequantize_bf16, uint16_t, f32_to_bf16)
DEFINE_DEQUANTIZE(dequantize_f32, float, F32_STORE)
