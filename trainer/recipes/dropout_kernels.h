// The hash-mask dropout (trainer/recipes/dropout.py), shared: a counter-based random stream, so the backward
// recomputes the mask from its seed (SASRec's attention kernel draws its mask the same way).
// Stands alone (its includes are paths from trainer/recipes/, the root kernels.py states); registers its
// functions with TRAINER_KERNELS at the end, so the module picks it up with no shared file edited.
#pragma once

#include "cpu_common.h"

namespace dropout_kernels {
using namespace trainer_cpu;

// murmur3's 32-bit finaliser on a Weyl sequence: a counter-based random stream (element i of a call draws
// fmix32(i * golden + seed)); 32-bit lanes, so a loop of it vectorises 16 wide (splitmix64's 64-bit
// multiplies ran the loop at 1.4 ns per element, slower than torch's generator).
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Inverted dropout in one pass: out[i] = x[i] * scale if the top 15 bits of fmix32(i * golden + seed) are
// >= threshold (p = threshold / 32768, as trainer/recipes/dropout.py's keep_mask), else 0. The backward is
// the same call on the gradient with the same seed: no mask is stored.
torch::Tensor dropout(torch::Tensor x, int64_t seed, int64_t threshold, double scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "kernels.dropout: a contiguous float32 CPU tensor");
  auto out = torch::empty_like(x);
  const float* __restrict__ xp = x.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  const uint32_t base = static_cast<uint32_t>(seed) ^ static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  const uint32_t thr = static_cast<uint32_t>(threshold);
  const float s = static_cast<float>(scale);
  at::parallel_for(0, x.numel(), 16384, [&](int64_t b, int64_t e) {
    const float* __restrict__ in = xp;
    float* __restrict__ o = op;
    for (int64_t i = b; i < e; ++i) {
      const uint32_t field = fmix32(static_cast<uint32_t>(i) * 0x9E3779B9u + base) >> 17;
      const float v = in[i] * s;            // loaded unconditionally: a masked load kept the loop scalar
      o[i] = field >= thr ? v : 0.f;
    }
  });
  return out;
}

// What this header adds to the module.
void register_dropout(pybind11::module_& m) {
  m.def("dropout", &dropout);
}
TRAINER_KERNELS(register_dropout);

}  // namespace dropout_kernels
