// mHC's residual streams and maps (trainer/recipes/sasrec/fused.py): the maps' projection, RMSNorm, gates and
// pre-mix, the stream mixes, the Sinkhorn projection and their gradients. Why: with n = 4 streams of width 50
// every element-wise pass over the (N, n, D) streams costs as much as the sub-layer's own matmuls, and PyTorch
// runs the stream mixing as batched 4x4 matmuls and broadcast temporaries (about 3 GFLOP/s). Each kernel here
// reads every token's streams once, with the token's n x n map and n gates in registers.
// Stands alone (its includes are paths from trainer/recipes/, the root kernels.py states); registers its
// functions with TRAINER_KERNELS at the end, so the module picks it up with no shared file edited.
#pragma once

#include "cpu_common.h"

namespace sasrec_mhc {
using namespace trainer_cpu;

template <typename F>
auto with_streams(int64_t n, F&& f) {
  return with_constant<1, 2, 3, 4, 6, 8>(n, "streams", "1, 2, 3, 4, 6 or 8", f);
}

// a[b] = x[b] W^T for `count` <= 4 consecutive tokens (rows of width floats at x) and wt = W^T (width, mq), mq =
// 16 V16 + 8 V8 (zero padded): 4 tokens x (V16 16-float + V8 8-float vectors) of accumulators, each row of W^T
// loaded once for the 4 tokens. Writes a[b][0 .. mq) for b < count (a's row stride mq).
template <int V16, int V8>
inline void project_tokens(const float* __restrict__ x, int count, int64_t width, const float* __restrict__ wt,
                           float* __restrict__ a) {
  typedef float v8f __attribute__((vector_size(32)));
  constexpr int mq = 16 * V16 + 8 * V8;
  const float* rows[4];
  for (int b = 0; b < 4; ++b) rows[b] = x + std::min(b, count - 1) * width;   // a short group repeats its last
  v16f acc[4][V16 > 0 ? V16 : 1];
  v8f acc8[4];
  for (int b = 0; b < 4; ++b) {
    for (int v = 0; v < V16; ++v) acc[b][v] = v16f{};
    acc8[b] = v8f{};
  }
  for (int64_t f = 0; f < width; ++f) {
    const float* __restrict__ w = wt + f * mq;
    v16f wv[V16 > 0 ? V16 : 1];
    v8f w8;
    for (int v = 0; v < V16; ++v) std::memcpy(&wv[v], w + 16 * v, sizeof(v16f));
    if (V8) std::memcpy(&w8, w + 16 * V16, sizeof(v8f));
    for (int b = 0; b < 4; ++b) {
      const float s = rows[b][f];
      for (int v = 0; v < V16; ++v) acc[b][v] += s * wv[v];
      if (V8) acc8[b] += s * w8;
    }
  }
  for (int b = 0; b < count; ++b) {
    for (int v = 0; v < V16; ++v) std::memcpy(a + b * mq + 16 * v, &acc[b][v], sizeof(v16f));
    if (V8) std::memcpy(a + b * mq + 16 * V16, &acc8[b], sizeof(v8f));
  }
}

// out[j] = the sum of v[j]'s 16 lanes for j < R: 16 vectors at a time folded in halves (lanes of two vectors
// side by side, then added) into one vector of 16 sums. Summing each vector's lanes in order was a chain of 15
// dependent adds and extracts per vector (the compiler may not reorder them), 7% of maps_backward_basis.
template <int R>
inline void reduce16(const v16f* __restrict__ v, float* __restrict__ out) {
  for (int g = 0; g < R; g += 16) {
    v16f a[16];
    for (int j = 0; j < 16; ++j) a[j] = g + j < R ? v[g + j] : v16f{};
    for (int j = 0; j < 8; ++j)                 // a[j]: 8 partial sums of vector 2j, then 8 of 2j + 1
      a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                     31);
    for (int j = 0; j < 4; ++j)                 // 4 partial sums of each of 4 vectors
      a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; ++j)                 // 2 of each of 8
      a[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    a[0] = __builtin_shufflevector(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int j = 0; j < 16 && g + j < R; ++j) out[g + j] = a[0][j];
  }
}

// r[i][j] = r[j][i] for 16 vectors of 16: the off-diagonal blocks swapped at every scale (8, 4, 2, 1 lanes),
// 64 two-vector shuffles. 16 maps of 4 x 4 held maps-last (one vector per entry) from 16 maps' rows and back:
// one lane at a time, the 512 inserts and 256 extracts were most of sinkhorn_backward.
#define TRANSPOSE_STEP(d, ...)                                                   \
  for (int i = 0; i < 16; ++i)                                                   \
    if (!(i & d)) {                                                              \
      const v16f a = r[i], b = r[i + d];                                         \
      r[i] = __builtin_shufflevector(a, b, __VA_ARGS__);                         \
      r[i + d] = __builtin_shufflevector(a, b, TRANSPOSE_HI_##d);                \
    }
#define TRANSPOSE_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define TRANSPOSE_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define TRANSPOSE_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define TRANSPOSE_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
inline void transpose16(v16f (&r)[16]) {
  TRANSPOSE_STEP(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
  TRANSPOSE_STEP(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
  TRANSPOSE_STEP(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
  TRANSPOSE_STEP(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
}
#undef TRANSPOSE_STEP

// v[k][l] = rows[l][k] for 16 rows of n * n (16 lanes, k < n * n): the transposition for n = 4, else lane by lane.
template <int n>
inline void to_lanes(const float* __restrict__ rows, v16f* __restrict__ v) {
  if constexpr (n * n == 16) {
    v16f r[16];
    for (int l = 0; l < 16; ++l) std::memcpy(&r[l], rows + l * 16, sizeof(v16f));
    transpose16(r);
    for (int k = 0; k < 16; ++k) v[k] = r[k];
  } else {
    for (int k = 0; k < n * n; ++k)
      for (int l = 0; l < 16; ++l) v[k][l] = rows[l * n * n + k];
  }
}

// to_lanes' inverse: rows[l][k] = v[k][l] for 16 rows.
template <int n>
inline void from_lanes(const v16f* __restrict__ v, float* __restrict__ rows) {
  if constexpr (n * n == 16) {
    v16f r[16];
    for (int k = 0; k < 16; ++k) r[k] = v[k];
    transpose16(r);
    for (int l = 0; l < 16; ++l) std::memcpy(rows + l * 16, &r[l], sizeof(v16f));
  } else {
    for (int k = 0; k < n * n; ++k)
      for (int l = 0; l < 16; ++l) rows[l * n * n + k] = v[k][l];
  }
}

// ss[b] = <x_b, x_b> for count <= kBlock rows of `width` floats at x: each row's sum in two vector
// accumulators, the block's reduced together (reduce16; a dot() per row, latency-bound, was 13% of maps_in).
inline void sum_squares(const float* __restrict__ x, int count, int64_t width, float* __restrict__ ss) {
  v16f acc[kBlock];
  float tail[kBlock] = {};
  for (int b = 0; b < kBlock; ++b) {
    v16f a = v16f{}, c = v16f{};
    if (b < count) {
      const float* __restrict__ xb = x + b * width;
      int64_t f = 0;
      for (; f + 32 <= width; f += 32) {
        v16f u, v;
        std::memcpy(&u, xb + f, sizeof(v16f));
        std::memcpy(&v, xb + f + 16, sizeof(v16f));
        a += u * u, c += v * v;
      }
      for (; f + 16 <= width; f += 16) {
        v16f u;
        std::memcpy(&u, xb + f, sizeof(v16f));
        a += u * u;
      }
      for (; f < width; ++f) tail[b] += xb[f] * xb[f];
    }
    acc[b] = a + c;
  }
  float sums[kBlock];
  reduce16<kBlock>(acc, sums);
  for (int b = 0; b < count; ++b) ss[b] = sums[b] + tail[b];
}

// Where maps_in and maps_backward read a sub-layer's streams: an (N, n, D) tensor, or the basis form, where
// token t's streams are combinations of K (N, D) vectors, x[t, i] = sum_k coef[t, i, k] v_k[t]. mHC's streams
// are: they start as n copies of the embedding e and every mix adds one sub-layer output y (x' = H_res x +
// H_post^T y), so before the l-th sub-layer they are combinations of e, y_0 .. y_{l-1} (fused.py BasisStreams).
// Read that way they are never written: a token's streams are expanded in cache from l + 1 vectors of D
// instead of n read and n written by every mix and its backward.
// with_streams for a basis of K vectors (Streams below).
template <typename F>
auto with_basis(int64_t K, F&& f) {
  return with_constant<1, 2, 3, 4, 5, 6, 7, 8>(K, "basis vectors", "1 .. 8", f);
}

// out[i * D + d] = sum_k c[i * K + k] v[k][d]: one token's n streams from its K basis vectors, 16 columns at a
// time with the coefficients in registers (loops over D = 50 per pair of i and k were bound by their overhead).
template <int n, int K>
inline void expand_token(const float* __restrict__ c, const float* const (&v)[K], int64_t D, float* __restrict__ out) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16f vk[K];
    for (int k = 0; k < K; ++k) std::memcpy(&vk[k], v[k] + d, sizeof(v16f));
    for (int i = 0; i < n; ++i) {
      v16f s = c[i * K] * vk[0];
      for (int k = 1; k < K; ++k) s += c[i * K + k] * vk[k];
      std::memcpy(out + i * D + d, &s, sizeof(v16f));
    }
  }
  for (; d < D; ++d)
    for (int i = 0; i < n; ++i) {
      float s = 0.f;
      for (int k = 0; k < K; ++k) s += c[i * K + k] * v[k][d];
      out[i * D + d] = s;
    }
}

// The terms maps_backward adds to the projection's gradient of a token's streams: cf x_i + pre_i grad_h.
struct DirectTerms {
  const float *x = nullptr, *pre = nullptr, *gh = nullptr;
  float cf = 0.f;
};

// expand_token's backward for the gradient gx of the token's n streams (rows of D; with `direct`, gx_i + cf x_i +
// pre_i gh, added on the way): gc[i * K + k] = <gx_i, v_k>, and gv[k] = sum_i c[i * K + k] gx_i, written where
// assign[k], else added. One pass over the columns.
template <int n, int K, bool Direct = false>
inline void contract_token(const float* __restrict__ gx, const float* __restrict__ c, const float* const (&v)[K],
                           float* const (&gv)[K], const char* assign, int64_t D, float* __restrict__ gc,
                           const DirectTerms& direct = DirectTerms()) {
  v16f acc[n][K];
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < K; ++k) acc[i][k] = v16f{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16f gi[n];
    for (int i = 0; i < n; ++i) std::memcpy(&gi[i], gx + i * D + d, sizeof(v16f));
    if (Direct) {
      v16f ghv, xv;
      std::memcpy(&ghv, direct.gh + d, sizeof(v16f));
      for (int i = 0; i < n; ++i) {
        std::memcpy(&xv, direct.x + i * D + d, sizeof(v16f));
        gi[i] += direct.cf * xv + direct.pre[i] * ghv;
      }
    }
    for (int k = 0; k < K; ++k) {
      v16f vk, s;
      std::memcpy(&vk, v[k] + d, sizeof(v16f));
      if (assign[k])
        s = v16f{};
      else
        std::memcpy(&s, gv[k] + d, sizeof(v16f));
      for (int i = 0; i < n; ++i) {
        acc[i][k] += gi[i] * vk;
        s += c[i * K + k] * gi[i];
      }
      std::memcpy(gv[k] + d, &s, sizeof(v16f));
    }
  }
  reduce16<n * K>(&acc[0][0], gc);
  for (; d < D; ++d) {
    float gi[n];
    for (int i = 0; i < n; ++i)
      gi[i] = gx[i * D + d] + (Direct ? direct.cf * direct.x[i * D + d] + direct.pre[i] * direct.gh[d] : 0.f);
    for (int k = 0; k < K; ++k) {
      float s = assign[k] ? 0.f : gv[k][d];
      for (int i = 0; i < n; ++i) {
        gc[i * K + k] += gi[i] * v[k][d];
        s += c[i * K + k] * gi[i];
      }
      gv[k][d] = s;
    }
  }
}

struct Streams {
  const float* x = nullptr;                 // (N, n, D), or null: the basis form
  const float* coef = nullptr;              // (N, n, K)
  std::vector<const float*> basis;          // K pointers to (N, D)
  int64_t n = 0, D = 0, K = 0;
  // n copies of basis[0] (the first sub-layer's streams; no coef): the kernels then read that vector as one
  // row of D and project it with the folded weight sum_i W_i, (sum_i W_i) e = W x for x n copies of e
  bool copies = false;

  // `count` consecutive tokens' streams from t0, rows of n D floats: in x, or expanded into buf (n: this n)
  template <int n_>
  const float* block(int64_t t0, int count, float* buf) const {
    if (x) return x + t0 * n_ * D;
    if (copies) return basis[0] + t0 * D;
    with_basis(K, [&](auto ks) {
      constexpr int K_ = decltype(ks)::value;
      for (int b = 0; b < count; ++b) {
        const int64_t t = t0 + b;
        const float* v[K_];
        for (int k = 0; k < K_; ++k) v[k] = basis[k] + t * D;
        expand_token<n_, K_>(coef + t * n_ * K_, v, D, buf + b * n_ * D);
      }
      return 0;
    });
    return buf;
  }
};

Streams copies_streams(const torch::Tensor& e, int64_t n) {
  check(e, "e", 2);
  Streams s;
  s.basis = {e.data_ptr<float>()}, s.n = n, s.D = e.size(1), s.K = 1, s.copies = true;
  return s;
}

Streams dense_streams(const torch::Tensor& x) {
  check(x, "x", 3);
  Streams s;
  s.x = x.data_ptr<float>(), s.n = x.size(1), s.D = x.size(2);
  return s;
}

Streams basis_streams(const torch::Tensor& coef, const std::vector<torch::Tensor>& basis) {
  check(coef, "coef", 3);
  Streams s;
  s.coef = coef.data_ptr<float>(), s.n = coef.size(1), s.K = coef.size(2);
  TORCH_CHECK(s.K >= 1 && static_cast<int64_t>(basis.size()) == s.K,
              "kernels: coef (N, n, K) needs K basis vectors, got ", basis.size());
  for (const auto& v : basis) {
    check(v, "basis vector", 2);
    TORCH_CHECK(v.size(0) == coef.size(0) && v.size(1) == basis[0].size(1), "kernels: basis vectors must be (N, D)");
    s.basis.push_back(v.data_ptr<float>());
  }
  s.D = basis[0].size(1);
  return s;
}

// The basis vectors' gradient buffers (each as its vector) and whether each is written (fresh) or added to.
std::pair<std::vector<float*>, std::vector<char>> gradient_buffers(const std::vector<torch::Tensor>& grads,
                                                                   const std::vector<bool>& assign,
                                                                   const std::vector<torch::Tensor>& basis,
                                                                   const char* kernel) {
  TORCH_CHECK(grads.size() == basis.size() && assign.size() == basis.size(), "kernels.", kernel,
              ": one gradient buffer and assign flag per basis vector");
  std::vector<float*> out;
  for (size_t k = 0; k < grads.size(); ++k) {
    check(grads[k], "basis gradient", 2);
    TORCH_CHECK(grads[k].sizes() == basis[k].sizes(), "kernels.", kernel, ": gradient buffers as the basis");
    out.push_back(grads[k].data_ptr<float>());
  }
  return {out, std::vector<char>(assign.begin(), assign.end())};
}

// The maps, with the projection a = x W^T, the RMSNorm scale, the three gates and the pre-mix in one read of
// each token's streams (flattened to nD = n * D): a per kBlock tokens into registers (project_tokens; the BLAS
// product read the streams once more and wrote a), r = 1 / rms(x), z = r a, pre = sigmoid(alpha0 z[:n] + b_pre),
// post = 2 sigmoid(alpha1 z[n:2n] + b_post), E = exp(L - max L) with L = alpha2 z[2n:] + b_res (the Sinkhorn input), h = sum_i pre_i x_i.
// Returns (z, r, pre, post, E, h).
typedef std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> MapsIn;
MapsIn maps_in_impl(const Streams& src, int64_t N, const torch::TensorOptions& options, torch::Tensor weight,
                    std::vector<double> alpha, torch::Tensor b_pre, torch::Tensor b_post, torch::Tensor b_res,
                    double eps) {
  check(weight, "weight", 2), check(b_pre, "b_pre", 1), check(b_post, "b_post", 1), check(b_res, "b_res", 2);
  const int64_t D = src.D, M = weight.size(0), n_ = src.n;
  TORCH_CHECK(M == 2 * n_ + n_ * n_ && weight.size(1) == n_ * D && alpha.size() == 3,
              "kernels.maps_in: weight must be (2n + n^2, n D), 3 gates");
  const int64_t mq = (M + 7) / 8 * 8;                  // W^T's row: whole 16- and 8-float vectors
  const int64_t pw = src.copies ? D : n_ * D;          // the projection's width (copies: e's, W folded)
  std::vector<float> wt(pw * mq, 0.f);                 // W^T, (pw, mq)
  const float* __restrict__ wsrc = weight.data_ptr<float>();
  for (int64_t k = 0; k < M; ++k)
    for (int64_t f0 = 0; f0 < n_ * D; f0 += pw)          // (copies: the n blocks of W summed)
      for (int64_t f = 0; f < pw; ++f) wt[f * mq + k] += wsrc[k * n_ * D + f0 + f];
  auto z = torch::empty({N, M}, options);
  auto r = torch::empty({N}, options);
  auto pre = torch::empty({N, n_}, options);
  auto post = torch::empty({N, n_}, options);
  auto e = torch::empty({N, n_, n_}, options);
  auto h = torch::empty({N, D}, options);
  const float* __restrict__ wtp = wt.data();
  const float *__restrict__ bpre = b_pre.data_ptr<float>(), *__restrict__ bpost = b_post.data_ptr<float>(),
              *__restrict__ bres = b_res.data_ptr<float>();
  float *__restrict__ zp = z.data_ptr<float>(), *__restrict__ rp = r.data_ptr<float>();
  float *__restrict__ pp = pre.data_ptr<float>(), *__restrict__ qp = post.data_ptr<float>();
  float *__restrict__ ep = e.data_ptr<float>(), *__restrict__ hp = h.data_ptr<float>();
  const float a0 = alpha[0], a1 = alpha[1], a2 = alpha[2];
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    constexpr int m = 2 * n + n * n;
    at::parallel_for(0, N, kGrain, [&](int64_t lo, int64_t hi) {
      // kBlock tokens at a time, their exponents token-last, so that the exponentials run as vector
      // operations across tokens (one token's 2n + n^2 scalar calls were half of the kernel's time)
      alignas(64) float arg[m][kBlock], ex[m][kBlock];
      constexpr int mq = (m + 7) / 8 * 8;
      alignas(64) float ab[kBlock][mq];
      std::vector<float> xbuf(src.x || src.copies ? 0 : kBlock * pw);
      for (int64_t t0 = lo; t0 < hi; t0 += kBlock) {
        const int count = static_cast<int>(std::min<int64_t>(kBlock, hi - t0));
        const float* __restrict__ xb = src.block<n>(t0, count, xbuf.data());   // the block's streams
        for (int b = 0; b < count; b += 4)
          project_tokens<mq / 16, (mq % 16) / 8>(xb + b * pw, std::min(4, count - b), pw, wtp,
                                                  &ab[b][0]);
        float ss[kBlock];
        sum_squares(xb, count, pw, ss);
        for (int l = 0; l < kBlock; ++l) {
          if (l >= count) {                                 // padding lanes: any finite exponent
            for (int k = 0; k < m; ++k) arg[k][l] = 0.f;
            continue;
          }
          const int64_t t = t0 + l;
          const float* __restrict__ xt = xb + l * pw;
          const float rt = 1.f / std::sqrt(ss[l] / pw + static_cast<float>(eps));   // (copies: the same mean)
          rp[t] = rt;
          float zt[m];
          for (int k = 0; k < m; ++k) zp[t * m + k] = zt[k] = rt * ab[l][k];
          for (int i = 0; i < n; ++i) {
            arg[i][l] = a0 * zt[i] + bpre[i];
            arg[n + i][l] = a1 * zt[n + i] + bpost[i];
          }
          float mx = -INFINITY;
          for (int k = 0; k < n * n; ++k) mx = std::max(mx, arg[2 * n + k][l] = a2 * zt[2 * n + k] + bres[k]);
          for (int k = 0; k < n * n; ++k) arg[2 * n + k][l] -= mx;
        }
        // every exponent made <= 0 (sigmoid(u) = 1 / (1 + exp(-u)) for u >= 0, exp(u) / (1 + exp(u)) below)
        for (int k = 0; k < m; ++k) {
          v16f v;
          std::memcpy(&v, arg[k], sizeof(v));
          if (k < 2 * n) v = v < 0.f ? v : -v;            // -|u| (the gates)
          v = exp_neg16(v);
          std::memcpy(ex[k], &v, sizeof(v));
        }
        for (int l = 0; l < count; ++l) {
          const int64_t t = t0 + l;
          const float* __restrict__ xt = xb + l * pw;
          float p[n];
          for (int i = 0; i < n; ++i) {
            const float ei = ex[i][l], ej = ex[n + i][l];
            const float sp = arg[i][l] >= 0 ? 1.f / (1.f + ei) : ei / (1.f + ei);
            const float sq = arg[n + i][l] >= 0 ? 1.f / (1.f + ej) : ej / (1.f + ej);
            p[i] = pp[t * n + i] = sp;
            qp[t * n + i] = 2.f * sq;
          }
          for (int k = 0; k < n * n; ++k) ep[t * n * n + k] = ex[2 * n + k][l];
          float* __restrict__ ht = hp + t * D;
          if (src.copies) {
            float ps = 0.f;
            for (int i = 0; i < n; ++i) ps += p[i];
            for (int64_t d = 0; d < D; ++d) ht[d] = ps * xt[d];
            continue;
          }
          for (int64_t d = 0; d < D; ++d) {
            float s = 0.f;
            for (int i = 0; i < n; ++i) s += p[i] * xt[i * D + d];
            ht[d] = s;
          }
        }
      }
    });
    return 0;
  });
  return {z, r, pre, post, e, h};
}

MapsIn maps_in(torch::Tensor x, torch::Tensor weight, std::vector<double> alpha, torch::Tensor b_pre,
               torch::Tensor b_post, torch::Tensor b_res, double eps) {
  return maps_in_impl(dense_streams(x), x.size(0), x.options(), weight, alpha, b_pre, b_post, b_res, eps);
}

// maps_in for streams that are n copies of e (N, D), the first sub-layer's (Streams.copies).
MapsIn maps_in_copies(torch::Tensor e, int64_t n, torch::Tensor weight, std::vector<double> alpha,
                      torch::Tensor b_pre, torch::Tensor b_post, torch::Tensor b_res, double eps) {
  return maps_in_impl(copies_streams(e, n), e.size(0), e.options(), weight, alpha, b_pre, b_post, b_res, eps);
}

// maps_in for streams in the basis form (Streams): coef (N, n, K), K basis vectors (N, D).
MapsIn maps_in_basis(torch::Tensor coef, std::vector<torch::Tensor> basis, torch::Tensor weight,
                     std::vector<double> alpha, torch::Tensor b_pre, torch::Tensor b_post, torch::Tensor b_res,
                     double eps) {
  return maps_in_impl(basis_streams(coef, basis), coef.size(0), coef.options(), weight, alpha, b_pre, b_post, b_res,
                      eps);
}

// gw[k0 + kk][c + u] += sum_b ga[b][k0 + kk] xs[b][c + u] (kk < KR rows, u < CR vectors of 16 columns, b < count):
// the accumulators stay in registers over the tile's tokens, each token's vectors loaded once for KR rows.
template <int KR, int CR>
inline void rank_update(float* __restrict__ gw, int64_t wp, const float* __restrict__ ga, int gs,
                        const float* __restrict__ xs, int count, int k0, int64_t c) {
  v16f acc[KR][CR];
  for (int kk = 0; kk < KR; ++kk)
    for (int u = 0; u < CR; ++u) std::memcpy(&acc[kk][u], gw + (k0 + kk) * wp + (c + u) * 16, sizeof(v16f));
  for (int b = 0; b < count; ++b) {
    v16f xv[CR];
    for (int u = 0; u < CR; ++u) std::memcpy(&xv[u], xs + b * wp + (c + u) * 16, sizeof(v16f));
    for (int kk = 0; kk < KR; ++kk) {
      const float s = ga[b * gs + k0 + kk];
      for (int u = 0; u < CR; ++u) acc[kk][u] += s * xv[u];
    }
  }
  for (int kk = 0; kk < KR; ++kk)
    for (int u = 0; u < CR; ++u) std::memcpy(gw + (k0 + kk) * wp + (c + u) * 16, &acc[kk][u], sizeof(v16f));
}

// ob[b][c + u] = sum_k ga[b][k] w[k][c + u] for TR tokens and CR vectors of columns: each row of w loaded once
// for TR tokens (one token at a time was bound by the loads).
template <int TR, int CR>
inline void project_back(float* __restrict__ ob, int64_t wp, const float* __restrict__ ga, int gs, int m,
                         const float* __restrict__ w, int64_t c) {
  v16f acc[TR][CR];
  for (int b = 0; b < TR; ++b)
    for (int u = 0; u < CR; ++u) acc[b][u] = v16f{};
  for (int k = 0; k < m; ++k) {
    v16f wv[CR];
    for (int u = 0; u < CR; ++u) std::memcpy(&wv[u], w + k * wp + (c + u) * 16, sizeof(v16f));
    for (int b = 0; b < TR; ++b) {
      const float s = ga[b * gs + k];
      for (int u = 0; u < CR; ++u) acc[b][u] += s * wv[u];
    }
  }
  for (int b = 0; b < TR; ++b)
    for (int u = 0; u < CR; ++u) std::memcpy(ob + b * wp + (c + u) * 16, &acc[b][u], sizeof(v16f));
}

// maps_backward's tokens per tile: W's gradient accumulators (24 rows x the padded width) are reloaded per tile
// from L2, so 16 tokens spent an eighth of the kernel on them; 64 took 0.75-0.9 of 16's time (interleaved,
// caches cold, 11k tokens), 128 no less than 64.
constexpr int kTile = 64;

// Where maps_backward puts the streams' gradient: (N, n, D) gx with the stream mix's term added (g, res), or,
// for streams in the basis form, that of their coefficients gc (N, n, K), gc[t, i, k] = <gx[t, i], v_k[t]>,
// and of the basis vectors, gv[k][t] = sum_i coef[t, i, k] gx[t, i], written (assign[k]) or added; there the
// mix's term is not here: the coefficients' mix is autograd's (fused.py).
struct StreamsGrad {
  float* gx = nullptr;
  const float *g = nullptr, *res = nullptr;
  bool collapsed = false;
  float* gc = nullptr;
  std::vector<float*> gv;
  std::vector<char> assign;
};

// maps_backward's last step for streams in the basis form (StreamsGrad), per tile of `count` tokens from t0:
// gx[t, i] = (ga W)[t, i] (in ob) + cf x[t, i] + pre[t, i] grad_h[t], and from it its coefficients' and basis
// vectors' gradients, in one pass (contract_token).
template <int n>
inline void basis_grad(const Streams& src, const StreamsGrad& out, int64_t t0, int count, const float* __restrict__ ob,
                       int64_t wp, const float* __restrict__ xs, const float* __restrict__ cf,
                       const float* __restrict__ pp, const float* __restrict__ ghp) {
  const int64_t D = src.D;
  with_basis(src.K, [&](auto ks) {
    constexpr int K = decltype(ks)::value;
    for (int b = 0; b < count; ++b) {
      const int64_t t = t0 + b;
      const float* __restrict__ gx = ob + b * wp;
      const float* __restrict__ xt = xs + b * wp;
      DirectTerms direct;
      direct.x = xt, direct.pre = pp + t * n, direct.gh = ghp + t * D, direct.cf = cf[b];
      const float* v[K];
      float* gv[K];
      for (int k = 0; k < K; ++k) v[k] = src.basis[k] + t * D, gv[k] = out.gv[k] + t * D;
      contract_token<n, K, true>(gx, src.coef + t * n * K, v, gv, out.assign.data(), D, out.gc + t * n * K, direct);
    }
    return 0;
  });
}

// maps_backward's last step for n copies of e (Streams.copies): e's gradient, the sum over the copies,
// (ga W')[t] (in ob; W' = sum_i W_i) + n cf e[t] + (sum_i pre[t, i]) grad_h[t], written (assign) or added.
template <int n>
inline void copies_grad(const Streams& src, const StreamsGrad& out, int64_t t0, int count,
                        const float* __restrict__ ob, int64_t wp, const float* __restrict__ xs,
                        const float* __restrict__ cf, const float* __restrict__ pp, const float* __restrict__ ghp) {
  const int64_t D = src.D;
  for (int b = 0; b < count; ++b) {
    const int64_t t = t0 + b;
    const float *__restrict__ gt = ob + b * wp, *__restrict__ et = xs + b * wp, *__restrict__ gh = ghp + t * D;
    float ps = 0.f;
    for (int i = 0; i < n; ++i) ps += pp[t * n + i];
    const float c = n * cf[b];
    float* __restrict__ ge = out.gv[0] + t * D;
    if (out.assign[0])
      for (int64_t d = 0; d < D; ++d) ge[d] = gt[d] + c * et[d] + ps * gh[d];
    else
      for (int64_t d = 0; d < D; ++d) ge[d] += gt[d] + c * et[d] + ps * gh[d];
  }
}

// maps_in's backward and the streams' whole gradient, given the gradients of post, of the Sinkhorn logits L
// (sinkhorn_backward), of h and of the stream mix's output (g). With u = alpha0 z[:n] + b_pre and
// v = alpha1 z[n:2n] + b_post:
//   grad_u = <x_i, grad_h> pre (1 - pre),  grad_v = grad_post post (1 - post / 2),
//   gz = (alpha0 grad_u, alpha1 grad_v, alpha2 grad_L),  ga = r gz (the gradient of a = x W^T),
//   coef = -(gz . z) r^2 / nD (the RMSNorm's term: coef x),
//   gx[t, i] = (ga W)[t, i] + coef x[t, i] + sum_j res[t, j, i] g[t, j] + pre[t, i] grad_h[t],  grad_W = ga^T x
// (g (N, 1, D): the same gradient g[t, 0] for every stream, collapse_mix's). One pass over the tokens, where
// three kernels and two BLAS calls read the streams four times and the ga W product wrote an (N, nD) temporary
// (in the epoch, freshly faulted-in memory). Per tile of kTile tokens the streams are copied once into a buffer
// padded to whole vectors; W's gradient is accumulated per thread in kTile-token rank updates (8 rows x 16
// columns in registers); x's gradient is written once. The gates' and biases' gradients, sums over the tokens
// (per thread, in double), come out as one vector `small`: alpha's (sum grad_u z[:n], sum grad_v z[n:2n],
// sum grad_L z[2n:]), then b_pre's (sum grad_u), b_post's (sum grad_v) and b_res's (sum grad_L).
// Returns (grad_W, small); the streams' gradient goes to `out`.
std::tuple<torch::Tensor, torch::Tensor> maps_backward_impl(
    const Streams& src, const StreamsGrad& out, int64_t N, const torch::TensorOptions& options, torch::Tensor z,
    torch::Tensor r, torch::Tensor pre, torch::Tensor post, torch::Tensor weight, std::vector<double> alpha,
    torch::Tensor grad_post, torch::Tensor grad_l, torch::Tensor grad_h) {
  check(z, "z", 2), check(r, "r", 1), check(pre, "pre", 2), check(post, "post", 2);
  check(weight, "weight", 2), check(grad_post, "grad_post", 2), check(grad_l, "grad_L", 3);
  check(grad_h, "grad_h", 2);
  const int64_t D = src.D, M = z.size(1), n_ = src.n, width = n_ * D, K = src.K;
  TORCH_CHECK(weight.size(0) == M && weight.size(1) == width, "kernels.maps_backward: weight must be (2n + n^2, n D)");
  const bool collapsed = out.collapsed, copies = src.copies;
  const int64_t pw = copies ? D : width;                        // the projection's width (maps_in_impl)
  const int64_t wp = (pw + 15) / 16 * 16, nv = wp / 16;         // padded, in v16f vectors
  const int64_t mp = (M + 7) / 8 * 8;                            // W's rows, padded to blocks of 8
  const int threads = at::get_num_threads();
  const int64_t ns_ = 3 + 2 * n_ + n_ * n_;                      // the small gradients' count
  std::vector<double> sums(static_cast<size_t>(threads) * ns_, 0.0);
  std::vector<float> wpad(mp * wp, 0.f), acc(static_cast<size_t>(threads) * mp * wp, 0.f);
  const float* __restrict__ wsrc = weight.data_ptr<float>();
  for (int64_t k = 0; k < M; ++k)
    for (int64_t f0 = 0; f0 < width; f0 += pw)          // (copies: the n blocks of W summed)
      for (int64_t f = 0; f < pw; ++f) wpad[k * wp + f] += wsrc[k * width + f0 + f];
  const float* __restrict__ zp = z.data_ptr<float>();
  const float* __restrict__ rp = r.data_ptr<float>();
  const float *__restrict__ pp = pre.data_ptr<float>(), *__restrict__ qp = post.data_ptr<float>();
  const float *__restrict__ gqp = grad_post.data_ptr<float>(), *__restrict__ glp = grad_l.data_ptr<float>();
  const float *__restrict__ ghp = grad_h.data_ptr<float>(), *__restrict__ gp = out.g;
  const float* __restrict__ resp = out.res;
  const float* __restrict__ wv = wpad.data();
  float* __restrict__ gxp = out.gx;
  const float a0 = alpha[0], a1 = alpha[1], a2 = alpha[2];
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    constexpr int m = 2 * n + n * n;
    at::parallel_for(0, (N + kTile - 1) / kTile, 4, [&](int64_t lo, int64_t hi) {
      float* __restrict__ gw = &acc[static_cast<size_t>(at::get_thread_num()) * mp * wp];
      double* __restrict__ sm = &sums[static_cast<size_t>(at::get_thread_num()) * ns_];
      std::vector<float> xbuf(kTile * wp, 0.f), obuf(kTile * wp);
      float* __restrict__ xs = xbuf.data();
      float* __restrict__ ob = obuf.data();
      constexpr int gs = (m + 7) / 8 * 8;                // ga's row stride: whole blocks of 8
      alignas(64) float ga[kTile][gs] = {};              // columns m .. gs stay zero (rank_update's last block)
      float coef[kTile];                                 // the RMSNorm's term per token
      float al[m], tz[m] = {}, tb[m] = {};               // the gate of each of z's columns; the tile's sums
      for (int k = 0; k < m; ++k) al[k] = k < n ? a0 : k < 2 * n ? a1 : a2;
      for (int64_t tile = lo; tile < hi; ++tile) {
        const int64_t t0 = tile * kTile;
        const int count = static_cast<int>(std::min<int64_t>(kTile, N - t0));
        if (!src.x && !copies)                            // (xs rows are wp apart: one token at a time)
          for (int b = 0; b < count; ++b) src.block<n>(t0 + b, 1, xs + b * wp);
        for (int b = 0; b < count; ++b) {                 // (rows past count feed only unused ob rows)
          const int64_t t = t0 + b;
          const float* __restrict__ xt = xs + b * wp;
          if (src.x || copies)
            std::memcpy(xs + b * wp, src.x ? src.x + t * width : src.basis[0] + t * D, pw * sizeof(float));
          const float* __restrict__ gh = ghp + t * D;
          const float rt = rp[t];
          float eh[n];                                   // <x_i, grad_h> (copies: every stream's the same)
          const float* gv1[1] = {gh};
          if (copies) {
            dots<1, 1>(xt, gv1, D, eh);
            for (int i = 1; i < n; ++i) eh[i] = eh[0];
          } else {
            dots<n, 1>(xt, gv1, D, eh);
          }
          // g = (grad_u, grad_v, grad_L): the gradient of (u, v, L), whose z-scaled sums (per gate) and sums
          // are the small gradients; per tile in float, vectorised over k (a double per token added into
          // one sum was a chain of dependent adds through memory)
          float g[m];
          for (int i = 0; i < n; ++i) {
            const float p = pp[t * n + i], q = qp[t * n + i];
            g[i] = eh[i] * p * (1.f - p);
            g[n + i] = gqp[t * n + i] * q * (1.f - 0.5f * q);
          }
          for (int k = 0; k < n * n; ++k) g[2 * n + k] = glp[t * n * n + k];
          const float* __restrict__ zt = zp + t * m;
          float zg = 0.f;
#pragma omp simd reduction(+ : zg)
          for (int k = 0; k < m; ++k) {
            const float gz = al[k] * g[k];
            tz[k] += g[k] * zt[k];
            tb[k] += g[k];
            zg += gz * zt[k];
            ga[b][k] = gz * rt;
          }
          coef[b] = -zg * rt * rt / width;
        }
        for (int k = 0; k < m; ++k) {                      // the tile's sums into the thread's (double)
          sm[k < n ? 0 : k < 2 * n ? 1 : 2] += tz[k];
          sm[3 + k] += tb[k];
          tz[k] = tb[k] = 0.f;
        }
        // W's gradient, gw[k] += sum_b ga[b][k] xs[b]: 8 rows x 3 vectors of columns in registers
        for (int k0 = 0; k0 < m; k0 += 8) {
          int64_t c = 0;
          for (; c + 3 <= nv; c += 3) rank_update<8, 3>(gw, wp, &ga[0][0], gs, xs, count, k0, c);
          for (; c < nv; ++c) rank_update<8, 1>(gw, wp, &ga[0][0], gs, xs, count, k0, c);
        }
        // (ga W) for 4 tokens x 4 vectors of columns at a time (padding tokens' ga is zero)
        for (int b0 = 0; b0 < count; b0 += 4) {
          int64_t c = 0;
          for (; c + 4 <= nv; c += 4) project_back<4, 4>(ob + b0 * wp, wp, &ga[b0][0], gs, m, wv, c);
          for (; c < nv; ++c) project_back<4, 1>(ob + b0 * wp, wp, &ga[b0][0], gs, m, wv, c);
        }
        // x's gradient, token by token: the projection's term and the streams' terms
        if (copies) {
          copies_grad<n>(src, out, t0, count, ob, wp, xs, coef, pp, ghp);
          continue;
        }
        if (!src.x) {
          basis_grad<n>(src, out, t0, count, ob, wp, xs, coef, pp, ghp);
          continue;
        }
        for (int b = 0; b < count; ++b) {
          const float* __restrict__ obt = ob + b * wp;
          const int64_t t = t0 + b;
          const float* __restrict__ xt = xs + b * wp;
          const float* __restrict__ gt = gp + t * width;
          const float* __restrict__ gh = ghp + t * D;
          float* __restrict__ ot = gxp + t * width;
          float rs[n * n], p[n];
          for (int k = 0; k < n * n; ++k) rs[k] = resp[t * n * n + k];
          for (int i = 0; i < n; ++i) p[i] = pp[t * n + i];
          const float cf = coef[b];
          if (collapsed) {                                 // every stream's gradient is g[t, 0]
            const float* __restrict__ g0 = gp + t * D;
            for (int i = 0; i < n; ++i) {
              float cs = 0.f;
              for (int j = 0; j < n; ++j) cs += rs[j * n + i];
              for (int64_t d = 0; d < D; ++d)
                ot[i * D + d] = obt[i * D + d] + cf * xt[i * D + d] + p[i] * gh[d] + cs * g0[d];
            }
            continue;
          }
          for (int i = 0; i < n; ++i)
            for (int64_t d = 0; d < D; ++d) {
              float s = obt[i * D + d] + cf * xt[i * D + d] + p[i] * gh[d];
              for (int j = 0; j < n; ++j) s += rs[j * n + i] * gt[j * D + d];
              ot[i * D + d] = s;
            }
        }
      }
    });
    return 0;
  });
  auto grad_w = torch::zeros({M, width}, options);
  float* __restrict__ gwp = grad_w.data_ptr<float>();
  for (int th = 0; th < threads; ++th)
    for (int64_t k = 0; k < M; ++k) {
      const float* __restrict__ part = &acc[(static_cast<size_t>(th) * mp + k) * wp];
      for (int64_t f0 = 0; f0 < width; f0 += pw)         // (copies: every W_i's the same)
        for (int64_t f = 0; f < pw; ++f) gwp[k * width + f0 + f] += part[f];
    }
  auto small = torch::zeros({ns_}, options.dtype(torch::kDouble));
  double* __restrict__ sp = small.data_ptr<double>();
  for (int th = 0; th < threads; ++th)
    for (int64_t k = 0; k < ns_; ++k) sp[k] += sums[static_cast<size_t>(th) * ns_ + k];
  return {grad_w, small.to(torch::kFloat)};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> maps_backward(
    torch::Tensor x, torch::Tensor z, torch::Tensor r, torch::Tensor pre, torch::Tensor post, torch::Tensor weight,
    std::vector<double> alpha, torch::Tensor grad_post, torch::Tensor grad_l, torch::Tensor grad_h, torch::Tensor g,
    torch::Tensor res) {
  const Streams src = dense_streams(x);
  check(g, "grad", 3), check(res, "res", 3);
  const int64_t N = x.size(0), D = x.size(2), n_ = x.size(1);
  TORCH_CHECK(g.size(0) == N && (g.size(1) == n_ || g.size(1) == 1) && g.size(2) == D,
              "kernels.maps_backward: the streams' gradient must be (N, n, D) or (N, 1, D)");
  auto gx = torch::empty_like(x);
  StreamsGrad out;
  out.gx = gx.data_ptr<float>(), out.g = g.data_ptr<float>(), out.res = res.data_ptr<float>();
  out.collapsed = g.size(1) == 1;
  auto [grad_w, small] = maps_backward_impl(src, out, N, x.options(), z, r, pre, post, weight, alpha, grad_post,
                                            grad_l, grad_h);
  return {gx, grad_w, small};
}

// maps_backward for n copies of e (maps_in_copies): e's gradient into grad_e (written where assign, else added).
// Returns (grad_W, small).
std::tuple<torch::Tensor, torch::Tensor> maps_backward_copies(
    torch::Tensor e, torch::Tensor z, torch::Tensor r, torch::Tensor pre, torch::Tensor post, torch::Tensor weight,
    std::vector<double> alpha, torch::Tensor grad_post, torch::Tensor grad_l, torch::Tensor grad_h,
    torch::Tensor grad_e, bool assign) {
  const Streams src = copies_streams(e, pre.size(1));
  check(grad_e, "grad_e", 2);
  TORCH_CHECK(grad_e.sizes() == e.sizes(), "kernels.maps_backward_copies: grad_e must be e's shape");
  StreamsGrad out;
  out.gv = {grad_e.data_ptr<float>()}, out.assign = {static_cast<char>(assign)};
  return maps_backward_impl(src, out, e.size(0), e.options(), z, r, pre, post, weight, alpha, grad_post, grad_l,
                            grad_h);
}

// maps_backward for streams in the basis form (maps_in_basis): the coefficients' gradient (returned) and the
// basis vectors' (into grads[k], written where assign[k], else added). Returns (grad_coef, grad_W, small).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> maps_backward_basis(
    torch::Tensor coef, std::vector<torch::Tensor> basis, torch::Tensor z, torch::Tensor r, torch::Tensor pre,
    torch::Tensor post, torch::Tensor weight, std::vector<double> alpha, torch::Tensor grad_post,
    torch::Tensor grad_l, torch::Tensor grad_h, std::vector<torch::Tensor> grads, std::vector<bool> assign) {
  const Streams src = basis_streams(coef, basis);
  auto gc = torch::empty_like(coef);
  StreamsGrad out;
  out.gc = gc.data_ptr<float>();
  std::tie(out.gv, out.assign) = gradient_buffers(grads, assign, basis, "maps_backward_basis");
  auto [grad_w, small] = maps_backward_impl(src, out, coef.size(0), coef.options(), z, r, pre, post, weight, alpha,
                                            grad_post, grad_l, grad_h);
  return {gc, grad_w, small};
}

// out[t, i] = sum_j res[t, i, j] x[t, j] + post[t, i] y[t]
torch::Tensor stream_mix(torch::Tensor res, torch::Tensor x, torch::Tensor post, torch::Tensor y) {
  check(res, "res", 3), check(x, "x", 3), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = x.size(0), D = x.size(2);
  auto out = torch::empty_like(x);
  const float* __restrict__ rp = res.data_ptr<float>();
  const float* __restrict__ xp = x.data_ptr<float>();
  const float* __restrict__ pp = post.data_ptr<float>();
  const float* __restrict__ yp = y.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  with_streams(x.size(1), [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* __restrict__ xt = xp + t * n * D;
        const float* __restrict__ yt = yp + t * D;
        float r[n * n], p[n];
        for (int k = 0; k < n * n; ++k) r[k] = rp[t * n * n + k];
        for (int i = 0; i < n; ++i) p[i] = pp[t * n + i];
        float* __restrict__ ot = op + t * n * D;
        for (int i = 0; i < n; ++i)
          for (int64_t d = 0; d < D; ++d) {
            float s = p[i] * yt[d];
            for (int j = 0; j < n; ++j) s += r[i * n + j] * xt[j * D + d];
            ot[i * D + d] = s;
          }
      }
    });
    return 0;
  });
  return out;
}

// The gradients stream_mix's output gradient g gives its small inputs: grad_res[t, i, j] = <g_i, x_j>,
// grad_post[t, i] = <g_i, y>, grad_y[t] = sum_i post_i g_i (the streams' own gradient comes later, fused
// into maps_backward).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> stream_mix_backward(
    torch::Tensor g, torch::Tensor x, torch::Tensor post, torch::Tensor y) {
  check(g, "grad", 3), check(x, "x", 3), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = x.size(0), D = x.size(2);
  const int64_t n_ = x.size(1);
  auto grad_res = torch::empty({N, n_, n_}, x.options());
  auto grad_post = torch::empty({N, n_}, x.options());
  auto grad_y = torch::empty({N, D}, x.options());
  const float* __restrict__ gp = g.data_ptr<float>();
  const float* __restrict__ xp = x.data_ptr<float>();
  const float* __restrict__ pp = post.data_ptr<float>();
  const float* __restrict__ yp = y.data_ptr<float>();
  float* __restrict__ grp = grad_res.data_ptr<float>();
  float* __restrict__ gpp = grad_post.data_ptr<float>();
  float* __restrict__ gyp = grad_y.data_ptr<float>();
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* __restrict__ gt = gp + t * n * D;
        const float* __restrict__ xt = xp + t * n * D;
        const float* __restrict__ yt = yp + t * D;
        float* __restrict__ gy = gyp + t * D;
        float p[n];
        for (int i = 0; i < n; ++i) p[i] = pp[t * n + i];
        for (int64_t d = 0; d < D; ++d) {
          float s = 0.f;
          for (int i = 0; i < n; ++i) s += p[i] * gt[i * D + d];
          gy[d] = s;
        }
        const float* src[n + 1];
        for (int j = 0; j < n; ++j) src[j] = xt + j * D;
        src[n] = yt;
        float out[n * (n + 1)];
        dots<n, n + 1>(gt, src, D, out);
        for (int i = 0; i < n; ++i) {
          for (int j = 0; j < n; ++j) grp[(t * n + i) * n + j] = out[i * (n + 1) + j];
          gpp[t * n + i] = out[i * (n + 1) + n];
        }
      }
    });
    return 0;
  });
  return {grad_res, grad_post, grad_y};
}

// The last mHC sub-layer's stream mix and the collapse of its streams to their mean, in one pass that never
// writes the last streams: out[t] = (1/n) sum_i (sum_j res[t, i, j] x[t, j] + post[t, i] y[t])
//                                 = sum_j w_j x[t, j] + q y[t],  w_j = column mean of res, q = mean of post.
torch::Tensor collapse_mix(torch::Tensor res, torch::Tensor x, torch::Tensor post, torch::Tensor y) {
  check(res, "res", 3), check(x, "x", 3), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = x.size(0), D = x.size(2);
  auto out = torch::empty({N, D}, x.options());
  const float *__restrict__ rp = res.data_ptr<float>(), *__restrict__ xp = x.data_ptr<float>();
  const float *__restrict__ pp = post.data_ptr<float>(), *__restrict__ yp = y.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  with_streams(x.size(1), [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float w[n], q = 0.f;
        for (int j = 0; j < n; ++j) w[j] = 0.f;
        for (int i = 0; i < n; ++i) {
          q += pp[t * n + i];
          for (int j = 0; j < n; ++j) w[j] += rp[(t * n + i) * n + j];
        }
        q /= n;
        for (int j = 0; j < n; ++j) w[j] /= n;
        const float *__restrict__ xt = xp + t * n * D, *__restrict__ yt = yp + t * D;
        float* __restrict__ ot = op + t * D;
        for (int64_t d = 0; d < D; ++d) {
          float s = q * yt[d];
          for (int j = 0; j < n; ++j) s += w[j] * xt[j * D + d];
          ot[d] = s;
        }
      }
    });
    return 0;
  });
  return out;
}

// collapse_mix's gradients for its small inputs from g0 = (its output's gradient) / n, the gradient every one
// of the uncollapsed streams would get: grad_res[t, i, j] = <g0, x_j> (the same for every row i),
// grad_post[t, i] = <g0, y>, grad_y = (sum_i post_i) g0. The streams' own gradient is maps_backward's.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> collapse_mix_backward(
    torch::Tensor g0, torch::Tensor x, torch::Tensor post, torch::Tensor y) {
  check(g0, "grad", 2), check(x, "x", 3), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = x.size(0), D = x.size(2), n_ = x.size(1);
  auto grad_res = torch::empty({N, n_, n_}, x.options());
  auto grad_post = torch::empty({N, n_}, x.options());
  auto grad_y = torch::empty({N, D}, x.options());
  const float *__restrict__ gp = g0.data_ptr<float>(), *__restrict__ xp = x.data_ptr<float>();
  const float *__restrict__ pp = post.data_ptr<float>(), *__restrict__ yp = y.data_ptr<float>();
  float *__restrict__ grp = grad_res.data_ptr<float>(), *__restrict__ gpp = grad_post.data_ptr<float>();
  float* __restrict__ gyp = grad_y.data_ptr<float>();
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* __restrict__ gt = gp + t * D;
        const float* src[n + 1];
        for (int j = 0; j < n; ++j) src[j] = xp + (t * n + j) * D;
        src[n] = yp + t * D;
        float out[n + 1];
        dots<1, n + 1>(gt, src, D, out);
        float q = 0.f;
        for (int i = 0; i < n; ++i) {
          q += pp[t * n + i];
          gpp[t * n + i] = out[n];
          for (int j = 0; j < n; ++j) grp[(t * n + i) * n + j] = out[j];
        }
        float* __restrict__ gy = gyp + t * D;
        for (int64_t d = 0; d < D; ++d) gy[d] = q * gt[d];
      }
    });
    return 0;
  });
  return {grad_res, grad_post, grad_y};
}

// f(std::integral_constant<int, n>, std::integral_constant<int, K>, t) for every token t < N: the coefficients'
// kernels below, per token, with the stream and basis counts as constants.
template <typename F>
void for_tokens_nk(int64_t N, int64_t n, int64_t K, F&& f) {
  with_streams(n, [&](auto ns) {
    return with_basis(K, [&](auto ks) {
      at::parallel_for(0, N, 1024, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) f(ns, ks, t);
      });
      return 0;
    });
  });
}

// The stream mix H_res x + H_post^T y on streams in the basis form (Streams), where it acts on the coefficients
// only: out[t] = [res[t] coef[t] | post[t]], (N, n, K + 1) with y the new basis vector (torch's bmm on
// batches of 4 x 4 maps took 0.4 ms a call, as long as the maps' kernel).
torch::Tensor coef_mix(torch::Tensor res, torch::Tensor coef, torch::Tensor post) {
  check(res, "res", 3), check(coef, "coef", 3), check(post, "post", 2);
  const int64_t N = coef.size(0), n_ = coef.size(1);
  TORCH_CHECK(res.size(0) == N && res.size(1) == n_ && res.size(2) == n_ && post.size(0) == N && post.size(1) == n_,
              "kernels.coef_mix: res (N, n, n), coef (N, n, K), post (N, n)");
  auto out = torch::empty({N, n_, coef.size(2) + 1}, coef.options());
  const float *__restrict__ rp = res.data_ptr<float>(), *__restrict__ cp = coef.data_ptr<float>();
  const float* __restrict__ pp = post.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  for_tokens_nk(N, n_, coef.size(2), [&](auto ns, auto ks, int64_t t) {
    constexpr int n = decltype(ns)::value, K = decltype(ks)::value;
    const float *__restrict__ r = rp + t * n * n, *__restrict__ c = cp + t * n * K;
    float* __restrict__ o = op + t * n * (K + 1);
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k < K; ++k) {
        float s = 0.f;
        for (int j = 0; j < n; ++j) s += r[i * n + j] * c[j * K + k];
        o[i * (K + 1) + k] = s;
      }
      o[i * (K + 1) + K] = pp[t * n + i];
    }
  });
  return out;
}

// coef_mix's gradients from g (N, n, K + 1): grad_res = g[:, :, :K] coef^T, grad_coef = res^T g[:, :, :K],
// grad_post = g[:, :, K].
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> coef_mix_backward(torch::Tensor g, torch::Tensor res,
                                                                          torch::Tensor coef) {
  check(g, "grad", 3), check(res, "res", 3), check(coef, "coef", 3);
  const int64_t N = coef.size(0), n_ = coef.size(1);
  TORCH_CHECK(g.size(0) == N && g.size(1) == n_ && g.size(2) == coef.size(2) + 1,
              "kernels.coef_mix_backward: g (N, n, K + 1)");
  auto grad_res = torch::empty_like(res);
  auto grad_coef = torch::empty_like(coef);
  auto grad_post = torch::empty({N, n_}, coef.options());
  const float *__restrict__ gp = g.data_ptr<float>(), *__restrict__ rp = res.data_ptr<float>();
  const float* __restrict__ cp = coef.data_ptr<float>();
  float *__restrict__ grp = grad_res.data_ptr<float>(), *__restrict__ gcp = grad_coef.data_ptr<float>();
  float* __restrict__ gpp = grad_post.data_ptr<float>();
  for_tokens_nk(N, n_, coef.size(2), [&](auto ns, auto ks, int64_t t) {
    constexpr int n = decltype(ns)::value, K = decltype(ks)::value;
    const float *__restrict__ gt = gp + t * n * (K + 1), *__restrict__ r = rp + t * n * n;
    const float* __restrict__ c = cp + t * n * K;
    for (int i = 0; i < n; ++i) {
      gpp[t * n + i] = gt[i * (K + 1) + K];
      for (int j = 0; j < n; ++j) {
        float s = 0.f;
        for (int k = 0; k < K; ++k) s += gt[i * (K + 1) + k] * c[j * K + k];
        grp[(t * n + i) * n + j] = s;
      }
    }
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < K; ++k) {
        float s = 0.f;
        for (int i = 0; i < n; ++i) s += r[i * n + j] * gt[i * (K + 1) + k];
        gcp[(t * n + j) * K + k] = s;
      }
  });
  return {grad_res, grad_coef, grad_post};
}

// The mean of the last streams in the basis form (Streams), the model's output: out[t] = sum_k w[t, k] v_k[t],
// w[t, k] = mean_i coef[t, i, k].
// Token t's basis vectors v[k] and its coefficients' mean over the streams w[k] (basis_mean's weights).
template <int K>
inline void mean_weights(const Streams& src, int64_t t, const float* (&v)[K], float (&w)[K]) {
  for (int k = 0; k < K; ++k) {
    v[k] = src.basis[k] + t * src.D;
    float s = 0.f;
    for (int64_t i = 0; i < src.n; ++i) s += src.coef[(t * src.n + i) * K + k];
    w[k] = s / src.n;
  }
}

torch::Tensor basis_mean(torch::Tensor coef, std::vector<torch::Tensor> basis) {
  const Streams src = basis_streams(coef, basis);
  const int64_t N = coef.size(0), D = src.D;
  auto out = torch::empty({N, D}, coef.options());
  float* __restrict__ op = out.data_ptr<float>();
  with_basis(src.K, [&](auto ks) {
    constexpr int K = decltype(ks)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* v[K];
        float w[K];
        mean_weights<K>(src, t, v, w);
        expand_token<1, K>(w, v, D, op + t * D);
      }
    });
    return 0;
  });
  return out;
}

// basis_mean's backward from its output's gradient g: returns grad_coef[t, i, k] = <g[t], v_k[t]> / n and
// writes (assign[k]) or adds w[t, k] g[t] into grads[k].
torch::Tensor basis_mean_backward(torch::Tensor g, torch::Tensor coef, std::vector<torch::Tensor> basis,
                                  std::vector<torch::Tensor> grads, std::vector<bool> assign) {
  check(g, "grad", 2);
  const Streams src = basis_streams(coef, basis);
  const int64_t N = coef.size(0), D = src.D, n = src.n;
  TORCH_CHECK(g.size(0) == N && g.size(1) == D, "kernels.basis_mean_backward: g (N, D)");
  const auto buffers = gradient_buffers(grads, assign, basis, "basis_mean_backward");
  const std::vector<float*>& gvp = buffers.first;     // (not a structured binding: lambdas capture it below)
  const std::vector<char>& fresh = buffers.second;
  auto grad_coef = torch::empty_like(coef);
  const float* __restrict__ gp = g.data_ptr<float>();
  float* __restrict__ gcp = grad_coef.data_ptr<float>();
  with_basis(src.K, [&](auto ks) {
    constexpr int K = decltype(ks)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* v[K];
        float* gv[K];
        float w[K], gw[K];
        mean_weights<K>(src, t, v, w);
        for (int k = 0; k < K; ++k) gv[k] = gvp[k] + t * D;
        contract_token<1, K>(gp + t * D, w, v, gv, fresh.data(), D, gw);
        for (int64_t i = 0; i < n; ++i)
          for (int k = 0; k < K; ++k) gcp[(t * n + i) * K + k] = gw[k] / n;
      }
    });
    return 0;
  });
  return grad_coef;
}

// max over (N, n, n) maps of |row sum - 1| (the Sinkhorn's row error the recipe logs; five torch ops before).
double row_error(torch::Tensor res) {
  check(res, "res", 3);
  const int64_t N = res.size(0), n = res.size(1);
  const float* __restrict__ rp = res.data_ptr<float>();
  return at::parallel_reduce(0, N * n, 4096, 0.0, [&](int64_t b, int64_t e, double acc) {
    float m = 0.f;
    for (int64_t r = b; r < e; ++r) {
      float s = 0.f;
      for (int64_t j = 0; j < n; ++j) s += rp[r * n + j];
      m = std::max(m, std::abs(s - 1.f));
    }
    return std::max(acc, static_cast<double>(m));
  }, [](double a, double b) { return std::max(a, b); });
}

// The first mHC sub-layer's stream mix, where the n streams are n copies of the embedding e (never written):
// out[t, i] = rows[t, i] e[t] + post[t, i] y[t], with rows the row sums of H_res (sum_j res[t, i, j] x[t, j]
// for x[t, j] = e[t]). One read of e and y, one write of the streams.
torch::Tensor copies_mix(torch::Tensor rows, torch::Tensor e, torch::Tensor post, torch::Tensor y) {
  check(rows, "rows", 2), check(e, "e", 2), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = e.size(0), D = e.size(1), n_ = rows.size(1);
  TORCH_CHECK(post.size(1) == n_ && y.size(1) == D, "kernels.copies_mix: rows, post (N, n), e, y (N, D)");
  auto out = torch::empty({N, n_, D}, e.options());
  const float *__restrict__ rp = rows.data_ptr<float>(), *__restrict__ ep = e.data_ptr<float>();
  const float *__restrict__ pp = post.data_ptr<float>(), *__restrict__ yp = y.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t end) {
      for (int64_t t = b; t < end; ++t) {
        const float *__restrict__ et = ep + t * D, *__restrict__ yt = yp + t * D;
        for (int i = 0; i < n; ++i) {
          const float r = rp[t * n + i], q = pp[t * n + i];
          float* __restrict__ ot = op + (t * n + i) * D;
          for (int64_t d = 0; d < D; ++d) ot[d] = r * et[d] + q * yt[d];
        }
      }
    });
    return 0;
  });
  return out;
}

// copies_mix's gradients from the streams' gradient g, in one read of it: grad_rows[t, i] = <g_i, e>,
// grad_post[t, i] = <g_i, y>, grad_e = sum_i rows_i g_i, grad_y = sum_i post_i g_i.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> copies_mix_backward(
    torch::Tensor g, torch::Tensor rows, torch::Tensor e, torch::Tensor post, torch::Tensor y) {
  check(g, "grad", 3), check(rows, "rows", 2), check(e, "e", 2), check(post, "post", 2), check(y, "y", 2);
  const int64_t N = e.size(0), D = e.size(1), n_ = rows.size(1);
  auto grad_rows = torch::empty({N, n_}, e.options());
  auto grad_post = torch::empty({N, n_}, e.options());
  auto grad_e = torch::empty({N, D}, e.options());
  auto grad_y = torch::empty({N, D}, e.options());
  const float* __restrict__ gp = g.data_ptr<float>();
  const float *__restrict__ rp = rows.data_ptr<float>(), *__restrict__ ep = e.data_ptr<float>();
  const float *__restrict__ pp = post.data_ptr<float>(), *__restrict__ yp = y.data_ptr<float>();
  float *__restrict__ grp = grad_rows.data_ptr<float>(), *__restrict__ gpp = grad_post.data_ptr<float>();
  float *__restrict__ gep = grad_e.data_ptr<float>(), *__restrict__ gyp = grad_y.data_ptr<float>();
  with_streams(n_, [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t b, int64_t end) {
      for (int64_t t = b; t < end; ++t) {
        const float* __restrict__ gt = gp + t * n * D;
        float r[n], q[n];
        for (int i = 0; i < n; ++i) r[i] = rp[t * n + i], q[i] = pp[t * n + i];
        float *__restrict__ ge = gep + t * D, *__restrict__ gy = gyp + t * D;
        for (int64_t d = 0; d < D; ++d) {
          float se = 0.f, sy = 0.f;
          for (int i = 0; i < n; ++i) se += r[i] * gt[i * D + d], sy += q[i] * gt[i * D + d];
          ge[d] = se, gy[d] = sy;
        }
        const float* src[2] = {ep + t * D, yp + t * D};
        float out[n * 2];
        dots<n, 2>(gt, src, D, out);
        for (int i = 0; i < n; ++i) grp[t * n + i] = out[2 * i], gpp[t * n + i] = out[2 * i + 1];
      }
    });
    return 0;
  });
  return {grad_rows, grad_post, grad_e, grad_y};
}

inline v16f abs16(v16f v) { return v < 0.f ? -v : v; }

// x = A^-1 b for n x n systems held in vector lanes, a = [A | b] row-major (n rows of n + 1): Gaussian
// elimination with partial pivoting, each lane choosing and swapping its own pivot rows by selects. a is
// overwritten.
template <int n>
inline void solve_lanes(v16f* __restrict__ a, v16f* __restrict__ x) {
  constexpr int w = n + 1;
  for (int c = 0; c < n; ++c) {
    v16f best = abs16(a[c * w + c]);
    v16i piv = v16i{} + c;
    for (int r = c + 1; r < n; ++r) {
      const v16i larger = abs16(a[r * w + c]) > best;
      best = larger ? abs16(a[r * w + c]) : best;
      piv = larger ? v16i{} + r : piv;
    }
    for (int r = c + 1; r < n; ++r) {                     // swap rows c and r in the lanes whose pivot is r
      const v16i take = piv == r;
      for (int j = c; j < w; ++j) {
        const v16f top = a[c * w + j];
        a[c * w + j] = take ? a[r * w + j] : top;
        a[r * w + j] = take ? top : a[r * w + j];
      }
    }
    for (int r = c + 1; r < n; ++r) {
      const v16f f = a[r * w + c] / a[c * w + c];
      for (int j = c; j < w; ++j) a[r * w + j] -= f * a[c * w + j];
    }
  }
  for (int i = n - 1; i >= 0; --i) {
    v16f s = a[i * w + n];
    for (int j = i + 1; j < n; ++j) s -= a[i * w + j] * x[j];
    x[i] = s / a[i * w + i];
  }
}

// Newton steps on the row scaling of 16 maps held in vector lanes (P[i * n + j], columns summing to 1): the
// rows' sums r as a function of row factors exp(d) with the columns renormalised have the Jacobian
// J = diag(r) - P P^T (null along 1: the common factor), so (J + 1 1^T) d = 1 - r, then rows times exp(d - max d)
// and the columns normalised. A lane takes a step only if it lowers its largest row error, else it halves its
// step length for the next (backtracking along the same direction); it stops once the error is within tol or
// after `steps`. live: lanes that may step (padding lanes not). Sinkhorn's iterations converge linearly, the
// slower the sharper the map (late in training rows were still off by up to 0.8 after 20 iterations); from
// there these steps reach 1e-4 in a few.
template <int n>
void newton_lanes(v16f* __restrict__ P, v16i live, int64_t steps, float tol) {
  constexpr int w = n + 1;
  auto row_sums = [&](const v16f* M, v16f* r) {
    v16f worst = v16f{};
    for (int i = 0; i < n; ++i) {
      r[i] = M[i * n];
      for (int j = 1; j < n; ++j) r[i] += M[i * n + j];
      const v16f e = abs16(r[i] - 1.f);
      worst = e > worst ? e : worst;
    }
    return worst;
  };
  v16f r[n], err = row_sums(P, r), length = v16f{} + 1.f;
  for (int64_t step = 0; step < steps; ++step) {
    live &= err > tol;
    bool any = false;
    for (int l = 0; l < kBlock; ++l) any |= live[l] != 0;
    if (!any) return;
    v16f a[n * w], d[n], Q[n * n], r2[n];
    for (int i = 0; i < n; ++i) {
      a[i * w + n] = 1.f - r[i];
      for (int k = 0; k < n; ++k) {
        v16f ppt = v16f{};
        for (int j = 0; j < n; ++j) ppt += P[i * n + j] * P[k * n + j];
        a[i * w + k] = (i == k ? r[i] : v16f{}) + 1.f - ppt;
      }
    }
    solve_lanes<n>(a, d);
    v16f top = d[0];
    for (int i = 1; i < n; ++i) top = d[i] > top ? d[i] : top;
    for (int i = 0; i < n; ++i) {
      const v16f f = exp_neg16(length * (d[i] - top));
      for (int j = 0; j < n; ++j) Q[i * n + j] = P[i * n + j] * f;
    }
    for (int j = 0; j < n; ++j) {
      v16f c = Q[j];
      for (int i = 1; i < n; ++i) c += Q[i * n + j];
      const v16f inv = 1.f / c;
      for (int i = 0; i < n; ++i) Q[i * n + j] *= inv;
    }
    const v16f err2 = row_sums(Q, r2);
    const v16i take = live & (err2 < err);                 // (NaN compares false: a failed solve is not taken)
    for (int k = 0; k < n * n; ++k) P[k] = take ? Q[k] : P[k];
    for (int i = 0; i < n; ++i) r[i] = take ? r2[i] : r[i];
    err = take ? err2 : err;
    length = take ? v16f{} + 1.f : length * 0.5f;
  }
}

// Sinkhorn on a chunk of maps held maps-last in m[n * n][kLanes] (so every step is a vector operation over
// the maps): iterations first .. last - 1 of rows then columns. With tol > 0 each map stops on its own: before
// an iteration (not the first), a map whose rows all sum to 1 within tol (columns are exact after each
// iteration) is left as it is from then on (its lane multiplied by 1) and ran[l] records the iterations it ran;
// the chunk returns once no lane runs. Lanes with ran[l] >= 0 on entry do not run; -1 on return: still running.
template <int n>
void sinkhorn_lanes(float (*__restrict__ m)[kLanes], int64_t first, int64_t last, float tol,
                    int32_t* __restrict__ ran) {
  alignas(64) float s[n][kLanes], live[kLanes];
  for (int l = 0; l < kLanes; ++l) live[l] = ran[l] < 0 ? 1.f : 0.f;
  for (int64_t it = first; it < last; ++it) {
    for (int i = 0; i < n; ++i) {                      // row sums
      for (int l = 0; l < kLanes; ++l) s[i][l] = m[i * n][l];
      for (int j = 1; j < n; ++j)
        for (int l = 0; l < kLanes; ++l) s[i][l] += m[i * n + j][l];
    }
    if (tol > 0 && it > 0) {
      int running = 0;
#pragma omp simd reduction(+ : running)
      for (int l = 0; l < kLanes; ++l) {
        float worst = 0.f;
        for (int i = 0; i < n; ++i) worst = std::max(worst, std::abs(s[i][l] - 1.f));
        const bool stop = live[l] != 0.f && worst <= tol;
        ran[l] = stop ? static_cast<int32_t>(it) : ran[l];
        live[l] = stop ? 0.f : live[l];
        running += live[l] != 0.f;
      }
      if (!running) return;
    }
    for (int i = 0; i < n; ++i) {                      // rows
      for (int l = 0; l < kLanes; ++l) s[i][l] = live[l] != 0.f ? 1.f / s[i][l] : 1.f;
      for (int j = 0; j < n; ++j)
        for (int l = 0; l < kLanes; ++l) m[i * n + j][l] *= s[i][l];
    }
    for (int j = 0; j < n; ++j) {                      // columns
      float* __restrict__ c = s[0];
      for (int l = 0; l < kLanes; ++l) c[l] = m[j][l];
      for (int i = 1; i < n; ++i)
        for (int l = 0; l < kLanes; ++l) c[l] += m[i * n + j][l];
      for (int l = 0; l < kLanes; ++l) c[l] = live[l] != 0.f ? 1.f / c[l] : 1.f;
      for (int i = 0; i < n; ++i)
        for (int l = 0; l < kLanes; ++l) m[i * n + j][l] *= c[l];
    }
  }
}

// Sinkhorn on (N, n, n) positive maps E = exp(L - max) (the exponential is the caller's: vectorised there),
// normalised by rows then columns, at most iters times; with tol > 0 each map stops before an iteration once
// its rows sum to 1 within tol (columns are exact after each iteration): the PyTorch path's rule. The maps still
// running are gathered into whole chunks every kRound iterations, so that the slow maps do not hold every chunk
// they share. Maps still above tol after `iters` then get up to `newton` Newton steps (newton_lanes; tol > 0).
// Returns (P, the iterations the slowest map ran).
constexpr int64_t kRound = 8;
std::tuple<torch::Tensor, int64_t> sinkhorn(torch::Tensor logits, int64_t iters, double tol, int64_t newton) {
  check(logits, "maps", 3);
  const int64_t N = logits.size(0);
  TORCH_CHECK(logits.size(2) == logits.size(1), "kernels.sinkhorn: square maps");
  auto p = logits.clone();                               // the maps' current values, normalised in place
  float* pp = p.data_ptr<float>();
  const float ftol = static_cast<float>(tol);
  std::vector<int32_t> ran(N, -1);                       // iterations run by a map that stopped; -1: running
  std::vector<int64_t> live(N);
  std::iota(live.begin(), live.end(), 0);
  return with_streams(logits.size(1), [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    int64_t first = 0;
    while (!live.empty() && first < iters) {
      const int64_t last = tol > 0 ? std::min(iters, first + kRound) : iters;
      const int64_t count = static_cast<int64_t>(live.size()), chunks = (count + kLanes - 1) / kLanes;
      at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
        alignas(64) float m[n * n][kLanes];
        alignas(64) int32_t lr[kLanes];
        for (int64_t c = b; c < e; ++c) {
          const int64_t t0 = c * kLanes;
          const int lanes = static_cast<int>(std::min<int64_t>(kLanes, count - t0));
          for (int l = 0; l < kLanes; ++l) lr[l] = l < lanes ? -1 : 0;   // padding lanes do not run
          for (int l0 = 0; l0 < kLanes; l0 += 16) {
            if (n * n == 16 && l0 + 16 <= lanes) {             // 16 whole maps: one transposition (to_lanes)
              v16f r[16];
              for (int l = 0; l < 16; ++l) std::memcpy(&r[l], pp + live[t0 + l0 + l] * 16, sizeof(v16f));
              transpose16(r);
              for (int k = 0; k < 16; ++k) std::memcpy(&m[k][l0], &r[k], sizeof(v16f));
              continue;
            }
            for (int l = l0; l < l0 + 16; ++l) {
              const float* src = pp + live[t0 + std::min(l, lanes - 1)] * n * n;
              for (int k = 0; k < n * n; ++k) m[k][l] = src[k];
            }
          }
          sinkhorn_lanes<n>(m, first, last, ftol, lr);
          for (int l0 = 0; l0 < lanes; l0 += 16) {
            if (n * n == 16 && l0 + 16 <= lanes) {
              v16f r[16];
              for (int k = 0; k < 16; ++k) std::memcpy(&r[k], &m[k][l0], sizeof(v16f));
              transpose16(r);
              for (int l = 0; l < 16; ++l) std::memcpy(pp + live[t0 + l0 + l] * 16, &r[l], sizeof(v16f));
              continue;
            }
            for (int l = l0; l < std::min(lanes, l0 + 16); ++l) {
              float* dst = pp + live[t0 + l] * n * n;
              for (int k = 0; k < n * n; ++k) dst[k] = m[k][l];
            }
          }
          for (int l = 0; l < lanes; ++l) ran[live[t0 + l]] = lr[l];
        }
      });
      first = last;
      live.erase(std::remove_if(live.begin(), live.end(), [&](int64_t t) { return ran[t] >= 0; }), live.end());
    }
    if (tol > 0 && newton > 0 && !live.empty()) {          // the maps the iterations left above tol
      const int64_t count = static_cast<int64_t>(live.size());
      at::parallel_for(0, (count + kBlock - 1) / kBlock, 4, [&](int64_t b, int64_t e) {
        for (int64_t c = b; c < e; ++c) {
          const int64_t t0 = c * kBlock;
          const int lanes = static_cast<int>(std::min<int64_t>(kBlock, count - t0));
          v16f P[n * n];
          v16i real;
          for (int l = 0; l < kBlock; ++l) {
            real[l] = l < lanes ? -1 : 0;
            const float* src = pp + live[t0 + std::min(l, lanes - 1)] * n * n;
            for (int k = 0; k < n * n; ++k) P[k][l] = src[k];
          }
          newton_lanes<n>(P, real, newton, ftol);
          for (int l = 0; l < lanes; ++l) {
            float* dst = pp + live[t0 + l] * n * n;
            for (int k = 0; k < n * n; ++k) dst[k] = P[k][l];
          }
        }
      });
    }
    int64_t slowest = tol <= 0 || !live.empty() ? iters : 0;
    for (int64_t t = 0; t < N && slowest < iters; ++t) slowest = std::max<int64_t>(slowest, ran[t]);
    return std::tuple<torch::Tensor, int64_t>{p, slowest};
  });
}

// Gradient of the converged projection (implicit differentiation; see model.py's _Sinkhorn.backward):
// dL = P * (G - a 1^T - 1 b^T), (I + 1 1^T - P^T P) b = colsum(P G) - P^T rowsum(P G), a = rowsum(P G) - P b.
// One n x n solve per map, Gaussian elimination with partial pivoting, on 16 maps at a time held maps-last in
// vector lanes (each lane picks and swaps its own pivot rows by selects): one map at a time, the elimination's
// scalar steps were the kernel (0.6 ms at 11k maps, as much as the Sinkhorn's 20 iterations).
template <int n>
void sinkhorn_backward_lanes(const float* __restrict__ pm, const float* __restrict__ gm, float* __restrict__ om,
                             int lanes) {
  constexpr int w = n + 1;                                // augmented system [A | rhs], A = I + 1 1^T - P^T P
  v16f P[n * n], pg[n * n], rows[n], cols[n], a[n * w], x[n];
  if (lanes == kBlock) {
    to_lanes<n>(pm, P);
    to_lanes<n>(gm, pg);
  } else {
    for (int k = 0; k < n * n; ++k)
      for (int l = 0; l < kBlock; ++l) {                  // padding lanes: the identity map, zero gradient
        const bool real = l < lanes;
        P[k][l] = real ? pm[l * n * n + k] : (k % (n + 1) == 0 ? 1.f : 0.f);
        pg[k][l] = real ? gm[l * n * n + k] : 0.f;
      }
  }
  for (int k = 0; k < n * n; ++k) pg[k] *= P[k];
  for (int i = 0; i < n; ++i) rows[i] = cols[i] = v16f{};
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) rows[i] += pg[i * n + j], cols[j] += pg[i * n + j];
  for (int i = 0; i < n; ++i) {
    v16f rhs = cols[i];
    for (int k = 0; k < n; ++k) rhs -= P[k * n + i] * rows[k];
    a[i * w + n] = rhs;
    for (int j = 0; j < n; ++j) {
      v16f ptp = v16f{};
      for (int k = 0; k < n; ++k) ptp += P[k * n + i] * P[k * n + j];
      a[i * w + j] = (i == j ? 2.f : 1.f) - ptp;
    }
  }
  solve_lanes<n>(a, x);
  v16f o[n * n];
  for (int i = 0; i < n; ++i) {
    v16f pb = v16f{};
    for (int j = 0; j < n; ++j) pb += P[i * n + j] * x[j];
    const v16f ai = rows[i] - pb;
    for (int j = 0; j < n; ++j) o[i * n + j] = pg[i * n + j] - P[i * n + j] * (ai + x[j]);
  }
  if (lanes == kBlock) {
    from_lanes<n>(o, om);
    return;
  }
  for (int k = 0; k < n * n; ++k)
    for (int l = 0; l < lanes; ++l) om[l * n * n + k] = o[k][l];
}

torch::Tensor sinkhorn_backward(torch::Tensor p, torch::Tensor grad) {
  check(p, "P", 3), check(grad, "grad", 3);
  const int64_t N = p.size(0);
  auto out = torch::empty_like(p);
  const float* __restrict__ pp = p.data_ptr<float>();
  const float* __restrict__ gp = grad.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  with_streams(p.size(1), [&](auto ns) {
    constexpr int n = decltype(ns)::value;
    at::parallel_for(0, (N + kBlock - 1) / kBlock, 4, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const int64_t t0 = c * kBlock;
        sinkhorn_backward_lanes<n>(pp + t0 * n * n, gp + t0 * n * n, op + t0 * n * n,
                                   static_cast<int>(std::min<int64_t>(kBlock, N - t0)));
      }
    });
    return 0;
  });
  return out;
}

// What this header adds to the module.
void register_mhc(pybind11::module_& m) {
  m.def("maps_in", &maps_in);
  m.def("maps_backward", &maps_backward);
  m.def("maps_in_basis", &maps_in_basis);
  m.def("maps_in_copies", &maps_in_copies);
  m.def("maps_backward_copies", &maps_backward_copies);
  m.def("maps_backward_basis", &maps_backward_basis);
  m.def("coef_mix", &coef_mix);
  m.def("coef_mix_backward", &coef_mix_backward);
  m.def("basis_mean", &basis_mean);
  m.def("basis_mean_backward", &basis_mean_backward);
  m.def("row_error", &row_error);
  m.def("stream_mix", &stream_mix);
  m.def("stream_mix_backward", &stream_mix_backward);
  m.def("copies_mix", &copies_mix);
  m.def("collapse_mix", &collapse_mix);
  m.def("collapse_mix_backward", &collapse_mix_backward);
  m.def("copies_mix_backward", &copies_mix_backward);
  m.def("sinkhorn", &sinkhorn, py::arg("maps"), py::arg("iters"), py::arg("tol"), py::arg("newton") = 0);
  m.def("sinkhorn_backward", &sinkhorn_backward);
}
TRAINER_KERNELS(register_mhc);

}  // namespace sasrec_mhc
