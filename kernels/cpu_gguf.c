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

#include <omp.h>

#include "cpu_gguf_simd.h"


int gguf_gemm_simd(void) { return SIMD_LEVEL; }  // 2: AVX512-VNNI, 1: AVX2, 0: plain C

// The 32-element formats, given how to unpack a block (q, d, min) and whether q is signed. Blocks
// go in pairs into two sets of sums: one set made each block wait for the last one's FMA (4
// cycles), which bound the loop at m = 1.
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


#if SIMD_LEVEL == 2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// AVX-512: 16 blocks at a time. Every format dots unsigned weights (Q8_0's moved by 128, Q4_0/Q5_0's
// not centred) and takes the offset, or Q4_1/Q5_1's min, through the activation sums: one vector FMA
// per 16 blocks, as is the scale (16 fp16 scales gathered and converted at once). The nibble formats
// unpack four blocks' 16-byte halves into one register with one and/shift; the activation is stored
// in the matching order (per 4 blocks: the four first halves, then the four second halves), and each
// block's int32 sums stay in its own 128-bit lane until one FMA per 4 blocks applies the scales.
#define WIDE 1
enum { K_Q8_0, K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1 };

// 16 blocks' first 4 bytes (the fp16 scale, and min or fifth bits), nvalid of them, zeros after: scalar loads,
// faster than a gather on AMD Zen 4.
static inline __m512i hdr16(const uint8_t* p, const int BYTES, int gran) {
  uint32_t h[16];
  for (int i = 0; i < 16; ++i) { if (i < gran) memcpy(&h[i], p + i * BYTES, 4); else h[i] = 0; }
  return _mm512_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]);
}
static inline __attribute__((always_inline)) void wide_batch(const uint8_t* wb, const Act* a, int64_t r0, int R,
                                                             int64_t b0, const int gran, int nvalid, const int BYTES, const int KIND,
                                                             __m512 (*acc)[4], __m512* tac) {
  const int NA = R <= 2 ? 4 : 2;  // independent sums per row: one chained FMA per 2 or 4 blocks bound the loop
  const int NIB = KIND != K_Q8_0, MIN = KIND == K_Q4_1 || KIND == K_Q5_1, FIVE = KIND == K_Q5_0 || KIND == K_Q5_1;
  const int QS = KIND == K_Q8_0 || KIND == K_Q4_0 ? 2 : KIND == K_Q4_1 ? 4 : KIND == K_Q5_0 ? 6 : 8;
  const float OFF = KIND == K_Q8_0 ? -128.f : KIND == K_Q4_0 ? -8.f : KIND == K_Q5_0 ? -16.f : 0.f;
  // a last, partial batch (gran a constant, 4, 8 or 12) reads no block past the row's nvalid: zeros
  // there (scales 0, against the activation's zero padding)
  const __m512i hdr = hdr16(wb, BYTES, nvalid);
  const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
  const __m512 c = MIN ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)))
                       : _mm512_mul_ps(dw, _mm512_set1_ps(OFF));
  __m512i q[8];
  const __m512i m15 = _mm512_set1_epi8(15);
  int nv;
  if (!NIB) {
    nv = (gran + 1) / 2;
    for (int g = 0; g < nv; ++g) {
      const __m256i lo = _mm256_loadu_si256((const __m256i*)(wb + 2 * g * BYTES + QS));
      const __m256i hi = 2 * g + 1 < nvalid ? _mm256_loadu_si256((const __m256i*)(wb + (2 * g + 1) * BYTES + QS))
                                          : _mm256_setzero_si256();
      q[g] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char)0x80));
    }
  } else {
    nv = 2 * ((gran + 3) / 4);
    uint64_t mlo[4], mhi[4];
    if (FIVE) {
      const __m512i qh = hdr16(wb + (KIND == K_Q5_0 ? 2 : 4), BYTES, nvalid);
      _mm256_storeu_si256((__m256i*)mlo, _mm512_cvtepi32_epi16(qh));
      _mm256_storeu_si256((__m256i*)mhi, _mm512_cvtepi32_epi16(_mm512_srli_epi32(qh, 16)));
    }
    for (int g = 0; g < nv / 2; ++g) {
      const uint8_t* p = wb + 4 * g * BYTES + QS;
      __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
      if (4 * g + 3 < nvalid) {
        raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + BYTES)), 1);
        raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + 2 * BYTES)), 2);
        raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + 3 * BYTES)), 3);
      } else
        for (int l = 1; l < 4; ++l)
          raw = _mm512_inserti32x4(raw, 4 * g + l < nvalid ? _mm_loadu_si128((const __m128i*)(p + l * BYTES))
                                                         : _mm_setzero_si128(), l);
      __m512i lo = _mm512_and_si512(raw, m15), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15);
      if (FIVE) {
        lo = _mm512_mask_add_epi8(lo, (__mmask64)mlo[g], lo, _mm512_set1_epi8(16));
        hi = _mm512_mask_add_epi8(hi, (__mmask64)mhi[g], hi, _mm512_set1_epi8(16));
      }
      q[2 * g] = lo, q[2 * g + 1] = hi;
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t at = AT(r, b0);
    const __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps(a->d + at));
    tac[r] = _mm512_fmadd_ps(c, _mm512_loadu_ps(a->s + at), tac[r]);
    const int8_t* x = a->q + at * 32;
    if (!NIB)
      for (int g = 0; g < nv; ++g) {
        const __m512i ip = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[g], _mm512_loadu_si512(x + 64 * g));
        const __m512i idx = _mm512_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1,
                                              2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
        acc[r][g % NA] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip), _mm512_permutexvar_ps(idx, sc), acc[r][g % NA]);
      }
    else
      for (int g = 0; g < nv / 2; ++g) {
        __m512i ip = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[2 * g], _mm512_loadu_si512(x + 128 * g));
        ip = _mm512_dpbusd_epi32(ip, q[2 * g + 1], _mm512_loadu_si512(x + 128 * g + 64));
        const __m512i idx = _mm512_setr_epi32(4 * g, 4 * g, 4 * g, 4 * g, 4 * g + 1, 4 * g + 1, 4 * g + 1, 4 * g + 1,
                                              4 * g + 2, 4 * g + 2, 4 * g + 2, 4 * g + 2, 4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3);
        acc[r][g % NA] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip), _mm512_permutexvar_ps(idx, sc), acc[r][g % NA]);
      }
  }
}

#define DEFINE_WIDE(NAME, BYTES, KIND)                                                              \
  ROW_KERNEL(NAME) {                                                                               \
    __m512 acc[MR][4], tac[MR];                                                                    \
    for (int r = 0; r < R; ++r)                                                                    \
      acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = tac[r] = _mm512_setzero_ps();                \
    int64_t b0 = 0;                                                                                \
    for (; b0 + 16 <= a->nb; b0 += 16) wide_batch(w + b0 * (BYTES), a, r0, R, b0, 16, 16, BYTES, KIND, acc, tac); \
    const int left = (int)(a->nb - b0);                                                            \
    if (left > 8) wide_batch(w + b0 * (BYTES), a, r0, R, b0, 12, left, BYTES, KIND, acc, tac);     \
    else if (left > 4) wide_batch(w + b0 * (BYTES), a, r0, R, b0, 8, left, BYTES, KIND, acc, tac); \
    else if (left > 0) wide_batch(w + b0 * (BYTES), a, r0, R, b0, 4, left, BYTES, KIND, acc, tac); \
    for (int r = 0; r < R; ++r)                                                                    \
      out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),             \
                                                  _mm512_add_ps(_mm512_add_ps(acc[r][2], acc[r][3]), tac[r]))); \
  }

DEFINE_WIDE(row_q8_0, 34, K_Q8_0)
DEFINE_WIDE(row_q4_0, 18, K_Q4_0)
DEFINE_WIDE(row_q4_1, 20, K_Q4_1)
DEFINE_WIDE(row_q5_0, 22, K_Q5_0)
DEFINE_WIDE(row_q5_1, 24, K_Q5_1)

// The nibble formats' activation order: per 4 blocks, values 0-15 of each, then values 16-31 of each.
static void nib_order(int8_t* q, int64_t nbp) {
  int8_t t[128];
  for (int64_t g = 0; g < nbp / 4; ++g, q += 128) {
    memcpy(t, q, 128);
    for (int l = 0; l < 4; ++l) memcpy(q + 16 * l, t + 32 * l, 16), memcpy(q + 64 + 16 * l, t + 32 * l + 16, 16);
  }
}
#else
#define WIDE 0
DEFINE_SMALL(row_q8_0, 34, 1, 0, ld32(w + 2))
DEFINE_SMALL(row_q4_0, 18, 1, 0, vsub(nib32(w + 2), 8))
DEFINE_SMALL(row_q4_1, 20, 0, 1, nib32(w + 4))
DEFINE_SMALL(row_q5_0, 22, 1, 0, vsub(vor(nib32(w + 6), bits16(w + 2)), 16))
DEFINE_SMALL(row_q5_1, 24, 0, 1, vor(nib32(w + 8), bits16(w + 4)))
#endif

#include "cpu_gguf_kquants.h"

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

int gguf_gemm_supported(int qtype) { return gguf_block_bytes(qtype) != 0; }

// One activation row into blocks of `block` values: q = round(x / d), d = max|x| / 127.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// quantize_row's 32-value blocks in registers, bit for bit the same: the same division for the
// scale, and vcvtps2dq rounds to nearest even as nearbyintf does (the default rounding mode). The
// scalar loops ran ~0.45 ns a value: serial, they took a sixth of a 32-row GEMM over 1536 columns.
static void quantize_row32(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128((__m128i*)(q + 32 * b), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(q1));
    d[b] = amax / 127.f;
    s[b] = d[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}
#endif

static void quantize_row(const float* x, int64_t k, int block, int8_t* q, float* d, float* s, int16_t* bs) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (block == 32 && s && !bs) {
    quantize_row32(x, k, q, d, s);
    return;
  }
#endif
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

// Rows of x [m, k] into Q8_0-style blocks in natural order (the x16 GEMM's activation, cpu_gguf_x16.c).
void gguf_quantize_rows32(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t i = 0; i < m; ++i) quantize_row(x + i * k, k, 32, q + i * k, d + i * (k / 32), s + i * (k / 32), NULL);
}

// The activation's scratch, kept per calling thread and grown as needed: no allocation per call.
static __thread char* scratch;
static __thread size_t scratch_size;

char* gguf_act_scratch(size_t want) {
  if (want > scratch_size) {
    free(scratch);
    scratch = malloc(want), scratch_size = scratch ? want : 0;
  }
  return scratch;
}

// y [m, n] fp32 = x [m, k] fp32 . W^T (+ bias [n] fp32), W [n] rows of k / block blocks of
// `qtype`. 0 on success; 1 for a format or shape this kernel does not take; 2 out of memory.
int gguf_gemm_f32(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k, const float* bias,
                  float* y) {
  const int block = gguf_block_elems(qtype), bytes = gguf_block_bytes(qtype);
  if (!bytes || m < 1 || n < 1 || k < block || k % block) return 1;
  const int small = block == 32, nib = small && qtype != Q8_0;
  Act a = {0};
  a.k = k, a.nb = k / block;
  a.nbp = small && WIDE ? (a.nb + 15) / 16 * 16 : a.nb;
  const size_t want = (size_t)(m * a.nbp * block + 4 * m * a.nbp + (small ? 4 * m * a.nbp : 2 * m * (k / 16)));
  char* mem = gguf_act_scratch(want);
  if (!mem) return 2;
  a.q = (int8_t*)mem;
  a.d = (float*)(mem + m * a.nbp * block);  // a multiple of 32: aligned
  if (small) a.s = a.d + m * a.nbp;
  else a.bs = (int16_t*)(a.d + m * a.nbp);
  const int serial = m * n * k < SERIAL_WORK;
#pragma omp parallel for schedule(static) if (!serial && m * k >= 65536)
  for (int64_t i = 0; i < m; ++i) {
    int8_t* q = a.q + i * a.nbp * block;
    float* d = a.d + i * a.nbp;
    quantize_row(x + i * k, k, block, q, d, small ? a.s + i * a.nbp : NULL, small ? NULL : a.bs + i * (k / 16));
    if (a.nbp > a.nb) {  // zero blocks up to the padded length
      memset(q + k, 0, (size_t)((a.nbp - a.nb) * block));
      memset(d + a.nb, 0, (size_t)(a.nbp - a.nb) * 4);
      memset(a.s + i * a.nbp + a.nb, 0, (size_t)(a.nbp - a.nb) * 4);
    }
#if WIDE
    if (nib) nib_order(q, a.nbp);
#endif
  }
  (void)nib;
  const rows_fn run = rows_for(qtype);
  // dynamic: on a shared machine one thread may be preempted; the others take its chunks. About
  // CHUNKS_PER_THREAD chunks a thread, not CHUNK_ROWS-row ones: each claim moves the loop's counter
  // between cores, and 192 claims (3072 rows) cost more than the rows they handed out.
  const int team = serial ? 1 : omp_get_max_threads();
  int64_t cr = (n + (int64_t)team * CHUNKS_PER_THREAD - 1) / ((int64_t)team * CHUNKS_PER_THREAD);
  cr = cr < CHUNK_ROWS ? CHUNK_ROWS : (cr + CHUNK_ROWS - 1) / CHUNK_ROWS * CHUNK_ROWS;
  const int64_t rb = a.nb * bytes, chunks = (n + cr - 1) / cr;
#pragma omp parallel for schedule(dynamic, 1) if (!serial && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n1 = (c + 1) * cr < n ? (c + 1) * cr : n;
    run(w, rb, &a, m, c * cr, n1, n, bias, y);
  }
  return 0;
}
