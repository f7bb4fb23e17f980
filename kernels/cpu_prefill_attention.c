// Causal attention for multi-token query rows (prompt chunks) over paged KV, for the CPU.
//
// torch's SDPA needs each chunk's K/V as contiguous tensors (a gather per layer when the chunk
// has context), and ran far below the cores' peak, a large share of a prefill step. Here every
// (sequence, kv head, tile of query positions) is one work item: the
// tile's query heads of that GQA group share each K/V row they load, keys come in chunks of 16
// read in place from the block pool (the step's own K/V is already there), and an online softmax
// keeps one pass over the keys. The tile is held transposed (query rows in vector lanes): scores,
// the softmax statistics and the P.V product are then all vertical vector operations, register-
// tiled 4 keys (or 4 dimensions) x up to 4 row vectors, with GCC vector types that become zmm
// (AVX-512) or ymm pairs (AVX2) as the build allows; nothing is transposed per key chunk.
// scripts/bench_prefill_attention.py measures it against the torch path (scripts/benchmarks.md).
//
// Layout as in cpu_paged_attention.c: q [T, Hq, D] with row stride q_row, out [T, Hq, D]
// contiguous, caches [num_blocks, block_size, Hkv, D], block_tables [seqs, bt_stride] int32.
// Sequence i owns query rows q_starts[i] .. q_starts[i] + q_lens[i], at positions
// ctx_lens[i] .. ctx_lens[i] + q_lens[i] - 1; a query at position p sees keys 0..p, or with a
// sliding window (`window` > 0) keys p - window + 1 .. p. `cap` > 0: scores are soft-capped,
// cap * tanh(score / cap), before the mask and the softmax (Gemma 2).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

#define KEYS 16   // keys per chunk
#define LANES 16  // query rows per vector
#define MAX_RV 4  // row vectors per work item: up to 64 query rows (positions x group heads)
#define MAX_DIM 256
#define MAX_GROUP 16

typedef float v16 __attribute__((vector_size(LANES * sizeof(float)), aligned(64)));

// One work item's scratch, 64-byte aligned. Row r of the tile is lane r % 16 of vector r / 16.
typedef struct {
  v16 qt[MAX_DIM][MAX_RV];    // pre-scaled queries, transposed
  v16 acc[MAX_DIM][MAX_RV];   // P.V, transposed
  v16 p[KEYS][MAX_RV];        // one chunk's scores, then probabilities
  v16 m[MAX_RV], l[MAX_RV];   // running row max and sum
  v16 pos[MAX_RV];            // each row's position (as float: exact below 2^24)
  float k[KEYS][MAX_DIM], v[KEYS][MAX_DIM];  // one chunk of K and V rows, as float
} Scratch;

// p[j][rv] = q . k_j for keys j0..j0+3 and every row vector: 4 x RV accumulators in registers.
static inline __attribute__((always_inline)) void scores(Scratch* w, int j0, int d, const int RV) {
  v16 a[4][MAX_RV] = {{{0}}};
  for (int k = 0; k < d; ++k) {
    const float k0 = w->k[j0][k], k1 = w->k[j0 + 1][k], k2 = w->k[j0 + 2][k], k3 = w->k[j0 + 3][k];
    for (int rv = 0; rv < RV; ++rv) {
      const v16 q = w->qt[k][rv];
      a[0][rv] += k0 * q;
      a[1][rv] += k1 * q;
      a[2][rv] += k2 * q;
      a[3][rv] += k3 * q;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) w->p[j0 + i][rv] = a[i][rv];
}

// acc[k][rv] += sum_j v_j[k] * p[j][rv] for dimensions k0..k0+3 and every row vector.
static inline __attribute__((always_inline)) void pv(Scratch* w, int k0, int nk, const int RV) {
  v16 a[4][MAX_RV];
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) a[i][rv] = w->acc[k0 + i][rv];
  for (int j = 0; j < nk; ++j) {
    const float v0 = w->v[j][k0], v1 = w->v[j][k0 + 1], v2 = w->v[j][k0 + 2], v3 = w->v[j][k0 + 3];
    for (int rv = 0; rv < RV; ++rv) {
      const v16 p = w->p[j][rv];
      a[0][rv] += v0 * p;
      a[1][rv] += v1 * p;
      a[2][rv] += v2 * p;
      a[3][rv] += v3 * p;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int rv = 0; rv < RV; ++rv) w->acc[k0 + i][rv] = a[i][rv];
}

// The online-softmax update for one chunk of nk keys starting at position k0: soft-cap the
// scores (cap > 0), mask keys past each row's position or `win` or more behind it, fold the
// chunk's max into m (rescaling l and acc), turn scores into probabilities and add them to l.
static inline __attribute__((always_inline)) void softmax_chunk(Scratch* w, int64_t k0, int nk, int d,
                                                                 int masked, float win, float cap,
                                                                 const int RV) {
  for (int rv = 0; rv < RV; ++rv) {
    float* mx = (float*)&w->m[rv];
    float* l = (float*)&w->l[rv];
    const float* pos = (const float*)&w->pos[rv];
    float m_new[LANES], alpha[LANES];
    for (int i = 0; i < LANES; ++i) m_new[i] = mx[i];
    for (int j = 0; j < KEYS; ++j) {
      float* s = (float*)&w->p[j][rv];
      if (cap > 0.f) {
#pragma omp simd
        for (int i = 0; i < LANES; ++i) s[i] = soft_cap(s[i], cap);
      }
      if (masked) {
        const float kp = (float)(k0 + j);
#pragma omp simd
        for (int i = 0; i < LANES; ++i) s[i] = (j >= nk || kp > pos[i] || kp <= pos[i] - win) ? -INFINITY : s[i];
      }
#pragma omp simd
      for (int i = 0; i < LANES; ++i) m_new[i] = s[i] > m_new[i] ? s[i] : m_new[i];
    }
    int rescale = 0;
#pragma omp simd reduction(| : rescale)
    for (int i = 0; i < LANES; ++i) {
      // m is -inf only before the first chunk, where l and acc are still 0.
      alpha[i] = mx[i] == m_new[i] ? 1.f : (mx[i] == -INFINITY ? 0.f : exp_neg(mx[i] - m_new[i]));
      rescale |= alpha[i] != 1.f;
      l[i] *= alpha[i];
      mx[i] = m_new[i];
    }
    if (rescale) {
      v16 a;
      memcpy(&a, alpha, sizeof a);
      for (int k = 0; k < d; ++k) w->acc[k][rv] *= a;
    }
    for (int j = 0; j < KEYS; ++j) {
      float* s = (float*)&w->p[j][rv];
#pragma omp simd
      for (int i = 0; i < LANES; ++i) {
        s[i] = s[i] == -INFINITY ? 0.f : exp_neg(s[i] - m_new[i]);
        l[i] += s[i];
      }
    }
  }
}

static inline __attribute__((always_inline)) void chunk(Scratch* w, int64_t k0, int nk, int d, int masked,
                                                         float win, float cap, const int RV) {
  for (int j = 0; j < KEYS; j += 4) scores(w, j, d, RV);
  softmax_chunk(w, k0, nk, d, masked, win, cap, RV);
  for (int k = 0; k < d; k += 4) pv(w, k, nk, RV);
}

#define DEFINE_PREFILL(NAME, T, LOAD, STORE)                                                     \
  static void NAME##_item(const T* q, int64_t q_row, const T* k_cache, const T* v_cache,        \
                          const int32_t* table, int64_t row0, int64_t pos0, int npos,           \
                          T* out, int num_heads, int num_kv_heads, int h, int d,                \
                          int block_size, float scale, int window, float cap, Scratch* w) {     \
    const int group = num_heads / num_kv_heads;                                                 \
    const int rows = npos * group, nrv = (rows + LANES - 1) / LANES;                            \
    for (int r = 0; r < nrv * LANES; ++r) {                                                     \
      /* row r: position pos0 + r / group, query head h * group + r % group; padding rows */   \
      /* repeat the last real row, so they stay finite, and are not written out */            \
      const int rr = r < rows ? r : rows - 1;                                                   \
      const T* qp = q + (row0 + rr / group) * q_row + (int64_t)(h * group + rr % group) * d;    \
      for (int k = 0; k < d; ++k) ((float*)&w->qt[k][r / LANES])[r % LANES] = LOAD(qp[k]) * scale; \
      ((float*)&w->pos[r / LANES])[r % LANES] = (float)(pos0 + rr / group);                     \
    }                                                                                           \
    for (int rv = 0; rv < nrv; ++rv) {                                                          \
      w->m[rv] = (v16){0} - INFINITY;                                                           \
      w->l[rv] = (v16){0};                                                                      \
      for (int k = 0; k < d; ++k) w->acc[k][rv] = (v16){0};                                     \
    }                                                                                           \
    /* keys 0 .. end-1; with a window, from the first row's first visible key */               \
    const int64_t end = pos0 + npos;                                                            \
    const int64_t start = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;              \
    const float win = window > 0 ? (float)window : INFINITY;                                    \
    for (int64_t k0 = start; k0 < end; k0 += KEYS) {                                            \
      const int nk = end - k0 < KEYS ? (int)(end - k0) : KEYS;                                  \
      for (int j = 0; j < KEYS; ++j) {                                                          \
        if (j < nk) {                                                                           \
          const int64_t p = k0 + j;                                                             \
          const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;   \
          const T* kp = k_cache + (slot * num_kv_heads + h) * d;                                \
          const T* vp = v_cache + (slot * num_kv_heads + h) * d;                                \
          _Pragma("omp simd")                                                                   \
          for (int k = 0; k < d; ++k) w->k[j][k] = LOAD(kp[k]);                                 \
          _Pragma("omp simd")                                                                   \
          for (int k = 0; k < d; ++k) w->v[j][k] = LOAD(vp[k]);                                 \
        } else {                                                                                \
          memset(w->k[j], 0, sizeof(float) * d);                                                \
        }                                                                                       \
      }                                                                                         \
      /* keys past the first row's position need the causal mask; windows always mask */      \
      const int masked = window > 0 || k0 + KEYS > pos0 + 1;                                    \
      switch (nrv) {                                                                            \
        case 1: chunk(w, k0, nk, d, masked, win, cap, 1); break;                                     \
        case 2: chunk(w, k0, nk, d, masked, win, cap, 2); break;                                     \
        case 3: chunk(w, k0, nk, d, masked, win, cap, 3); break;                                     \
        default: chunk(w, k0, nk, d, masked, win, cap, 4); break;                                    \
      }                                                                                         \
    }                                                                                           \
    for (int r = 0; r < rows; ++r) {                                                            \
      T* op = out + ((row0 + r / group) * num_heads + (int64_t)h * group + r % group) * d;      \
      const float inv = 1.f / ((float*)&w->l[r / LANES])[r % LANES];                            \
      for (int k = 0; k < d; ++k) op[k] = STORE(((float*)&w->acc[k][r / LANES])[r % LANES] * inv); \
    }                                                                                           \
  }                                                                                             \
  int NAME(const T* q, int64_t q_row, const T* k_cache, const T* v_cache,                       \
           const int32_t* block_tables, int64_t bt_stride, const int32_t* q_starts,             \
           const int32_t* q_lens, const int32_t* ctx_lens, T* out, int num_seqs, int num_heads, \
           int num_kv_heads, int d, int block_size, float scale, int window, float cap) {       \
    const int group = num_heads / num_kv_heads;                                                 \
    if (d > MAX_DIM || d % 4 || group > MAX_GROUP || num_heads % num_kv_heads) return 1;        \
    const int most = MAX_RV * LANES / group; /* query positions a work item can hold */        \
    int64_t items = 0;                                                                          \
    for (int i = 0; i < num_seqs; ++i) items += (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most); \
    static _Thread_local Scratch* scratch = 0; /* one per OpenMP thread, kept for later calls */ \
    int failed = 0;                                                                             \
    _Pragma("omp parallel")                                                                     \
    {                                                                                           \
      if (!scratch) scratch = aligned_alloc(64, sizeof(Scratch));                               \
      Scratch* w = scratch;                                                                     \
      if (!w) {                                                                                 \
        _Pragma("omp atomic write")                                                             \
        failed = 1;                                                                             \
      }                                                                                         \
      /* later tiles see more keys: hand items out as threads free up */                       \
      _Pragma("omp for schedule(dynamic, 1)")                                                   \
      for (int64_t it = 0; it < items; ++it) {                                                  \
        if (!w) continue;                                                                       \
        int64_t rest = it;                                                                      \
        int i = 0;                                                                              \
        for (;; ++i) {                                                                          \
          const int64_t n = (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most);            \
          if (rest < n) break;                                                                  \
          rest -= n;                                                                            \
        }                                                                                       \
        /* equal tiles: 64 positions at groups of 3 are 4 x 16, not 3 x 21 + 1 */              \
        const int tiles = (q_lens[i] + most - 1) / most;                                        \
        const int tile = (q_lens[i] + tiles - 1) / tiles;                                       \
        const int h = (int)(rest / tiles), t = (int)(rest % tiles);                             \
        const int first = t * tile;                                                             \
        const int npos = q_lens[i] - first < tile ? q_lens[i] - first : tile;                   \
        NAME##_item(q, q_row, k_cache, v_cache, block_tables + (int64_t)i * bt_stride,          \
                    (int64_t)q_starts[i] + first, (int64_t)ctx_lens[i] + first, npos, out,      \
                    num_heads, num_kv_heads, h, d, block_size, scale, window, cap, w);          \
      }                                                                                         \
    }                                                                                           \
    return failed ? 2 : 0;                                                                      \
  }

DEFINE_PREFILL(paged_prefill_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_PREFILL(paged_prefill_f32, float, F32_LOAD, F32_STORE)
