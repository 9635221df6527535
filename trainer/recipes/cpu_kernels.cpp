// The CPU kernels' one module (float32, contiguous), built by `make setup` or on first use
// (trainer/recipes/kernels.py): each recipe's kernels live in its folder and are included here, so the module
// compiles once, as one unit; the shared helpers are cpu_common.h, the shared dropout dropout_kernels.h.
#include "cpu_common.h"
#include "sasrec/mhc_kernels.h"
#include "kgat/kgat_kernels.h"
#include "dropout_kernels.h"
#include "sasrec/attention_kernels.h"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
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
  m.def("dropout", &dropout);
  m.def("sinkhorn", &sinkhorn, py::arg("maps"), py::arg("iters"), py::arg("tol"), py::arg("newton") = 0);
  m.def("sinkhorn_backward", &sinkhorn_backward);
  m.def("attention", &attention);
  m.def("has_blas", &has_blas);
  m.def("gather_dot", &gather_dot);
  m.def("segment_softmax", &segment_softmax);
  m.def("adam_rows_", &adam_rows_);
  m.def("attention_backward", &attention_backward);
}
