// bfloat16 <-> float for the native CPU kernels (bf16 is the top half of an IEEE float).
#ifndef RILL_CPU_BF16_H
#define RILL_CPU_BF16_H

#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>

// 16 floats rounded to bfloat16 as torch rounds them (nearest even, NaN quieted, denormals kept:
// the AVX512-BF16 instruction would flush them), each in the top half of its 32-bit lane.
static inline __m512i bf16_round_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i nearest = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __m512i r = _mm512_mask_mov_epi32(nearest, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                          _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

// The same rounding, the bf16 bits in each lane's low half (what a store of 16 bf16 values takes).
static inline __m512i bf16_bits16(__m512 v) { return _mm512_srli_epi32(bf16_round_bits16(v), 16); }
#endif

static inline float bf16_to_f32(uint16_t x) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)x << 16;
  return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  // quiet NaN
  v.u += 0x7fffu + ((v.u >> 16) & 1u);  // round to nearest even, as torch does
  return (uint16_t)(v.u >> 16);
}

// The fp32 instantiations of the same kernels load and store floats as they are.
#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

// 16 lanes at a time as GCC vector types, for the element-wise passes on CPUs with AVX512-BF16
// (RILL_VEC16). There GCC's own vectorisation of the scalar conversions above spends most of a
// bf16 RMSNorm on widening and rounding (these helpers take it to less than half the time).
// Elsewhere the kernels keep their scalar loops: these helpers built for AVX-512 without BF16 or
// for AVX2 ran slower than those loops.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RILL_VEC16 1
#else
#define RILL_VEC16 0
#pragma GCC diagnostic ignored "-Wpsabi"  // the (unused) 64-byte vector helpers below
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline f32x16 f32x16_bits(u32x16 u) {
  f32x16 f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float f32x16_sum(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Per element type: LOAD16 widens 16 values to float; STORE16 rounds 16 floats to the type,
// stores them and returns what it stored, as floats (for a value that is used again); ROUND16
// rounds to the type's precision without storing. bf16 rounds to nearest even and quiets NaNs, as f32_to_bf16 does; with
// AVX512-BF16 one instruction does that, except that it flushes denormal inputs to zero (torch
// keeps them; activations never get near 1e-38).
static inline f32x16 bf16_widen16(u16x16 h) {
#ifdef __AVX512F__
  // One vpmovzxwd: GCC, preferring 256-bit vectors, splits the generic widening into four.
  return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
  return f32x16_bits(__builtin_convertvector(h, u32x16) << 16);
#endif
}

static inline f32x16 bf16_load16(const uint16_t* p) {
  u16x16 h;
  memcpy(&h, p, sizeof h);
  return bf16_widen16(h);
}

static inline u16x16 bf16_narrow16(f32x16 f) {
#ifdef __AVX512BF16__
  const __m256bh h = _mm512_cvtneps_pbh((__m512)f);
  u16x16 r;
  memcpy(&r, &h, sizeof r);
  return r;
#else  // only so that the (never taken) vector loops compile without AVX512-BF16
  u16x16 r;
  for (int i = 0; i < 16; ++i) r[i] = f32_to_bf16(f[i]);
  return r;
#endif
}

static inline f32x16 bf16_store16(uint16_t* p, f32x16 f) {
  const u16x16 h = bf16_narrow16(f);
  memcpy(p, &h, sizeof h);
  return bf16_widen16(h);
}

static inline f32x16 bf16_round16(f32x16 f) { return bf16_widen16(bf16_narrow16(f)); }

static inline f32x16 f32_load16(const float* p) {
  f32x16 f;
  memcpy(&f, p, sizeof f);
  return f;
}

static inline f32x16 f32_store16(float* p, f32x16 f) {
  memcpy(p, &f, sizeof f);
  return f;
}

static inline f32x16 f32_round16(f32x16 f) { return f; }

#endif
