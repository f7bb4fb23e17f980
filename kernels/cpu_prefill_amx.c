// Causal attention for prompt chunks over paged KV in bfloat16 on AMX tiles (Sapphire Rapids and
// later): the same contract as paged_prefill_bf16 in cpu_prefill_attention.c.
//
// That kernel multiplies in fp32 vector FMAs, an order of magnitude below the AMX tiles the
// step's GEMMs run on, so attention becomes a large share of a bf16 prefill step. Here
// Q.K^T and P.V are tile products (TDPBF16PS: 16 x 16 fp32 += 16 x 32 bf16 . 32 x 16 bf16) and
// the vector units only do the online softmax between them.
//
// A tile product wants its right-hand operand with pairs of the reduced dimension side by side
// ("VNNI" layout), which the cache does not have: K must be transposed (pairs of head dimensions
// per key become rows) and V interleaved (the same dimension of two consecutive keys becomes a
// pair). Both are packed once per call, per (sequence, KV head, chunk of 32 keys), in a first
// parallel pass; every query tile that reads a chunk then loads it with plain tile loads. The
// score tile is rounded to bf16 for P.V, as flash attention does on GPUs; scores, the softmax
// statistics and the output accumulate in fp32.
//
// Work items as in the vector kernel: (sequence, KV head, up to 64 query rows = positions x the
// GQA group's heads), in 16-row tiles that share every packed chunk.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CHUNK 32     // keys per packed chunk: the reduced dimension of one P.V tile product
#define TROWS 16     // query rows per tile
#define MAX_TILES 4  // row tiles per work item
#define MAX_DIM 256

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux gives a process the 8 KB tile state only on request; without it a tile instruction
// faults. Granting twice (torch's oneDNN asks too) is harmless. 0 when the tiles can be used.
int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 1; }

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

// Per-thread scratch of one work item (64-byte aligned).
typedef struct {
  uint16_t q[MAX_TILES * TROWS * MAX_DIM];  // the item's query rows, [rows][d], bf16
  float o[MAX_TILES * TROWS * MAX_DIM];     // P.V, [rows][d]
  float s[TROWS][CHUNK];                    // one tile's scores
  uint16_t p[TROWS][CHUNK];                 // ... as bf16 probabilities
  float l[MAX_TILES * TROWS];  // softmax denominators
  int32_t pos[MAX_TILES * TROWS];
} AmxScratch;

// Packed chunk of 32 keys (u32 = two bf16, low half first), chunk_u32(d) = 32 d words:
//   K: [2 halves of 16 keys][d/2 dimension pairs][16 keys]  (B operand of Q.K^T, per 32-dim step)
//   V: [16 key pairs][d dims]                               (B operand of P.V, per 16 dims)
static inline int64_t chunk_u32(int d) { return (int64_t)CHUNK * d; }

static void pack_chunk(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t k0,
                       int nk, int num_kv_heads, int h, int d, int block_size, uint32_t* dst) {
  const int pairs = d / 2;
  uint32_t* kp = dst;
  uint32_t* vp = dst + (int64_t)CHUNK * pairs;
  int64_t row[CHUNK];  // where key k0 + n's row of head h starts in either cache; -1 past the end
  for (int n = 0; n < CHUNK; ++n) {
    const int64_t p = k0 + n;
    row[n] = n < nk ? (((int64_t)table[p / block_size] * block_size + p % block_size) * num_kv_heads + h) * d : -1;
  }
  for (int n = 0; n < CHUNK; ++n) {
    uint32_t* col = kp + (int64_t)(n / 16) * pairs * 16 + n % 16;
    const uint32_t* kr = row[n] < 0 ? 0 : (const uint32_t*)(k_cache + row[n]);
    for (int j = 0; j < pairs; ++j) col[j * 16] = kr ? kr[j] : 0u;
  }
  for (int jp = 0; jp < CHUNK / 2; ++jp) {
    const uint16_t* v0 = row[2 * jp] < 0 ? 0 : v_cache + row[2 * jp];
    const uint16_t* v1 = row[2 * jp + 1] < 0 ? 0 : v_cache + row[2 * jp + 1];
    uint32_t* out = vp + (int64_t)jp * d;
#pragma omp simd
    for (int c = 0; c < d; ++c) out[c] = (v0 ? (uint32_t)v0[c] : 0u) | (v1 ? (uint32_t)v1[c] << 16 : 0u);
  }
}

// Keys j < lim of a chunk are visible to a row: its mask, as two 16-lane halves.
static inline uint32_t visible(int64_t lim) { return lim <= 0 ? 0u : lim >= 32 ? 0xffffffffu : (1u << lim) - 1u; }

// S = Q . K^T for one row tile and one chunk into tiles 4 (keys 0-15) and 5 (keys 16-31), stored to w->s.
static inline void scores(AmxScratch* w, int r0, const uint32_t* kp, int d) {
  _tile_zero(4);
  _tile_zero(5);
  for (int ks = 0; ks < d / 32; ++ks) {
    _tile_loadd(6, w->q + (int64_t)r0 * d + ks * 32, d * 2);
    _tile_loadd(7, kp + ks * 16 * 16, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, kp + (int64_t)(d / 2) * 16 + ks * 16 * 16, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, w->s[0], CHUNK * 4);
  _tile_stored(5, w->s[0] + 16, CHUNK * 4);
}

// O (tiles 0 .. n-1, resident) += P (tile 6) . V for output dimensions [16 g, 16 (g + n)).
#define PV(N)                                                                      \
  do {                                                                             \
    _tile_loadd(7, vp + 16 * g, d * 4);                                            \
    _tile_dpbf16ps(0, 6, 7);                                                       \
    if (N > 1) { _tile_loadd(7, vp + 16 * (g + 1), d * 4); _tile_dpbf16ps(1, 6, 7); } \
    if (N > 2) { _tile_loadd(7, vp + 16 * (g + 2), d * 4); _tile_dpbf16ps(2, 6, 7); } \
    if (N > 3) { _tile_loadd(7, vp + 16 * (g + 3), d * 4); _tile_dpbf16ps(3, 6, 7); } \
  } while (0)

#define STORE_O(N)                                                                 \
  do {                                                                             \
    float* o0 = w->o + (int64_t)r0 * d + 16 * g;                                   \
    _tile_stored(0, o0, d * 4);                                                    \
    if (N > 1) _tile_stored(1, o0 + 16, d * 4);                                    \
    if (N > 2) _tile_stored(2, o0 + 32, d * 4);                                    \
    if (N > 3) _tile_stored(3, o0 + 48, d * 4);                                    \
  } while (0)

// One 16-row tile in two passes over its keys, so that the output never needs rescaling and
// stays in tile registers: pass 1 finds each row's maximum score, pass 2 forms the final
// probabilities and accumulates P.V (for head dims over 64, once per 64 output dimensions,
// recomputing the cheap Q.K^T tiles). An online softmax would rescale the output after every
// chunk, in memory: the tile loads that follow vector stores to the same lines stalled on them.
static void row_tile(AmxScratch* w, const uint32_t* packed, int r0, int nrows, int d, float scale, float cap) {
  const int64_t cu = chunk_u32(d);
  const int64_t last = w->pos[r0 + nrows - 1];  // the tile's last key
  __m512 mx[TROWS];
  for (int r = 0; r < TROWS; ++r) mx[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t k0 = 0; k0 <= last; k0 += CHUNK) {
    scores(w, r0, packed + (k0 / CHUNK) * cu, d);
    for (int r = 0; r < nrows; ++r) {
      const uint32_t vis = visible(w->pos[r0 + r] - k0 + 1);
      mx[r] = _mm512_mask_max_ps(mx[r], (__mmask16)vis, mx[r], _mm512_loadu_ps(w->s[r]));
      mx[r] = _mm512_mask_max_ps(mx[r], (__mmask16)(vis >> 16), mx[r], _mm512_loadu_ps(w->s[r] + 16));
    }
  }
  // scaled (and soft-capped: the cap keeps the order) row maxima; key 0 is visible to every
  // row, so they are finite
  float m[TROWS];
  __m512 l[TROWS];
  for (int r = 0; r < TROWS; ++r) {
    m[r] = r < nrows ? _mm512_reduce_max_ps(mx[r]) * scale : 0.f;
    if (cap > 0.f) m[r] = soft_cap(m[r], cap);
    l[r] = _mm512_setzero_ps();
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < d / 16; g += 4) {
    const int n = d / 16 - g < 4 ? d / 16 - g : 4;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 <= last; k0 += CHUNK) {
      const uint32_t* kp = packed + (k0 / CHUNK) * cu;
      const uint32_t* vp = kp + (int64_t)CHUNK * (d / 2);
      scores(w, r0, kp, d);
      for (int r = 0; r < TROWS; ++r) {
        const uint32_t vis = r < nrows ? visible(w->pos[r0 + r] - k0 + 1) : 0u;
        const __m512 mr = _mm512_set1_ps(m[r]);
        const __m512 x_lo = cap > 0.f ? _mm512_sub_ps(soft_cap16(_mm512_mul_ps(_mm512_loadu_ps(w->s[r]), sc), cap), mr)
                                      : _mm512_fmsub_ps(_mm512_loadu_ps(w->s[r]), sc, mr);
        const __m512 x_hi = cap > 0.f
                                ? _mm512_sub_ps(soft_cap16(_mm512_mul_ps(_mm512_loadu_ps(w->s[r] + 16), sc), cap), mr)
                                : _mm512_fmsub_ps(_mm512_loadu_ps(w->s[r] + 16), sc, mr);
        const __m512 lo = _mm512_maskz_mov_ps((__mmask16)vis, exp_neg16(x_lo));
        const __m512 hi = _mm512_maskz_mov_ps((__mmask16)(vis >> 16), exp_neg16(x_hi));
        if (g == 0) l[r] = _mm512_add_ps(l[r], _mm512_add_ps(lo, hi));
        _mm512_storeu_si512(w->p[r], (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
      _tile_loadd(6, w->p[0], CHUNK * 2);
      switch (n) {
        case 1: PV(1); break;
        case 2: PV(2); break;
        case 3: PV(3); break;
        default: PV(4); break;
      }
    }
    switch (n) {
      case 1: STORE_O(1); break;
      case 2: STORE_O(2); break;
      case 3: STORE_O(3); break;
      default: STORE_O(4); break;
    }
  }
  for (int r = 0; r < nrows; ++r) w->l[r0 + r] = _mm512_reduce_add_ps(l[r]);
}

static void item(const uint16_t* q, int64_t q_row, const uint32_t* packed, int64_t row0, int64_t pos0, int npos,
                 uint16_t* out, int num_heads, int num_kv_heads, int h, int d, float scale, float cap, AmxScratch* w) {
  const int group = num_heads / num_kv_heads;
  const int rows = npos * group, ntiles = (rows + TROWS - 1) / TROWS;
  for (int r = 0; r < ntiles * TROWS; ++r) {
    // row r: position pos0 + r / group, query head h * group + r % group; padding rows repeat
    // the last real row (finite scores) and are not written out
    const int rr = r < rows ? r : rows - 1;
    memcpy(w->q + (int64_t)r * d, q + (row0 + rr / group) * q_row + (int64_t)(h * group + rr % group) * d,
           (size_t)d * 2);
    w->pos[r] = (int32_t)(pos0 + rr / group);
  }
  for (int t = 0; t < ntiles; ++t) {
    const int r0 = t * TROWS;
    row_tile(w, packed, r0, rows - r0 < TROWS ? rows - r0 : TROWS, d, scale, cap);
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* op = out + ((row0 + r / group) * num_heads + (int64_t)h * group + r % group) * d;
    const float inv = 1.f / w->l[r];
    const float* o = w->o + (int64_t)r * d;
    for (int c = 0; c < d; ++c) op[c] = f32_to_bf16(o[c] * inv);
  }
}

int paged_prefill_bf16_amx(const uint16_t* q, int64_t q_row, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_tables, int64_t bt_stride, const int32_t* q_starts,
                           const int32_t* q_lens, const int32_t* ctx_lens, uint16_t* out, int num_seqs,
                           int num_heads, int num_kv_heads, int d, int block_size, float scale, int window,
                           float cap) {
  const int group = num_heads / num_kv_heads;
  if (d > MAX_DIM || d % 32 || num_heads % num_kv_heads || group > MAX_TILES * TROWS) return 1;
  if (window > 0) return 3;  // no sliding-window mask here: the caller takes the dot or vector kernel
  // Packed chunks: sequence i's keys 0 .. ctx + q_len - 1, per KV head.
  int64_t total_chunks = 0;
  for (int i = 0; i < num_seqs; ++i) total_chunks += (ctx_lens[i] + q_lens[i] + CHUNK - 1) / CHUNK;
  const int64_t cu = chunk_u32(d);
  static _Thread_local uint32_t* packed = 0;  // the calling thread's buffer, kept for later calls
  static _Thread_local int64_t capacity = 0;
  const int64_t need = total_chunks * num_kv_heads * cu;
  if (need > capacity) {
    free(packed);
    packed = aligned_alloc(64, (size_t)need * 4);
    capacity = packed ? need : 0;
    if (!packed) return 2;
  }
  const int most = MAX_TILES * TROWS / group;  // query positions a work item can hold
  int64_t items = 0;
  for (int i = 0; i < num_seqs; ++i) items += (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most);
  static _Thread_local AmxScratch* scratch = 0;  // one per OpenMP thread, kept for later calls
  int failed = 0;
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  uint32_t* const buf = packed;
#pragma omp parallel
  {
    // 1. pack every (sequence, KV head, chunk): item `it` is chunk c of (i, h), stored at
    //    it * cu = ((first chunk of i) * num_kv_heads + h * (chunks of i) + c) * cu
#pragma omp for schedule(dynamic, 4)
    for (int64_t it = 0; it < total_chunks * num_kv_heads; ++it) {
      int64_t rest = it;
      int i = 0;
      for (;; ++i) {
        const int64_t n = (ctx_lens[i] + q_lens[i] + CHUNK - 1) / CHUNK;
        if (rest < n * num_kv_heads) break;
        rest -= n * num_kv_heads;
      }
      const int64_t n = (ctx_lens[i] + q_lens[i] + CHUNK - 1) / CHUNK;
      const int h = (int)(rest / n);
      const int64_t c = rest % n, k0 = c * CHUNK, len = ctx_lens[i] + q_lens[i];
      pack_chunk(k_cache, v_cache, block_tables + (int64_t)i * bt_stride, k0,
                 len - k0 < CHUNK ? (int)(len - k0) : CHUNK, num_kv_heads, h, d, block_size, buf + it * cu);
    }
    // 2. attention per work item (the loop above ends in a barrier)
    if (!scratch) scratch = aligned_alloc(64, sizeof(AmxScratch));
    AmxScratch* w = scratch;
    if (!w) {
#pragma omp atomic write
      failed = 1;
    }
    _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      if (!w) continue;
      int64_t rest = it, first = 0;
      int i = 0;
      for (;; ++i) {
        const int64_t n = (int64_t)num_kv_heads * ((q_lens[i] + most - 1) / most);
        if (rest < n) break;
        rest -= n;
        first += (ctx_lens[i] + q_lens[i] + CHUNK - 1) / CHUNK;
      }
      const int tiles = (q_lens[i] + most - 1) / most;
      const int tile = (q_lens[i] + tiles - 1) / tiles;  // equal tiles, as in the vector kernel
      const int h = (int)(rest / tiles), t = (int)(rest % tiles);
      const int start = t * tile;
      const int npos = q_lens[i] - start < tile ? q_lens[i] - start : tile;
      const int64_t nch = (ctx_lens[i] + q_lens[i] + CHUNK - 1) / CHUNK;
      item(q, q_row, buf + (first * num_kv_heads + (int64_t)h * nch) * cu, (int64_t)q_starts[i] + start,
           (int64_t)ctx_lens[i] + start, npos, out, num_heads, num_kv_heads, h, d, scale, cap, w);
    }
    _tile_release();
  }
  return failed ? 2 : 0;
}

#else  // no AMX-BF16 in this build: the caller uses the vector kernel

int amx_enable(void) { return 1; }

int paged_prefill_bf16_amx(const uint16_t* q, int64_t q_row, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_tables, int64_t bt_stride, const int32_t* q_starts,
                           const int32_t* q_lens, const int32_t* ctx_lens, uint16_t* out, int num_seqs,
                           int num_heads, int num_kv_heads, int d, int block_size, float scale, int window,
                           float cap) {
  (void)q, (void)q_row, (void)k_cache, (void)v_cache, (void)block_tables, (void)bt_stride, (void)q_starts;
  (void)q_lens, (void)ctx_lens, (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads, (void)d;
  (void)block_size, (void)scale, (void)window, (void)cap;
  return 3;
}

#endif
