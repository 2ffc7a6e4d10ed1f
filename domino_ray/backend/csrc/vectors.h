// GCC's generic vectors for our CPU kernels: 8 floats (an AVX2 register, half of an AVX-512 one) and, on AVX-512, 16
// (one register), loaded and stored without alignment. -march=native picks the instructions.
// bf16 values (raw uint16 bits) widen to fp32 exactly: the bits shifted into a float's upper half (zero-extend, shift).
#pragma once

#include <cstdint>

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) { v8 x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float lane_sum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// bf16 (`Halves`: n uint16) -> n fp32 (`Floats`), through n uint32 (`Words`).
template <typename Floats, typename Halves, typename Words>
inline Floats widen(const uint16_t* p) {
  Halves h;
  __builtin_memcpy(&h, p, sizeof h);
  const Words bits = __builtin_convertvector(h, Words) << 16;
  Floats x;
  __builtin_memcpy(&x, &bits, sizeof x);
  return x;
}

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
inline v8 widen8(const uint16_t* p) { return widen<v8, u16x8, u32x8>(p); }

#ifdef __AVX512F__  // only where one register holds it: on AVX2, GCC kept 16-float vectors in memory, not in registers
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline v16 widen16(const uint16_t* p) { return widen<v16, u16x16, u32x16>(p); }
#endif
