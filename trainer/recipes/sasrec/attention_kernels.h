// SASRec's training attention over packed sequences with dropout, and its gradient (trainer/recipes/sasrec/
// fused.py), on the BLAS's sgemm where torch's library exports it.
// Stands alone (its includes are paths from trainer/recipes/, the root kernels.py states); registers its
// functions with TRAINER_KERNELS at the end, so the module picks it up with no shared file edited.
#pragma once

#include "cpu_common.h"
#include "dropout_kernels.h"

namespace sasrec_attention {
using namespace trainer_cpu;
using dropout_kernels::fmix32;     // the mask's random stream: the same draws as the dropout kernel's

// Causal self-attention with dropout over packed sequences: the real (non-padded) positions of a batch, row
// after row, as the (N, 3, H, dh) output of the Q/K/V projection, and starts (B + 1: row b's tokens are
// starts[b] .. starts[b + 1] - 1). One (row, head) at a time with its L x L scores in cache: in PyTorch the
// (B, H, T, T) scores, probabilities, dropout mask and their gradients were each written to memory and read
// back, padded positions included; reading q, k, v where the projection left them (row stride 3 H dh) and
// scaling inside the products saves the copies and the scaling passes. The backward recomputes the scores from
// q and k and the rows' log-sum-exps, and the mask from its seed, and writes one (N, 3, H, dh) gradient.
// A token sees the tokens of its row up to itself (model.py's attention_bias on the real positions).
// Dropout keeps element (bh, i, j) (bh = b H + head) when the top 15 bits of
// fmix32(((bh T + i) T + j) golden + seed) are >= threshold, and scales the kept ones by `factor`.
struct Attn {
  int64_t T, H, dh;
  float scale;
  uint32_t base, thr;
  float factor;

  // the counter of element (bh, i, 0); element j's is row + j (mod 2^32)
  uint32_t row(int64_t bh, int64_t i) const { return static_cast<uint32_t>((bh * T + i) * T); }
  bool kept(uint32_t row, uint32_t j) const { return (fmix32((row + j) * 0x9E3779B9u + base) >> 17) >= thr; }
  // offsets of token t's q (part 0), k (1), v (2) of head h in (N, 3, H, dh), and of its output in (N, H, dh)
  int64_t in(int64_t t, int64_t part, int64_t h) const { return ((t * 3 + part) * H + h) * dh; }
  int64_t out(int64_t t, int64_t h) const { return (t * H + h) * dh; }
};

Attn make_attn(const torch::Tensor& qkv, const torch::Tensor& starts, int64_t T, double scale, int64_t seed,
               int64_t threshold, double factor) {
  check(qkv, "qkv", 4);
  TORCH_CHECK(qkv.size(1) == 3, "kernels.attention: qkv must be (N, 3, H, dh)");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == torch::kLong && starts.is_contiguous() &&
              starts.size(0) >= 1, "kernels.attention: starts must be a contiguous int64 vector");
  const int64_t* st = starts.data_ptr<int64_t>();
  for (int64_t b = 0; b + 1 < starts.size(0); ++b)
    TORCH_CHECK(st[b] >= 0 && st[b] <= st[b + 1] && st[b + 1] - st[b] <= T, "kernels.attention: row ", b,
                " spans tokens ", st[b], " to ", st[b + 1], " (at most T = ", T, ")");
  TORCH_CHECK(st[0] == 0 && st[starts.size(0) - 1] == qkv.size(0), "kernels.attention: starts do not cover the ",
              qkv.size(0), " tokens");
  return Attn{T, qkv.size(2), qkv.size(3), static_cast<float>(scale),
              static_cast<uint32_t>(seed) ^ static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32),
              static_cast<uint32_t>(threshold), static_cast<float>(factor)};
}

// exp(x) of a score minus its row's maximum or log-sum-exp; below e^-80 counts as 0 against a row sum >= 1.
// Branch-free, so the row loops vectorise.
inline float row_exp(float x) {
  const float e = exp_neg(std::min(x, 0.f));
  return x < -80.f ? 0.f : e;
}

// The BLAS's Fortran sgemm_ where torch's library exports it (MKL in the x86 wheels), looked up at run time:
// a per-sequence product is ~2 MFLOP, and an ATen call around it cost a tenth of that again.
// TRAINER_KERNEL_SGEMM=0 takes ATen's path (what builds without an exported sgemm_ run; tested that way).
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);
sgemm_fn blas_sgemm() {
  static const sgemm_fn f = []() -> sgemm_fn {
    const char* off = std::getenv("TRAINER_KERNEL_SGEMM");
    if (off && std::strcmp(off, "0") == 0) return nullptr;
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);     // loaded already: torch is imported
    void* sym = lib ? dlsym(lib, "sgemm_") : nullptr;
    return reinterpret_cast<sgemm_fn>(sym ? sym : dlsym(RTLD_DEFAULT, "sgemm_"));
  }();
  return f;
}

bool has_blas() { return blas_sgemm() != nullptr; }

// Row-major C (M x N, ldc) = alpha op(A) op(B) + beta C, as the column-major C^T = op(B)^T op(A)^T.
void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
        const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (const sgemm_fn f = blas_sgemm()) {
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    f(tb ? "T" : "N", ta ? "T" : "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  auto a = torch::from_blob(const_cast<float*>(A), {ta ? K : M, ta ? M : K}, {lda, 1}, opts);
  auto b = torch::from_blob(const_cast<float*>(B), {tb ? N : K, tb ? K : N}, {ldb, 1}, opts);
  auto c = torch::from_blob(C, {M, N}, {ldc, 1}, opts);
  at::addmm_out(c, c, ta ? a.t() : a, tb ? b.t() : b, beta, alpha);
}

// The causal blocks of an L x L product: the first half of the rows needs only the first half of the columns
// (model.py's causal_blocks), a quarter of the work skipped.
inline int64_t causal_half(int64_t L) { return L >= 64 ? L / 2 : 0; }

// S (L x L, row stride L) = alpha A B^T over the causal blocks, for A, B (L x dh, row strides lda, ldb).
void causal_abt(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t L, int64_t dh, float alpha,
                float* S) {
  const int64_t h = causal_half(L);
  if (h) mm(false, true, h, h, dh, alpha, A, lda, B, ldb, 0.f, S, L);
  mm(false, true, L - h, L, dh, alpha, A + h * lda, lda, B, ldb, 0.f, S + h * L, L);
}

// Out (L x dh, row stride ldo) = alpha P X over the causal blocks (P lower triangular, L x L; X row stride ldx),
// or alpha P^T X.
void causal_px(bool transpose, const float* P, const float* X, int64_t L, int64_t dh, int64_t ldx, float alpha,
               float* Out, int64_t ldo) {
  const int64_t h = causal_half(L);
  if (!transpose) {
    if (h) mm(false, false, h, dh, h, alpha, P, L, X, ldx, 0.f, Out, ldo);
    mm(false, false, L - h, dh, L, alpha, P + h * L, L, X, ldx, 0.f, Out + h * ldo, ldo);
    return;
  }
  mm(true, false, L, dh, L - h, alpha, P + h * L, L, X + h * ldx, ldx, 0.f, Out, ldo);
  if (h) mm(true, false, h, dh, h, alpha, P, L, X, ldx, 1.f, Out, ldo);
}

// Calls f(bh, L, t0) for every (row, head) in parallel: L its tokens, t0 its first token.
// The rows' costs (~L^2) differ a hundredfold, so they are dealt longest first to the least-loaded thread: an
// even split of the batch's rows left one thread ~10% more work on ml-100k's batches.
template <typename F>
void for_each_head(const Attn& a, const torch::Tensor& starts, F&& f) {
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t n = (starts.size(0) - 1) * a.H;
  const auto tokens = [&](int64_t bh) { return st[bh / a.H + 1] - st[bh / a.H]; };
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return tokens(x) > tokens(y); });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<double> load(threads, 0.0);
  for (const int64_t bh : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    const double L = static_cast<double>(tokens(bh));
    lists[t].push_back(bh);
    load[t] += L * L + 64.0 * L;              // the L x L maps, and the per-row work
  }
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (const int64_t bh : lists[t]) {
        const int64_t L = tokens(bh);
        if (L) f(bh, L, st[bh / a.H]);
      }
  });
}

// Returns (out (N, H, dh), lse (N, H)).
std::tuple<torch::Tensor, torch::Tensor> attention(torch::Tensor qkv, torch::Tensor starts, int64_t T, double scale,
                                                   int64_t seed, int64_t threshold, double factor) {
  const Attn a = make_attn(qkv, starts, T, scale, seed, threshold, factor);
  const int64_t N = qkv.size(0), ld = 3 * a.H * a.dh, ldo = a.H * a.dh;
  auto out = torch::empty({N, a.H, a.dh}, qkv.options());
  auto lse = torch::empty({N, a.H}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  for_each_head(a, starts, [&](int64_t bh, int64_t L, int64_t t0) {
    const int64_t h = bh % a.H;
    thread_local std::vector<float> buf;
    buf.resize(L * L);
    float* S = buf.data();
    causal_abt(x + a.in(t0, 0, h), ld, x + a.in(t0, 1, h), ld, L, a.dh, a.scale, S);
    for (int64_t i = 0; i < L; ++i) {
      float* __restrict__ r = S + i * L;
      float m = r[0];
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j <= i; ++j) m = std::max(m, r[j]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j <= i; ++j) {
        r[j] = row_exp(r[j] - m);
        sum += r[j];
      }
      const float inv = 1.f / sum;
      const uint32_t c = a.row(bh, i);
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) r[j] = a.kept(c, static_cast<uint32_t>(j)) ? r[j] * inv : 0.f;
      std::fill(r + i + 1, r + L, 0.f);
      lp[(t0 + i) * a.H + h] = m + std::log(sum);
    }
    causal_px(false, S, x + a.in(t0, 2, h), L, a.dh, ld, a.factor, op + a.out(t0, h), ldo);
  });
  return {out, lse};
}

// The gradient (N, 3, H, dh) of attention()'s qkv, given its output gradient g (N, H, dh) and lse.
torch::Tensor attention_backward(torch::Tensor g, torch::Tensor qkv, torch::Tensor starts, torch::Tensor lse,
                                 int64_t T, double scale, int64_t seed, int64_t threshold, double factor) {
  const Attn a = make_attn(qkv, starts, T, scale, seed, threshold, factor);
  check(g, "grad", 3), check(lse, "lse", 2);
  const int64_t ld = 3 * a.H * a.dh, ldo = a.H * a.dh;
  auto grad = torch::empty_like(qkv);
  const float *gp = g.data_ptr<float>(), *x = qkv.data_ptr<float>(), *lp = lse.data_ptr<float>();
  float* dx = grad.data_ptr<float>();
  for_each_head(a, starts, [&](int64_t bh, int64_t L, int64_t t0) {
    const int64_t h = bh % a.H;
    const float *Q = x + a.in(t0, 0, h), *K = x + a.in(t0, 1, h), *V = x + a.in(t0, 2, h), *G = gp + a.out(t0, h);
    thread_local std::vector<float> buf;
    buf.resize(3 * L * L);
    float *P = buf.data(), *dS = P + L * L, *Pd = dS + L * L;
    causal_abt(Q, ld, K, ld, L, a.dh, a.scale, P);
    causal_abt(G, ldo, V, ld, L, a.dh, 1.f, dS);                 // g V^T: the kept probabilities' gradient
    for (int64_t i = 0; i < L; ++i) {
      float *__restrict__ p = P + i * L, *__restrict__ ds = dS + i * L, *__restrict__ pd = Pd + i * L;
      const float l = lp[(t0 + i) * a.H + h];
      const uint32_t c = a.row(bh, i);
      float rowdot = 0.f;
#pragma omp simd reduction(+ : rowdot)
      for (int64_t j = 0; j <= i; ++j) {
        p[j] = row_exp(p[j] - l);
        const bool kept = a.kept(c, static_cast<uint32_t>(j));
        ds[j] = kept ? a.factor * ds[j] : 0.f;
        pd[j] = kept ? p[j] : 0.f;
        rowdot += p[j] * ds[j];
      }
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) ds[j] = p[j] * (ds[j] - rowdot);
      std::fill(ds + i + 1, ds + L, 0.f);
      std::fill(pd + i + 1, pd + L, 0.f);
    }
    causal_px(true, Pd, G, L, a.dh, ldo, a.factor, dx + a.in(t0, 2, h), ld);
    causal_px(false, dS, K, L, a.dh, ld, a.scale, dx + a.in(t0, 0, h), ld);
    causal_px(true, dS, Q, L, a.dh, ld, a.scale, dx + a.in(t0, 1, h), ld);
  });
  return grad;
}

// What this header adds to the module.
void register_attention(pybind11::module_& m) {
  m.def("attention", &attention);
  m.def("has_blas", &has_blas);
  m.def("attention_backward", &attention_backward);
}
TRAINER_KERNELS(register_attention);

}  // namespace sasrec_attention
