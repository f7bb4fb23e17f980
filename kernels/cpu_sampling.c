// Greedy sampling's argmax over rows of fp32 logits (sampler.py calls it for greedy rows).
//
// torch's argmax(dim=-1) over a batch-32 x 49152 SmolLM2 logits matrix took ~1 ms of a ~50 ms
// decode step on a 2-core AMD EPYC VM, one thread and scalar; this is one vector pass per row,
// rows split across the threads. Same answer as torch: the first index of the largest value,
// and the first NaN where a row has one (torch ranks NaN above every number).

#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

static int64_t argmax_row(const float* x, int64_t n) {
#ifdef __AVX512F__
  if (n >= 16) {
    // Per lane: the largest value so far and where it was (strictly greater: the first one).
    __m512 best = _mm512_loadu_ps(x);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = where;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t j = 16;
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      idx = _mm512_add_epi32(idx, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, gt, v);
      where = _mm512_mask_mov_epi32(where, gt, idx);
    }
    if (nan || n > INT32_MAX) return argmax_scalar(x, n);
    float vals[16];
    int32_t pos[16];
    _mm512_storeu_ps(vals, best);
    _mm512_storeu_si512(pos, where);
    int64_t arg = pos[0];
    for (int i = 1; i < 16; ++i)
      if (vals[i] > x[arg] || (vals[i] == x[arg] && pos[i] < arg)) arg = pos[i];
    for (; j < n; ++j) {
      if (isnan(x[j])) return j;
      if (x[j] > x[arg]) arg = j;
    }
    return arg;
  }
#endif
  return argmax_scalar(x, n);
}

void argmax_rows_f32(const float* x, int64_t m, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (m * n > 65536)
  for (int64_t i = 0; i < m; ++i) out[i] = argmax_row(x + i * n, n);
}
