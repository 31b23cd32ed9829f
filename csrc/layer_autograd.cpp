// decoder_layer: the C++ autograd Function over decoder_layer_fwd / decoder_layer_bwd, its
// Autocast and below-autograd kernels, their registrations, and what Python reads of the
// layer's spec (csrc/layer_spec.h): the weight slots and the residuals of each part and preset.
// <ATen/autocast_mode.h> brings in <ATen/ATen.h> (every operator), so this file cannot take
// the per-operator headers' guard; the autograd Function needs only custom_function.h.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "kernel_ops.h"
#include "layer_spec.h"

namespace ckpt_ext {
namespace layer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The three layer ops, looked up by name like the kernel ops.
using LayerResult = std::tuple<at::Tensor, at::Tensor>;  // (y, router_logits)
const kernel::KernelOp<LayerResult(const at::Tensor& LAYER_SIG)> layer_op{
    "ckpt_ext::decoder_layer"};
const kernel::KernelOp<FwdResult(const at::Tensor& LAYER_SIG)> fwd_op{
    "ckpt_ext::decoder_layer_fwd"};
const kernel::KernelOp<BwdResult(const at::Tensor&, const at::Tensor& LAYER_SIG,
                                 at::TensorList, const c10::List<bool>&, const OptTensor&)>
    bwd_op{"ckpt_ext::decoder_layer_bwd"};

// The op's weights list from the given tensors (one per slot in `present`).
c10::List<OptTensor> as_list(at::TensorList given, const std::vector<int64_t>& present) {
  c10::List<OptTensor> l(std::vector<OptTensor>(kNumSlots, std::nullopt));
  for (size_t j = 0; j < present.size(); ++j) l.set(present[j], given[j]);
  return l;
}

OptTensor as_opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Saved-tensor layout of DecoderLayerFn: x, the TENSOR arguments (undefined where absent),
// the given weights (`present`), then the residuals.
enum SavedSlot : int64_t {
  kSavedX = 0,
#define CKPT_LAYER_SAVED_SLOT_(param, name) kSaved_##name,
  CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_SAVED_SLOT_)
#undef CKPT_LAYER_SAVED_SLOT_
  kSavedWeights
};

struct DecoderLayerFn : public torch::autograd::Function<DecoderLayerFn> {
  // weights: the given slots' tensors (the differentiable inputs), `present` their slots.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               at::TensorList weights, const LayerTensors& t,
                               const LayerOptions& o, const std::vector<int64_t>& present) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, saved, logits] = fwd_op(x LAYER_ARGS_OF(as_list(weights, present), t, o));
#define CKPT_LAYER_SAVE_TENSOR_(param, name) t.name.value_or(at::Tensor()),
    variable_list to_save = {x, CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_SAVE_TENSOR_)};
#undef CKPT_LAYER_SAVE_TENSOR_
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    to_save.insert(to_save.end(), saved.begin(), saved.end());
    ctx->save_for_backward(to_save);
    o.save(ctx);
    ctx->saved_data["present"] = c10::List<int64_t>(present);
    // An output no loss reached gets no gradient tensor (not a materialised zero): the router
    // logits are (B*S, E), and without router_logits / router_stats an empty placeholder.
    ctx->set_materialize_grads(false);
    if (!o.router_logits && !o.router_stats) ctx->mark_non_differentiable({logits});
    return {y, logits};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    CKPT_CHECK(!at::GradMode::is_enabled(), "decoder_layer",
               "double backward (create_graph=True) through a fused decoder layer is not "
               "supported: its backward is one opaque op. For higher-order gradients use "
               "policy 'none' or 'torch' with attention that has a double backward (HF: "
               "attn_implementation='eager'; ckpt_ext.modules: inside "
               "torch.nn.attention.sdpa_kernel(SDPBackend.MATH))");
    // Unpack before the guard: unpacking may run an outer checkpoint's recompute.
    const variable_list v = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;
    const LayerOptions o = LayerOptions::load(ctx);
    const std::vector<int64_t> present = ctx->saved_data["present"].toIntVector();
#define CKPT_LAYER_LOAD_TENSOR_(param, name) as_opt(v[kSaved_##name]),
    const LayerTensors t{CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_LOAD_TENSOR_)};
#undef CKPT_LAYER_LOAD_TENSOR_
    const int64_t n = static_cast<int64_t>(present.size());
    const at::TensorList w(v.data() + kSavedWeights, n);
    const at::TensorList saved(v.data() + kSavedWeights + n, v.size() - kSavedWeights - n);
    // A slot that o.part does not read gets no gradient (None).
    const Part part = parse_part(o.part, "decoder_layer");
    c10::List<bool> needs;
    for (int64_t s = 0; s < kNumSlots; ++s) needs.push_back(false);
    for (int64_t j = 0; j < n; ++j)
      needs.set(present[j], ctx->needs_input_grad(1 + j) && uses_slot(part, present[j]));
    const at::Tensor& x = v[kSavedX];
    // x may be in host memory (offload's streamed inputs): a missing dy is zeros on the
    // device the layer computes on, its weights'.
    const at::Tensor dy =
        grad_outputs[0].defined()
            ? grad_outputs[0]
            : at::zeros(x.sizes(), x.options().device(n ? w[0].device() : x.device()));
    const OptTensor dlogits =
        (o.router_logits || o.router_stats) && grad_outputs[1].defined()
            ? OptTensor(grad_outputs[1])
            : std::nullopt;
    auto [dx, dw] = bwd_op(dy, x LAYER_ARGS_OF(as_list(w, present), t, o), saved, needs,
                           dlogits);
    variable_list grads = {dx};
    for (int64_t j = 0; j < n; ++j)
      grads.push_back(needs.get(present[j]) ? dw[present[j]] : at::Tensor());
    grads.resize(grads.size() + 3);  // t, o, present
    return grads;
  }
};

LayerResult decoder_layer_autograd(const at::Tensor& x LAYER_PARAMS) {
  std::vector<at::Tensor> given;
  std::vector<int64_t> present;
  for (int64_t s = 0; s < static_cast<int64_t>(weights.size()); ++s) {
    const OptTensor w = weights.get(s);
    if (!checks::absent(w)) given.push_back(*w), present.push_back(s);
  }
  const variable_list out = DecoderLayerFn::apply(x, at::TensorList(given),
                                                  LAYER_TENSORS_OF_PARAMS,
                                                  LAYER_OPTIONS_OF_PARAMS, present);
  return {out[0], out[1]};
}

// Below autograd (no grad, inference tensors): the forward alone, nothing kept.
LayerResult decoder_layer_plain(const at::Tensor& x LAYER_PARAMS) {
  auto [y, saved, logits] = fwd_op(x LAYER_ARGS);
  return {y, logits};
}

// Under autocast: compute in the autocast dtype (unless the caller fixed compute_dtype), with
// the inputs left as they are (see csrc/layer_spec.h).
template <c10::DeviceType device>
LayerResult decoder_layer_autocast(const at::Tensor& x LAYER_PARAMS) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  const LayerTensors t = LAYER_TENSORS_OF_PARAMS;
  LayerOptions o = LAYER_OPTIONS_OF_PARAMS;
  if (!o.compute_dtype && x.device().type() == device && at::isFloatingType(x.scalar_type()) &&
      x.scalar_type() != at::kDouble) {
    o.compute_dtype = at::autocast::get_autocast_dtype(device);
  }
  return layer_op(x LAYER_ARGS_OF(weights, t, o));
}

}  // namespace
}  // namespace layer

// The slot names of the `weights` list, in order (read by ckpt_ext/blocks.py).
std::vector<std::string> layer_weight_slots() {
  std::vector<std::string> names;
  for (int64_t s = 0; s < layer::kNumSlots; ++s) names.push_back(layer::slot_name(s));
  return names;
}

// The names of the residuals decoder_layer_fwd returns for (part, preset), in order (read by
// ckpt_ext/blocks.py: the fake's `saved` output).
std::vector<std::string> layer_residuals(const std::string& part, const std::string& preset,
                                         bool moe) {
  const char* op = "layer_residuals";
  std::vector<std::string> names;
  for (layer::Member m :
       layer::kept(layer::parse_part(part, op), layer::parse_preset(preset, op), moe))
    names.push_back(layer::residual_name(m));
  return names;
}

TORCH_LIBRARY_IMPL(ckpt_ext, Autograd, m) {
  m.impl("decoder_layer", layer::decoder_layer_autograd);
}

TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCPU, m) {
  m.impl("decoder_layer", layer::decoder_layer_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCUDA, m) {
  m.impl("decoder_layer", layer::decoder_layer_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) {
  m.impl("decoder_layer", layer::decoder_layer_plain);
  m.impl("decoder_layer_fwd", layer::decoder_layer_fwd);
  m.impl("decoder_layer_bwd", layer::decoder_layer_bwd);
}

}  // namespace ckpt_ext
