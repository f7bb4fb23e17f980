// The SIMD steps of the GGUF block GEMM (cpu_gguf.c), one set per instruction level: AVX512-VNNI
// (with VL), AVX2, plain C; the 8-bit activation layout and the row-kernel scaffolding.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gguf_formats.h"

#define MR 4            // activation rows dotted per pass over a weight row (unpacked once)
#define CHUNK_ROWS 16   // a thread's claims of output rows are multiples of this
#define SERIAL_WORK (1 << 18)  // m * n * k below this stays on the calling thread (measured)
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 8  // claims of output rows a thread makes in one GEMM (see cpu_gguf.c)
#endif

// The activation's scratch of the calling thread, grown to `want` bytes (NULL: out of memory),
// and Q8_0-style quantization of activation rows in natural order (both in cpu_gguf.c).
char* gguf_act_scratch(size_t want);
void gguf_quantize_rows32(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s);

// The 8-bit activation: q [m][k]; d the scale of each block (32 or 256 values); s = d * sum(q)
// per 32 (32-element formats); bs the sums of q per 16 (K formats).
typedef struct {
  int8_t* q;
  float* d;
  float* s;
  int16_t* bs;
  int64_t k, nb;
  int64_t nbp;  // blocks per row as stored: nb, or (the AVX-512 32-element kernels) nb rounded up to 16, zeros
} Act;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD_LEVEL 1
typedef __m256i v32;     // 32 byte values
typedef __m256i ilanes;  // 8 int32: lanes 0-3 sum values 0-15, lanes 4-7 values 16-31
typedef __m256 accf;

static inline float half_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
static inline v32 ld32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
// 16 bytes: low nibbles as values 0-15, high nibbles as 16-31 (Q4_0 .. Q5_1)
static inline v32 nib32(const uint8_t* p) {
  const __m128i r = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r, 4), m), _mm_and_si128(r, m));
}
static inline v32 nib_lo(const uint8_t* p) { return _mm256_and_si256(ld32(p), _mm256_set1_epi8(15)); }
static inline v32 nib_hi(const uint8_t* p) {
  return _mm256_and_si256(_mm256_srli_epi16(ld32(p), 4), _mm256_set1_epi8(15));
}
// ((p[j] >> shift) & mask) << 4 for 32 bytes (the K formats' high bits)
static inline v32 plane(const uint8_t* p, int shift, int mask) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(ld32(p), shift), _mm256_set1_epi8((char)mask)), 4);
}
// 16 where bit j of the little-endian uint32 at p is set (Q5_0/Q5_1's fifth bits)
static inline v32 bits16(const uint8_t* p) {
  uint32_t b;
  memcpy(&b, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_set1_epi8(b, 16);
#else
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}
static inline v32 vor(v32 a, v32 b) { return _mm256_or_si256(a, b); }
static inline v32 vsub(v32 a, int c) { return _mm256_sub_epi8(a, _mm256_set1_epi8((char)c)); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#undef SIMD_LEVEL
#define SIMD_LEVEL 2
static inline ilanes dot_us(v32 u, v32 x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x); }
#else  // |u . x| per pair stays under 2^15 here (u <= 128, |x| <= 127), so vpmaddubsw cannot saturate
static inline ilanes dot_us(v32 u, v32 x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}
#endif
static inline ilanes dot_ss(v32 w, v32 x) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
// u . x with lanes 0-3 times s0 and 4-7 times s1 (the K formats' sub-block scales): the 16-bit pair
// sums of vpmaddubsw (u <= 63: no saturation) times the scales in vpmaddwd, two ops where
// vpdpbusd + vpmulld + a broadcast took three, also with VNNI.
typedef __m256i sc16;
static inline sc16 sc_pair(int s0, int s1) { return _mm256_setr_m128i(_mm_set1_epi16((short)s0), _mm_set1_epi16((short)s1)); }
static inline ilanes dot_scaled(v32 u, v32 x, sc16 s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s); }
static inline ilanes il_zero(void) { return _mm256_setzero_si256(); }
static inline ilanes il_add(ilanes a, ilanes b) { return _mm256_add_epi32(a, b); }
static inline accf acc_zero(void) { return _mm256_setzero_ps(); }
static inline accf acc_fma(accf acc, ilanes a, float s) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(s), acc);
}
static inline float acc_sum(accf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#else  // plain C: the same steps on arrays
#define SIMD_LEVEL 0
typedef struct { uint8_t b[32]; } v32;
typedef struct { int32_t h[2]; } ilanes;  // sums of values 0-15 and 16-31
typedef float accf;

static inline float half_at(const uint8_t* p) {
  const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, man = h & 0x3ff;
  if (e == 0) return (sign ? -1.f : 1.f) * ldexpf((float)man, -24);
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u | man << 13 : (e + 112) << 23 | man << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline v32 ld32(const void* p) { v32 v; memcpy(v.b, p, 32); return v; }
static inline v32 nib32(const uint8_t* p) {
  v32 v;
  for (int j = 0; j < 16; ++j) v.b[j] = p[j] & 15, v.b[j + 16] = p[j] >> 4;
  return v;
}
static inline v32 nib_lo(const uint8_t* p) { v32 v; for (int j = 0; j < 32; ++j) v.b[j] = p[j] & 15; return v; }
static inline v32 nib_hi(const uint8_t* p) { v32 v; for (int j = 0; j < 32; ++j) v.b[j] = p[j] >> 4; return v; }
static inline v32 plane(const uint8_t* p, int shift, int mask) {
  v32 v;
  for (int j = 0; j < 32; ++j) v.b[j] = (uint8_t)(((p[j] >> shift) & mask) << 4);
  return v;
}
static inline v32 bits16(const uint8_t* p) {
  v32 v;
  for (int j = 0; j < 32; ++j) v.b[j] = (uint8_t)(((p[j / 8] >> (j % 8)) & 1) << 4);
  return v;
}
static inline v32 vor(v32 a, v32 b) { for (int j = 0; j < 32; ++j) a.b[j] |= b.b[j]; return a; }
static inline v32 vsub(v32 a, int c) { for (int j = 0; j < 32; ++j) a.b[j] = (uint8_t)(a.b[j] - c); return a; }
static inline ilanes dot_us(v32 u, v32 x) {
  ilanes s = {{0, 0}};
  for (int j = 0; j < 32; ++j) s.h[j / 16] += (int32_t)u.b[j] * (int8_t)x.b[j];
  return s;
}
static inline ilanes dot_ss(v32 w, v32 x) {
  ilanes s = {{0, 0}};
  for (int j = 0; j < 32; ++j) s.h[j / 16] += (int32_t)(int8_t)w.b[j] * (int8_t)x.b[j];
  return s;
}
typedef ilanes sc16;
static inline sc16 sc_pair(int s0, int s1) { sc16 s = {{s0, s1}}; return s; }
static inline ilanes dot_scaled(v32 u, v32 x, sc16 s) {
  ilanes d = dot_us(u, x);
  d.h[0] *= s.h[0], d.h[1] *= s.h[1];
  return d;
}
static inline ilanes il_zero(void) { ilanes s = {{0, 0}}; return s; }
static inline ilanes il_add(ilanes a, ilanes b) { a.h[0] += b.h[0], a.h[1] += b.h[1]; return a; }
static inline accf acc_zero(void) { return 0.f; }
static inline accf acc_fma(accf acc, ilanes a, float s) { return acc + (float)(a.h[0] + a.h[1]) * s; }
static inline float acc_sum(accf a) { return a; }
#endif

// One weight row against activation rows r0 .. r0+R-1 (R <= MR, a constant once inlined), the
// block unpacked once for all of them: out[r] = the dot products, bias not added.
#define ROW_KERNEL(NAME) static inline __attribute__((always_inline)) void NAME( \
    const uint8_t* w, const Act* a, int64_t r0, int R, float* out)
#define ROW_BEGIN                                   \
  accf acc[MR];                                     \
  float tail[MR];                                   \
  for (int r = 0; r < R; ++r) acc[r] = acc_zero(), tail[r] = 0.f;
#define ROW_END for (int r = 0; r < R; ++r) out[r] = acc_sum(acc[r]) + tail[r];
#define AT(r, b) (((r0) + (r)) * a->nbp + (b))  // index of activation block b of row r0 + r
