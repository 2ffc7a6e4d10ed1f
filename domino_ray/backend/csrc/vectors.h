// GCC's generic vectors for our CPU kernels: 8 floats (an AVX2 register, half of an AVX-512 one) and, on AVX-512, 16
// (one register), loaded and stored without alignment. -march=native picks the instructions.
#pragma once

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) { v8 x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float lane_sum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

#ifdef __AVX512F__  // only where one register holds it: on AVX2, GCC kept 16-float vectors in memory, not in registers
typedef float v16 __attribute__((vector_size(64)));
#endif
