// The K formats (Q4_K, Q5_K, Q6_K) of the GGUF block GEMM (cpu_gguf.c): 256-value blocks with
// packed sub-block scales. Included by cpu_gguf.c after cpu_gguf_simd.h.
#pragma once

// Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
static inline void k_scales(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
    mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// Q4_K and Q5_K: d * sc[j] * q - dmin * mn[j] per 32 values j; the mins through the sums per 16.
#if SIMD_LEVEL >= 1
// With SIMD the scales and mins are unpacked in vector registers, not in scalar code (which took
// most of a block's time): the 12 scale bytes as ggml does (4 words, masks), each scale broadcast by a
// byte shuffle, and the mins (Q6_K: the offsets) dotted with the activation sums in one vpmaddwd.
static inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 1)));
}
// element e (0-7) of the 8 int16 in both 128-bit lanes of v, broadcast
static inline __m256i bcast16(__m256i v, int e) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0101 * 2 * e + 0x0100))); }

#define DEFINE_K45(NAME, BYTES, QS, UNPACK)                                                      \
  ROW_KERNEL(NAME) {                                                                           \
    ROW_BEGIN                                                                                  \
    for (int64_t b = 0; b < a->nb; ++b, w += (BYTES)) {                                        \
      uint32_t u[4];                                                                           \
      memcpy(u, w + 4, 12);                                                                    \
      u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);                   \
      const uint32_t u1 = u[1] & 0x3f3f3f3f;                                                   \
      u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);                          \
      u[2] = u1;                                                                               \
      u[0] &= 0x3f3f3f3f; /* bytes 0-7: the scales, 8-15: the mins */                          \
      const __m128i sm = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)u));               \
      const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(u + 2)));       \
      const __m256i scl = _mm256_broadcastsi128_si256(sm);                                     \
      v32 q[8];                                                                                \
      sc16 scv[8];                                                                             \
      for (int j = 0; j < 8; ++j) {                                                            \
        const uint8_t* nib = w + (QS) + 32 * (j / 2);                                          \
        q[j] = UNPACK;                                                                         \
        scv[j] = bcast16(scl, j);                                                              \
      }                                                                                        \
      const float d = half_at(w), dmin = half_at(w + 2);                                       \
      for (int r = 0; r < R; ++r) {                                                            \
        const int64_t at = AT(r, b);                                                           \
        const int8_t* x = a->q + at * 256;                                                     \
        const int16_t* bs = a->bs + at * 16;                                                   \
        ilanes s = il_zero();                                                                  \
        for (int j = 0; j < 8; ++j) s = il_add(s, dot_scaled(q[j], ld32(x + 32 * j), scv[j])); \
        const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)bs),             \
                                             _mm_loadu_si128((const __m128i*)(bs + 8)));       \
        const int mn = hsum4(_mm_madd_epi16(mins, pairs));                                     \
        acc[r] = acc_fma(acc[r], s, d * a->d[at]);                                             \
        tail[r] -= dmin * a->d[at] * (float)mn;                                                \
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
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 192)));  // 16 int16
    const __m256i slo = _mm256_permute2x128_si256(sc, sc, 0x00), shi = _mm256_permute2x128_si256(sc, sc, 0x11);
    v32 q[8];
    sc16 scv[8];
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4, c = j % 4;  // half of the block, run of 32 in it
      const uint8_t* ql = w + 64 * h + 32 * (c & 1);
      q[j] = vor(c & 2 ? nib_hi(ql) : nib_lo(ql), plane(w + 128 + 32 * h, 2 * c, 3));
      const int e = 2 * (j % 4);  // scales 2j, 2j + 1: elements e, e + 1 of one half of sc
      scv[j] = _mm256_shuffle_epi8(j < 4 ? slo : shi,
                                   _mm256_setr_m128i(_mm_set1_epi16((short)(0x0101 * 2 * e + 0x0100)),
                                                     _mm_set1_epi16((short)(0x0101 * 2 * (e + 1) + 0x0100))));
    }
    const float d = half_at(w + 208);
    for (int r = 0; r < R; ++r) {
      const int64_t at = AT(r, b);
      const int8_t* x = a->q + at * 256;
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + at * 16));
      ilanes s = il_zero();
      for (int j = 0; j < 8; ++j) s = il_add(s, dot_scaled(q[j], ld32(x + 32 * j), scv[j]));
      const __m256i o = _mm256_madd_epi16(sc, bs);
      const int offset = hsum4(_mm_add_epi32(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1)));
      const float dd = d * a->d[at];
      acc[r] = acc_fma(acc[r], s, dd);
      tail[r] -= dd * (float)(32 * offset);
    }
  }
  ROW_END
}
#else
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

#endif
