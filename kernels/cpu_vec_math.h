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
#endif

#endif
