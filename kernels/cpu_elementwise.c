// The residual add + RMSNorm between a Llama layer's GEMMs in one pass per row
// (torch_ops.rms_norm calls it when the library is there).
//
// In torch it is six ops, each a pass over memory and a dispatch: 353 us for 512 fp32 rows of 576
// on a 2-core CPU, 161 us in one pass (64 vs 31 us at 32 rows). Rounding follows the torch code: the
// residual sum and the normalised row are rounded to the model dtype before the weight multiply
// (HF Llama's order). The sum of squares runs in a different order than torch's, so results
// agree to float rounding, not bit for bit. (A fused SiLU(gate) * up was tried too: with a
// vectorised polynomial exp it ran slower than torch's three ops on an AVX2 CPU, the division
// dominating, so it is not here.)

#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

// Rows of at most this many elements in all stay on the calling thread (decode batches): a
// parallel region costs more than the work there.
#define SERIAL_ELEMENTS 65536

// out[m, :] = weight * round(s * rsqrt(mean(s^2) + eps)), s = x[m, :] (+ residual[m, :], rounded
// to T and stored to sum[m, :]). Statistics in fp32.
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                     \
  static inline void NAME##_row(const T* x, const T* res, const T* w, T* out, T* sum, int64_t k,  \
                                float eps) {                                                      \
    float ss = 0.f;                                                                               \
    if (res) {                                                                                    \
      _Pragma("omp simd reduction(+:ss)")                                                         \
      for (int64_t j = 0; j < k; ++j) {                                                           \
        const T s = STORE(LOAD(x[j]) + LOAD(res[j]));                                             \
        sum[j] = s;                                                                               \
        ss += LOAD(s) * LOAD(s);                                                                  \
      }                                                                                           \
      x = sum;                                                                                    \
    } else {                                                                                      \
      _Pragma("omp simd reduction(+:ss)")                                                         \
      for (int64_t j = 0; j < k; ++j) ss += LOAD(x[j]) * LOAD(x[j]);                              \
    }                                                                                             \
    const float inv = 1.f / sqrtf(ss / (float)k + eps);                                           \
    _Pragma("omp simd")                                                                           \
    for (int64_t j = 0; j < k; ++j) out[j] = STORE(LOAD(w[j]) * LOAD(STORE(LOAD(x[j]) * inv)));   \
  }                                                                                               \
  void NAME(const T* x, const T* res, const T* w, T* out, T* sum, int64_t m, int64_t k, float eps) { \
    if (m * k <= SERIAL_ELEMENTS) {                                                               \
      for (int64_t i = 0; i < m; ++i)                                                             \
        NAME##_row(x + i * k, res ? res + i * k : 0, w, out + i * k, sum ? sum + i * k : 0, k, eps); \
      return;                                                                                     \
    }                                                                                             \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t i = 0; i < m; ++i)                                                               \
      NAME##_row(x + i * k, res ? res + i * k : 0, w, out + i * k, sum ? sum + i * k : 0, k, eps); \
  }

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE)
