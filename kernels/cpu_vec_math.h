// Math helpers shared by the native CPU kernels, written so that `omp simd` loops vectorise them.
#ifndef RILL_CPU_VEC_MATH_H
#define RILL_CPU_VEC_MATH_H

#include <math.h>
#include <stdint.h>

// exp(x) for the softmax (x <= 0): 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial
// (relative error ~2e-7). Plain arithmetic, so `omp simd` loops vectorise it; libm's expf would
// be a scalar call per score.
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;  // e^-87 ~ 1.6e-38: still a normal float, n + 127 >= 1 below
  const float n = rintf(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  union { int32_t i; float f; } scale;
  scale.i = ((int32_t)n + 127) << 23;
  return p * scale.f;
}

// cap * tanh(s / cap): attention logit soft-capping (Gemma 2). tanh from exp_neg, so that
// `omp simd` loops vectorise it; near 0, where 1 - e^-2a cancels, a short odd series instead.
static inline float soft_cap(float s, float cap) {
  const float x = s / cap, a = x < 0.f ? -x : x, x2 = x * x;
  const float e = exp_neg(-2.f * a);
  const float t = a < 0.0625f ? a * (1.f + x2 * (-1.f / 3.f + x2 * (2.f / 15.f - x2 * (17.f / 315.f))))
                              : (1.f - e) / (1.f + e);
  return cap * (x < 0.f ? -t : t);
}

#ifdef __AVX512F__
#include <immintrin.h>

// exp_neg on 16 lanes; lanes with x > 0 come out as garbage (callers mask them).
static inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// soft_cap on 16 lanes.
static inline __m512 soft_cap16(__m512 s, float cap) {
  const __m512 c = _mm512_set1_ps(cap), x = _mm512_div_ps(s, c), a = _mm512_abs_ps(x);
  const __m512 x2 = _mm512_mul_ps(x, x), one = _mm512_set1_ps(1.f);
  const __m512 e = exp_neg16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  __m512 series = _mm512_fnmadd_ps(x2, _mm512_set1_ps(17.f / 315.f), _mm512_set1_ps(2.f / 15.f));
  series = _mm512_fmadd_ps(x2, series, _mm512_set1_ps(-1.f / 3.f));
  series = _mm512_mul_ps(a, _mm512_fmadd_ps(x2, series, one));
  const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.0625f), _CMP_LT_OQ),
                                        _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)), series);
  // the sign of x back on |tanh|
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
  return _mm512_mul_ps(c, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)));
}
#endif

#endif
