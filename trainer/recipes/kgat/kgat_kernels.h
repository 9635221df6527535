// KGAT's kernels (trainer/recipes/kgat/model.py, trainer/engine/optim.py): attention scores over the edges, the
// per-row softmax, and Adam on a sparse gradient's rows.
// Stands alone (its includes are paths from trainer/recipes/, the root kernels.py states); registers its
// functions with TRAINER_KERNELS at the end, so the module picks it up with no shared file edited.
#pragma once

#include "cpu_common.h"

namespace kgat_kernels {
using namespace trainer_cpu;

// KGAT's attention scores: out[e] = <a[ia[e]], b[ib[e]]> for (Na, D) and (Nb, D) row tables and int32 row
// indices. One pass over the edges reading two rows each, where torch gathered both into (E, D) copies,
// multiplied them into a third and summed it (four passes over E x D floats).
// The rows are prefetched kAhead edges ahead: once a relation's tables outgrow the core's L2 (amazon-book's full
// size), each random row waited on L3, and the edge pass took 1.4x as long per edge as at 1/8 of the size.
constexpr int64_t kAhead = 16;
torch::Tensor gather_dot(torch::Tensor a, torch::Tensor ia, torch::Tensor b, torch::Tensor ib) {
  check(a, "a", 2), check(b, "b", 2);
  TORCH_CHECK(ia.device().is_cpu() && ib.device().is_cpu() && ia.scalar_type() == torch::kInt &&
                  ib.scalar_type() == torch::kInt && ia.is_contiguous() && ib.is_contiguous() &&
                  ia.dim() == 1 && ib.sizes() == ia.sizes(),
              "kernels.gather_dot: ia and ib must be contiguous int32 CPU vectors of one length");
  const int64_t E = ia.size(0), D = a.size(1), na = a.size(0), nb = b.size(0);
  TORCH_CHECK(b.size(1) == D, "kernels.gather_dot: a and b must have the same width");
  auto out = torch::empty({E}, a.options());
  const float *__restrict__ ap = a.data_ptr<float>(), *__restrict__ bp = b.data_ptr<float>();
  const int32_t *__restrict__ iap = ia.data_ptr<int32_t>(), *__restrict__ ibp = ib.data_ptr<int32_t>();
  float* __restrict__ op = out.data_ptr<float>();
  std::atomic<bool> bad{false};
  at::parallel_for(0, E, 2048, [&](int64_t lo, int64_t hi) {
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t i = iap[e], j = ibp[e];
      if (i < 0 || i >= na || j < 0 || j >= nb) {
        bad = true;
        return;
      }
      if (e + kAhead < hi) {             // the rows kAhead edges on, on their way while this pair is summed
        const int64_t i2 = iap[e + kAhead], j2 = ibp[e + kAhead];
        if (i2 >= 0 && i2 < na && j2 >= 0 && j2 < nb)
          for (int64_t c = 0; c < D; c += 16) {
            __builtin_prefetch(ap + i2 * D + c);
            __builtin_prefetch(bp + j2 * D + c);
          }
      }
      op[e] = dot(ap + i * D, bp + j * D, D);
    }
  });
  TORCH_CHECK(!bad, "kernels.gather_dot: a row index is out of range");
  return out;
}

// Adam (AdamW when decoupled) on the rows of a sparse gradient, in place on the (n, D) parameter and its two
// moment tables, for an uncoalesced gradient (indices int64 (R), values (R, D)): the repeated rows' values are
// summed (in their order), then each distinct row is updated in one pass over its three table rows, the next
// rows prefetched. torch's path (trainer/engine/optim.py adam_rows_) coalesced the gradient (a sort, 0.9 ms for
// a 6k-row KG batch), gathered the three tables' rows and scattered them back: 4.4 ms a step at amazon-book's
// size on one thread, 2.6 ms at 1/8 (the scatters into 47 MB tables missing the cache). grad_scale divides the
// values (a GradScaler's); step is the step count after this step.
void adam_rows_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor idx, torch::Tensor vals, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool decoupled, double step,
                double grad_scale) {
  check(p, "param", 2), check(m, "exp_avg", 2), check(v, "exp_avg_sq", 2), check(vals, "values", 2);
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == torch::kLong && idx.is_contiguous() && idx.dim() == 1 &&
                  idx.size(0) == vals.size(0) && m.sizes() == p.sizes() && v.sizes() == p.sizes() &&
                  vals.size(1) == p.size(1),
              "kernels.adam_rows_: a (n, D) parameter and moments, int64 indices (R) and values (R, D)");
  const int64_t R = idx.size(0), D = p.size(1), n = p.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t k = 0; k < R; ++k) TORCH_CHECK(ip[k] >= 0 && ip[k] < n, "kernels.adam_rows_: row ", ip[k], " of ", n);
  std::vector<int64_t> order(R);
  if (R < (int64_t{1} << 24) && n < (int64_t{1} << 39)) {   // (row, position) in one key: a plain sort, 2x faster
    for (int64_t k = 0; k < R; ++k) order[k] = ip[k] << 24 | k;
    std::sort(order.begin(), order.end());
    for (int64_t k = 0; k < R; ++k) order[k] &= (int64_t{1} << 24) - 1;
  } else {
    for (int64_t k = 0; k < R; ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[a] < ip[b]; });
  }
  std::vector<int64_t> starts;
  for (int64_t k = 0; k < R; ++k)
    if (k == 0 || ip[order[k]] != ip[order[k - 1]]) starts.push_back(k);
  starts.push_back(R);
  const int64_t U = static_cast<int64_t>(starts.size()) - 1;
  float *__restrict__ pp = p.data_ptr<float>(), *__restrict__ mp = m.data_ptr<float>(), *__restrict__ vp = v.data_ptr<float>();
  const float* __restrict__ gp = vals.data_ptr<float>();
  const float b1 = beta1, b2 = beta2, fe = eps, wd = weight_decay, scale = grad_scale;
  const float bc2 = 1.0 - std::pow(beta2, step), step_size = lr / (1.0 - std::pow(beta1, step));
  const float decay = 1.0 - lr * weight_decay;
  at::parallel_for(0, U, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> g(D);
    for (int64_t u = lo; u < hi; ++u) {
      if (u + 8 < hi) {                                   // the row 8 on, on its way while this one is updated
        const int64_t ahead = ip[order[starts[u + 8]]] * D;
        for (int64_t c = 0; c < D; c += 16) {
          __builtin_prefetch(pp + ahead + c, 1);
          __builtin_prefetch(mp + ahead + c, 1);
          __builtin_prefetch(vp + ahead + c, 1);
        }
      }
      const int64_t row = ip[order[starts[u]]];
      std::memcpy(g.data(), gp + order[starts[u]] * D, D * sizeof(float));
      for (int64_t k = starts[u] + 1; k < starts[u + 1]; ++k) {
        const float* gk = gp + order[k] * D;
        for (int64_t d = 0; d < D; ++d) g[d] += gk[d];
      }
      float *__restrict__ x = pp + row * D, *__restrict__ mr = mp + row * D, *__restrict__ vr = vp + row * D;
      float* __restrict__ gr = g.data();
      if (scale != 1.f)                                   // (the branches outside the loop that vectorises)
        for (int64_t d = 0; d < D; ++d) gr[d] /= scale;
      if (wd != 0.f && decoupled)
        for (int64_t d = 0; d < D; ++d) x[d] *= decay;
      else if (wd != 0.f)
        for (int64_t d = 0; d < D; ++d) gr[d] += wd * x[d];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const float gd = gr[d], md = mr[d] * b1 + (1.f - b1) * gd, vd = vr[d] * b2 + (1.f - b2) * gd * gd;
        mr[d] = md, vr[d] = vd;
        x[d] -= step_size * md / (std::sqrt(vd / bc2) + fe);
      }
    }
  });
}

// KGAT's attention normalisation: the softmax of scores within each row's edges crow[i] .. crow[i + 1] - 1
// (edges sorted by head), one row at a time in cache; torch's scatter max, gather, exp, scatter sum, gather
// and divide were six passes over the edges with random access into node-sized tables.
torch::Tensor segment_softmax(torch::Tensor scores, torch::Tensor crow) {
  check(scores, "scores", 1);
  TORCH_CHECK(crow.device().is_cpu() && crow.scalar_type() == torch::kLong && crow.is_contiguous() &&
                  crow.dim() == 1 && crow.size(0) >= 1,
              "kernels.segment_softmax: crow must be a contiguous int64 CPU vector");
  const int64_t rows = crow.size(0) - 1, E = scores.size(0);
  const int64_t* __restrict__ cp = crow.data_ptr<int64_t>();
  TORCH_CHECK(cp[0] == 0 && cp[rows] == E, "kernels.segment_softmax: crow must run from 0 to the edge count");
  auto out = torch::empty_like(scores);
  const float* __restrict__ sp = scores.data_ptr<float>();
  float* __restrict__ op = out.data_ptr<float>();
  at::parallel_for(0, rows, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t a = cp[i], b = cp[i + 1];
      if (b <= a) continue;
      float mx = -INFINITY, total = 0.f;
      for (int64_t e = a; e < b; ++e) mx = std::max(mx, sp[e]);
#pragma omp simd reduction(+ : total)
      for (int64_t e = a; e < b; ++e) total += op[e] = exp_neg(sp[e] - mx);
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t e = a; e < b; ++e) op[e] *= inv;
    }
  });
  return out;
}

// What this header adds to the module.
void register_kgat(pybind11::module_& m) {
  m.def("gather_dot", &gather_dot);
  m.def("segment_softmax", &segment_softmax);
  m.def("adam_rows_", &adam_rows_);
}
TRAINER_KERNELS(register_kgat);

}  // namespace kgat_kernels
