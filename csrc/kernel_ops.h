// The kernel ops that the C++ autograd Functions call through the dispatcher, one declaration
// per op: its C++ signature (matching the schema in csrc/ckpt_ext.cpp) and its name. Calling
// one, e.g. `kernel::rope_fwd(q, k, cos, sin)`, goes to whatever backend registered the op
// for these tensors (CPU ATen, Triton from Python, CUDA C++).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace ckpt_ext {
namespace kernel {

using OptTensor = std::optional<at::Tensor>;
using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// A dispatcher op of signature Sig, looked up on its first call (the schemas are registered
// when the library loads, after static initialisation may have run).
template <class Sig>
class KernelOp;

template <class R, class... A>
class KernelOp<R(A...)> {
 public:
  explicit KernelOp(const char* name) : name_(name) {}

  R operator()(A... args) const {
    std::call_once(once_, [this] {
      handle_.emplace(
          c10::Dispatcher::singleton().findSchemaOrThrow(name_, "").template typed<R(A...)>());
    });
    return handle_->call(std::forward<A>(args)...);
  }

 private:
  const char* name_;
  mutable std::once_flag once_;
  mutable std::optional<c10::TypedOperatorHandle<R(A...)>> handle_;
};

using Tensor = const at::Tensor&;

// (out, lse) = attention_fwd(q, k, v, key_padding_mask, segment_ids, window, causal, scale,
//                             q_offset, softcap)
//   (q_offset 0: q holds every query; softcap 0: no logit cap)
inline const KernelOp<T2(Tensor, Tensor, Tensor, const OptTensor&, const OptTensor&,
                         std::optional<int64_t>, bool, double, int64_t, double)>
    attention_fwd{"ckpt_ext::attention_fwd"};

// (dq, dk, dv) = attention_bwd(dout, q, k, v, out, lse, key_padding_mask, segment_ids,
//                              window, causal, scale, q_offset, dk_acc, dv_acc, softcap)
//   (dk_acc / dv_acc nullopt: dk, dv returned; given: added into them, dk, dv empty (0,))
inline const KernelOp<T3(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const OptTensor&,
                         const OptTensor&, std::optional<int64_t>, bool, double, int64_t,
                         const OptTensor&, const OptTensor&, double)>
    attention_bwd{"ckpt_ext::attention_bwd"};

// lora_dropout(x, seed, stream, p, row_offset)
inline const KernelOp<at::Tensor(Tensor, Tensor, int64_t, double, int64_t)> lora_dropout{
    "ckpt_ext::lora_dropout"};

// (y, gate, up) = swiglu_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down, lora,
//                            lora_scaling, return_gate_up, lora_dropout, dropout_seed,
//                            dropout_row_offset, dropout_streams, activation)
inline const KernelOp<T3(Tensor, Tensor, Tensor, Tensor, const OptTensor&, const OptTensor&,
                         const OptTensor&, const c10::List<OptTensor>&, c10::ArrayRef<double>,
                         bool, c10::ArrayRef<double>, const OptTensor&, int64_t,
                         c10::ArrayRef<int64_t>, c10::string_view)>
    swiglu_fwd{"ckpt_ext::swiglu_fwd"};

// (dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, dlora) = swiglu_bwd(dy, x, w_gate,
//     w_up, w_down, b_gate, b_up, b_down, lora, lora_scaling, gate, up, needs_grad,
//     lora_dropout, dropout_seed, dropout_row_offset, dropout_streams, activation,
//     dw_gate_sum, dw_up_sum, dw_down_sum, sum_beta, lora_a_gate_sum, lora_b_gate_sum,
//     lora_a_up_sum, lora_b_up_sum, lora_a_down_sum, lora_b_down_sum)
using SwigluGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor, std::vector<at::Tensor>>;
inline const KernelOp<SwigluGrads(Tensor, Tensor, Tensor, Tensor, Tensor, const OptTensor&,
                                  const OptTensor&, const OptTensor&,
                                  const c10::List<OptTensor>&, c10::ArrayRef<double>,
                                  const OptTensor&, const OptTensor&, const c10::List<bool>&,
                                  c10::ArrayRef<double>, const OptTensor&, int64_t,
                                  c10::ArrayRef<int64_t>, c10::string_view, const OptTensor&,
                                  const OptTensor&, const OptTensor&, double,
                                  const OptTensor&, const OptTensor&, const OptTensor&,
                                  const OptTensor&, const OptTensor&, const OptTensor&)>
    swiglu_bwd{"ckpt_ext::swiglu_bwd"};

// y = rms_norm_fwd(x, weight, eps); (dx, dweight) = rms_norm_bwd(dy, x, weight, eps)
inline const KernelOp<at::Tensor(Tensor, Tensor, double)> rms_norm_fwd{"ckpt_ext::rms_norm_fwd"};
inline const KernelOp<T2(Tensor, Tensor, Tensor, double)> rms_norm_bwd{"ckpt_ext::rms_norm_bwd"};

// (q_out, k_out) = rope_fwd(q, k, cos, sin); (dq, dk) = rope_bwd(dq_out, dk_out, cos, sin)
inline const KernelOp<T2(Tensor, Tensor, Tensor, Tensor)> rope_fwd{"ckpt_ext::rope_fwd"};
inline const KernelOp<T2(Tensor, Tensor, Tensor, Tensor)> rope_bwd{"ckpt_ext::rope_bwd"};

}  // namespace kernel
}  // namespace ckpt_ext
