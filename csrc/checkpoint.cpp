// The segment checkpoint behind ckpt_ext.checkpoint: a C++ autograd Function that keeps only
// the inputs of a Python callable and re-runs it in backward.
//
// Forward (checkpoint_apply, called from ckpt_ext/checkpoint.py):
//   1. snapshot the RNG state (CPU generator and the CUDA generator of every CUDA device
//      among the inputs) and the autocast state;
//   2. run the segment once with grad mode on, on detached aliases of the inputs, under
//      saved-tensor hooks that drop everything an op tries to save (the Python runner installs
//      them). The graph this builds is never used for backward: it tells which outputs require
//      grad and which tensors from outside the arguments (parameters of a module, tensors of a
//      closure, non-leaf tensors computed earlier) the segment reads. Its intermediates die as
//      the segment returns, so nothing of size "activations" outlives the forward;
//   3. wrap the outputs in CheckpointFunction, whose inputs are the argument tensors (saved
//      with save_for_backward: they are all the segment holds) plus the outside tensors found
//      in step 2 (edges only; the segment's closure keeps them alive anyway).
// Backward: restore the snapshots, re-run the segment with grad on, check that it produced the
// same number, shapes and dtypes of outputs, and differentiate it with torch::autograd::grad.
#include <torch/extension.h>

#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ckpt_ext {
namespace {

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::AutogradContext;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// ---- RNG -----------------------------------------------------------------------------------

// Default-generator states of the CPU and of the given CUDA devices.
struct RngSnapshot {
  std::vector<std::pair<c10::Device, at::Tensor>> states;

  static RngSnapshot capture(const std::vector<c10::Device>& devices) {
    RngSnapshot snap;
    snap.states.reserve(devices.size());
    for (const auto& device : devices) {
      auto gen = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      snap.states.emplace_back(device, gen.get_state());
    }
    return snap;
  }

  std::vector<c10::Device> devices() const {
    std::vector<c10::Device> out;
    for (const auto& s : states) out.push_back(s.first);
    return out;
  }

  void restore() const {
    for (const auto& s : states) {
      auto gen = at::globalContext().defaultGenerator(s.first);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(s.second);
    }
  }
};

// Replays `saved` for the lifetime of the guard, then puts the caller's streams back, so that
// recomputation draws what forward drew and the caller's RNG does not move.
class RngFork {
 public:
  explicit RngFork(const RngSnapshot& saved) : caller_(RngSnapshot::capture(saved.devices())) {
    saved.restore();
  }
  ~RngFork() { caller_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngSnapshot caller_;
};

// ---- autocast ------------------------------------------------------------------------------

struct AutocastSnapshot {
  static constexpr std::array<at::DeviceType, 2> kTypes = {at::kCPU, at::kCUDA};
  std::array<bool, 2> enabled{};
  std::array<at::ScalarType, 2> dtype{};
  bool cache_enabled = true;

  static AutocastSnapshot capture() {
    AutocastSnapshot s;
    for (size_t i = 0; i < kTypes.size(); ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kTypes[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kTypes[i]);
    }
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }

  bool any_enabled() const { return enabled[0] || enabled[1]; }

  void apply() const {
    for (size_t i = 0; i < kTypes.size(); ++i) {
      at::autocast::set_autocast_enabled(kTypes[i], enabled[i]);
      at::autocast::set_autocast_dtype(kTypes[i], dtype[i]);
    }
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Enters the forward's autocast state like `torch.autocast` would (nesting counted, cast cache
// cleared when the outermost region closes) and restores the caller's state on exit.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastSnapshot& want)
      : prev_(AutocastSnapshot::capture()), nested_(want.any_enabled()) {
    want.apply();
    if (nested_) at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    prev_.apply();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastSnapshot prev_;
  bool nested_;
};

// ---- the segment ---------------------------------------------------------------------------

struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
};

struct SegmentState : torch::CustomClassHolder {
  py::object runner;  // runner(tensors: list[Tensor], recompute: bool) -> list[Tensor]
  bool preserve_rng = true;
  RngSnapshot rng;
  AutocastSnapshot autocast;
  std::vector<bool> arg_requires_grad;
  std::vector<at::Tensor> outside;   // inputs after the arguments: leaves and edge proxies
  std::vector<TensorMeta> out_meta;  // what forward produced
  std::vector<bool> out_requires_grad;
  variable_list pending_outputs;     // handed from checkpoint_apply to forward

  ~SegmentState() override {
    if (!runner) return;
    if (python_alive()) {
      py::gil_scoped_acquire gil;
      runner = py::object();
    } else {
      runner.release();  // interpreter shutting down: leak rather than touch Python
    }
  }

  static bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
  }
};

std::string describe(const TensorMeta& m) {
  std::ostringstream os;
  os << c10::toString(m.dtype) << c10::IntArrayRef(m.sizes) << " on " << m.device;
  return os.str();
}

[[noreturn]] void not_deterministic(const std::string& what) {
  TORCH_CHECK(false,
              "ckpt_ext.checkpoint: recomputing the segment in backward gave ", what,
              ", so the function is not deterministic (its outputs depend on something other "
              "than its inputs, the RNG state and the autocast state); its gradients cannot be "
              "computed by recomputation");
}

std::vector<at::Tensor> run_segment(SegmentState& st, const variable_list& inputs,
                                    bool recompute) {
  py::object result = st.runner(py::cast(inputs), recompute);
  return result.cast<std::vector<at::Tensor>>();
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `args` and `outside` are TensorLists so that Function::apply takes them as inputs (edges).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentState> state,
                               at::TensorList args, at::TensorList outside) {
    (void)outside;  // present for its edges; the state holds the tensors
    ctx->save_for_backward(args.vec());
    variable_list outputs = std::move(state->pending_outputs);
    state->pending_outputs.clear();
    variable_list non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!state->out_requires_grad[i]) non_differentiable.push_back(outputs[i]);
    }
    ctx->mark_non_differentiable(non_differentiable);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "ckpt_ext.checkpoint does not support double backward (create_graph=True). "
                "Use torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) for "
                "segments that need higher-order gradients.");
    const variable_list args = ctx->get_saved_variables();
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(
        ctx->saved_data.at("state").toCapsule());
    const size_t n_args = args.size();
    const size_t n_inputs = n_args + state->outside.size();

    variable_list detached(n_args);
    for (size_t i = 0; i < n_args; ++i) {
      detached[i] = args[i].detach();
      if (state->arg_requires_grad[i]) detached[i].requires_grad_(true);
    }

    std::vector<at::Tensor> outs;
    {
      py::gil_scoped_acquire gil;
      std::optional<RngFork> fork;
      if (state->preserve_rng) fork.emplace(state->rng);
      AutocastScope autocast(state->autocast);
      at::AutoGradMode grad_on(true);
      outs = run_segment(*state, detached, /*recompute=*/true);
    }

    if (outs.size() != state->out_meta.size()) {
      not_deterministic(std::to_string(outs.size()) + " tensor outputs where forward gave " +
                        std::to_string(state->out_meta.size()));
    }
    variable_list roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      const auto& m = state->out_meta[i];
      const TensorMeta now{outs[i].sizes().vec(), outs[i].scalar_type(), outs[i].device()};
      if (now.sizes != m.sizes || now.dtype != m.dtype || now.device != m.device) {
        not_deterministic("output " + std::to_string(i) + " as " + describe(now) +
                          " where forward gave " + describe(m));
      }
      if (state->out_requires_grad[i] && grad_outputs[i].defined() && outs[i].requires_grad()) {
        roots.push_back(outs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }

    variable_list wrt;
    std::vector<size_t> wrt_index;
    for (size_t i = 0; i < n_inputs; ++i) {
      if (!ctx->needs_input_grad(i)) continue;
      const at::Tensor& t = i < n_args ? detached[i] : state->outside[i - n_args];
      if (!t.requires_grad()) continue;
      wrt.push_back(t);
      wrt_index.push_back(i);
    }

    // One gradient per forward argument: [state (none), args..., outside...].
    variable_list grads(1 + n_inputs);
    if (!roots.empty() && !wrt.empty()) {
      variable_list got = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < wrt.size(); ++j) grads[1 + wrt_index[j]] = got[j];
    }
    return grads;
  }
};

// Tensors the segment read from outside its arguments, found by walking the graph built
// during forward. Nodes created by the segment have sequence numbers >= `first_seq`; an edge
// into an older node is a non-leaf tensor from outside, an AccumulateGrad a leaf.
class OutsideFinder {
 public:
  OutsideFinder(const variable_list& detached_args, uint64_t first_seq) : first_seq_(first_seq) {
    for (const auto& t : detached_args) args_.insert(t.unsafeGetTensorImpl());
  }

  void visit_output(const at::Tensor& out) {
    if (!out.defined() || !out.requires_grad()) return;
    Edge edge = torch::autograd::impl::gradient_edge(out);
    if (!edge.is_valid()) {
      // A leaf returned as is: an argument, or a parameter read from outside.
      add_leaf(out);
      return;
    }
    visit_edge(edge, out);
  }

  void walk() {
    while (!stack_.empty()) {
      Node* node = stack_.back();
      stack_.pop_back();
      for (const Edge& edge : node->next_edges()) {
        if (edge.is_valid()) visit_edge(edge, at::Tensor());
      }
    }
  }

  std::vector<at::Tensor> take() { return std::move(found_); }

 private:
  void add_leaf(const at::Tensor& leaf) {
    auto* impl = leaf.unsafeGetTensorImpl();
    if (args_.count(impl) || !seen_leaves_.insert(impl).second) return;
    found_.push_back(leaf);
  }

  void visit_edge(const Edge& edge, const at::Tensor& known) {
    Node* node = edge.function.get();
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      add_leaf(acc->variable);
      return;
    }
    if (node->sequence_nr() < first_seq_) {
      // A non-leaf tensor computed before the segment. Gradients reach it through a proxy
      // that carries its gradient edge (the proxy owns no data).
      if (!seen_edges_.insert({node, edge.input_nr}).second) return;
      if (known.defined()) {
        found_.push_back(known);
        return;
      }
      const auto& meta = node->input_metadata(edge.input_nr);
      at::Tensor proxy = at::empty({0}, meta.options());
      torch::autograd::impl::set_gradient_edge(proxy, edge);
      found_.push_back(proxy);
      return;
    }
    if (visited_.insert(node).second) stack_.push_back(node);
  }

  struct EdgeHash {
    size_t operator()(const std::pair<Node*, uint32_t>& e) const {
      return std::hash<Node*>()(e.first) ^ (static_cast<size_t>(e.second) << 1);
    }
  };

  uint64_t first_seq_;
  std::unordered_set<c10::TensorImpl*> args_;
  std::unordered_set<c10::TensorImpl*> seen_leaves_;
  std::unordered_set<std::pair<Node*, uint32_t>, EdgeHash> seen_edges_;
  std::unordered_set<Node*> visited_;
  std::vector<Node*> stack_;
  std::vector<at::Tensor> found_;
};

std::vector<c10::Device> rng_devices(const std::vector<at::Tensor>& args) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& t : args) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

// Runs the segment (see the file comment) and returns its tensor outputs, attached to a
// CheckpointFunction node when any of them requires grad.
std::vector<at::Tensor> checkpoint_apply(py::object runner, bool preserve_rng,
                                         const std::vector<at::Tensor>& args) {
  TORCH_CHECK(at::GradMode::is_enabled(),
              "ckpt_ext._C.checkpoint_apply must be called with grad mode enabled");
  auto state = c10::make_intrusive<SegmentState>();
  state->runner = std::move(runner);
  state->preserve_rng = preserve_rng;
  if (preserve_rng) state->rng = RngSnapshot::capture(rng_devices(args));
  state->autocast = AutocastSnapshot::capture();

  variable_list detached(args.size());
  state->arg_requires_grad.resize(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    TORCH_CHECK(args[i].defined(), "ckpt_ext.checkpoint: argument tensor ", i, " is undefined");
    detached[i] = args[i].detach();
    state->arg_requires_grad[i] = args[i].requires_grad();
    if (args[i].requires_grad()) detached[i].requires_grad_(true);
  }

  const uint64_t first_seq = at::sequence_number::peek();
  std::vector<at::Tensor> outs = run_segment(*state, detached, /*recompute=*/false);

  OutsideFinder finder(detached, first_seq);
  bool any_requires_grad = false;
  for (const auto& o : outs) {
    finder.visit_output(o);
    any_requires_grad = any_requires_grad || o.requires_grad();
  }
  if (!any_requires_grad) return outs;  // nothing to differentiate: no node, nothing held
  finder.walk();
  state->outside = finder.take();

  state->out_meta.reserve(outs.size());
  state->out_requires_grad.reserve(outs.size());
  state->pending_outputs.reserve(outs.size());
  for (const auto& o : outs) {
    state->out_meta.push_back({o.sizes().vec(), o.scalar_type(), o.device()});
    state->out_requires_grad.push_back(o.requires_grad());
    state->pending_outputs.push_back(o.detach());
  }
  outs.clear();  // drop the discovery graph before the node is built
  const variable_list outside = state->outside;
  return CheckpointFunction::apply(state, at::TensorList(args), at::TensorList(outside));
}

}  // namespace

void bind_checkpoint(py::module& m) {
  m.def("checkpoint_apply", &checkpoint_apply, py::arg("runner"), py::arg("preserve_rng"),
        py::arg("args"),
        "Run a segment and wrap its outputs in the C++ checkpoint Function "
        "(use ckpt_ext.checkpoint instead of calling this directly).");
}

}  // namespace ckpt_ext
