// Paged decode attention for the CPU: one query token per sequence, KV read in place from the
// block pool (no gathered copy, no padding to the longest sequence, no work for other kv heads).
//
// Built at run time by kernels/cpu_native.py (gcc -O3 -march=native -fopenmp) and called through
// ctypes; torch_ops.paged_attention uses it for single-token rows and keeps its plain-torch path
// as the fallback and the reference the tests compare against.
//
// Layout, as kernels/ops.py documents: q / out [rows, heads, head_dim] (q's rows may be strided,
// e.g. a slice of the fused qkv output; out is contiguous); K and V caches
// [num_blocks, block_size, kv_heads, head_dim]; block_tables [seqs, table_stride] int32.
// Work is split over sequences (or, with few of them, (sequence, kv head) pairs): the query heads of
// one GQA group share every K/V row they load, which is what makes few-kv-head models cheap here.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

// Scores -> unnormalised probabilities in place (exp of score - row max) and their sums, for
// each of the `group` query heads' rows of `len` scores; the first `skip` (outside a sliding
// window) are left out, and the V pass starts after them too.
static inline void softmax_scores(float* scores, int64_t len, int64_t skip, int group, const float* mx,
                                  float* total) {
  for (int g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float m = mx[g];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = skip; t < len; ++t) {
      sg[t] = exp_neg(sg[t] - m);
      sum += sg[t];
    }
    total[g] = sum;
  }
}

// Each head's maximum over scores skip..len-1: the K pass's maximum also took the positions
// before a sliding window's start (those share the window's first block), which must not count.
static inline void window_max(const float* scores, int64_t len, int64_t skip, int group, float* mx) {
  for (int g = 0; g < group; ++g) {
    const float* sg = scores + g * len;
    float m = -INFINITY;
    for (int64_t t = skip; t < len; ++t) m = sg[t] > m ? sg[t] : m;
    mx[g] = m;
  }
}

// Soft-capping (Gemma 2): scores skip..len-1 become cap * tanh(score / cap), and each head's
// maximum is taken again over them.
static inline void cap_scores(float* scores, int64_t len, int64_t skip, int group, float cap, float* mx) {
  for (int g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = skip; t < len; ++t) {
      sg[t] = soft_cap(sg[t], cap);
      m = sg[t] > m ? sg[t] : m;
    }
    mx[g] = m;
  }
}

// q . k over n floats. Written out because compilers finish an `omp simd` reduction with a
// chain of scalar adds through memory, which made the score pass 3x slower than its loads.
static inline float dot(const float* a, const float* b, int n) {
  int d = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#else
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[d + j] * b[d + j];
  sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
// Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the jump from one to
// the next: the passes ask for rows ahead themselves. One prefetch per row into L1 one block
// ahead leaves too few misses in flight to cover DRAM latency (the KV streamed at a fraction of
// what the memory gives); so the K pass also asks three blocks ahead into L2 (locality 2), and
// for the V row of the position it is at, which the V pass then finds in L2 (the gain:
// scripts/bench_decode_attention.py, figures in scripts/benchmarks.md).
#define PREFETCH_ROW_TO(p, locality)                                                             \
  do {                                                                                           \
    for (int line = 0; line < (int)(head_dim * sizeof(*(p))); line += 64)                         \
      __builtin_prefetch((const char*)(p) + line, 0, locality);                                  \
  } while (0)
#define PREFETCH_ROW(p) PREFETCH_ROW_TO(p, 3)
#define FAR_BLOCKS 3
#define K_PASS_PREFETCH(t, hd)                                                                   \
  do {                                                                                           \
    if ((t) + block_size < len) PREFETCH_ROW(k_cache + (ROW_OF((t) + block_size) * num_kv_heads + h) * (hd)); \
    if ((t) + FAR_BLOCKS * block_size < len)                                                     \
      PREFETCH_ROW_TO(k_cache + (ROW_OF((t) + FAR_BLOCKS * block_size) * num_kv_heads + h) * (hd), 2); \
    PREFETCH_ROW_TO(v_cache + (ROW_OF(t) * num_kv_heads + h) * (hd), 2);                         \
  } while (0)
#define V_PASS_PREFETCH(t, hd)                                                                   \
  do {                                                                                           \
    if ((t) + block_size < len) PREFETCH_ROW(v_cache + (ROW_OF((t) + block_size) * num_kv_heads + h) * (hd)); \
  } while (0)
#define ROW_OF(t)                                                                                \
  (pow2 ? ((int64_t)table[(t) >> shift] << shift) + ((t) & mask)                                  \
        : (int64_t)table[(t) / block_size] * block_size + (t) % block_size)

#ifdef __AVX512F__
// head_dim 64 and GQA groups of up to 4 (SmolLM2, most small Llamas): the same two passes with
// every vector in registers. The generic loop stages each K/V row and the accumulators through
// memory and turns out instruction-bound, far below memory speed; here q (G x 4 vectors), the row
// being read (4) and the accumulators (G x 4) all stay in zmm registers. fp32 caches keep the
// generic path's operation order (q scaled first, one FMA chain per score); bf16 caches with
// AVX512-BF16 take their dot products in bf16 pairs (kpass64_bf16), scaled after. Then the same
// softmax and V pass.
static inline void row64_bf16(const uint16_t* p, __m512 r[4]) {
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16 * i))), 16));
}
static inline void row64_f32(const float* p, __m512 r[4]) {
  for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(p + 16 * i);
}

// The K pass: scores[g * len + t] = q_g . k_t * scale for the G query heads, and each head's
// maximum. Rows widened to fp32 (ROW), q scaled first, one FMA chain per score: the fp32
// caches' pass, and bf16's on CPUs without AVX512-BF16.
#define DEFINE_KPASS_WIDE(NAME, T, ROW)                                                          \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const int G, const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, \
      int num_kv_heads, int h, int block_size, int pow2, int shift, int64_t mask, float scale,   \
      float* scores, float* mx) {                                                                \
    const int head_dim = 64; /* read by the prefetch macros */                                 \
    __m512 qv[4][4];                                                                             \
    for (int g = 0; g < G; ++g) {                                                                \
      ROW(q + g * 64, qv[g]);                                                                    \
      for (int i = 0; i < 4; ++i) qv[g][i] = _mm512_mul_ps(qv[g][i], _mm512_set1_ps(scale));     \
      mx[g] = -INFINITY;                                                                         \
    }                                                                                            \
    for (int64_t t = 0; t < len; ++t) {                                                          \
      K_PASS_PREFETCH(t, 64);                                                                    \
      __m512 k[4];                                                                               \
      ROW(k_cache + (ROW_OF(t) * num_kv_heads + h) * 64, k);                                     \
      for (int g = 0; g < G; ++g) {                                                              \
        __m512 d = _mm512_mul_ps(qv[g][0], k[0]);                                                \
        d = _mm512_fmadd_ps(qv[g][1], k[1], d);                                                  \
        d = _mm512_fmadd_ps(qv[g][2], k[2], d);                                                  \
        d = _mm512_fmadd_ps(qv[g][3], k[3], d);                                                  \
        const float score = _mm512_reduce_add_ps(d);                                             \
        scores[g * len + t] = score;                                                             \
        mx[g] = score > mx[g] ? score : mx[g];                                                   \
      }                                                                                          \
    }                                                                                            \
  }

DEFINE_KPASS_WIDE(kpass64_f32, float, row64_f32)

#ifdef __AVX512BF16__
// Sums of 16 vectors' lanes as one vector: out[j] = sum of v[j]'s lanes. A tree of 15 pair
// merges (2 shuffles + 1 add each) instead of 16 horizontal sums (~8 dependent ops each).
static inline __m512 sum16_lanes(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: two partials each of v[2i], v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial each of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes pairwise: [b0 L0+L1, b0 L2+L3, b1 L0+L1, b1 L2+L3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// bf16 caches: q . k straight from the bf16 rows with vdpbf16ps (exact products, fp32 sums; no
// widening of K), then * scale; 16 positions at a time, their partial sums merged into one
// vector of 16 scores by sum16_lanes. The K pass had been the bulk of the kernel's instructions
// (per score: 4 FMAs, a horizontal sum, a share of 4 widenings).
static inline __attribute__((always_inline)) void kpass64_bf16(
    const int G, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,
    int64_t len, int num_kv_heads, int h, int block_size, int pow2, int shift, int64_t mask, float scale,
    float* scores, float* mx) {
  const int head_dim = 64; /* read by the prefetch macros */
  __m512bh qb[4][2];
  __m512 top[4];
  for (int g = 0; g < G; ++g) {
    qb[g][0] = (__m512bh)_mm512_loadu_si512(q + g * 64);
    qb[g][1] = (__m512bh)_mm512_loadu_si512(q + g * 64 + 32);
    top[g] = _mm512_set1_ps(-INFINITY);
  }
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t t0 = 0;
  for (; t0 + 16 <= len; t0 += 16) {
    const uint16_t* kr[16];
    for (int j = 0; j < 16; ++j) {
      K_PASS_PREFETCH(t0 + j, 64);
      kr[j] = k_cache + (ROW_OF(t0 + j) * num_kv_heads + h) * 64;
    }
    for (int g = 0; g < G; ++g) {
      __m512 part[16];
      for (int j = 0; j < 16; ++j)
        part[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(kr[j])),
                                   qb[g][1], (__m512bh)_mm512_loadu_si512(kr[j] + 32));
      const __m512 s16 = _mm512_mul_ps(sum16_lanes(part), sv);
      _mm512_storeu_ps(scores + g * len + t0, s16);
      top[g] = _mm512_max_ps(top[g], s16);
    }
  }
  for (int g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(top[g]);
  for (int64_t t = t0; t < len; ++t) {
    K_PASS_PREFETCH(t, 64);
    const uint16_t* kp = k_cache + (ROW_OF(t) * num_kv_heads + h) * 64;
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(kp)),
                                        qb[g][1], (__m512bh)_mm512_loadu_si512(kp + 32));
      const float score = _mm512_reduce_add_ps(d) * scale;
      scores[g * len + t] = score;
      mx[g] = score > mx[g] ? score : mx[g];
    }
  }
}
#define KPASS64_BF16 kpass64_bf16
#else
DEFINE_KPASS_WIDE(kpass64_bf16_widened, uint16_t, row64_bf16)
#define KPASS64_BF16 kpass64_bf16_widened
#endif

// The V pass and the output, after the K pass (KPASS) and the softmax.
#define DEFINE_PAIR64(NAME, T, ROW, STORE, KPASS)                                               \
  static inline __attribute__((always_inline)) void NAME(                                        \
      const int G, const T* q, const T* k_cache, const T* v_cache, const int32_t* table,         \
      int64_t len, int num_kv_heads, int h, int block_size, int pow2, int shift, int64_t mask,   \
      float scale, int64_t skip, float softcap, float* scores, T* out) {                         \
    const int head_dim = 64; /* read by the prefetch macros */                                 \
    __m512 acc[4][4];                                                                            \
    float mx[4], total[4];                                                                       \
    KPASS(G, q, k_cache, v_cache, table, len, num_kv_heads, h, block_size, pow2, shift, mask, scale, scores, mx); \
    if (softcap > 0.f)                                                                           \
      cap_scores(scores, len, skip, G, softcap, mx);                                             \
    else if (skip)                                                                               \
      window_max(scores, len, skip, G, mx);                                                      \
    for (int g = 0; g < G; ++g)                                                                  \
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();                               \
    softmax_scores(scores, len, skip, G, mx, total);                                             \
    for (int64_t t = skip; t < len; ++t) {                                                       \
      V_PASS_PREFETCH(t, 64);                                                                    \
      __m512 v[4];                                                                               \
      ROW(v_cache + (ROW_OF(t) * num_kv_heads + h) * 64, v);                                     \
      for (int g = 0; g < G; ++g) {                                                              \
        const __m512 p = _mm512_set1_ps(scores[g * len + t]);                                    \
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);             \
      }                                                                                          \
    }                                                                                            \
    for (int g = 0; g < G; ++g) {                                                                \
      float o[64];                                                                               \
      const __m512 inv = _mm512_set1_ps(1.f / total[g]);                                         \
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(acc[g][i], inv));   \
      for (int d = 0; d < 64; ++d) out[g * 64 + d] = STORE(o[d]);                                \
    }                                                                                            \
  }

DEFINE_PAIR64(pair64_bf16, uint16_t, row64_bf16, f32_to_bf16, KPASS64_BF16)
DEFINE_PAIR64(pair64_f32, float, row64_f32, F32_STORE, kpass64_f32)

// Runs the register path and yields 1 when it applies (head_dim 64, group <= 4), else 0. One
// case per group size, so that G is a constant and the loops over it unroll into registers.
#define FAST64(PAIR, ...)                                                                        \
  (head_dim == 64 && group <= 4 ? ({                                                             \
    switch (group) {                                                                             \
      case 1: PAIR(1, __VA_ARGS__); break;                                                       \
      case 2: PAIR(2, __VA_ARGS__); break;                                                       \
      case 3: PAIR(3, __VA_ARGS__); break;                                                       \
      default: PAIR(4, __VA_ARGS__); break;                                                      \
    }                                                                                            \
    1;                                                                                           \
  }) : 0)
#else
#define FAST64(PAIR, ...) 0
#endif

// One function per cache dtype: T is the element type, LOAD / STORE convert to and from float.
// `generic_only` skips the register path (benchmarks and tests compare the two). `window` > 0:
// sliding-window attention, the query at position p sees keys p - window + 1 .. p only; the
// table is entered at the window's first block, and the positions of that block before the
// window (`skip`) are scored but left out of the softmax and the V pass. `softcap` > 0: scores
// are soft-capped (cap_scores) before the softmax.
// Per (sequence, kv head) pair: scores of the group's query heads against every position (one
// pass over K), softmax, then one pass over V. `work` holds group * max_len scores per thread.
#define DEFINE_DECODE(NAME, T, LOAD, STORE, PAIR64)                                      \
  int NAME(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int32_t* block_tables,          \
           int64_t table_stride, const int32_t* seq_lens, const int64_t* rows, T* out,            \
           int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
           int64_t max_len, float scale, int generic_only, int64_t window, float softcap) {      \
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0 ||          \
        num_heads / num_kv_heads > MAX_GROUP || max_len < 1)                                     \
      return 1;                                                                                  \
    const int group = num_heads / num_kv_heads;                                                  \
    /* cache row of position t: shifts when the block size is a power of two (always, in practice) */ \
    const int pow2 = (block_size & (block_size - 1)) == 0;                                       \
    const int shift = __builtin_ctz((unsigned)block_size);                                       \
    const int64_t mask = block_size - 1;                                                         \
    const int threads = omp_get_max_threads();                                                   \
    float* scratch = (float*)malloc(sizeof(float) * (size_t)threads * group * max_len);          \
    if (!scratch) return 2;                                                                      \
    /* Enough sequences: one item takes all of a sequence's kv heads, whose rows share its cache  \
       lines (a token's heads sit side by side); few: (sequence, kv head) pairs, for the threads. */ \
    const int whole = num_seqs >= 4 * threads;                                                   \
    const int64_t items = whole ? (int64_t)num_seqs : (int64_t)num_seqs * num_kv_heads;          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                        \
    for (int64_t item = 0; item < items; ++item)                                                 \
    for (int h = whole ? 0 : (int)(item % num_kv_heads), h_end = whole ? num_kv_heads : h + 1; h < h_end; ++h) { \
      const int64_t s = whole ? item : item / num_kv_heads;                                      \
      int64_t len = seq_lens[s], skip = 0;                                                       \
      const int32_t* table = block_tables + s * table_stride;                                    \
      if (window > 0 && len > window) {                                                          \
        const int64_t first_block = (len - window) / block_size;                                 \
        table += first_block;                                                                    \
        len -= first_block * block_size;                                                         \
        skip = len - window;                                                                     \
      }                                                                                          \
      const int64_t row = rows[s];                                                               \
      float* scores = scratch + (size_t)omp_get_thread_num() * group * max_len;                  \
      if (!generic_only && FAST64(PAIR64, q + row * q_row_stride + (int64_t)h * group * head_dim, k_cache, v_cache, table, len, \
                 num_kv_heads, h, block_size, pow2, shift, mask, scale, skip, softcap, scores,    \
                 out + (row * num_heads + (int64_t)h * group) * head_dim))                        \
        continue;                                                                                \
      float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], kv[MAX_HEAD_DIM];         \
      float mx[MAX_GROUP], total[MAX_GROUP];                                                     \
      for (int g = 0; g < group; ++g) {                                                          \
        const T* qp = q + row * q_row_stride + ((int64_t)h * group + g) * head_dim;                    \
        for (int d = 0; d < head_dim; ++d) qf[g][d] = LOAD(qp[d]) * scale;                       \
        memset(acc[g], 0, sizeof(float) * head_dim);                                             \
        mx[g] = -INFINITY;                                                                       \
      }                                                                                          \
      for (int64_t t = 0; t < len; ++t) {                                                        \
        const T* kp = k_cache + (ROW_OF(t) * num_kv_heads + h) * head_dim;                       \
        K_PASS_PREFETCH(t, head_dim);                                                            \
        _Pragma("omp simd")                                                                      \
        for (int d = 0; d < head_dim; ++d) kv[d] = LOAD(kp[d]);                                  \
        for (int g = 0; g < group; ++g) {                                                        \
          const float score = dot(qf[g], kv, head_dim);                                          \
          scores[g * len + t] = score;                                                           \
          mx[g] = score > mx[g] ? score : mx[g];                                                 \
        }                                                                                        \
      }                                                                                          \
      if (softcap > 0.f)                                                                         \
        cap_scores(scores, len, skip, group, softcap, mx);                                       \
      else if (skip)                                                                             \
        window_max(scores, len, skip, group, mx);                                                \
      softmax_scores(scores, len, skip, group, mx, total);                                       \
      for (int64_t t = skip; t < len; ++t) {                                                     \
        const T* vp = v_cache + (ROW_OF(t) * num_kv_heads + h) * head_dim;                       \
        V_PASS_PREFETCH(t, head_dim);                                                            \
        _Pragma("omp simd")                                                                      \
        for (int d = 0; d < head_dim; ++d) kv[d] = LOAD(vp[d]);                                  \
        for (int g = 0; g < group; ++g) {                                                        \
          const float p = scores[g * len + t];                                                   \
          _Pragma("omp simd")                                                                    \
          for (int d = 0; d < head_dim; ++d) acc[g][d] += p * kv[d];                             \
        }                                                                                        \
      }                                                                                          \
      for (int g = 0; g < group; ++g) {                                                          \
        T* op = out + (row * num_heads + (int64_t)h * group + g) * head_dim;                      \
        const float inv = 1.f / total[g];                                                        \
        for (int d = 0; d < head_dim; ++d) op[d] = STORE(acc[g][d] * inv);                       \
      }                                                                                          \
    }                                                                                            \
    free(scratch);                                                                               \
    return 0;                                                                                    \
  }

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, pair64_bf16)
DEFINE_DECODE(paged_decode_f32, float, F32_LOAD, F32_STORE, pair64_f32)
