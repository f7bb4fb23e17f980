// Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights repacked 16 output rows at a time ("x16"), for
// the GEMM of few activation rows.
//
// Row by row (cpu_gguf.c) each block's dot product ends in a horizontal sum and every 16 blocks
// first gather their scales one by one: at one activation row that bookkeeping, not the memory,
// bounds the loop. Repacked, the same block of 16 rows sits together (their 16 fp16 scales, their
// 16 mins, then their nibbles so that 32-bit lane r of each 64-byte load holds row r's next 4
// bytes): one vpdpbusd takes 4 values of all 16 rows against 4 broadcast activation bytes, the
// sums stay in lane r, and the scales apply with one FMA per block. Same arithmetic as cpu_gguf.c
// (8-bit activation blocks, integer dots, fp32 scales), summed in another order.
//
// Layout (gguf_blocks.pack_x16 builds it): for each group of 16 rows (zero rows pad the last), for
// each block of 32 values: d[16] fp16, (Q4_1) m[16] fp16, then 4 x 64 bytes of nibbles, or (Q8_0)
// 8 x 64 bytes of values + 128. Q4_0 is packed as Q4_1 (d (q - 8) = d q + m with m = -8 d), Q5_0
// as Q8_0 (its codes q - 16 fit a signed byte), Q4_K as Q4_1 per 32-value sub-block with fp32 d and
// m (d sc and -dmin m, exact in fp32; not in fp16): d[16] fp32, m[16] fp32, then the nibbles;
// Q5_K the same, then 64 bytes of fifth bits (bit u of byte e of lane r: value 4 u + e of row r).
// Q6_K per 32 values: its super-block's d[16] fp16, its two 16-value scales (sc0, sc1 int8) per
// row, the low nibbles as Q4_1's, then 2 x 64 bytes of the high 2 bits (bits 2c of byte e of lane
// r in load j: value 16 j + 4 c + e of row r): the file's bits, moved, so the rows come back.
// w = d sc (u - 32): the sums start at -32 sum(x) of their 16 values, so no min term is needed.
// AVX512-VNNI only.

#include <omp.h>

#include "cpu_bf16.h"
#include "cpu_gguf_simd.h"

#define X16_BLOCK_Q4_1 320  // bytes of one block of 16 rows: 32 + 32 + 256
#define X16_BLOCK_Q8_0 544  // 32 + 512
#define X16_BLOCK_Q4_F 384  // 64 + 64 + 256 (Q4_K)
#define X16_BLOCK_Q5_F 448  // 64 + 64 + 256 + 64 (Q5_K)
#define X16_BLOCK_Q6 448    // 32 + 32 + 256 + 128 (Q6_K)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define X16_MAX_ROWS 8  // activation rows per pass over a weight block (their sums stay in registers)
#ifndef X16_TILE_BYTES
#define X16_TILE_BYTES (512 << 10)  // weights every pass of a tile reads again (half an L2; measured)
#endif

int gguf_gemm_x16_supported(int qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0 || qtype == Q4_K || qtype == Q5_K ||
         qtype == Q6_K;
}

// The five layouts, and Q4_0 in Q4_1's: its mins (-8 d) are left out for an integer offset.
enum { X16_Q4_1, X16_Q8_0, X16_Q4_F, X16_Q5_F, X16_Q6, X16_Q4_0 };

static inline int64_t x16_block_bytes(int kind) {
  switch (kind) {
    case X16_Q8_0: return X16_BLOCK_Q8_0;
    case X16_Q4_F: return X16_BLOCK_Q4_F;
    case X16_Q5_F: return X16_BLOCK_Q5_F;
    case X16_Q6: return X16_BLOCK_Q6;
    default: return X16_BLOCK_Q4_1;
  }
}

static int x16_kind(int qtype) {
  switch (qtype) {
    case Q8_0: case Q5_0: return X16_Q8_0;
    case Q4_0: return X16_Q4_0;
    case Q4_K: return X16_Q4_F;
    case Q5_K: return X16_Q5_F;
    case Q6_K: return X16_Q6;
    default: return X16_Q4_1;
  }
}

// 4 activation bytes broadcast to the 16 lanes (an unaligned, aliasing load).
static inline __m512i x4(const int8_t* p) {
  return _mm512_set1_epi32(*(const int32_t __attribute__((may_alias, aligned(1)))*)p);
}

// Output rows of groups g0..g1-1 for activation rows r0..r0+R-1. Q4_1: w = d q + m, q unsigned
// nibbles; Q8_0: w = d q, q stored + 128 (vpdpbusd wants one unsigned operand): each dot starts
// at -128 sum(q_x), an integer, so the sum is exact and no min term (a multiply, on the ports the
// dot products use) is needed; Q4_0 (nibbles, w = d (q - 8)) the same from -8 sum(q_x). Inlined
// with R a constant (x16_pass) so acc[] and accm[] stay in registers, the activation bytes broadcast from the row itself (copied
// to a local array first, they went through the stack: the 8-row passes then gained nothing).
static inline __attribute__((always_inline)) void x16_groups(
    const int kind, const uint8_t* w, int64_t nb, const int8_t* q, const float* d, const float* s,
    const int32_t* o, int64_t k, int64_t r0, int R, int64_t g0, int64_t g1, int64_t n, const float* bias, void* y,
    int bf16) {
  const int Q8 = kind == X16_Q8_0, Q5 = kind == X16_Q5_F, F32 = kind == X16_Q4_F || Q5, Q6 = kind == X16_Q6;
  const int offset = Q8 || kind == X16_Q4_0;  // w = d (q - c): the dots start at -c sum(x) (o)
  const int64_t bytes = x16_block_bytes(kind);
  const int64_t values = F32 ? 128 : 64;
  const __m512i m15 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(16), m48 = _mm512_set1_epi8(48);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[X16_MAX_ROWS], accm[X16_MAX_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
    const uint8_t* p = w + g * nb * bytes;
    for (int64_t b = 0; b < nb; ++b, p += bytes) {
      __m512i v[8];  // v[t]: values 4t..4t+3 of the 16 rows
      if (Q8)
        for (int t = 0; t < 8; ++t) v[t] = _mm512_loadu_si512(p + 32 + 64 * t);
      else
        for (int t = 0; t < 4; ++t) {
          const __m512i raw = _mm512_loadu_si512(p + values + 64 * t);
          v[t] = _mm512_and_si512(raw, m15);
          v[4 + t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15);
        }
      if (Q5) {  // the fifth bit of v[u] at bit u, moved to bit 4
        const __m512i h = _mm512_loadu_si512(p + 384);
        v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), m16));
        v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), m16));
        v[2] = _mm512_or_si512(v[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), m16));
        v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), m16));
        v[4] = _mm512_or_si512(v[4], _mm512_and_si512(h, m16));
        v[5] = _mm512_or_si512(v[5], _mm512_and_si512(_mm512_srli_epi16(h, 1), m16));
        v[6] = _mm512_or_si512(v[6], _mm512_and_si512(_mm512_srli_epi16(h, 2), m16));
        v[7] = _mm512_or_si512(v[7], _mm512_and_si512(_mm512_srli_epi16(h, 3), m16));
      }
      if (Q6) {  // the high 2 bits of v[4 j + c] at bits 2c of load j, moved to bits 4-5
        const __m512i h0 = _mm512_loadu_si512(p + 320), h1 = _mm512_loadu_si512(p + 384);
        for (int j = 0; j < 2; ++j) {
          const __m512i h = j ? h1 : h0;
          v[4 * j] = _mm512_or_si512(v[4 * j], _mm512_and_si512(_mm512_slli_epi16(h, 4), m48));
          v[4 * j + 1] = _mm512_or_si512(v[4 * j + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), m48));
          v[4 * j + 2] = _mm512_or_si512(v[4 * j + 2], _mm512_and_si512(h, m48));
          v[4 * j + 3] = _mm512_or_si512(v[4 * j + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), m48));
        }
      }
      const __m512 dw = F32 ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      if (Q6) {  // d sc0 and d sc1 per row; lane r of the pairs: sc0 | sc1 << 8
        const __m512i pairs = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)(p + 32)));
        const __m512 ds0 = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 24), 24)));
        const __m512 ds1 = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 8)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          const int8_t* xq = q + row * k + b * 32;
          const int32_t* off = o + 2 * (row * nb + b);  // -32 sum(x) of values 0-15, 16-31
          __m512i s0 = _mm512_set1_epi32(off[0]), s1 = _mm512_set1_epi32(off[1]);
          for (int t = 0; t < 4; ++t) {
            s0 = _mm512_dpbusd_epi32(s0, v[t], x4(xq + 4 * t));
            s1 = _mm512_dpbusd_epi32(s1, v[4 + t], x4(xq + 16 + 4 * t));
          }
          const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), ds1, _mm512_mul_ps(_mm512_cvtepi32_ps(s0), ds0));
          acc[r] = _mm512_fmadd_ps(part, _mm512_set1_ps(d[row * nb + b]), acc[r]);
        }
        continue;
      }
      // The mins (Q4_1, the K formats); with an offset (Q8_0, Q4_0) the sums are exact without them.
      const __m512 cw = offset ? _mm512_setzero_ps()
                        : F32  ? _mm512_loadu_ps(p + 64)
                               : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = q + row * k + b * 32;  // 4 activation bytes broadcast per vpdpbusd
        const __m512i start = offset ? _mm512_set1_epi32(o[row * nb + b]) : _mm512_setzero_si512();
        __m512i s0 = _mm512_dpbusd_epi32(start, v[0], x4(xq));
        __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], x4(xq + 16));
        for (int t = 1; t < 4; ++t) {
          s0 = _mm512_dpbusd_epi32(s0, v[t], x4(xq + 4 * t));
          s1 = _mm512_dpbusd_epi32(s1, v[4 + t], x4(xq + 16 + 4 * t));
        }
        const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(d[row * nb + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sc, acc[r]);
        if (!offset) accm[r] = _mm512_fmadd_ps(cw, _mm512_set1_ps(s[row * nb + b]), accm[r]);
      }
    }
    const int64_t cols = n - g * 16 < 16 ? n - g * 16 : 16;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + g * 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 out = _mm512_add_ps(_mm512_add_ps(acc[r], accm[r]), bv);
      const int64_t at = (r0 + r) * n + g * 16;
      if (bf16)
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t*)y + at, keep, bf16_bits16(out));
      else
        _mm512_mask_storeu_ps((float*)y + at, keep, out);
    }
  }
}

#define X16_CASE(R)                                                                                \
  case R:                                                                                          \
    if (kind == X16_Q8_0) x16_groups(X16_Q8_0, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16);    \
    else if (kind == X16_Q4_0) x16_groups(X16_Q4_0, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16); \
    else if (kind == X16_Q4_F) x16_groups(X16_Q4_F, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16); \
    else if (kind == X16_Q5_F) x16_groups(X16_Q5_F, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16); \
    else if (kind == X16_Q6) x16_groups(X16_Q6, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16);   \
    else x16_groups(X16_Q4_1, w, nb, q, d, s, o, k, r0, R, g0, g1, n, bias, y, bf16);                    \
    break;

static void x16_pass(int kind, const uint8_t* w, int64_t nb, const int8_t* q, const float* d, const float* s,
                     const int32_t* o, int64_t k, int64_t r0, int R, int64_t g0, int64_t g1, int64_t n,
                     const float* bias, void* y, int bf16) {
  switch (R) {
    X16_CASE(1) X16_CASE(2) X16_CASE(3) X16_CASE(4) X16_CASE(5) X16_CASE(6) X16_CASE(7) X16_CASE(8)
  }
}

// y [m, n] = x [m, k] fp32 . W^T (+ bias [n] fp32), W packed x16, y fp32 or (bf16) bfloat16. 0 on
// success; 1 for a format or shape this kernel does not take; 2 out of memory.
int gguf_gemm_x16(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k,
                  const float* bias, void* y, int bf16) {
  if (!gguf_gemm_x16_supported(qtype) || m < 1 || n < 1 || k < 32 || k % 32) return 1;
  const int64_t nb = k / 32, groups = (n + 15) / 16;
  const int kind = x16_kind(qtype);
  char* scratch = gguf_act_scratch((size_t)(m * k + 4) + 16 * m * nb);
  if (!scratch) return 2;
  int8_t* q = (int8_t*)scratch;
  float* d = (float*)(scratch + (m * k + 3) / 4 * 4);
  float* s = d + m * nb;
  int32_t* o = (int32_t*)(s + m * nb);  // Q6_K: -32 sum(x) per 16 values; Q8_0 / Q4_0: -128 / -8 sum(x) per 32
  const int team = m * n * k < SERIAL_WORK ? 1 : omp_get_max_threads();
  // Quantized row by row across the team from a few rows up: serial, it took a third of a 192-column
  // GEMM at 512 rows and a sixth of a 576 x 1536 one at 32.
#pragma omp parallel for schedule(static) if (team > 1 && m * k >= 4096)
  for (int64_t i = 0; i < m; ++i) {
    gguf_quantize_rows32(x + i * k, 1, k, q + i * k, d + i * nb, s + i * nb);
    // The integer offsets the dots start from: c sum(q_x) per run of `len` activation bytes.
    const int c = kind == X16_Q6 ? -32 : kind == X16_Q8_0 ? -128 : kind == X16_Q4_0 ? -8 : 0;
    const int64_t len = kind == X16_Q6 ? 16 : 32;
    for (int64_t j = i * k / len; c && j < (i + 1) * k / len; ++j) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t at = 0; at < len; at += 16)
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + len * j + at))));
      o[j] = c * _mm512_reduce_add_epi32(sum);
    }
  }
  // Several claims a thread: a thread preempted on a shared machine leaves its groups to the others.
  const int64_t claims = (int64_t)team * CHUNKS_PER_THREAD;
  const int64_t per = (groups + claims - 1) / claims, chunks = (groups + per - 1) / per;
  const int64_t fit = X16_TILE_BYTES / (nb * x16_block_bytes(kind)), tile = fit > 1 ? fit : 1;  // groups
#pragma omp parallel for schedule(dynamic, 1) if (team > 1 && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g1 = (c + 1) * per < groups ? (c + 1) * per : groups;
    // Every pass of X16_MAX_ROWS rows over a tile of groups that stays in L2: a pass over a whole
    // chunk (an LM head's is megabytes) read its weights from memory once per pass.
    for (int64_t t0 = c * per; t0 < g1; t0 += tile) {
      const int64_t t1 = t0 + tile < g1 ? t0 + tile : g1;
      for (int64_t r0 = 0; r0 < m; r0 += X16_MAX_ROWS) {
        const int R = (int)(m - r0 < X16_MAX_ROWS ? m - r0 : X16_MAX_ROWS);
        x16_pass(kind, w, nb, q, d, s, o, k, r0, R, t0, t1, n, bias, y, bf16);
      }
    }
  }
  return 0;
}

#else

int gguf_gemm_x16_supported(int qtype) {
  (void)qtype;
  return 0;
}

int gguf_gemm_x16(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k,
                  const float* bias, void* y, int bf16) {
  (void)x, (void)m, (void)w, (void)qtype, (void)n, (void)k, (void)bias, (void)y, (void)bf16;
  return 1;
}

#endif
