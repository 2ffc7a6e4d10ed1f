// Decode attention on CPU over the paged KV pool: a few queries per (row, K/V head) against that row's keys; fp32
// queries and arithmetic, the pool fp32 or bf16 (each key and value widened exactly in registers).
//
// Why not torch's kernels: at this shape (e.g. 3 queries x 1,000 keys x 64 dims per row and head) SDPA
// and matmul-softmax-matmul read the keys at about half the rate the cores can stream them, and over pages they
// would need the keys gathered first. Here each key and value is read from its page once for all the queries of
// its K/V group, the values are prefetched into L2 while the keys are scored, and visibility is each query's key
// limit instead of a mask.
//
// query        [r, H, M, D]  (H = K/V heads; M = the queries of a K/V group: its query heads x positions)
// key_pool     [N, H, bs, D] contiguous, value_pool likewise (a layer's view of the pool; bs a power of two, 8 | bs)
// block_tables [r, nb] int32  logical key p of row b is at offset p % bs of block block_tables[b, p / bs]
// limits       [r, M] int64   query m of row b sees keys [0, limits[b, m]); a limit of 0 gives a zero output
// -> out [r, H, M, D]
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

// Where one (row, K/V head)'s keys and values live: a base pointer per page, read once per key block of 8 (a block
// never crosses a page: 8 | bs) or per run of keys within a page (values).
// T: float, or uint16_t for a bf16 pool's bits.
template <typename T>
struct Pages {
  const T* const* k;      // [pages] each [bs, D]
  const T* const* v;
  int shift;              // log2(bs)
  int64_t mask;           // bs - 1
  const T* key(int64_t j, int64_t D) const { return k[j >> shift] + (j & mask) * D; }
  const T* value(int64_t j, int64_t D) const { return v[j >> shift] + (j & mask) * D; }
};

inline v8 load_kv(const float* p) { return load8(p); }
inline v8 load_kv(const uint16_t* p) { return widen8(p); }

// One (row, K/V head): q [M, D], keys/values [n, D] in pages (n = the largest limit), s scratch [M, n8],
// out [M, D]. NV = D / 8 when it is a compile-time constant, else 0 (then nv_runtime).
template <int NV, typename T>
void attend(const float* q, const Pages<T>& pages, const int64_t* limits, int64_t M, int64_t n, int nv_runtime,
            float scale, float* s, float* inv, float* out) {
  const int nv = NV ? NV : nv_runtime;
  const int64_t D = 8 * nv, n8 = (n + 7) / 8 * 8;

  // Scores, 8 keys at a time: the block is read from memory once and serves every query from L1, two
  // queries per pass (each key vector loaded once for both).
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t keys = std::min<int64_t>(8, n - j);
    const T* k = pages.key(j, D);  // [keys, D]
    const T* v = pages.value(j, D);
    constexpr int64_t kLine = 64 / sizeof(T);  // elements a cache line
    for (int64_t c = 0; c < keys * D; c += kLine) __builtin_prefetch(v + c, 0, 2);
    const int64_t ahead = j + kKeyPrefetch;
    if (ahead < n) {
      const T* ka = pages.key(ahead, D);
      for (int64_t c = 0; c < (std::min(n, ahead + 8) - ahead) * D; c += kLine) __builtin_prefetch(ka + c, 0, 3);
    }
    // 4 keys x 2 queries: 6 loads for 8 FMAs. An odd query out runs paired with itself: every query's scores come
    // from this one path, so a query scores its keys the same whatever M (a verify's W + 1 positions or a step's one).
    for (int64_t m = 0; m < M; m += 2) {
      const bool pair = m + 1 < M;
      const float* q0 = q + m * D;
      const float* q1 = pair ? q0 + D : q0;
      for (int64_t j4 = 0; j4 < 8; j4 += 4) {
        v8 acc[8];
        for (int a = 0; a < 8; ++a) acc[a] = splat(0.f);
        const int64_t count = std::min<int64_t>(4, keys - j4);  // may be <= 0 in the last block
        for (int i = 0; i < nv; ++i) {
          const v8 a0 = load8(q0 + 8 * i), a1 = load8(q1 + 8 * i);
          for (int jj = 0; jj < 4; ++jj)
            if (jj < count) {
              const v8 kk = load_kv(k + (j4 + jj) * D + 8 * i);
              acc[jj] += kk * a0;
              acc[4 + jj] += kk * a1;
            }
        }
        const v8 sums = lane_sums(acc) * splat(scale);  // [m keys 0-3, m+1 keys 0-3]
        for (int jj = 0; jj < 4; ++jj) {
          s[m * n8 + j + j4 + jj] = sums[jj];
          if (pair) s[(m + 1) * n8 + j + j4 + jj] = sums[4 + jj];
        }
      }
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

  // Values, in blocks that stay in L1 while every query's weights are applied to them; within a block, runs of
  // keys on one page (contiguous [run, D]).
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
        for (int64_t run = j0; run < j1;) {
          const int64_t stop = std::min(j1, (run | pages.mask) + 1);  // the end of run's page
          const T* vj = pages.value(run, D) + 8 * i0;
          for (int64_t j = run; j < stop; ++j, vj += D) {
            const v8 p = splat(sm[j]);
            for (int i = 0; i < 8; ++i)
              if (i < width) acc[i] += p * load_kv(vj + 8 * i);
          }
          run = stop;
        }
        for (int i = 0; i < width; ++i) store8(om + 8 * (i0 + i), load8(om + 8 * (i0 + i)) + acc[i]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < nv; ++i) store8(out + m * D + 8 * i, load8(out + m * D + 8 * i) * splat(inv[m]));
}

// Every (row, K/V head) of the call over a pool of element T.
template <typename T>
void run_pages(const at::Tensor& q, const T* kp, const T* vp, const int32_t* tp, const int64_t* lp, int64_t r,
               int64_t H, int64_t M, int64_t D, int64_t nb, int64_t bs, double scale, at::Tensor& out) {
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t page = bs * D, block_stride = H * page;  // a (block, head)'s [bs, D]; a block's [H, bs, D]
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(bs));
  const int nv = static_cast<int>(D / 8);
  const auto run = nv == 8 ? attend<8, T> : nv == 16 ? attend<16, T> : attend<0, T>;
  at::parallel_for(0, r * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(M * nb * bs), inv(M);
    std::vector<const T*> key_pages(nb), value_pages(nb);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const int64_t n = M ? *std::max_element(lp + b * M, lp + (b + 1) * M) : 0;
      for (int64_t i = 0; i < (n + bs - 1) >> shift; ++i) {
        const int64_t at = tp[b * nb + i] * block_stride + h * page;
        key_pages[i] = kp + at;
        value_pages[i] = vp + at;
      }
      const Pages<T> pages{key_pages.data(), value_pages.data(), shift, bs - 1};
      run(qp + task * M * D, pages, lp + b * M, M, n, nv, static_cast<float>(scale), scores.data(), inv.data(),
          op + task * M * D);
    }
  });
}

}  // namespace

namespace domino_ray {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                            const at::Tensor& block_tables, const at::Tensor& limits, double scale) {
  TORCH_CHECK(query.dim() == 4 && key_pool.dim() == 4 && value_pool.dim() == 4 && block_tables.dim() == 2 &&
              limits.dim() == 2,
              "decode_attention: query [r, Hkv, M, D], key/value pools [N, Hkv, bs, D], block_tables [r, nb], "
              "limits [r, M]");
  const bool bf16 = key_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK(query.scalar_type() == at::kFloat && (bf16 || key_pool.scalar_type() == at::kFloat) &&
              value_pool.scalar_type() == key_pool.scalar_type() && block_tables.scalar_type() == at::kInt &&
              limits.scalar_type() == at::kLong,
              "decode_attention: float32 query, float32 or bfloat16 key_pool/value_pool, int32 block_tables and "
              "int64 limits");
  TORCH_CHECK(query.device().is_cpu() && key_pool.device().is_cpu() && value_pool.device().is_cpu() &&
              block_tables.device().is_cpu() && limits.device().is_cpu(), "decode_attention: CPU tensors");
  const auto q = query.contiguous();
  const auto lim = limits.contiguous();
  const auto tables = block_tables.contiguous();
  const int64_t r = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t N = key_pool.size(0), bs = key_pool.size(2), nb = tables.size(1);
  TORCH_CHECK(D % 8 == 0, "decode_attention: head dim ", D, " is not a multiple of 8");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes() && key_pool.size(1) == H && key_pool.size(3) == D,
              "decode_attention: key/value pools ", key_pool.sizes(), " and ", value_pool.sizes(),
              " do not match query ", q.sizes(), " (pools [N, Hkv, bs, D])");
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), "decode_attention: pools must be contiguous");
  TORCH_CHECK(bs >= 8 && (bs & (bs - 1)) == 0,
              "decode_attention: block size ", bs, " must be a power of two and a multiple of 8");
  TORCH_CHECK(tables.size(0) == r, "decode_attention: block_tables ", tables.sizes(), " for query ", q.sizes());
  TORCH_CHECK(lim.size(0) == r && lim.size(1) == M, "decode_attention: limits ", lim.sizes(), " for query ", q.sizes());
  const int64_t* lp = lim.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < r; ++b) {
    int64_t n = 0;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t limit = lp[b * M + m];
      TORCH_CHECK(limit >= 0 && limit <= nb * bs, "decode_attention: key limit ", limit, " of row ", b,
                  " outside [0, ", nb * bs, "] (", nb, " blocks of ", bs, ")");
      n = std::max(n, limit);
    }
    for (int64_t i = 0; i < (n + bs - 1) / bs; ++i)  // the blocks row b reads; entries past them are never read
      TORCH_CHECK(tp[b * nb + i] >= 0 && tp[b * nb + i] < N, "decode_attention: block id ", tp[b * nb + i],
                  " (row ", b, ", block ", i, ") out of range for a pool of ", N, " blocks");
  }

  auto out = at::empty_like(q);
  if (bf16)
    run_pages(q, bf16_bits(key_pool), bf16_bits(value_pool), tp, lp, r, H, M, D, nb, bs, scale, out);
  else
    run_pages(q, key_pool.data_ptr<float>(), value_pool.data_ptr<float>(), tp, lp, r, H, M, D, nb, bs, scale, out);
  return out;
}

}  // namespace domino_ray
