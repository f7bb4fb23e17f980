// bfloat16 <-> float for the native CPU kernels (bf16 is the top half of an IEEE float).
#ifndef RILL_CPU_BF16_H
#define RILL_CPU_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)x << 16;
  return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  // quiet NaN
  v.u += 0x7fffu + ((v.u >> 16) & 1u);  // round to nearest even, as torch does
  return (uint16_t)(v.u >> 16);
}

// The fp32 instantiations of the same kernels load and store floats as they are.
#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

#endif
