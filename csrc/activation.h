// The activation of the gated MLP, down(act(gate) * up): the `activation` argument of
// swiglu_fwd / swiglu_bwd and of the decoder layer.
//   "silu"       act(g) = g sigmoid(g)                                       LLaMA's SwiGLU
//   "gelu_tanh"  act(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))       Gemma's GeGLU
//                (torch's gelu(approximate="tanh"), HF's "gelu_pytorch_tanh")
// Both are computed in the compute dtype (float32; float64 for float64), as ATen's silu / gelu.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <c10/util/string_view.h>

#include <string>

#include "checks.h"

namespace ckpt_ext {

enum class Activation { kSilu, kGeluTanh };

inline Activation parse_activation(c10::string_view name, const char* op) {
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  CKPT_CHECK_VALUE(false, op, "activation must be one of 'silu', 'gelu_tanh', got '",
                   std::string(name), "'");
}

// act(g) and, given grad = dL/d act(g), dL/dg = grad act'(g) (ATen's kernels).
inline at::Tensor activate(const at::Tensor& g, Activation act) {
  return act == Activation::kSilu ? at::silu(g) : at::gelu(g, "tanh");
}
inline at::Tensor activate_backward(const at::Tensor& grad, const at::Tensor& g, Activation act) {
  return act == Activation::kSilu ? at::silu_backward(grad, g)
                                  : at::gelu_backward(grad, g, "tanh");
}

// act(gate) * up in the compute dtype (the wider of gate's and up's), rounded to `dt`: the
// SwiGLU product that the down projection reads. gate, up (rows, I) in a float dtype.
inline at::Tensor swiglu_product(const at::Tensor& gate, const at::Tensor& up, at::ScalarType dt,
                                 Activation act) {
  const at::ScalarType cdt = at::promote_types(gate.scalar_type(), up.scalar_type());
  return activate(gate.to(cdt), act).mul_(up.to(cdt)).to(dt);
}

}  // namespace ckpt_ext
