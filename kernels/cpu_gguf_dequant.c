// GGUF block-quantized weight rows -> fp32 or bf16, equal bit for bit to gguf_blocks.dequantize
// (fp32; bf16 = that rounded to nearest-even, as torch's .to(torch.bfloat16)).
//
// Why: from ~16 activation rows up, the integer-dot GEMM on the blocks (cpu_gguf.c) unpacks every
// weight block again for each 4 rows and loses to a float GEMM; QuantLinear then dequantizes a
// tile of weight rows into a reused scratch buffer and hands it to torch's GEMM.
//
// Bit-equality needs the reference's float steps: fp16 -> fp32 exactly, then one multiply and at
// most one add or subtract, each rounded. A fused multiply-add rounds once and would differ, so
// contraction is off for this file (the build's flags would otherwise allow it).
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_gguf_formats.h"

#if defined(__F16C__)
#include <immintrin.h>
static inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
static inline float fp16_at(const uint8_t* p) {
  const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, man = h & 0x3ff;
  if (e == 0) return (sign ? -1.f : 1.f) * ldexpf((float)man, -24);  // subnormal: exact in fp32
  const uint32_t bits = sign | (e == 31 ? 0x7f800000u | man << 13 : (e + 112) << 23 | man << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
#endif

#define PARALLEL_ELEMS (1 << 16)  // below this many outputs, threads cost more than they save

typedef void (*block_fn)(const uint8_t* b, float* y);

static void dq_q8_0(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const int8_t* q = (const int8_t*)(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = (float)q[j] * d;
}

static void dq_q4_0(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((b[2 + j] & 15) - 8);
    y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
  }
}

static void dq_q4_1(const uint8_t* b, float* y) {
  const float d = fp16_at(b), m = fp16_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)(b[4 + j] & 15) + m;
    y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
  }
}

// Q5_0/Q5_1: the 32 fifth bits are a little-endian uint32 before the nibbles.
static inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

static void dq_q5_0(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const uint32_t qh = u32_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((int)((b[6 + j] & 15) | ((qh >> j) & 1) << 4) - 16);  // int: qh is unsigned
    y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
  }
}

static void dq_q5_1(const uint8_t* b, float* y) {
  const float d = fp16_at(b), m = fp16_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((b[8 + j] & 15) | ((qh >> j) & 1) << 4) + m;
    y[j + 16] = d * (float)((b[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
  }
}

// Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
static inline void scales_k4(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
    mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// Q4_K (qh NULL) and Q5_K: (d * sc) * q - (dmin * mn) per 32 values, sub-block j from the nibbles
// of bytes 32 * (j / 2) (low for even j, high for odd) and, for Q5_K, bit j of qh[l].
static inline void dq_k45(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
  int sc[8], mn[8];
  scales_k4(b + 4, sc, mn);
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int l = 0; l < 32; ++l) {
      const int hi = qh ? ((qh[l] >> j) & 1) << 4 : 0;
      y[32 * j + l] = dj * (float)(((q[l] >> shift) & 15) | hi) - mj;
    }
  }
}

static void dq_q4_k(const uint8_t* b, float* y) { dq_k45(b, NULL, b + 16, y); }
static void dq_q5_k(const uint8_t* b, float* y) { dq_k45(b, b + 16, b + 48, y); }

// Q6_K: (d * sc[g]) * (u - 32) per 16 values g; in each 128-value half h, run f of 32 takes the
// low (f < 2) or high nibbles of ql[64h + 32 (f & 1) + l] and bits 2f of qh[32h + l].
static void dq_q6_k(const uint8_t* b, float* y) {
  const float d = fp16_at(b + 208);
  const int8_t* sc = (const int8_t*)(b + 192);
  for (int h = 0; h < 2; ++h)
    for (int f = 0; f < 4; ++f) {
      const uint8_t* ql = b + 64 * h + 32 * (f & 1);
      const uint8_t* qh = b + 128 + 32 * h;
      const int shift = 4 * (f >> 1);
      for (int half = 0; half < 2; ++half) {
        const int e0 = 128 * h + 32 * f + 16 * half;
        const float dg = d * (float)sc[e0 / 16];
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          y[128 * h + 32 * f + l] = dg * (float)((((ql[l] >> shift) & 15) | ((qh[l] >> (2 * f)) & 3) << 4) - 32);
      }
    }
}

static void format_of(int qtype, block_fn* fn, int* elems, int* bytes) {
  switch (qtype) {
    case Q4_0: *fn = dq_q4_0; break;
    case Q4_1: *fn = dq_q4_1; break;
    case Q5_0: *fn = dq_q5_0; break;
    case Q5_1: *fn = dq_q5_1; break;
    case Q8_0: *fn = dq_q8_0; break;
    case Q4_K: *fn = dq_q4_k; break;
    case Q5_K: *fn = dq_q5_k; break;
    case Q6_K: *fn = dq_q6_k; break;
    default: *fn = NULL;
  }
  *elems = *fn ? gguf_block_elems(qtype) : 0;
  *bytes = gguf_block_bytes(qtype);
}

int gguf_dequant_supported(int qtype) {
  block_fn fn;
  int e, b;
  format_of(qtype, &fn, &e, &b);
  return fn != NULL;
}

// fp32 -> bf16, round to nearest-even (a NaN stays a quiet NaN), as torch rounds.
static inline uint16_t bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16, quiet = (u >> 16) | 0x40;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);  // a select: vectorizes
}

// Rows of blocks w [n, k / elems * bytes] -> out [n, k]: fp32, or bf16 (uint16) when bf16 != 0.
// 0 on success; 1 for a format or shape this does not take.
int gguf_dequant(const uint8_t* w, int qtype, int64_t n, int64_t k, void* out, int bf16) {
  block_fn fn;
  int elems, bytes;
  format_of(qtype, &fn, &elems, &bytes);
  if (!fn || n < 1 || k < elems || k % elems) return 1;
  const int64_t nb = k / elems, rb = nb * bytes;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_ELEMS)
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* wr = w + row * rb;
    if (!bf16) {
      float* y = (float*)out + row * k;
      for (int64_t b = 0; b < nb; ++b) fn(wr + b * bytes, y + b * elems);
      continue;
    }
    uint16_t* y = (uint16_t*)out + row * k;
    float tmp[256];
    for (int64_t b = 0; b < nb; ++b) {
      fn(wr + b * bytes, tmp);
      for (int j = 0; j < elems; ++j) y[b * elems + j] = bf16_of(tmp[j]);
    }
  }
  return 0;
}

// Q6_K's 32-value block as pack_x16 converts it: d, sc0, sc1, low nibbles (Q4_1's order), high bits.
static void dq_q6_f(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  for (int i = 0; i < 32; ++i) {
    const int u = (i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4) | ((b[20 + 4 * (i / 16) + i % 4] >> (2 * (i % 16 / 4))) & 3) << 4;
    y[i] = (d * (float)(int8_t)b[2 + i / 16]) * (float)(u - 32);
  }
}

// Rows `ids` [m] of a weight repacked 16 rows at a time (gguf_blocks.pack_x16: Q4_0 as Q4_1, Q5_0
// as Q8_0, Q6_K per 32 values (dq_q6_f); per group and block the 16 rows' 2-byte fields, then
// 64-byte loads whose 4-byte lane r holds row r's next 4 value bytes, Q8_0's + 128) -> out [m, k]
// as gguf_dequant writes them: each block of a row gathered back into its (converted) layout, then
// dequantized. Equal to dequantizing the original rows (Q4_0's d q - 8 d and Q5_0's d (q - 16) are
// exact products either way; Q6_K's the same operations). For an embedding lookup on a tied head's
// repacked blocks, and the dequant route's tiles of a repacked weight (no unpacked copy of them
// first). 0 on success; 1 for a format, shape or id this does not take.
int gguf_dequant_x16_rows(const uint8_t* packed, int qtype, int64_t n, int64_t k, const int64_t* ids, int64_t m,
                          void* out, int bf16) {
  const int q41 = qtype == Q4_0 || qtype == Q4_1, q80 = qtype == Q5_0 || qtype == Q8_0, q6 = qtype == Q6_K;
  if ((!q41 && !q80 && !q6) || n < 1 || k < 32 || k % (q6 ? 256 : 32)) return 1;
  for (int64_t i = 0; i < m; ++i)
    if (ids[i] < 0 || ids[i] >= n) return 1;
  const int size = q41 ? 20 : q6 ? 28 : 34, head = q80 ? 2 : 4, lanes = (size - head) / 4;
  const block_fn fn = q41 ? dq_q4_1 : q6 ? dq_q6_f : dq_q8_0;
  const int64_t nb = k / 32, group = nb * 16 * size;
#pragma omp parallel for schedule(static) if (m * k >= 65536)  // a dequant-route tile; a lookup stays serial
  for (int64_t i = 0; i < m; ++i) {
    const int64_t g = ids[i] / 16, r = ids[i] % 16;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = packed + g * group + b * 16 * size;
      uint8_t block[34];
      float y[32];
      for (int f = 0; f < head; f += 2) memcpy(block + f, src + f * 16 + 2 * r, 2);
      for (int j = 0; j < lanes; ++j) memcpy(block + head + 4 * j, src + 16 * head + 64 * j + 4 * r, 4);
      if (q80)
        for (int j = 2; j < 34; ++j) block[j] ^= 0x80;
      fn(block, y);
      if (!bf16) {
        memcpy((float*)out + i * k + b * 32, y, sizeof y);
      } else {
        uint16_t* yb = (uint16_t*)out + i * k + b * 32;
        for (int j = 0; j < 32; ++j) yb[j] = bf16_of(y[j]);
      }
    }
  }
  return 0;
}
