// The helpers every CPU kernel shares (float32, contiguous): argument checks, dot products in vector registers,
// a vectorisable exp, compile-time dispatch on small sizes; and the registry through which each kernel header adds
// its functions to the module (TRAINER_KERNELS), so the module's init (written by kernels.py) edits nothing shared.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace trainer_cpu {

constexpr int64_t kGrain = 64;    // tokens per parallel chunk
constexpr int kLanes = 32;        // Sinkhorn maps per vectorised chunk (maps last, as in the PyTorch path); 32 took
                                  // 0.75-0.96x the time of 64 at n = 4 (interleaved, 11.8k maps), 16 up to 1.3x
static_assert(kLanes % 16 == 0, "the Sinkhorn chunks are gathered 16 maps at a time");
constexpr int kBlock = 16;        // maps_in's tokens per vectorised exponential (one v16f below)

inline void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == dim,
              "kernels: ", name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
}

// <a, b> over D floats; the pragma lets the compiler reorder the sum into vector lanes (OpenMP simd).
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// out[i * m + j] = <a_i, b_j> for n rows a_i (stride D) and m rows b_j: partial sums in n * m 8-float vector
// registers (GCC/Clang vector type) over the width, reduced once at the end (a dot() per pair reloaded a_i
// and reduced every pair; 16-float registers with a shuffle-tree reduction measured slower).
template <int n, int m>
inline void dots(const float* __restrict__ a, const float* const (&b)[m], int64_t D, float* out) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 acc[n][m];
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < m; ++j) acc[i][j] = v8{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    v8 bv[m];
    for (int j = 0; j < m; ++j) std::memcpy(&bv[j], b[j] + d, sizeof(v8));
    for (int i = 0; i < n; ++i) {
      v8 av;
      std::memcpy(&av, a + i * D + d, sizeof(v8));
      for (int j = 0; j < m; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < m; ++j) {
      const v8 v = acc[i][j];
      float s = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
      for (int64_t e = d; e < D; ++e) s += a[i * D + e] * b[j][e];
      out[i * m + j] = s;
    }
}

// exp(x) for x <= 0 by range reduction and a degree-6 polynomial (Cephes' expf, ~1 ulp), written so the
// compiler vectorises a loop of it: libm's expf is a scalar call (24 per token were half of maps_in).
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;   // 2^k (k >= -126 after the clamp)
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp_neg over kBlock = 16 lanes in one vector (GCC/Clang vector types): the same steps, but the compiler did
// not vectorise a loop of exp_neg (its floor and bit cast stayed scalar).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static_assert(sizeof(v16f) == kBlock * sizeof(float), "maps_in's token block is one v16f");
inline v16f exp_neg16(v16f x) {
  x = x < -87.f ? v16f{} - 87.f : x;
  const v16f y = x * 1.44269504088896341f + 0.5f;
  v16i ki = __builtin_convertvector(y, v16i);                       // truncation, then down to the floor
  ki += __builtin_convertvector(ki, v16f) > y;                     // (true is -1)
  const v16f k = __builtin_convertvector(ki, v16f);
  const v16f r = x - k * 0.693359375f + k * 2.12194440e-4f;
  v16f p = v16f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v16i bits = (ki + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Calls f(std::integral_constant<int, v>) for v one of First, Rest..., so that the per-token loops over streams
// (or basis vectors) unroll and the loops over the width vectorise.
template <int First, int... Rest, typename F>
auto with_constant(int64_t v, const char* what, const char* built, F&& f) {
  if (v == First) return f(std::integral_constant<int, First>{});
  if constexpr (sizeof...(Rest) > 0) {
    return with_constant<Rest...>(v, what, built, f);
  } else {
    TORCH_CHECK(false, "kernels: ", v, " ", what, " (built for ", built, ")");
    return f(std::integral_constant<int, First>{});   // (not reached: the check throws)
  }
}

// Each kernel header registers a function that adds its kernels to the module; the module's init calls them all.
using Registrar = void (*)(pybind11::module_&);
inline std::vector<Registrar>& registrars() {
  static std::vector<Registrar> all;
  return all;
}
struct Registered {
  explicit Registered(Registrar add) { registrars().push_back(add); }
};
inline void register_all(pybind11::module_& m) {
  for (Registrar add : registrars()) add(m);
}

// The hash-mask dropout's random stream (dropout_kernels.inc, SASRec's attention): murmur3's 32-bit finaliser on a Weyl sequence: a counter-based random stream (element i of a call draws
// fmix32(i * golden + seed)); 32-bit lanes, so a loop of it vectorises 16 wide (splitmix64's 64-bit
// multiplies ran the loop at 1.4 ns per element, slower than torch's generator).
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

}  // namespace trainer_cpu

// At a kernel fragment's end: TRAINER_KERNELS(register_mine); registers register_mine when the module loads. The
// fragments share one translation unit (kernels.py writes it), so each registrar runs once; their order is the
// include order, which nothing depends on (each adds functions of its own names).
#define TRAINER_KERNELS(registrar) static const ::trainer_cpu::Registered registrar##_registered{registrar}
