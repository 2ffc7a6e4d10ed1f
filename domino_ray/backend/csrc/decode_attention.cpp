// Decode attention on CPU: a few queries per (row, K/V head) against that row's keys, fp32.
//
// Why not torch's kernels: at this shape (e.g. 3 queries x 1,000 keys x 64 dims per row and head) SDPA
// and matmul-softmax-matmul read the keys at about half the rate the cores can stream them. Here each
// key and value is read from memory once for all the queries of its K/V group, the values are prefetched
// into L2 while the keys are scored, and visibility is each query's key limit instead of a mask.
//
// query  [R, H, M, D]  (H = K/V heads; M = the queries of a K/V group: its query heads x positions)
// keys   [R, H, T, D]  values likewise (views into the engine's buffers: rows and heads may be strided)
// limits [R, M] int64  query m of row b sees keys [0, limits[b, m]); a limit of 0 gives a zero output
// -> out [R, H, M, D]
//
// Vectors are GCC's generic 8-float vectors: AVX2 and AVX-512 machines both run them well (-march=native).

#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

typedef int v8i __attribute__((vector_size(32)));
inline float lane_max(v8 x) { float m = x[0]; for (int i = 1; i < 8; ++i) m = std::max(m, x[i]); return m; }

// The lane sums of 8 vectors as one vector: out[i] = sum of a[i]'s lanes (a transpose-and-add tree).
inline v8 lane_sums(const v8* a) {
  v8 p[4], q[2];
  for (int i = 0; i < 4; ++i)
    p[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf, within ~2 ulp; underflows to ~1e-38, not 0.
inline v8 exp_nonpositive(v8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v8 round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v8 n = (x * splat(1.44269504088896341f) + round) - round;
  const v8 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);  // x - n ln2, ln2 in two parts
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const v8i two_to_n = (__builtin_convertvector(n, v8i) + 127) << 23;
  return p * (v8)two_to_n;
}

constexpr int kKeyPrefetch = 16;  // keys ahead of the scoring loop

// One (row, K/V head): q [M, D], k/v [n, D] (n = the largest limit), s scratch [M, n8], out [M, D].
// NV = D / 8 when it is a compile-time constant, else 0 (then nv_runtime).
template <int NV>
void attend(const float* q, const float* k, const float* v, const int64_t* limits, int64_t M, int64_t n,
            int nv_runtime, float scale, float* s, float* inv, float* out) {
  const int nv = NV ? NV : nv_runtime;
  const int64_t D = 8 * nv, n8 = (n + 7) / 8 * 8;

  // Scores, 8 keys at a time: the block is read from memory once and serves every query from L1, two
  // queries per pass (each key vector loaded once for both).
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t keys = std::min<int64_t>(8, n - j);
    for (int64_t c = j * D; c < (j + keys) * D; c += 16) __builtin_prefetch(v + c, 0, 2);
    const int64_t ahead = j + kKeyPrefetch;
    for (int64_t c = ahead * D; c < std::min(n, ahead + 8) * D; c += 16) __builtin_prefetch(k + c, 0, 3);
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {  // 4 keys x 2 queries: 6 loads for 8 FMAs
      const float* q0 = q + m * D;
      const float* q1 = q0 + D;
      for (int64_t j4 = 0; j4 < 8; j4 += 4) {
        v8 acc[8];
        for (int a = 0; a < 8; ++a) acc[a] = splat(0.f);
        const int64_t count = std::min<int64_t>(4, keys - j4);  // may be <= 0 in the last block
        for (int i = 0; i < nv; ++i) {
          const v8 a0 = load8(q0 + 8 * i), a1 = load8(q1 + 8 * i);
          for (int jj = 0; jj < 4; ++jj)
            if (jj < count) {
              const v8 kk = load8(k + (j + j4 + jj) * D + 8 * i);
              acc[jj] += kk * a0;
              acc[4 + jj] += kk * a1;
            }
        }
        const v8 sums = lane_sums(acc) * splat(scale);  // [m keys 0-3, m+1 keys 0-3]
        for (int jj = 0; jj < 4; ++jj) {
          s[m * n8 + j + j4 + jj] = sums[jj];
          s[(m + 1) * n8 + j + j4 + jj] = sums[4 + jj];
        }
      }
    }
    for (; m < M; ++m) {  // an odd query out: 8 keys x 1 query
      const float* qm = q + m * D;
      v8 acc[8];
      for (int64_t jj = 0; jj < 8; ++jj) {
        v8 a = splat(0.f);
        if (jj < keys) {
          const float* kj = k + (j + jj) * D;
          for (int i = 0; i < nv; ++i) a += load8(kj + 8 * i) * load8(qm + 8 * i);
        }
        acc[jj] = a;
      }
      store8(s + m * n8 + j, lane_sums(acc) * splat(scale));
    }
  }

  // Softmax numerators in place, zero past each query's limit; the division is applied to the output.
  for (int64_t m = 0; m < M; ++m) {
    float* sm = s + m * n8;
    const int64_t limit = limits[m], full = limit / 8 * 8;
    float top = -INFINITY;
    if (full) {
      v8 t = load8(sm);
      for (int64_t j = 8; j < full; j += 8) { const v8 x = load8(sm + j); t = t < x ? x : t; }
      top = lane_max(t);
    }
    for (int64_t j = full; j < limit; ++j) top = std::max(top, sm[j]);
    v8 total = splat(0.f);
    for (int64_t j = 0; j < full; j += 8) {
      const v8 e = exp_nonpositive(load8(sm + j) - splat(top));
      store8(sm + j, e);
      total += e;
    }
    float sum = lane_sum(total);
    if (limit > full) {
      const v8 e = exp_nonpositive(load8(sm + full) - splat(top));
      for (int64_t j = full; j < limit; ++j) { sm[j] = e[j - full]; sum += sm[j]; }
    }
    for (int64_t j = limit; j < n8; ++j) sm[j] = 0.f;
    inv[m] = limit ? 1.f / sum : 0.f;
  }

  // Values, in blocks that stay in L1 while every query's weights are applied to them.
  std::fill(out, out + M * D, 0.f);
  const int64_t block = std::max<int64_t>(8, 4096 / D);
  for (int64_t j0 = 0; j0 < n; j0 += block) {
    const int64_t j1 = std::min(n, j0 + block);
    for (int64_t m = 0; m < M; ++m) {
      const float* sm = s + m * n8;
      float* om = out + m * D;
      for (int i0 = 0; i0 < nv; i0 += 8) {  // 8 accumulator vectors (64 dims) at a time
        const int width = std::min(8, nv - i0);
        v8 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = splat(0.f);
        for (int64_t j = j0; j < j1; ++j) {
          const v8 p = splat(sm[j]);
          const float* vj = v + j * D + 8 * i0;
          for (int i = 0; i < 8; ++i)
            if (i < width) acc[i] += p * load8(vj + 8 * i);
        }
        for (int i = 0; i < width; ++i) store8(om + 8 * (i0 + i), load8(om + 8 * (i0 + i)) + acc[i]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < nv; ++i) store8(out + m * D + 8 * i, load8(out + m * D + 8 * i) * splat(inv[m]));
}

}  // namespace

namespace domino_ray {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& limits, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && limits.dim() == 2,
              "decode_attention: query/keys/values [R, H, *, D], limits [R, M]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && limits.scalar_type() == at::kLong,
              "decode_attention: float32 query/keys/values and int64 limits");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && limits.device().is_cpu(),
              "decode_attention: CPU tensors");
  const auto q = query.contiguous();
  const auto lim = limits.contiguous();
  const int64_t R = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3), T = keys.size(2);
  TORCH_CHECK(D % 8 == 0, "decode_attention: head dim ", D, " is not a multiple of 8");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == R && keys.size(1) == H && keys.size(3) == D,
              "decode_attention: keys/values ", keys.sizes(), " do not match query ", q.sizes());
  TORCH_CHECK(lim.size(0) == R && lim.size(1) == M, "decode_attention: limits ", lim.sizes(), " for query ", q.sizes());
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == D && values.stride(3) == 1 && values.stride(2) == D,
              "decode_attention: each row and head's keys/values must be contiguous [T, D]");
  const int64_t* lp = lim.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * M; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] <= T, "decode_attention: key limit ", lp[i], " outside [0, ", T, "]");

  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t k_row = keys.stride(0), k_head = keys.stride(1), v_row = values.stride(0), v_head = values.stride(1);
  const int nv = static_cast<int>(D / 8);
  const auto run = nv == 8 ? attend<8> : nv == 16 ? attend<16> : attend<0>;
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(M * ((T + 7) / 8 * 8)), inv(M);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t n = *std::max_element(lp + b * M, lp + (b + 1) * M);
      run(qp + task * M * D, kp + b * k_row + h * k_head, vp + b * v_row + h * v_head, lp + b * M, M, n, nv,
          static_cast<float>(scale), scores.data(), inv.data(), op + task * M * D);
    }
  });
  return out;
}

}  // namespace domino_ray
