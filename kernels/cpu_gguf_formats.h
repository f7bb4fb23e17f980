// The GGUF (ggml) block formats the native GEMM (cpu_gguf.c) and dequantizer (cpu_gguf_dequant.c)
// take: type ids and block sizes, as gguf_blocks.py's table has them.
#pragma once

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Values per block of a supported format.
static inline int gguf_block_elems(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : 32; }

// Bytes per block of a supported format; 0 for any other.
static inline int gguf_block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}
