// The Python module ckpt_ext._C: loading it registers every TORCH_LIBRARY block of the
// extension; the functions bound here are the pieces that cannot go through the dispatcher
// (the segment checkpoint takes a Python callable).
//
// It binds no tensor, so it needs pybind11 alone (and its STL casters), not
// <torch/extension.h>, which alone took minutes of a two-core build.
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
namespace layer {
void set_streamed_input_check(bool on);
}
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_ext C++ extension: op schemas, CPU kernels, C++ autograd Functions";
#ifdef CKPT_EXT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  ckpt_ext::bind_checkpoint(m);
  m.def("set_streamed_input_check", &ckpt_ext::layer::set_streamed_input_check,
        pybind11::arg("on"),
        "Test hook: every fused layer backward reads its input as one streamed from host "
        "memory (token chunks copied as the walk reads them, the input's stand-in a NaN), also "
        "when the input is on the layer's device (the CPU tests' way to run that path)");
  m.def("layer_weight_slots", &ckpt_ext::layer_weight_slots,
        "The slot names of decoder_layer's weights list, in order");
  m.def("chunk_bytes", &ckpt_ext::chunking::chunk_bytes,
        "The byte cap of one token chunk's transient (ckpt_ext.config's chunk_bytes)");
  m.def("set_chunk_bytes", &ckpt_ext::chunking::set_chunk_bytes, pybind11::arg("bytes"),
        "Set the byte cap (ckpt_ext.config does, at each change of chunk_bytes)");
  // The layer's chunk rows, by its FFN's sizes: dense (intermediate = I) by default; an MoE
  // FFN with top_k > 0 (intermediate: its shared expert's, 0 without one).
  m.def(
      "layer_chunk_rows",
      [](int64_t q_width, int64_t intermediate, int64_t element_size, int64_t cap,
         int64_t hidden, int64_t experts, int64_t top_k, int64_t expert_intermediate,
         int64_t min_rows) {
        namespace ch = ckpt_ext::chunking;
        return ch::layer_chunk_rows(
            q_width, ch::ffn_row_width(intermediate, hidden, experts, top_k, expert_intermediate),
            element_size, cap, min_rows);
      },
      pybind11::arg("q_width"), pybind11::arg("intermediate"), pybind11::arg("element_size"),
      pybind11::arg("cap"), pybind11::kw_only(), pybind11::arg("hidden") = 0,
      pybind11::arg("experts") = 0, pybind11::arg("top_k") = 0,
      pybind11::arg("expert_intermediate") = 0, pybind11::arg("min_rows") = 0,
      "Tokens per chunk of the fused layer (intermediate 0 and top_k 0: the attention "
      "sublayer; top_k > 0: an MoE FFN of `experts` experts of expert_intermediate, hidden H), "
      "at least min_rows (cuda_min_rows on CUDA)");
  m.def("occupancy_min_rows", &ckpt_ext::chunking::occupancy_min_rows, pybind11::arg("sms"),
        pybind11::arg("heads"), pybind11::arg("tile_rows") = ckpt_ext::chunking::kAttentionTileRows,
        pybind11::arg("waves") = ckpt_ext::chunking::kOccupancyWaves,
        "The fewest query rows per layer chunk giving `waves` waves of attention programs on "
        "`sms` multiprocessors with `heads` query heads (0: no minimum)");
  m.def("cuda_sms", &ckpt_ext::chunking::cuda_sms,
        "The CUDA multiprocessors the layer's chunk rows read (0 until set)");
  m.def("set_cuda_sms", &ckpt_ext::chunking::set_cuda_sms, pybind11::arg("sms"),
        "Set the CUDA multiprocessors (ckpt_ext.blocks does, at the first CUDA layer call)");
  m.def(
      "mlp_chunk_rows",
      [](int64_t intermediate, int64_t element_size, int64_t cap, int64_t hidden,
         int64_t experts, int64_t top_k, int64_t expert_intermediate, int64_t min_rows) {
        namespace ch = ckpt_ext::chunking;
        return ch::mlp_chunk_rows(
            ch::ffn_row_width(intermediate, hidden, experts, top_k, expert_intermediate),
            element_size, cap, min_rows);
      },
      pybind11::arg("intermediate"), pybind11::arg("element_size"), pybind11::arg("cap"),
      pybind11::kw_only(), pybind11::arg("hidden") = 0, pybind11::arg("experts") = 0,
      pybind11::arg("top_k") = 0, pybind11::arg("expert_intermediate") = 0,
      pybind11::arg("min_rows") = 0,
      "Tokens per chunk of the fused layer's FFN (MoE sizes as for layer_chunk_rows), at "
      "least min_rows (gemm_min_rows on CUDA)");
  m.attr("gemm_min_rows") = ckpt_ext::chunking::kGemmMinRows;
  m.def("cuda_min_rows", &ckpt_ext::chunking::cuda_min_rows, pybind11::arg("sms"),
        pybind11::arg("heads"),
        "The fewest rows per layer chunk on CUDA: occupancy_min_rows and gemm_min_rows");
  m.def("ffn_row_width", &ckpt_ext::chunking::ffn_row_width, pybind11::arg("intermediate"),
        pybind11::kw_only(), pybind11::arg("hidden") = 0, pybind11::arg("experts") = 0,
        pybind11::arg("top_k") = 0, pybind11::arg("expert_intermediate") = 0,
        "Elements one token holds in a chunk of the layer's FFN at the compute width "
        "(csrc/chunking.h ffn_row_width; MoE sizes as for layer_chunk_rows)");
  m.def("swiglu_buffers", &ckpt_ext::chunking::swiglu_buffers, pybind11::arg("backward"),
        pybind11::arg("gate_up"),
        "The CPU SwiGLU's (rows, I) buffers per chunk (gate_up: it returns gate/up in forward, "
        "is given them in backward)");
  m.def("swiglu_chunk_rows", &ckpt_ext::chunking::swiglu_chunk_rows,
        pybind11::arg("intermediate"), pybind11::arg("buffers"), pybind11::arg("element_size"),
        pybind11::arg("cap"), "Tokens per chunk of the CPU SwiGLU MLP");
  m.def("lce_chunk_rows", &ckpt_ext::chunking::lce_chunk_rows, pybind11::arg("vocab"),
        pybind11::arg("element_size"), pybind11::arg("buffers"), pybind11::arg("cap"),
        "Tokens per chunk of the CPU linear cross-entropy's (rows, V) logits");
  m.def(
      "chunk_sum",
      [](bool chunked, bool half_operands, bool cuda, bool fp32_out_ok) -> std::string {
        switch (ckpt_ext::chunking::chunk_sum(chunked, half_operands, cuda, fp32_out_ok)) {
          case ckpt_ext::chunking::ChunkSum::kProduct: return "product";
          case ckpt_ext::chunking::ChunkSum::kInGemm: return "in_gemm";
          case ckpt_ext::chunking::ChunkSum::kAddAfter: break;
        }
        return "add_after";
      },
      pybind11::arg("chunked"), pybind11::arg("half_operands"), pybind11::arg("cuda"),
      pybind11::arg("fp32_out_ok"),
      "How the fused layer sums a token chunk's gradient product (csrc/chunking.h chunk_sum): "
      "'product' (one chunk), 'in_gemm' (addmm into the float32 sum), 'add_after'");
  m.def("layer_residuals", &ckpt_ext::layer_residuals, pybind11::arg("part"),
        pybind11::arg("preset"), pybind11::arg("moe") = false,
        "The names of the residuals decoder_layer_fwd returns for (part, preset), in order "
        "(moe: for a mixture-of-experts MLP, num_experts_per_tok > 0)");
}
