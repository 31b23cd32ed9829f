// The activation of the gated MLP, down(act(gate) * up): the `activation` argument of
// swiglu_fwd / swiglu_bwd and of the decoder layer.
//   "silu"       act(g) = g sigmoid(g)                                       LLaMA's SwiGLU
//   "gelu_tanh"  act(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))       Gemma's GeGLU
//                (torch's gelu(approximate="tanh"), HF's "gelu_pytorch_tanh")
// Both are computed in the compute dtype (float32; float64 for float64), as ATen's silu / gelu.
#pragma once

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

}  // namespace ckpt_ext
