// The Python module ckpt_ext._C: loading it registers every TORCH_LIBRARY block of the
// extension; the functions bound here are the pieces that cannot go through the dispatcher
// (the segment checkpoint takes a Python callable).
//
// It binds no tensor, so it needs pybind11 alone (and its STL casters), not
// <torch/extension.h>, which alone took minutes of a two-core build.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "chunking.h"

namespace ckpt_ext {
void bind_checkpoint(pybind11::module& m);
std::vector<std::string> layer_weight_slots();
std::vector<std::string> layer_residuals(const std::string& part, const std::string& preset,
                                         bool moe);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_ext C++ extension: op schemas, CPU kernels, C++ autograd Functions";
#ifdef CKPT_EXT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  ckpt_ext::bind_checkpoint(m);
  m.def("layer_weight_slots", &ckpt_ext::layer_weight_slots,
        "The slot names of decoder_layer's weights list, in order");
  m.def(
      "chunk_bytes",
      [] {
        try {
          return ckpt_ext::chunking::chunk_bytes();
        } catch (const c10::ValueError& e) {
          throw pybind11::value_error(e.what_without_backtrace());
        }
      },
      "The byte cap of one token chunk's transient (CKPT_EXT_CHUNK_BYTES, read at each call; "
      "64 MiB by default)");
  m.def("layer_residuals", &ckpt_ext::layer_residuals, pybind11::arg("part"),
        pybind11::arg("preset"), pybind11::arg("moe") = false,
        "The names of the residuals decoder_layer_fwd returns for (part, preset), in order "
        "(moe: for a mixture-of-experts MLP, num_experts_per_tok > 0)");
}
