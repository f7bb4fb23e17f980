// Causal attention for prompt chunks over paged KV in bfloat16 with AVX512-BF16 dot products
// (VDPBF16PS), for CPUs that have them but no AMX tiles (AMD Zen 4 and later, Cooper Lake): the
// same contract as paged_prefill_bf16 in cpu_prefill_attention.c.
//
// That kernel widens every bf16 value and multiplies in fp32 FMAs. One VDPBF16PS does the work
// of two: each fp32 lane adds the products of a pair of bf16 values. The tile layout is the
// vector kernel's (query rows in lanes, so the softmax is vertical): for Q.K^T a lane holds one
// row's pair of head dimensions (2k, 2k+1) and the key's pair is broadcast from the cache as it
// lies; for P.V a lane holds one row's probabilities of two consecutive keys and the broadcast is
// those keys' values of one dimension, so V is interleaved by key pairs once per chunk. The
// probabilities are rounded to bf16 for P.V, as flash attention does on GPUs and the AMX kernel
// does here; scores, the softmax statistics and the output accumulate in fp32.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define KEYS 16   // keys per chunk
#define LANES 16  // query rows per vector
#define MAX_RV 4  // row vectors per work item: up to 64 query rows (positions x group heads)
#define MAX_DIM 256

// One work item's scratch, 64-byte aligned. Row r of the tile is lane r % 16 of vector r / 16.
typedef struct {
  __m512i q2[MAX_DIM / 2][MAX_RV];   // queries, bf16 pairs of head dimensions, rows in lanes
  __m512 acc[MAX_DIM][MAX_RV];       // P.V, rows in lanes
  __m512 s[KEYS][MAX_RV];            // one chunk's scaled scores, then probabilities
  __m512i p2[KEYS / 2][MAX_RV];      // ... as bf16 pairs of consecutive keys
  __m512 m[MAX_RV], l[MAX_RV];       // running row max and sum
  __m512 pos[MAX_RV];                // each row's position (as float: exact below 2^24)
  uint32_t v2[KEYS / 2][MAX_DIM];    // one chunk of V, bf16 pairs of consecutive keys
} DotScratch;

static const uint16_t zeros[MAX_DIM] __attribute__((aligned(64)));

// s[j][rv] = q . k_j for keys j0..j0+3: 4 x RV accumulators in registers, one dot per pair.
static inline __attribute__((always_inline)) void scores(DotScratch* w, const uint16_t* const* krow, int j0,
                                                         int pairs, const int RV) {
  __m512 a[4][MAX_RV];
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) a[i][rv] = _mm512_setzero_ps();
  const uint32_t *k0 = (const uint32_t*)krow[j0], *k1 = (const uint32_t*)krow[j0 + 1];
  const uint32_t *k2 = (const uint32_t*)krow[j0 + 2], *k3 = (const uint32_t*)krow[j0 + 3];
  for (int k = 0; k < pairs; ++k) {
    const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)k0[k]), b1 = (__m512bh)_mm512_set1_epi32((int)k1[k]);
    const __m512bh b2 = (__m512bh)_mm512_set1_epi32((int)k2[k]), b3 = (__m512bh)_mm512_set1_epi32((int)k3[k]);
    for (int rv = 0; rv < RV; ++rv) {
      const __m512bh q = (__m512bh)w->q2[k][rv];
      a[0][rv] = _mm512_dpbf16_ps(a[0][rv], q, b0);
      a[1][rv] = _mm512_dpbf16_ps(a[1][rv], q, b1);
      a[2][rv] = _mm512_dpbf16_ps(a[2][rv], q, b2);
      a[3][rv] = _mm512_dpbf16_ps(a[3][rv], q, b3);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) w->s[j0 + i][rv] = a[i][rv];
}

// acc[c][rv] += sum over key pairs of p2 . v2 for dimensions c0..c0+3.
static inline __attribute__((always_inline)) void pv(DotScratch* w, int c0, const int RV) {
  __m512 a[4][MAX_RV];
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) a[i][rv] = w->acc[c0 + i][rv];
  for (int jp = 0; jp < KEYS / 2; ++jp) {
    const uint32_t* v = w->v2[jp] + c0;
    const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)v[0]), b1 = (__m512bh)_mm512_set1_epi32((int)v[1]);
    const __m512bh b2 = (__m512bh)_mm512_set1_epi32((int)v[2]), b3 = (__m512bh)_mm512_set1_epi32((int)v[3]);
    for (int rv = 0; rv < RV; ++rv) {
      const __m512bh p = (__m512bh)w->p2[jp][rv];
      a[0][rv] = _mm512_dpbf16_ps(a[0][rv], p, b0);
      a[1][rv] = _mm512_dpbf16_ps(a[1][rv], p, b1);
      a[2][rv] = _mm512_dpbf16_ps(a[2][rv], p, b2);
      a[3][rv] = _mm512_dpbf16_ps(a[3][rv], p, b3);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) w->acc[c0 + i][rv] = a[i][rv];
}

// The online-softmax update for one chunk of nk keys from position k0: scale, soft-cap (cap > 0,
// Gemma 2), mask keys past
// each row's position (and past the chunk), fold the chunk's max into m (rescaling l and acc),
// turn scores into probabilities, add them to l and pair them up in bf16 for P.V.
static inline __attribute__((always_inline)) void softmax_chunk(DotScratch* w, int64_t k0, int nk, int d,
                                                                int masked, float scale, float win, float cap,
                                                                const int RV) {
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  // interleave two 16-value bf16 halves: element 2i from the first, 2i + 1 from the second
  const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int rv = 0; rv < RV; ++rv) {
    __m512 m_new = w->m[rv];
    for (int j = 0; j < KEYS; ++j) {
      __m512 s = _mm512_mul_ps(w->s[j][rv], sc);
      if (cap > 0.f) s = soft_cap16(s, cap);
      if (masked) {
        const __m512 kp = _mm512_set1_ps((float)(k0 + j));
        // past the row's position, or `win` or more behind it (a sliding window; else win is inf)
        const __mmask16 hide = j >= nk ? (__mmask16)0xffff
                                       : _mm512_cmp_ps_mask(kp, w->pos[rv], _CMP_GT_OQ)
                                             | _mm512_cmp_ps_mask(kp, _mm512_sub_ps(w->pos[rv], _mm512_set1_ps(win)),
                                                                  _CMP_LE_OQ);
        s = _mm512_mask_mov_ps(s, hide, ninf);
      }
      w->s[j][rv] = s;
      m_new = _mm512_max_ps(m_new, s);
    }
    const __m512 m_old = w->m[rv];
    // m is -inf only before the first chunk, where l and acc are still 0
    const __mmask16 changed = _mm512_cmp_ps_mask(m_old, m_new, _CMP_NEQ_OQ) | _mm512_cmp_ps_mask(m_old, ninf, _CMP_EQ_OQ);
    if (changed) {
      const __m512 alpha = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, ninf, _CMP_EQ_OQ),
                                                exp_neg16(_mm512_sub_ps(m_old, m_new)), _mm512_setzero_ps());
      const __m512 a = _mm512_mask_blend_ps(changed, _mm512_set1_ps(1.f), alpha);
      w->l[rv] = _mm512_mul_ps(w->l[rv], a);
      for (int k = 0; k < d; ++k) w->acc[k][rv] = _mm512_mul_ps(w->acc[k][rv], a);
    }
    w->m[rv] = m_new;
    __m512 l = w->l[rv];
    for (int j = 0; j < KEYS; j += 2) {
      // masked scores are -inf: exp_neg16 clamps them, so zero them explicitly
      const __m512 s0 = w->s[j][rv], s1 = w->s[j + 1][rv];
      const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_OQ), exp_neg16(_mm512_sub_ps(s0, m_new)));
      const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_OQ), exp_neg16(_mm512_sub_ps(s1, m_new)));
      l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
      w->p2[j / 2][rv] = _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    w->l[rv] = l;
  }
}

static inline __attribute__((always_inline)) void chunk(DotScratch* w, const uint16_t* const* krow, int64_t k0,
                                                        int nk, int d, int masked, float scale, float win,
                                                        float cap, const int RV) {
  for (int j = 0; j < KEYS; j += 4) scores(w, krow, j, d / 2, RV);
  softmax_chunk(w, k0, nk, d, masked, scale, win, cap, RV);
  for (int c = 0; c < d; c += 4) pv(w, c, RV);
}

static void item(const uint16_t* q, int64_t q_row, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int32_t* table, int64_t row0, int64_t pos0, int npos, uint16_t* out, int num_heads,
                 int num_kv_heads, int h, int d, int block_size, float scale, int window, float cap,
                 DotScratch* w) {
  const int group = num_heads / num_kv_heads;
  const int rows = npos * group, nrv = (rows + LANES - 1) / LANES, pairs = d / 2;
  for (int r = 0; r < nrv * LANES; ++r) {
    // row r: position pos0 + r / group, query head h * group + r % group; padding rows repeat
    // the last real row, so they stay finite, and are not written out
    const int rr = r < rows ? r : rows - 1;
    const uint32_t* qp = (const uint32_t*)(q + (row0 + rr / group) * q_row + (int64_t)(h * group + rr % group) * d);
    for (int k = 0; k < pairs; ++k) ((uint32_t*)&w->q2[k][r / LANES])[r % LANES] = qp[k];
    ((float*)&w->pos[r / LANES])[r % LANES] = (float)(pos0 + rr / group);
  }
  for (int rv = 0; rv < nrv; ++rv) {
    w->m[rv] = _mm512_set1_ps(-INFINITY);
    w->l[rv] = _mm512_setzero_ps();
    for (int k = 0; k < d; ++k) w->acc[k][rv] = _mm512_setzero_ps();
  }
  // keys 0 .. end-1; with a window, from the first row's first visible key
  const int64_t end = pos0 + npos;
  const int64_t start = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
  const float win = window > 0 ? (float)window : INFINITY;
  for (int64_t k0 = start; k0 < end; k0 += KEYS) {
    const int nk = end - k0 < KEYS ? (int)(end - k0) : KEYS;
    const uint16_t* krow[KEYS];
    const uint16_t* vrow[KEYS];
    for (int j = 0; j < KEYS; ++j) {
      if (j < nk) {
        const int64_t p = k0 + j;
        const int64_t off = (((int64_t)table[p / block_size] * block_size + p % block_size) * num_kv_heads + h) * d;
        krow[j] = k_cache + off;
        vrow[j] = v_cache + off;
      } else {  // past the chunk: masked scores, and zero values (0 * NaN would poison P.V)
        krow[j] = vrow[j] = zeros;
      }
    }
    for (int jp = 0; jp < KEYS / 2; ++jp) {
      const uint16_t *v0 = vrow[2 * jp], *v1 = vrow[2 * jp + 1];
      uint32_t* dst = w->v2[jp];
      int c = 0;
      for (; c + 16 <= d; c += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v0 + c)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v1 + c)));
        _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      for (; c < d; ++c) dst[c] = (uint32_t)v0[c] | (uint32_t)v1[c] << 16;
    }
    const int masked = window > 0 || k0 + KEYS > pos0 + 1;  // keys past the first row's position
    switch (nrv) {
      case 1: chunk(w, krow, k0, nk, d, masked, scale, win, cap, 1); break;
      case 2: chunk(w, krow, k0, nk, d, masked, scale, win, cap, 2); break;
      case 3: chunk(w, krow, k0, nk, d, masked, scale, win, cap, 3); break;
      default: chunk(w, krow, k0, nk, d, masked, scale, win, cap, 4); break;
    }
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* op = out + ((row0 + r / group) * num_heads + (int64_t)h * group + r % group) * d;
    const float inv = 1.f / ((float*)&w->l[r / LANES])[r % LANES];
    for (int k = 0; k < d; ++k) op[k] = f32_to_bf16(((float*)&w->acc[k][r / LANES])[r % LANES] * inv);
  }
}

int paged_prefill_bf16_dot(const uint16_t* q, int64_t q_row, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_tables, int64_t bt_stride, const int32_t* q_starts,
                           const int32_t* q_lens, const int32_t* ctx_lens, uint16_t* out, int num_seqs,
                           int num_heads, int num_kv_heads, int d, int block_size, float scale, int window,
                           float cap) {
  const int group = num_heads / num_kv_heads;
  if (d > MAX_DIM || d % 4 || num_heads % num_kv_heads || group > MAX_RV * LANES) return 1;
  const int most = MAX_RV * LANES / group;  // query positions a work item can hold
  int64_t items = 0;
  for (int i = 0; i < num_seqs; ++i) items += (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most);
  static _Thread_local DotScratch* scratch = 0;  // one per OpenMP thread, kept for later calls
  int failed = 0;
#pragma omp parallel
  {
    if (!scratch) scratch = aligned_alloc(64, sizeof(DotScratch));
    DotScratch* w = scratch;
    if (!w) {
#pragma omp atomic write
      failed = 1;
    }
    // later tiles see more keys: hand items out as threads free up
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      if (!w) continue;
      int64_t rest = it;
      int i = 0;
      for (;; ++i) {
        const int64_t n = (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most);
        if (rest < n) break;
        rest -= n;
      }
      const int tiles = (q_lens[i] + most - 1) / most;
      const int tile = (q_lens[i] + tiles - 1) / tiles;  // equal tiles, as in the vector kernel
      const int h = (int)(rest / tiles), t = (int)(rest % tiles);
      const int first = t * tile;
      const int npos = q_lens[i] - first < tile ? q_lens[i] - first : tile;
      item(q, q_row, k_cache, v_cache, block_tables + (int64_t)i * bt_stride, (int64_t)q_starts[i] + first,
           (int64_t)ctx_lens[i] + first, npos, out, num_heads, num_kv_heads, h, d, block_size, scale, window, cap,
           w);
    }
  }
  return failed ? 2 : 0;
}

int prefill_dot_available(void) { return 1; }

#else  // no AVX512-BF16 in this build: the caller uses the vector kernel

int paged_prefill_bf16_dot(const uint16_t* q, int64_t q_row, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_tables, int64_t bt_stride, const int32_t* q_starts,
                           const int32_t* q_lens, const int32_t* ctx_lens, uint16_t* out, int num_seqs,
                           int num_heads, int num_kv_heads, int d, int block_size, float scale, int window,
                           float cap) {
  (void)q, (void)q_row, (void)k_cache, (void)v_cache, (void)block_tables, (void)bt_stride, (void)q_starts;
  (void)q_lens, (void)ctx_lens, (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads, (void)d;
  (void)block_size, (void)scale, (void)window, (void)cap;
  return 3;
}

int prefill_dot_available(void) { return 0; }

#endif
