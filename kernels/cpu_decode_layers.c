// Every layer of a Llama-style model for a few token rows in one call: the decode steps of a chat
// and a speculative verify step. Through Python each layer is ~12 kernel calls, and at one row
// their dispatch (argument checks, tensor allocation, ctypes) takes longer than the kernels.
// Here the same kernels of this library run in the same order on the same buffers, so the rows
// come out bit for bit as the per-op path computes them (decode_layers.py checks it in tests).
//
// Each row attends as a single-token decode over its own context length: a sequence's rows of one
// step (a verify step, a short prompt) see positions up to their own, which is causal attention,
// since every row's K/V is written before attention reads it.
//
// A linear layer is one or more parts stacked along its outputs, each served by the GGUF block
// GEMM on the raw or the x16-repacked blocks (fp32 in and out, rounded to the model dtype after,
// as gguf_linear.py does) or by the bf16 small GEMM (bf16 in and out); layers needing anything
// else are not run here.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

void rms_norm_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, uint16_t* out, uint16_t* sum,
                   int64_t m, int64_t k, float eps);
void rms_norm_f32(const float* x, const float* res, const float* w, float* out, float* sum, int64_t m, int64_t k,
                  float eps);
void rope_write_kv_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t q_stride,
                        int64_t k_stride, int64_t v_stride,
                        const int64_t* positions, const int64_t* slots, const float* cos_sin, uint16_t* q_out,
                        uint16_t* k_out, uint16_t* k_cache, uint16_t* v_cache, int64_t t, int64_t hq, int64_t hkv,
                        int64_t d);
void rope_write_kv_f32(const float* q, const float* k, const float* v, int64_t q_stride, int64_t k_stride,
                       int64_t v_stride, const int64_t* positions,
                       const int64_t* slots, const float* cos_sin, float* q_out, float* k_out, float* k_cache,
                       float* v_cache, int64_t t, int64_t hq, int64_t hkv, int64_t d);
int paged_decode_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, const int64_t* rows,
                      uint16_t* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      int64_t max_len, float scale, int generic_only, int64_t window, float softcap);
int paged_decode_f32(const float* q, int64_t q_row_stride, const float* k_cache, const float* v_cache,
                     const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, const int64_t* rows,
                     float* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                     int64_t max_len, float scale, int generic_only, int64_t window, float softcap);
void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t m, int64_t f);
void silu_mul_f32(const float* gu, float* out, int64_t m, int64_t f);
int small_gemm_bf16(const uint16_t* x, int64_t m, const uint16_t* wp, const uint16_t* bias, void* out, int f32,
                    int64_t n, int64_t k);
int gguf_gemm_f32(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k, const float* bias,
                  float* y);
int gguf_gemm_x16(const float* x, int64_t m, const uint8_t* w, int qtype, int64_t n, int64_t k,
                  const float* bias, void* y, int bf16);

#define MAX(a, b) ((a) > (b) ? (a) : (b))

enum { PART_BLOCKS = 1, PART_SMALL = 2, PART_X16 = 3 };
#define MAX_PARTS 4

typedef struct {
  int32_t kind, qtype;
  int64_t n;
  const void* w;  // the raw blocks, or the small GEMM's packed bf16 weight
} Part;

typedef struct {
  int32_t num_parts, pad;
  int64_t n, k;
  Part parts[MAX_PARTS];
} Lin;

typedef struct {
  const void* input_norm;
  const void* post_norm;
  void* k_cache;
  void* v_cache;
  Lin qkv, o, gate_up, down;
  // Optional (NULL: none): per-head q/k norms before RoPE (Qwen3, Gemma 3), norms of the attention
  // and MLP outputs before their residual adds (Gemma); the layer's RoPE table and sliding window.
  const void *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm;
  const float* cos_sin;
  int64_t window;
} Layer;

typedef struct {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size;
  float eps, scale;
  int32_t bf16, generic_attention;
  int32_t gelu, pad;  // the MLP's gate: SiLU (SwiGLU) or tanh-GELU (GeGLU)
  const Layer* layers;
} Stack;

// The buffers of one call, carved from the caller's scratch (decode_layers.py sizes it).
typedef struct {
  void *x, *qkv, *q, *k, *attn, *gu, *act, *t;
  float *x32, *y32;
} Bufs;

// y [m, l->n] in the model dtype = x [m, l->k] . W^T, part by part.
static int linear(const Lin* l, int bf16, const void* x, void* y, const Bufs* b, int64_t m) {
  int have_x32 = 0, at = 0;
  const int64_t k = l->k, n = l->n, es = bf16 ? 2 : 4;
  for (int p = 0; p < l->num_parts; ++p) {
    const Part* pt = &l->parts[p];
    const int whole = l->num_parts == 1;
    if (pt->kind == PART_BLOCKS || pt->kind == PART_X16) {
      const float* xin = (const float*)x;
      if (bf16) {
        if (!have_x32) {
          const uint16_t* xs = (const uint16_t*)x;
          for (int64_t i = 0; i < m * k; ++i) b->x32[i] = bf16_to_f32(xs[i]);
          have_x32 = 1;
        }
        xin = b->x32;
      }
      // A whole layer is written in place: fp32 as it is, bf16 by the x16 GEMM (which rounds itself).
      const int direct = whole && (!bf16 || pt->kind == PART_X16);
      void* out = direct ? y : (void*)b->y32;
      const uint8_t* w = (const uint8_t*)pt->w;
      const int rc = pt->kind == PART_X16 ? gguf_gemm_x16(xin, m, w, pt->qtype, pt->n, k, 0, out, direct && bf16)
                                          : gguf_gemm_f32(xin, m, w, pt->qtype, pt->n, k, 0, (float*)out);
      if (rc) return rc;
      if (!direct)
        for (int64_t i = 0; i < m; ++i) {
          const float* src = b->y32 + i * pt->n;
          if (bf16) {
            uint16_t* dst = (uint16_t*)y + i * n + at;
            for (int64_t j = 0; j < pt->n; ++j) dst[j] = f32_to_bf16(src[j]);
          } else {
            memcpy((float*)y + i * n + at, src, (size_t)pt->n * 4);
          }
        }
    } else {
      if (!bf16) return 3;
      void* out = whole ? y : (void*)b->y32;
      const int rc = small_gemm_bf16((const uint16_t*)x, m, (const uint16_t*)pt->w, 0, out, 0, pt->n, k);
      if (rc) return rc;
      if (!whole)
        for (int64_t i = 0; i < m; ++i)
          memcpy((char*)y + (i * n + at) * es, (const uint16_t*)out + i * pt->n, (size_t)pt->n * 2);
    }
    at += pt->n;
  }
  return 0;
}

// RMSNorm of m rows of k values in the model dtype: out = w * norm(x) (out may be x); with `res`,
// of x + res, that sum stored to `sum` (which may be res).
static void norm_rows(int bf16, const void* x, const void* res, const void* w, void* out, void* sum, int64_t m,
                      int64_t k, float eps) {
  if (bf16) rms_norm_bf16(x, res, w, out, sum, m, k, eps);
  else rms_norm_f32(x, res, w, out, sum, m, k, eps);
}

// tanh-GELU as torch computes it (ATen's GELU kernel, fp32 math for bf16 too): cube = x x x,
// inner = beta (x + kappa cube) with the sum fused as torch's build fuses it, 0.5 x (1 + tanh).
#define GELU_BETA 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_KAPPA 0.044715f

static inline float gelu1(float x) {  // torch's scalar tail: libm's tanhf
  const float cube = x * x * x;
  return 0.5f * x * (1.f + tanhf(GELU_BETA * fmaf(GELU_KAPPA, cube, x)));
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
// torch's vector tanh (Sleef's, which libtorch_cpu exports; set by cpu_native.py at load), so that
// the driver's GELU is torch's bit for bit: the 16-lane one with AVX-512, else the 8-lane one.
// NULL: libm's tanhf per value (then the bits are not torch's, and the driver takes no GeGLU model).
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define vset1 _mm512_set1_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vfmadd _mm512_fmadd_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#else
#define VL 8
typedef __m256 vf;
#define vset1 _mm256_set1_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vfmadd _mm256_fmadd_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#endif
typedef vf (*tanh_fn)(vf);
static tanh_fn torch_tanh;

void decode_layers_set_tanh(void* fn16, void* fn8) { torch_tanh = (tanh_fn)(VL == 16 ? fn16 : fn8); }
int decode_layers_geglu_exact(void) { return torch_tanh != NULL; }

static inline vf gelu_v(vf x) {
  const vf cube = vmul(vmul(x, x), x);
  const vf inner = vmul(vset1(GELU_BETA), vfmadd(vset1(GELU_KAPPA), cube, x));
  return vmul(vmul(vset1(0.5f), x), vadd(vset1(1.f), torch_tanh(inner)));
}

// One row's GELU(gate) * up for the values torch's vector loop takes (two vectors of its type a
// turn: 2 x 2 VL bf16 or 2 VL fp32); returns where its scalar tail starts. Without AVX-512 bf16
// rounds lane by lane (as torch rounds; rare: Gemma serves bf16 where the CPU has AVX512-BF16).
static int64_t gelu_mul_vec(int bf16, const void* gu, void* out, int64_t i, int64_t f) {
  if (!torch_tanh) return 0;
  const int64_t vec = f - f % (bf16 ? 4 * VL : 2 * VL);
  for (int64_t j = 0; j < vec; j += VL) {
    const int64_t g = i * 2 * f + j, u = g + f;
    if (bf16) {
#if VL == 16
      const __m512 y = _mm512_castsi512_ps(bf16_round_bits16(gelu_v(bf16_load16((const uint16_t*)gu + g))));
      const __m512i r = bf16_bits16(_mm512_mul_ps(y, bf16_load16((const uint16_t*)gu + u)));
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + i * f + j), _mm512_cvtepi32_epi16(r));
#else
      const uint16_t* src = (const uint16_t*)gu;
      float x[VL], y[VL];
      for (int t = 0; t < VL; ++t) x[t] = bf16_to_f32(src[g + t]);
      vstore(y, gelu_v(vload(x)));
      for (int t = 0; t < VL; ++t)
        ((uint16_t*)out)[i * f + j + t] = f32_to_bf16(bf16_to_f32(f32_to_bf16(y[t])) * bf16_to_f32(src[u + t]));
#endif
    } else {
      vstore((float*)out + i * f + j, vmul(gelu_v(vload((const float*)gu + g)), vload((const float*)gu + u)));
    }
  }
  return vec;
}
#else
static const void* const torch_tanh = NULL;

void decode_layers_set_tanh(void* fn16, void* fn8) { (void)fn16, (void)fn8; }
int decode_layers_geglu_exact(void) { return 0; }

static int64_t gelu_mul_vec(int bf16, const void* gu, void* out, int64_t i, int64_t f) {
  (void)bf16, (void)gu, (void)out, (void)i, (void)f;
  return 0;
}
#endif

// tanh-GELU(gate) * up over rows [gate | up] of 2f values, rounded as torch's two ops round:
// the GELU in fp32 rounded to the model dtype, then the product. Exported for the tests.
void gelu_mul(int bf16, const void* gu, void* out, int64_t m, int64_t f) {
#pragma omp parallel for schedule(static) if (m * f >= (torch_tanh ? 16384 : 4096))
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = gelu_mul_vec(bf16, gu, out, i, f); j < f; ++j) {
      const int64_t g = i * 2 * f + j, u = g + f, e = i * f + j;
      const float y = gelu1(bf16 ? bf16_to_f32(((const uint16_t*)gu)[g]) : ((const float*)gu)[g]);
      if (bf16)
        ((uint16_t*)out)[e] = f32_to_bf16(bf16_to_f32(f32_to_bf16(y)) * bf16_to_f32(((const uint16_t*)gu)[u]));
      else
        ((float*)out)[e] = y * ((const float*)gu)[u];
    }
}

// The per-head norms of q and k, from the qkv output into `out`, laid out as that output (its v
// part unused: RoPE + the cache write read v from the qkv output itself).
static void qk_norms(const Stack* s, const Layer* L, const void* qkv, void* out, int64_t m) {
  const int64_t es = s->bf16 ? 2 : 4, hd = s->head_dim, hq = s->heads, hkv = s->kv_heads;
  const int64_t row = (hq + 2 * hkv) * hd * es;
  for (int64_t i = 0; i < m; ++i) {
    const char* r = (const char*)qkv + i * row;
    char* o = (char*)out + i * row;
    norm_rows(s->bf16, r, 0, L->q_norm, o, 0, hq, hd, s->eps);
    norm_rows(s->bf16, r + hq * hd * es, 0, L->k_norm, o + hq * hd * es, 0, hkv, hd, s->eps);
  }
}

// Carves one call's buffers from `scratch` (NULL: only counts); returns the bytes they take.
static int64_t carve(const Stack* s, int64_t m, char* scratch, Bufs* b) {
  const int64_t es = s->bf16 ? 2 : 4, hd = s->head_dim, hq = s->heads, hidden = s->hidden;
  const int64_t nqkv = (hq + 2 * s->kv_heads) * hd;
  // The widest input a linear layer takes (x32) and the widest output it makes (y32).
  const int64_t in_max = MAX(MAX(hidden, hq * hd), s->inter), out_max = MAX(MAX(nqkv, 2 * s->inter), hidden);
  const int64_t bytes[10] = {m * hidden * es, m * nqkv * es, m * hq * hd * es, m * s->kv_heads * hd * es,
                             m * hq * hd * es, m * 2 * s->inter * es, m * s->inter * es, m * nqkv * es,
                             m * in_max * 4, m * out_max * 4};
  void** fields[10] = {&b->x, &b->qkv, &b->q, &b->k, &b->attn, &b->gu, &b->act, &b->t, (void**)&b->x32,
                       (void**)&b->y32};
  int64_t total = 0;
  for (int i = 0; i < 10; ++i) {
    if (scratch) *fields[i] = scratch + total;
    total += (bytes[i] + 63) / 64 * 64;
  }
  return total;
}

// Bytes of scratch decode_layers needs for m rows.
int64_t decode_layers_scratch(const Stack* s, int64_t m) {
  Bufs b;
  return carve(s, m, 0, &b);
}

// Runs every layer on h [m, hidden] (the embedded rows, overwritten with the last layer's output);
// residual [m, hidden] receives the residual stream, so the caller's final norm takes h + residual.
// Row i writes its K/V at slots[i] and attends over seq_lens[i] positions of block_tables row i.
// 0 on success, else the first failing kernel's code.
int decode_layers(const Stack* s, int64_t m, void* h, void* residual, const int64_t* positions, const int64_t* slots,
                  const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, const int64_t* rows,
                  int64_t max_len, char* scratch) {
  const int bf16 = s->bf16;
  const int64_t es = bf16 ? 2 : 4, hd = s->head_dim, hq = s->heads, hkv = s->kv_heads, hidden = s->hidden;
  const int64_t nqkv = (hq + 2 * hkv) * hd;
  Bufs b;
  carve(s, m, scratch, &b);
  int rc;
  for (int64_t l = 0; l < s->num_layers; ++l) {
    const Layer* L = &s->layers[l];
    if (l == 0) {  // the residual stream starts as the embedded rows
      memcpy(residual, h, (size_t)(m * hidden * es));
      norm_rows(bf16, h, 0, L->input_norm, b.x, 0, m, hidden, s->eps);
    } else {
      norm_rows(bf16, h, residual, L->input_norm, b.x, residual, m, hidden, s->eps);
    }
    if ((rc = linear(&L->qkv, bf16, b.x, b.qkv, &b, m))) return rc;
    const char* qk = (const char*)b.qkv;  // q and k as RoPE takes them: normed per head, if the model does
    if (L->q_norm) {
      qk_norms(s, L, b.qkv, b.t, m);
      qk = (const char*)b.t;
    }
    const char* v = (const char*)b.qkv + (hq + hkv) * hd * es;
    if (bf16) {
      rope_write_kv_bf16((const uint16_t*)qk, (const uint16_t*)(qk + hq * hd * es), (const uint16_t*)v, nqkv, nqkv,
                         nqkv, positions, slots, L->cos_sin, b.q, b.k, L->k_cache, L->v_cache, m, hq, hkv, hd);
      rc = paged_decode_bf16(b.q, hq * hd, L->k_cache, L->v_cache, block_tables, table_stride, seq_lens, rows, b.attn,
                             (int)m, (int)hq, (int)hkv, (int)hd, (int)s->block_size, max_len, s->scale,
                             s->generic_attention, L->window, 0.f);
    } else {
      rope_write_kv_f32((const float*)qk, (const float*)(qk + hq * hd * es), (const float*)v, nqkv, nqkv, nqkv,
                        positions, slots, L->cos_sin, b.q, b.k, L->k_cache, L->v_cache, m, hq, hkv, hd);
      rc = paged_decode_f32(b.q, hq * hd, L->k_cache, L->v_cache, block_tables, table_stride, seq_lens, rows, b.attn,
                            (int)m, (int)hq, (int)hkv, (int)hd, (int)s->block_size, max_len, s->scale,
                            s->generic_attention, L->window, 0.f);
    }
    if (rc) return 100 + rc;
    if ((rc = linear(&L->o, bf16, b.attn, h, &b, m))) return rc;
    if (L->attn_out_norm) norm_rows(bf16, h, 0, L->attn_out_norm, h, 0, m, hidden, s->eps);
    norm_rows(bf16, h, residual, L->post_norm, b.x, residual, m, hidden, s->eps);
    if ((rc = linear(&L->gate_up, bf16, b.x, b.gu, &b, m))) return rc;
    if (s->gelu) gelu_mul(bf16, b.gu, b.act, m, s->inter);
    else if (bf16) silu_mul_bf16(b.gu, b.act, m, s->inter);
    else silu_mul_f32(b.gu, b.act, m, s->inter);
    if ((rc = linear(&L->down, bf16, b.act, h, &b, m))) return rc;
    if (L->mlp_out_norm) norm_rows(bf16, h, 0, L->mlp_out_norm, h, 0, m, hidden, s->eps);
  }
  return 0;
}
