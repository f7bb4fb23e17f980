// bf16 linear layers: out[M, N] = x[M, K] . W[N, K]^T (+ bias), M <= 1024 (decode batches and
// the prompt chunks of a CPU step).
//
// With 1-8 rows a step is a matrix-vector product: each weight is read once and used M times,
// so the step is bound by how fast the weights stream from memory, and oneDNN's blocked bf16
// GEMM read them well below memory speed at these sizes. With 9-128 rows (decode batches) the
// step is compute bound, and oneDNN stayed below what its large GEMMs reach; the register panel
// below keeps vdpbf16ps busier. Which one serves each shape is measured on the machine
// (kernels/chooser.py; figures in scripts/benchmarks.md).
//
// Here the weight is packed once (small_gemm_pack) as [N/16][K/2][16 rows][2]: one 64-byte
// vector holds a pair of K positions for 16 output rows, so AVX512-BF16's vdpbf16ps against the
// input's pair at those positions, broadcast, adds into 16 outputs at once, with no horizontal
// sums. Each thread works through a contiguous share of the 16-row blocks (one sequential stream
// of the packed weight) and may take blocks from others' (split_blocks), NB blocks x M input rows
// of accumulators in registers.
// Sums in fp32, the bias added in fp32, rounded once to bf16 (nearest even), as a GEMM with fp32
// accumulation does; only the order of the additions differs.
//
// Built only for CPUs with AVX512-BF16 (elsewhere small_gemm_available() is 0 and the caller
// keeps oneDNN). K must be even; N is padded to a multiple of 16 in the packed copy.

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define VECTOR_ROWS 8  // up to here one tile holds every input row
#define SMALL_GEMM_MAX_ROWS 1024  // beyond, oneDNN's blocked GEMM measured as fast
#define LANES 16

// Packed layout above from row-major W [n, k]; `packed` holds ceil(n / 16) * 16 * k values
// (padding rows are zero, so they sum to zero and are never stored).
void small_gemm_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t blocks = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* dst = packed + b * LANES * k;
    for (int64_t p = 0; p < k / 2; ++p)
      for (int r = 0; r < LANES; ++r) {
        const int64_t row = b * LANES + r;
        for (int e = 0; e < 2; ++e) dst[(p * LANES + r) * 2 + e] = row < n ? w[row * k + 2 * p + e] : 0;
      }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int small_gemm_available(void) { return SMALL_GEMM_MAX_ROWS; }

// NB blocks of 16 output rows x M input rows: NB * M accumulators, NB independent chains per row.
#define DEFINE_TILE(NAME, NB, M)                                                                 \
  static inline void NAME(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, void* out,   \
                          int f32, int64_t b0, int64_t n, int64_t k) {                           \
    __m512 acc[NB][M];                                                                           \
    for (int b = 0; b < NB; ++b)                                                                 \
      for (int m = 0; m < M; ++m) acc[b][m] = _mm512_setzero_ps();                               \
    const uint16_t* w = wp + b0 * LANES * k;                                                     \
    for (int64_t p = 0; p < k / 2; ++p) {                                                        \
      __m512bh xv[M];                                                                            \
      for (int m = 0; m < M; ++m) {                                                              \
        uint32_t pair;                                                                           \
        memcpy(&pair, x + m * k + 2 * p, sizeof pair);                                           \
        xv[m] = (__m512bh)_mm512_set1_epi32((int)pair);                                          \
      }                                                                                          \
      for (int b = 0; b < NB; ++b) {                                                             \
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (b * k + 2 * p) * LANES);          \
        for (int m = 0; m < M; ++m) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], wv, xv[m]);          \
      }                                                                                          \
    }                                                                                            \
    for (int b = 0; b < NB; ++b) {                                                               \
      const int64_t row = (b0 + b) * LANES;                                                      \
      const int64_t valid = n - row < LANES ? n - row : LANES;                                   \
      const __mmask16 mask = (__mmask16)((1u << valid) - 1u);                                    \
      __m512 bv = _mm512_setzero_ps();                                                           \
      if (bias)                                                                                  \
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(                                              \
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + row)), 16));             \
      for (int m = 0; m < M; ++m) {                                                              \
        const __m512 y = _mm512_add_ps(acc[b][m], bv);                                           \
        if (f32)                                                                                 \
          _mm512_mask_storeu_ps((float*)out + m * n + row, mask, y);                             \
        else                                                                                     \
          _mm256_mask_storeu_epi16((uint16_t*)out + m * n + row, mask, (__m256i)_mm512_cvtneps_pbh(y)); \
      }                                                                                          \
    }                                                                                            \
  }

// The tiles, by blocks (4, 2, 1) and input rows. One set serves both paths below.
#define PANEL_ROWS 6
#define PANEL_BLOCKS 4
DEFINE_TILE(panel_1, PANEL_BLOCKS, 1)
DEFINE_TILE(panel_2, PANEL_BLOCKS, 2)
DEFINE_TILE(panel_3, PANEL_BLOCKS, 3)
DEFINE_TILE(panel_4, PANEL_BLOCKS, 4)
DEFINE_TILE(panel_5, PANEL_BLOCKS, 5)
DEFINE_TILE(panel_6, PANEL_BLOCKS, 6)
DEFINE_TILE(pair_1, 2, 1)
DEFINE_TILE(pair_2, 2, 2)
DEFINE_TILE(pair_3, 2, 3)
DEFINE_TILE(pair_4, 2, 4)
DEFINE_TILE(pair_5, 2, 5)
DEFINE_TILE(pair_6, 2, 6)
DEFINE_TILE(pair_7, 2, 7)
DEFINE_TILE(pair_8, 2, 8)
DEFINE_TILE(tail_1, 1, 1)
DEFINE_TILE(tail_2, 1, 2)
DEFINE_TILE(tail_3, 1, 3)
DEFINE_TILE(tail_4, 1, 4)
DEFINE_TILE(tail_5, 1, 5)
DEFINE_TILE(tail_6, 1, 6)
DEFINE_TILE(tail_7, 1, 7)
DEFINE_TILE(tail_8, 1, 8)

// Work split: each thread owns a contiguous share of the blocks and works through it from the
// front, a few blocks per claim (one sequential stream of the weight, as a static split); a
// thread that runs out takes blocks from the back of another's share. On a 2-core server the
// other processes preempt one of the worker's threads every few ms; with fixed shares the other
// thread then spun at the barrier until it came back, here it takes over what is left.
// A share is [front, back) in one 64-bit word, so that a claim from either end is one CAS.
typedef struct {
  _Atomic uint64_t span;
  char pad[56];  // one cache line per share
} Share;

#define MAX_SHARES 64

static inline uint64_t span_of(int64_t front, int64_t back) { return (uint64_t)back << 32 | (uint64_t)front; }

// Up to `most` blocks from the front (the owner) or the back (a thief) of a share: the first
// block, and *count; -1 when it is empty.
static inline int64_t claim(Share* sh, int64_t most, int from_back, int64_t* count) {
  uint64_t s = atomic_load_explicit(&sh->span, memory_order_relaxed);
  for (;;) {
    const int64_t front = (int64_t)(s & 0xffffffffu), back = (int64_t)(s >> 32);
    if (front >= back) return -1;
    const int64_t n = back - front < most ? back - front : most;
    const uint64_t next = from_back ? span_of(front, back - n) : span_of(front + n, back);
    if (atomic_compare_exchange_weak_explicit(&sh->span, &s, next, memory_order_relaxed, memory_order_relaxed)) {
      *count = n;
      return from_back ? back - n : front;
    }
  }
}

typedef void (*range_fn)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, void*, int, int64_t, int64_t,
                         int64_t, int64_t);

// Blocks 0 .. blocks-1 over the team: own share first, PANEL_BLOCKS per claim, then 2 at a time
// from the back of the others'.
static void split_blocks(range_fn run, const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias,
                         void* out, int f32, int64_t n, int64_t k) {
  const int64_t blocks = (n + LANES - 1) / LANES;
  Share shares[MAX_SHARES] __attribute__((aligned(64)));
  int team = omp_get_max_threads();
  team = team < MAX_SHARES ? team : MAX_SHARES;
  for (int t = 0; t < team; ++t) atomic_init(&shares[t].span, span_of(blocks * t / team, blocks * (t + 1) / team));
#pragma omp parallel num_threads(team)
  {
    // the team may come out smaller than asked (nested in another parallel region): every share
    // is then still taken, from the back, by the threads there are
    const int id = omp_get_thread_num();
    int64_t b, count;
    while ((b = claim(&shares[id], PANEL_BLOCKS, 0, &count)) >= 0) run(x, m, wp, bias, out, f32, n, k, b, b + count);
    for (int j = 1; j < team; ++j) {
      Share* other = &shares[(id + j) % team];
      while ((b = claim(other, 2, 1, &count)) >= 0) run(x, m, wp, bias, out, f32, n, k, b, b + count);
    }
  }
}

// Up to 8 input rows, all in one tile: four blocks at a time up to 4 rows, two beyond (at most
// 16 accumulators), a block at a time for what is left of a range.
#define DEFINE_ROWS(M, WIDE, WIDEST)                                                             \
  static void rows_range_##M(const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias, \
                             void* out, int f32, int64_t n, int64_t k, int64_t b, int64_t hi) {  \
    (void)m;                                                                                     \
    while (b < hi) {                                                                             \
      if (WIDEST >= PANEL_BLOCKS && hi - b >= PANEL_BLOCKS) {                                    \
        WIDE(x, wp, bias, out, f32, b, n, k);                                                    \
        b += PANEL_BLOCKS;                                                                       \
      } else if (hi - b >= 2) {                                                                  \
        pair_##M(x, wp, bias, out, f32, b, n, k);                                                \
        b += 2;                                                                                  \
      } else {                                                                                   \
        tail_##M(x, wp, bias, out, f32, b, n, k);                                                \
        b += 1;                                                                                  \
      }                                                                                          \
    }                                                                                            \
  }

DEFINE_ROWS(1, panel_1, 4)
DEFINE_ROWS(2, panel_2, 4)
DEFINE_ROWS(3, panel_3, 4)
DEFINE_ROWS(4, panel_4, 4)
DEFINE_ROWS(5, pair_5, 2)
DEFINE_ROWS(6, pair_6, 2)
DEFINE_ROWS(7, pair_7, 2)
DEFINE_ROWS(8, pair_8, 2)

static const range_fn ROWS[VECTOR_ROWS + 1] = {0, rows_range_1, rows_range_2, rows_range_3, rows_range_4,
                                               rows_range_5, rows_range_6, rows_range_7, rows_range_8};

// More rows (a decode batch of 9-128, a prompt step up to 1024): the step is compute bound, so
// what matters is keeping vdpbf16ps fed. A tile is 4 blocks (64 outputs) x 6 input rows, 24
// accumulators, 4 weight vectors and 6 broadcasts per 24 dot products. For each tile of the blocks a thread claims, it
// walks every 6-row group of the input, so the tile's packed weight (64 x K bf16, 72-192 KB at
// these K) is read from memory once and from L2 after that.
typedef void (*tile_fn)(const uint16_t*, const uint16_t*, const uint16_t*, void*, int, int64_t, int64_t, int64_t);
static const tile_fn PANEL[PANEL_ROWS + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6};
static const tile_fn PAIR[PANEL_ROWS + 1] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};
static const tile_fn SINGLE[PANEL_ROWS + 1] = {0, tail_1, tail_2, tail_3, tail_4, tail_5, tail_6};

// Blocks b .. hi of the output, every row group of each tile before the next tile.
static void panel_range(const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias, void* out,
                        int f32, int64_t n, int64_t k, int64_t b, int64_t hi) {
  while (b < hi) {
    // Four blocks while they last, then two, then one (fewer accumulators, shorter chains).
    const int64_t width = hi - b >= PANEL_BLOCKS ? PANEL_BLOCKS : hi - b >= 2 ? 2 : 1;
    const tile_fn* tiles = width == PANEL_BLOCKS ? PANEL : width == 2 ? PAIR : SINGLE;
    for (int64_t r = 0; r < m; r += PANEL_ROWS) {
      const int rows = (int)(m - r < PANEL_ROWS ? m - r : PANEL_ROWS);
      void* rows_out = f32 ? (void*)((float*)out + r * n) : (void*)((uint16_t*)out + r * n);
      tiles[rows](x + r * k, wp, bias, rows_out, f32, b, n, k);
    }
    b += width;
  }
}

// out is bf16, or fp32 when f32 is set (logits: no rounding to bf16 and no widening pass after).
// 0 on success; 1 when the shape is not one this kernel takes (the caller uses oneDNN).
int small_gemm_bf16(const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias, void* out,
                    int f32, int64_t n, int64_t k) {
  if (m < 1 || m > SMALL_GEMM_MAX_ROWS || k % 2 != 0 || n < 1) return 1;
  split_blocks(m > VECTOR_ROWS ? panel_range : ROWS[m], x, m, wp, bias, out, f32, n, k);
  return 0;
}

#else  // no AVX512-BF16 in this build

int small_gemm_available(void) { return 0; }

int small_gemm_bf16(const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias, void* out,
                    int f32, int64_t n, int64_t k) {
  (void)x, (void)m, (void)wp, (void)bias, (void)out, (void)f32, (void)n, (void)k;
  return 1;
}

#endif
