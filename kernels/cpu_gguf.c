// Linear layers on GGUF block-quantized weights: y[m, n] = x[m, k] . W[n, k]^T (+ bias), each
// row of W the GGUF's raw blocks (ggml's layouts; gguf_blocks.py has the table and a reference
// dequantizer).
//
// Why: decoding a few rows is bound by how fast the weights stream from memory, and the blocks
// are 3.5-7x smaller than bf16. Dequantizing them to floats inside the loop costs more than it
// saves; as llama.cpp does, each activation row is instead quantized once per call to 8-bit
// blocks, Q8_0-style (32 values, an fp32 scale) for the 32-element formats and Q8_K-style (256
// values, one scale, sums per 16) for the K formats, and each weight block is dotted with them
// in integers: vpdpbusd (AVX512-VNNI with VL), else vpmaddubsw + vpmaddwd (AVX2), else plain C.
// An integer dot takes one unsigned and one signed operand: the formats whose values are signed
// (Q8_0, Q4_0, Q5_0) move the weight's sign onto the activation (|w| . sign(x, w)); the others
// dot their unsigned values and add the offset or the block's min through the activation sums.
// The result differs from the float GEMM by the activation's rounding, at most half a step of
// its block's scale per element.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define MR 4            // activation rows dotted per pass over a weight row (unpacked once)
#define CHUNK_ROWS 16   // output rows a thread claims at a time
#define SERIAL_WORK (1 << 18)  // m * n * k below this stays on the calling thread (measured)

// The 8-bit activation: q [m][k]; d the scale of each block (32 or 256 values); s = d * sum(q)
// per 32 (32-element formats); bs the sums of q per 16 (K formats).
typedef struct {
  int8_t* q;
  float* d;
  float* s;
  int16_t* bs;
  int64_t k, nb;
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

int gguf_gemm_simd(void) { return SIMD_LEVEL; }  // 2: AVX512-VNNI, 1: AVX2, 0: plain C

// One weight row against activation rows r0 .. r0+R-1 (R <= MR, a constant once inlined), the
// block unpacked once for all of them: out[r] = the dot products, bias not added.
#define ROW_KERNEL(NAME) static inline __attribute__((always_inline)) void NAME( \
    const uint8_t* w, const Act* a, int64_t r0, int R, float* out)
#define ROW_BEGIN                                   \
  accf acc[MR];                                     \
  float tail[MR];                                   \
  for (int r = 0; r < R; ++r) acc[r] = acc_zero(), tail[r] = 0.f;
#define ROW_END for (int r = 0; r < R; ++r) out[r] = acc_sum(acc[r]) + tail[r];
#define AT(r, b) (((r0) + (r)) * a->nb + (b))  // index of activation block b of row r0 + r

// The 32-element formats, given how to unpack a block (q, d, min) and whether q is signed. Blocks
// go in pairs into two sets of sums: one set made each block wait for the last one's FMA (4
// cycles), which bound the loop (2-core AMD EPYC: 1.4x slower at m = 1).
#define SMALL_STEP(P, B, UNPACK)                                                                      \
  {                                                                                            \
    const uint8_t* w = wrow + (B) * BYTES;                                                     \
    const v32 q = UNPACK;                                                                      \
    const float d = half_at(w), mn = HAS_MIN ? half_at(w + 2) : 0.f;                           \
    for (int r = 0; r < R; ++r) {                                                              \
      const int64_t at = AT(r, B);                                                             \
      const v32 x = ld32(a->q + at * 32);                                                      \
      acc[P][r] = acc_fma(acc[P][r], SIGNED ? dot_ss(q, x) : dot_us(q, x), d * a->d[at]);      \
      if (HAS_MIN) tail[P][r] += mn * a->s[at];                                                \
    }                                                                                          \
  }
#define DEFINE_SMALL(NAME, BYTES_, SIGNED_, HAS_MIN_, UNPACK_)                                  \
  ROW_KERNEL(NAME) {                                                                           \
    enum { BYTES = BYTES_, SIGNED = SIGNED_, HAS_MIN = HAS_MIN_ };                             \
    const uint8_t* wrow = w;                                                                   \
    accf acc[2][MR];                                                                           \
    float tail[2][MR];                                                                         \
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = acc_zero(), tail[0][r] = tail[1][r] = 0.f; \
    int64_t b = 0;                                                                             \
    for (; b + 1 < a->nb; b += 2) {                                                            \
      SMALL_STEP(0, b, UNPACK_)                                                                   \
      SMALL_STEP(1, b + 1, UNPACK_)                                                                   \
    }                                                                                          \
    if (b < a->nb) SMALL_STEP(0, b, UNPACK_)                                                      \
    for (int r = 0; r < R; ++r) out[r] = acc_sum(acc[0][r] + acc[1][r]) + tail[0][r] + tail[1][r]; \
  }

DEFINE_SMALL(row_q8_0, 34, 1, 0, ld32(w + 2))
DEFINE_SMALL(row_q4_0, 18, 1, 0, vsub(nib32(w + 2), 8))
DEFINE_SMALL(row_q4_1, 20, 0, 1, nib32(w + 4))
DEFINE_SMALL(row_q5_0, 22, 1, 0, vsub(vor(nib32(w + 6), bits16(w + 2)), 16))
DEFINE_SMALL(row_q5_1, 24, 0, 1, vor(nib32(w + 8), bits16(w + 4)))

// Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
static inline void k_scales(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
    mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// Q4_K and Q5_K: d * sc[j] * q - dmin * mn[j] per 32 values j; the mins through the sums per 16.
#define DEFINE_K45(NAME, BYTES, QS, UNPACK)                                                      \
  ROW_KERNEL(NAME) {                                                                           \
    ROW_BEGIN                                                                                  \
    for (int64_t b = 0; b < a->nb; ++b, w += (BYTES)) {                                        \
      int sc[8], mn[8];                                                                        \
      k_scales(w + 4, sc, mn);                                                                 \
      v32 q[8];                                                                                \
      sc16 scv[8];                                                                             \
      for (int j = 0; j < 8; ++j) {                                                            \
        const uint8_t* nib = w + (QS) + 32 * (j / 2);                                          \
        q[j] = UNPACK;                                                                         \
        scv[j] = sc_pair(sc[j], sc[j]);                                                        \
      }                                                                                        \
      const float d = half_at(w), dmin = half_at(w + 2);                                       \
      for (int r = 0; r < R; ++r) {                                                            \
        const int64_t at = AT(r, b);                                                           \
        const int8_t* x = a->q + at * 256;                                                     \
        const int16_t* bs = a->bs + at * 16;                                                   \
        ilanes s = il_zero();                                                                  \
        int mins = 0;                                                                          \
        for (int j = 0; j < 8; ++j) {                                                          \
          s = il_add(s, dot_scaled(q[j], ld32(x + 32 * j), scv[j]));                           \
          mins += mn[j] * (bs[2 * j] + bs[2 * j + 1]);                                         \
        }                                                                                      \
        acc[r] = acc_fma(acc[r], s, d * a->d[at]);                                             \
        tail[r] -= dmin * a->d[at] * (float)mins;                                              \
      }                                                                                        \
    }                                                                                          \
    ROW_END                                                                                    \
  }

DEFINE_K45(row_q4_k, 144, 16, (j % 2 ? nib_hi(nib) : nib_lo(nib)))
DEFINE_K45(row_q5_k, 176, 48, vor(j % 2 ? nib_hi(nib) : nib_lo(nib), plane(w + 16, j, 1)))

// Q6_K: d * sc[g] * (u - 32) per 16 values g, u six bits: four from ql, two from qh.
ROW_KERNEL(row_q6_k) {
  ROW_BEGIN
  for (int64_t b = 0; b < a->nb; ++b, w += 210) {
    const int8_t* sc = (const int8_t*)(w + 192);
    v32 q[8];
    sc16 scv[8];
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4, c = j % 4;  // half of the block, run of 32 in it
      const uint8_t* ql = w + 64 * h + 32 * (c & 1);
      q[j] = vor(c & 2 ? nib_hi(ql) : nib_lo(ql), plane(w + 128 + 32 * h, 2 * c, 3));
      scv[j] = sc_pair(sc[2 * j], sc[2 * j + 1]);
    }
    const float d = half_at(w + 208);
    for (int r = 0; r < R; ++r) {
      const int64_t at = AT(r, b);
      const int8_t* x = a->q + at * 256;
      const int16_t* bs = a->bs + at * 16;
      ilanes s = il_zero();
      int offset = 0;
      for (int j = 0; j < 8; ++j) s = il_add(s, dot_scaled(q[j], ld32(x + 32 * j), scv[j]));
      for (int g = 0; g < 16; ++g) offset += sc[g] * bs[g];
      const float dd = d * a->d[at];
      acc[r] = acc_fma(acc[r], s, dd);
      tail[r] -= dd * (float)(32 * offset);
    }
  }
  ROW_END
}

typedef void (*rows_fn)(const uint8_t* w, int64_t rb, const Act* a, int64_t m, int64_t n0, int64_t n1, int64_t n,
                        const float* bias, float* y);

// Output rows n0 .. n1-1 for every activation row, MR at a time, so that each weight row is read
// from memory once and unpacked once per MR activation rows.
#define DEFINE_ROWS(F)                                                                          \
  static void rows_##F(const uint8_t* w, int64_t rb, const Act* a, int64_t m, int64_t n0, int64_t n1, \
                       int64_t n, const float* bias, float* y) {                                \
    float out[MR];                                                                              \
    for (int64_t row = n0; row < n1; ++row) {                                                   \
      const uint8_t* wr = w + row * rb;                                                         \
      const float bv = bias ? bias[row] : 0.f;                                                  \
      for (int64_t r0 = 0; r0 < m; r0 += MR) {                                                  \
        const int64_t left = m - r0;                                                            \
        if (left >= 4) row_##F(wr, a, r0, 4, out);                                              \
        else if (left == 3) row_##F(wr, a, r0, 3, out);                                         \
        else if (left == 2) row_##F(wr, a, r0, 2, out);                                         \
        else row_##F(wr, a, r0, 1, out);                                                        \
        for (int64_t r = 0; r < (left < MR ? left : MR); ++r) y[(r0 + r) * n + row] = out[r] + bv; \
      }                                                                                         \
    }                                                                                           \
  }

DEFINE_ROWS(q8_0)
DEFINE_ROWS(q4_0)
DEFINE_ROWS(q4_1)
DEFINE_ROWS(q5_0)
DEFINE_ROWS(q5_1)
DEFINE_ROWS(q4_k)
DEFINE_ROWS(q5_k)
DEFINE_ROWS(q6_k)

// Block values and bytes of a supported format; 0 for any other.
static int block_elems(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : 32; }
static int block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}
static rows_fn rows_for(int qtype) {
  switch (qtype) {
    case Q4_0: return rows_q4_0;
    case Q4_1: return rows_q4_1;
    case Q5_0: return rows_q5_0;
    case Q5_1: return rows_q5_1;
    case Q8_0: return rows_q8_0;
    case Q4_K: return rows_q4_k;
    case Q5_K: return rows_q5_k;
    default: return rows_q6_k;
  }
}

int gguf_gemm_supported(int qtype) { return block_bytes(qtype) != 0; }

// One activation row into blocks of `block` values: q = round(x / d), d = max|x| / 127.
static void quantize_row(const float* x, int64_t k, int block, int8_t* q, float* d, float* s, int16_t* bs) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    int8_t* qb = q + b * block;
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int j = 0; j < block; ++j) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < block; ++j) {
      qb[j] = (int8_t)nearbyintf(xb[j] * inv);
      sum += qb[j];
    }
    d[b] = amax / 127.f;
    if (s) s[b] = d[b] * (float)sum;
    if (bs)
      for (int g = 0; g < block / 16; ++g) {
        int part = 0;
        for (int j = 0; j < 16; ++j) part += qb[16 * g + j];
        bs[b * (block / 16) + g] = (int16_t)part;
      }
  }
}

// y [m, n] fp32 = x [m, k] fp32 . W^T (+ bias [n] fp32), W [n] rows of k / block blocks of
// `qtype`. 0 on success; 1 for a format or shape this kernel does not take; 2 out of memory.
int gguf_gemm_f32(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k, const float* bias,
                  float* y) {
  const int block = block_elems(qtype), bytes = block_bytes(qtype);
  if (!bytes || m < 1 || n < 1 || k < block || k % block) return 1;
  const int small = block == 32;
  Act a = {0};
  a.k = k, a.nb = k / block;
  char* mem = malloc((size_t)(m * k + 4 * m * a.nb + (small ? 4 * m * a.nb : 2 * m * (k / 16))));
  if (!mem) return 2;
  a.q = (int8_t*)mem;
  a.d = (float*)(mem + m * k);  // m * k is a multiple of 32: aligned
  if (small) a.s = a.d + m * a.nb;
  else a.bs = (int16_t*)(a.d + m * a.nb);
  const int serial = m * n * k < SERIAL_WORK;
#pragma omp parallel for schedule(static) if (!serial && m * k >= 65536)
  for (int64_t i = 0; i < m; ++i)
    quantize_row(x + i * k, k, block, a.q + i * k, a.d + i * a.nb, small ? a.s + i * a.nb : NULL,
                 small ? NULL : a.bs + i * (k / 16));
  const rows_fn run = rows_for(qtype);
  const int64_t rb = a.nb * bytes, chunks = (n + CHUNK_ROWS - 1) / CHUNK_ROWS;
  // dynamic: on a shared machine one thread may be preempted; the others take its chunks
#pragma omp parallel for schedule(dynamic, 1) if (!serial)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n1 = (c + 1) * CHUNK_ROWS < n ? (c + 1) * CHUNK_ROWS : n;
    run(w, rb, &a, m, c * CHUNK_ROWS, n1, n, bias, y);
  }
  free(mem);
  return 0;
}
