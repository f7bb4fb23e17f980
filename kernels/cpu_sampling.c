// Sampling helpers over rows of fp32 logits: greedy argmax, and the structured-output token mask.
//
// torch's argmax(dim=-1) over a batch's logits runs on one thread, scalar, a visible share of a
// CPU decode step; this is one vector pass per row,
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

// Structured outputs: row rows[i] of x keeps the tokens whose bit is set in mask row i (32 tokens
// per int32 word, token t at bit t % 32 of word t / 32, as llguidance writes it); the rest become
// -inf, as does every column past the mask. A grammar's mask is mostly all-ones or all-zeros words
// (a free string, a fixed key), so whole words are settled without looking at bits.
void apply_token_bitmask_f32(float* x, int64_t n, const int64_t* rows, int64_t m, const int32_t* mask,
                             int64_t words) {
  const float ninf = -INFINITY;
#pragma omp parallel for schedule(static) if (m > 4)
  for (int64_t i = 0; i < m; ++i) {
    float* row = x + rows[i] * n;
    const uint32_t* w = (const uint32_t*)(mask + i * words);
    for (int64_t k = 0; k < words && 32 * k < n; ++k) {
      uint32_t bits = w[k];
      if (bits == 0xFFFFFFFFu) continue;
      int64_t lo = 32 * k, hi = lo + 32 < n ? lo + 32 : n;
      if (bits == 0) {
        for (int64_t t = lo; t < hi; ++t) row[t] = ninf;
        continue;
      }
      for (int64_t t = lo; t < hi; ++t)
        if (!((bits >> (t - lo)) & 1u)) row[t] = ninf;
    }
    for (int64_t t = 32 * words; t < n; ++t) row[t] = ninf;
  }
}
