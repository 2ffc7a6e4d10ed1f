// GCC's generic vectors for our CPU kernels: 8 floats (an AVX2 register, half of an AVX-512 one) and 16 (an AVX-512
// register, two AVX2 ones), loaded and stored without alignment. -march=native picks the instructions.
#pragma once

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

inline v8 load8(const float* p) { v8 x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof x); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float lane_sum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

inline v16 load16(const float* p) { v16 x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store16(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof x); }
