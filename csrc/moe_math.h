// The mixture-of-experts MLP's routed part, on plain tensors (the decoder layer's glue, its
// slots and options: the MoE section of csrc/layer_math.cpp and csrc/layer_spec.h).
//
//   logits = m Wr^T (T, E);  scores = softmax or sigmoid of logits, in float32;
//   (idx, w) = top-k of scores, w divided by its sum with norm_topk_prob;
//   y = sum over the k choices j of w_j * down_e(act(gate_e(m)) * up_e(m)),  e = idx_j,
// with the experts in transformers 5's layout: gate_up (E, 2I, H), the gate's I rows first,
// then up's, and down (E, H, I). This is what HF's Qwen2/3-MoE, Mixtral and OLMoE blocks
// compute (a token's k outputs summed in expert order, as HF's loop over experts adds them).
//
// The (T * k) token copies are sorted by expert once per call (group); each expert's rows are
// then one contiguous block, and the expert GEMMs are torch._grouped_mm over those blocks
// (float32 / bfloat16 / float16 with 16-byte aligned rows), or one matmul per expert where it
// does not apply (float64, odd sizes). No (T, E, H or I) tensor is made: the largest are the
// sorted copies, (T * k, H) and (T * k, 2I), and the router's (T, E).
//
// The backward recomputes the gate/up GEMMs from m and the saved routing (idx, w): it never
// routes again, so a recompute cannot pick other experts than the forward did.
//
// LoRA on the 3-D expert weights (PEFT's ParamWrapper, LoraConfig(target_parameters=...)): a
// weight W (E, out, in) with the factors A (r E, in) and B (out, r E) and the scaling s computes
// with W_e + s B_e A_e, where A_e = A.view(E, r, in)[e] (expert-major rows) and
// B_e = B.view(out, r, E)[:, :, e] (the expert index fastest), PEFT's get_delta_factors. The
// op never forms that sum: each sorted row block x_e gets x_e W_e^T + s (x_e A_e^T) B_e^T, the
// low-rank term through two more grouped GEMMs over the same blocks ((N, r) in between), and
// the backward gives dA and dB in PEFT's layouts (the factors' own, so they are the parameters'
// gradients) and the LoRA paths' share of dx. Recompute recomputes those terms too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <tuple>

#include "activation.h"

namespace ckpt_ext {
namespace moe {

enum class Router { kSoftmax, kSigmoid };
Router parse_router(c10::string_view name, const char* op);

// (idx (T, k) int32, w (T, k) float32) from the router's logits (T, E).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t k, Router router,
                                         bool norm_topk_prob);

// d logits (T, E) float32 from dw (T, k) float32, the gradient of route's w.
at::Tensor route_backward(const at::Tensor& logits, const at::Tensor& idx, const at::Tensor& dw,
                          Router router, bool norm_topk_prob);

// The experts' LoRA factors (undefined: that weight has none), in the experts' dtype:
// gate_up_a (r E, H), gate_up_b (2I, r E), down_a (r E, I), down_b (H, r E), PEFT's layouts
// (above); the two scalings.
struct ExpertLora {
  at::Tensor gate_up_a, gate_up_b, down_a, down_b;
  double gate_up_scale = 0.0, down_scale = 0.0;
  bool gate_up() const { return gate_up_a.defined(); }
  bool down() const { return down_a.defined(); }
};
// The load-balancing statistics of one layer's tokens (HF's load_balancing_loss_func reduces
// every layer's logits to these before its loss): from logits (T, E) and per-token weights
// (T,) (HF's attention_mask; undefined: every token weighs 1), a (3, E) tensor in float32 (float64
// for float64 logits):
//   [0, e] = sum_t weight_t * [e in the top-k of softmax(logits_t)]   (no gradient)
//   [1, e] = sum_t weight_t * softmax(logits_t)_e
//   [2, e] = sum_t weight_t                                          (every column alike)
// The softmax is over the logits whatever the layer's router is: HF's loss function is.
at::Tensor router_stats(const at::Tensor& logits, int64_t k, const at::Tensor& weight);

// d logits (T, E) in the stats' dtype from dprob (E,), the gradient of router_stats' row 1:
// weight_t * softmax-backward(p_t, dprob) = weight_t * p_t * (dprob - p_t . dprob).
at::Tensor router_stats_backward(const at::Tensor& logits, const at::Tensor& dprob,
                                 const at::Tensor& weight);

// The routed experts' output (T, H) in m's dtype; m (T, H), gate_up and down in one dtype.
at::Tensor experts_forward(const at::Tensor& m, const at::Tensor& idx, const at::Tensor& w,
                           const at::Tensor& gate_up, const at::Tensor& down, Activation act,
                           const ExpertLora& lora = {});

struct ExpertGrads {
  at::Tensor dm;        // (T, H)
  at::Tensor dw;        // (T, k) float32: d of the routing weights
  at::Tensor dgate_up;  // (E, 2I, H), undefined unless asked for (or added into acc_gate_up)
  at::Tensor ddown;     // (E, H, I), undefined unless asked for (or added into acc_down)
  // the LoRA factors' gradients in their own layouts (ExpertLora), undefined unless asked for
  at::Tensor dgate_up_a, dgate_up_b, ddown_a, ddown_b;
};

// Which of the experts' gradients a backward computes.
struct ExpertNeeds {
  bool gate_up = false, down = false;                      // the base weights
  bool gate_up_a = false, gate_up_b = false, down_a = false, down_b = false;  // the factors
};

// Backward of experts_forward for dy (T, H) in m's dtype. acc_gate_up / acc_down: where given
// (the sums of earlier token chunks), the weight gradients are added into them expert by
// expert and come back undefined, so that no second expert-sized tensor exists. The LoRA
// factors' gradients are small and come back whole (the caller sums them over chunks).
ExpertGrads experts_backward(const at::Tensor& dy, const at::Tensor& m, const at::Tensor& idx,
                             const at::Tensor& w, const at::Tensor& gate_up,
                             const at::Tensor& down, Activation act, const ExpertNeeds& needs,
                             at::Tensor* acc_gate_up = nullptr, at::Tensor* acc_down = nullptr,
                             const ExpertLora& lora = {});

// Whether experts GEMMs of this dtype and these sizes go through torch._grouped_mm (else one
// matmul per expert); exposed for the tests' and benchmarks' report.
bool grouped_mm_applies(at::ScalarType dtype, int64_t hidden, int64_t intermediate);

}  // namespace moe
}  // namespace ckpt_ext
