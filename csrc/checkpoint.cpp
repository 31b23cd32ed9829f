// The segment checkpoint behind ckpt_ext.checkpoint: a C++ autograd Function that keeps only
// the inputs of a Python callable and re-runs it in backward, with the semantics of
// torch.utils.checkpoint.checkpoint(use_reentrant=False): gradients reach every input and
// every tensor the segment reads from outside, double backward works, tensor hooks fire once,
// and a recomputation that differs from the forward raises CheckpointError.
//
// Forward (checkpoint_apply, called from ckpt_ext/checkpoint.py):
//   1. snapshot the RNG state (CPU generator and the CUDA generator of every CUDA device
//      among the inputs) and the autocast state;
//   2. run the segment once with grad mode on, on detached aliases of the inputs (an input
//      that requires grad is aliased by a leaf when it is a leaf, else by a tensor behind a
//      SegmentInput node that leads nowhere, so that an in-place change of it reaches the
//      Python runner's check, which names the argument, not autograd's leaf error), under
//      saved-tensor hooks that drop everything an op tries to save (the Python runner installs
//      them). The graph this builds is never used for backward: it tells which outputs require
//      grad, which tensors from outside the arguments (parameters of a module, tensors of a
//      closure, non-leaf tensors computed earlier) the segment reads, and which operations it
//      recorded, in order, with the dtype, device and shape of each tensor they produced. Its
//      intermediates die as the segment returns, so nothing of size "activations" outlives the
//      forward. The autocast
//      cast cache is off inside the segment (here and in the recomputation), so that both runs
//      cast the weights they read themselves and build the same graph;
//   3. wrap the outputs in CheckpointFunction, whose inputs are the argument tensors (saved
//      with save_for_backward: they are all the segment holds) plus the outside tensors found
//      in step 2 (edges only; the segment's closure keeps them alive anyway).
// Backward: restore the snapshots and re-run the segment with grad on, its arguments being the
// saved tensors each behind a SegmentInput node. Walk the recomputed graph down to where it
// meets the segment's inputs and point every such edge at the SegmentInput of that input;
// compare what the recomputation produced with the forward (outputs, recorded operations and
// the tensors they produced, outside tensors read) and raise
// torch.utils.checkpoint.CheckpointError where it differs; then differentiate it with
// torch::autograd::grad, capturing the gradients at the SegmentInput nodes. Those lead
// nowhere while the gradient is taken, so no hook of an input fires there (its hooks fire
// once, when this Function hands the gradient on) and no path between two inputs is followed
// twice. When backward runs with grad mode on (create_graph=True) the gradient is taken with
// create_graph and each SegmentInput is then connected to its input, so the gradient's own
// graph reaches the original tensors.
// Not <torch/extension.h> (the whole C++ frontend: nn, optim, data, serialization): the
// autograd Function's headers and torch's pybind11 casters for tensors.
#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
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

// What one run of the segment recorded, in walk order: the type of each autograd node and the
// dtype, device and shape of each tensor it produced (the node's input metadata), flattened.
struct OpTrace {
  std::vector<const std::type_info*> types;
  std::vector<size_t> begin;  // where node k's entries start in `meta`
  std::vector<int64_t> meta;  // per tensor: ndim (-1 when not recorded), dtype, device, sizes

  void add(const Node& node) {
    types.push_back(&typeid(node));
    begin.push_back(meta.size());
    for (uint32_t i = 0; i < node.num_inputs(); ++i) {
      const auto& m = node.input_metadata(i);
      if (m.was_default_constructed() || m.is_nested_tensor()) {
        meta.push_back(-1);
        continue;
      }
      const auto shape = m.shape_as_dim_vector();
      meta.push_back(static_cast<int64_t>(shape.size()));
      meta.push_back(static_cast<int64_t>(m.dtype().toScalarType()));
      meta.push_back(static_cast<int64_t>(m.device().type()));
      meta.push_back(m.device().index());
      for (const auto& size : shape) meta.push_back(size.maybe_as_int().value_or(-2));
    }
  }

  size_t size() const { return types.size(); }

  c10::ArrayRef<int64_t> outputs(size_t k) const {
    const size_t end = k + 1 < begin.size() ? begin[k + 1] : meta.size();
    return c10::ArrayRef<int64_t>(meta).slice(begin[k], end - begin[k]);
  }

  static std::string describe(c10::ArrayRef<int64_t> outputs) {
    std::ostringstream os;
    for (size_t i = 0; i < outputs.size();) {
      if (i) os << ", ";
      if (outputs[i] < 0) {
        os << "(not recorded)";
        ++i;
        continue;
      }
      const auto ndim = static_cast<size_t>(outputs[i]);
      os << c10::toString(static_cast<at::ScalarType>(outputs[i + 1]))
         << outputs.slice(i + 4, ndim) << " on "
         << c10::Device(static_cast<c10::DeviceType>(outputs[i + 2]),
                        static_cast<c10::DeviceIndex>(outputs[i + 3]));
      i += 4 + ndim;
    }
    return os.str();
  }
};

struct SegmentState : torch::CustomClassHolder {
  py::object runner;  // runner(tensors: list[Tensor], recompute: bool) -> list[Tensor]
  bool preserve_rng = true;
  bool check = true;  // compare the recomputation with the forward (determinism_check)
  RngSnapshot rng;
  AutocastSnapshot autocast;
  std::vector<bool> arg_requires_grad;
  std::vector<at::Tensor> outside;   // inputs after the arguments: leaves and edge proxies
  std::vector<TensorMeta> out_meta;  // what forward produced
  std::vector<bool> out_requires_grad;
  OpTrace ops;                       // the forward's autograd nodes (when checking)
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

std::string describe(const torch::autograd::InputMetadata& m) {
  std::ostringstream os;
  os << m.dtype();
  if (m.is_nested_tensor()) {
    os << " (nested)";
  } else {
    os << '[';
    const auto shape = m.shape_as_dim_vector();
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    os << ']';
  }
  os << " on " << m.device();
  return os.str();
}

std::string op_name(const std::type_info* type) {
  static const std::string generated = "torch::autograd::generated::";
  std::string name = c10::demangle(type->name());
  if (name.rfind(generated, 0) == 0) name.erase(0, generated.size());
  return name;
}

// Raises torch.utils.checkpoint.CheckpointError (a RuntimeError), so that `except
// CheckpointError` catches it as it catches torch's.
[[noreturn]] void not_deterministic(const std::string& what) {
  const std::string message =
      "ckpt_ext.checkpoint: recomputing the segment in backward " + what +
      ", so the segment is not deterministic (it depends on something other than its inputs, "
      "the RNG state and the autocast state: data-dependent control flow, a closure changed "
      "after forward, ...); its gradients cannot be computed by recomputation";
  py::gil_scoped_acquire gil;
  py::object error = py::module_::import("torch.utils.checkpoint").attr("CheckpointError");
  PyErr_SetString(error.ptr(), message.c_str());
  throw py::error_already_set();
}

std::vector<at::Tensor> run_segment(SegmentState& st, const variable_list& inputs,
                                    bool recompute) {
  py::object result = st.runner(py::cast(inputs), recompute);
  return result.cast<std::vector<at::Tensor>>();
}

// The graph one run of the segment built, walked from its outputs that require grad down to
// where it meets tensors the run did not create: the arguments, leaves from outside
// (AccumulateGrad) and non-leaf tensors from outside (nodes made before the run or on another
// thread; sequence numbers are per thread).
struct SegmentGraph {
  OpTrace ops;                   // the run's nodes, in walk order
  std::vector<Edge*> crossings;  // edges from a node of the run to a tensor it did not create
  std::vector<size_t> boundary_outputs;  // outputs that are such tensors themselves

  static SegmentGraph walk(const variable_list& outs, uint64_t first_seq, bool trace) {
    SegmentGraph g;
    const uint64_t thread = at::RecordFunction::currentThreadId();
    auto made_by_run = [&](const Node* node) {
      return node->thread_id() == thread && node->sequence_nr() >= first_seq &&
             dynamic_cast<const AccumulateGrad*>(node) == nullptr;
    };
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack;
    auto enter = [&](Node* node) {
      if (!seen.insert(node).second) return;
      if (trace) g.ops.add(*node);
      stack.push_back(node);
    };
    for (size_t k = 0; k < outs.size(); ++k) {
      if (!outs[k].defined() || !outs[k].requires_grad()) continue;
      Node* node = torch::autograd::impl::gradient_edge(outs[k]).function.get();
      if (node == nullptr) continue;
      if (made_by_run(node)) {
        enter(node);
      } else {
        g.boundary_outputs.push_back(k);
      }
    }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (Edge& edge : node->next_edges()) {
        if (!edge.is_valid()) continue;
        if (made_by_run(edge.function.get())) {
          enter(edge.function.get());
        } else {
          g.crossings.push_back(&edge);
        }
      }
    }
    return g;
  }
};

// Where the recomputed graph meets one input of the segment (an argument, or a leaf or
// non-leaf tensor from outside). The gradient of the input is captured here rather than at
// the input's own node, whose hooks would then fire a second time when CheckpointFunction
// hands the gradient on. The node leads nowhere while that gradient is taken (paths between
// inputs, such as an argument computed from a parameter the segment also reads, belong to the
// outer graph); connect() then leads it to the input, for the graph of a gradient taken with
// create_graph. The forward run's non-leaf arguments that require grad stand behind one too
// (never connected), so that they are not leaves there either.
struct SegmentInput : public Node {
  SegmentInput(Edge input, torch::autograd::InputMetadata meta)
      : Node(torch::autograd::edge_list{input}), input_(std::move(input)) {
    // The constructor gave this node the topological number of one that leads to `input`,
    // which stays right once connect() adds the edge back.
    next_edges().clear();
    input_metadata_.push_back(std::move(meta));
  }

  variable_list apply(variable_list&& grads) override { return std::move(grads); }
  std::string name() const override { return "ckpt_ext::SegmentInput"; }

  void connect() {
    if (next_edges().empty()) next_edges().push_back(input_);
  }

 private:
  Edge input_;
};

// Autograd nodes are held by std::shared_ptr up to torch 2.12 and by c10::intrusive_ptr from
// 2.13 on; this builds against both.
using NodePtr = decltype(Edge::function);
constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<Node>>;
using SegmentInputPtr = std::conditional_t<kSharedNodes, std::shared_ptr<SegmentInput>,
                                           c10::intrusive_ptr<SegmentInput>>;

template <class... Args>
SegmentInputPtr make_segment_input(Args&&... args) {
  if constexpr (kSharedNodes) {
    return std::make_shared<SegmentInput>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<SegmentInput>(std::forward<Args>(args)...);
  }
}

Edge edge_to(const SegmentInputPtr& node) { return Edge(NodePtr(node), 0); }

struct EdgeKeyHash {
  size_t operator()(const std::pair<const Node*, uint32_t>& e) const {
    return std::hash<const Node*>()(e.first) ^ (static_cast<size_t>(e.second) << 1);
  }
};
using EdgeKey = std::pair<const Node*, uint32_t>;

EdgeKey key_of(const Edge& edge) { return {edge.function.get(), edge.input_nr}; }

// A tensor that owns no data and whose gradient edge is `edge`: what torch::autograd::grad
// takes to capture the gradient arriving there.
at::Tensor edge_handle(const Edge& edge, const at::TensorOptions& options) {
  at::Tensor handle = at::empty({0}, options);
  torch::autograd::impl::set_gradient_edge(handle, edge);
  return handle;
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
    const bool create_graph = at::GradMode::is_enabled();
    const variable_list args = ctx->get_saved_variables();
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(
        ctx->saved_data.at("state").toCapsule());
    const size_t n_args = args.size();
    const size_t n_inputs = n_args + state->outside.size();

    // The recomputation's arguments: the saved tensors, each behind its SegmentInput.
    std::vector<SegmentInputPtr> entry(n_inputs);
    variable_list inputs(n_args);
    for (size_t i = 0; i < n_args; ++i) {
      inputs[i] = args[i].detach();
      if (!state->arg_requires_grad[i]) continue;
      entry[i] = make_segment_input(torch::autograd::impl::gradient_edge(args[i]),
                                    torch::autograd::InputMetadata(args[i]));
      torch::autograd::impl::set_gradient_edge(inputs[i], edge_to(entry[i]));
    }

    const uint64_t first_seq = at::sequence_number::peek();
    std::vector<at::Tensor> outs;
    {
      py::gil_scoped_acquire gil;
      std::optional<RngFork> fork;
      if (state->preserve_rng) fork.emplace(state->rng);
      AutocastScope autocast(state->autocast);
      at::AutoGradMode grad_on(true);
      outs = run_segment(*state, inputs, /*recompute=*/true);
    }
    check_outputs(*state, outs);

    SegmentGraph graph = SegmentGraph::walk(outs, first_seq, state->check);
    if (state->check) check_ops(state->ops, graph.ops);

    // Which input each crossing edge reaches; point it at that input's SegmentInput.
    std::unordered_map<EdgeKey, size_t, EdgeKeyHash> index_of;
    for (size_t i = 0; i < n_args; ++i) {
      if (entry[i]) index_of.emplace(EdgeKey{entry[i].get(), 0}, i);
    }
    for (size_t j = 0; j < state->outside.size(); ++j) {
      const Edge edge = torch::autograd::impl::gradient_edge(state->outside[j]);
      if (edge.is_valid()) index_of.emplace(key_of(edge), n_args + j);
    }
    auto input_of = [&](const Edge& edge) {
      auto it = index_of.find(key_of(edge));
      if (it == index_of.end()) {
        not_deterministic("reads a tensor that requires grad which the forward did not (" +
                          describe(edge.function->input_metadata(edge.input_nr)) + ")");
      }
      return it->second;
    };
    std::vector<char> reached(n_inputs, 0);
    for (Edge* edge : graph.crossings) {
      const size_t idx = input_of(*edge);
      reached[idx] = 1;
      if (idx < n_args) continue;  // already the argument's SegmentInput
      if (!entry[idx]) {
        entry[idx] = make_segment_input(*edge, edge->function->input_metadata(edge->input_nr));
      }
      *edge = edge_to(entry[idx]);
    }
    // Outputs that are inputs themselves pass their gradient straight through.
    variable_list direct(n_inputs);
    std::vector<char> is_boundary(outs.size(), 0);
    for (size_t k : graph.boundary_outputs) {
      is_boundary[k] = 1;
      const size_t idx = input_of(torch::autograd::impl::gradient_edge(outs[k]));
      reached[idx] = 1;
      if (!state->out_requires_grad[k] || !grad_outputs[k].defined()) continue;
      direct[idx] = direct[idx].defined() ? direct[idx] + grad_outputs[k] : grad_outputs[k];
    }
    if (state->check) {
      for (size_t j = 0; j < state->outside.size(); ++j) {
        if (reached[n_args + j]) continue;
        const Edge edge = torch::autograd::impl::gradient_edge(state->outside[j]);
        not_deterministic(
            "no longer reads a tensor the forward read (" +
            (edge.is_valid() ? describe(edge.function->input_metadata(edge.input_nr))
                             : std::string("a tensor that no longer requires grad")) +
            ")");
      }
    }

    variable_list roots, root_grads;
    for (size_t k = 0; k < outs.size(); ++k) {
      if (is_boundary[k] || !state->out_requires_grad[k] || !grad_outputs[k].defined()) continue;
      roots.push_back(outs[k]);
      root_grads.push_back(grad_outputs[k]);
    }
    variable_list wrt;
    std::vector<size_t> wrt_index;
    for (size_t idx = 0; idx < n_inputs; ++idx) {
      if (!entry[idx] || !ctx->needs_input_grad(idx)) continue;
      wrt.push_back(edge_handle(edge_to(entry[idx]), entry[idx]->input_metadata(0).options()));
      wrt_index.push_back(idx);
    }

    // One gradient per forward argument: [state (none), args..., outside...].
    variable_list grads(1 + n_inputs);
    if (!roots.empty() && !wrt.empty()) {
      variable_list got = torch::autograd::grad(roots, wrt, root_grads,
                                                /*retain_graph=*/create_graph, create_graph,
                                                /*allow_unused=*/true);
      for (size_t j = 0; j < wrt.size(); ++j) grads[1 + wrt_index[j]] = got[j];
    }
    for (size_t idx = 0; idx < n_inputs; ++idx) {
      if (!direct[idx].defined() || !ctx->needs_input_grad(idx)) continue;
      auto& g = grads[1 + idx];
      g = g.defined() ? g + direct[idx] : direct[idx];
    }
    if (create_graph) {
      for (auto& e : entry) {
        if (e) e->connect();
      }
    }
    return grads;
  }

  // Same number of tensor outputs, each of the same shape, dtype and device, requiring grad
  // where forward's did.
  static void check_outputs(const SegmentState& state, const std::vector<at::Tensor>& outs) {
    if (outs.size() != state.out_meta.size()) {
      not_deterministic("gave " + std::to_string(outs.size()) +
                        " tensor outputs where forward gave " +
                        std::to_string(state.out_meta.size()));
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      const auto& m = state.out_meta[i];
      const TensorMeta now{outs[i].sizes().vec(), outs[i].scalar_type(), outs[i].device()};
      if (now.sizes != m.sizes || now.dtype != m.dtype || now.device != m.device) {
        not_deterministic("gave output " + std::to_string(i) + " as " + describe(now) +
                          " where forward gave " + describe(m));
      }
      if (outs[i].requires_grad() != state.out_requires_grad[i]) {
        not_deterministic("gave output " + std::to_string(i) +
                          (outs[i].requires_grad() ? " requiring grad" : " not requiring grad") +
                          " where forward did not");
      }
    }
  }

  // The same autograd nodes in the same order, producing tensors of the same dtypes, devices
  // and shapes.
  static void check_ops(const OpTrace& forward, const OpTrace& now) {
    const size_t n = std::min(now.size(), forward.size());
    for (size_t k = 0; k < n; ++k) {
      if (*now.types[k] != *forward.types[k]) {
        not_deterministic("recorded operation " + std::to_string(k) +
                          " of its autograd graph as " + op_name(now.types[k]) +
                          " where forward had " + op_name(forward.types[k]));
      }
      if (now.outputs(k) != forward.outputs(k)) {
        not_deterministic("recorded operation " + std::to_string(k) +
                          " of its autograd graph, " + op_name(now.types[k]) +
                          ", with outputs " + OpTrace::describe(now.outputs(k)) +
                          " where forward had " + OpTrace::describe(forward.outputs(k)));
      }
    }
    if (now.size() != forward.size()) {
      not_deterministic("recorded " + std::to_string(now.size()) +
                        " operations in its autograd graph where forward recorded " +
                        std::to_string(forward.size()));
    }
  }
};

// The tensors from outside the arguments that the forward run reached: leaves (the tensor
// itself) and non-leaf tensors (the tensor when it is an output, else a proxy that owns no
// data and carries its gradient edge), each once.
std::vector<at::Tensor> outside_tensors(const SegmentGraph& graph, const variable_list& outs,
                                        const variable_list& detached_args,
                                        const std::vector<SegmentInputPtr>& arg_nodes) {
  std::unordered_set<c10::TensorImpl*> args;  // the arguments' leaf aliases
  for (const auto& t : detached_args) args.insert(t.unsafeGetTensorImpl());
  std::unordered_set<const Node*> arg_node_set;  // and their non-leaf ones
  for (const auto& node : arg_nodes) {
    if (node) arg_node_set.insert(node.get());
  }
  std::unordered_set<c10::TensorImpl*> seen_leaves;
  std::unordered_set<EdgeKey, EdgeKeyHash> seen_edges;
  std::vector<at::Tensor> found;
  auto visit = [&](const Edge& edge, const at::Tensor& known) {
    Node* node = edge.function.get();
    if (arg_node_set.count(node)) return;
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      auto* impl = acc->variable.unsafeGetTensorImpl();
      if (!args.count(impl) && seen_leaves.insert(impl).second) found.push_back(acc->variable);
      return;
    }
    if (!seen_edges.insert(key_of(edge)).second) return;
    found.push_back(known.defined()
                        ? known
                        : edge_handle(edge, node->input_metadata(edge.input_nr).options()));
  };
  for (size_t k : graph.boundary_outputs) {
    visit(torch::autograd::impl::gradient_edge(outs[k]), outs[k]);
  }
  for (const Edge* edge : graph.crossings) visit(*edge, at::Tensor());
  return found;
}

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

// Turns the autocast cast cache off for its lifetime (see the file comment).
class NoCastCache {
 public:
  NoCastCache() : prev_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoCastCache() { at::autocast::set_autocast_cache_enabled(prev_); }
  NoCastCache(const NoCastCache&) = delete;
  NoCastCache& operator=(const NoCastCache&) = delete;

 private:
  bool prev_;
};

// Runs the segment (see the file comment) and returns its tensor outputs, attached to a
// CheckpointFunction node when any of them requires grad.
std::vector<at::Tensor> checkpoint_apply(py::object runner, bool preserve_rng, bool check,
                                         const std::vector<at::Tensor>& args) {
  TORCH_CHECK(at::GradMode::is_enabled(),
              "ckpt_ext._C.checkpoint_apply must be called with grad mode enabled");
  auto state = c10::make_intrusive<SegmentState>();
  state->runner = std::move(runner);
  state->preserve_rng = preserve_rng;
  state->check = check;
  if (preserve_rng) state->rng = RngSnapshot::capture(rng_devices(args));
  state->autocast = AutocastSnapshot::capture();
  state->autocast.cache_enabled = false;  // for the recomputation, as for the run below

  variable_list detached(args.size());
  std::vector<SegmentInputPtr> arg_nodes(args.size());
  state->arg_requires_grad.resize(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    TORCH_CHECK(args[i].defined(), "ckpt_ext.checkpoint: argument tensor ", i, " is undefined");
    detached[i] = args[i].detach();
    state->arg_requires_grad[i] = args[i].requires_grad();
    if (!args[i].requires_grad()) continue;
    if (args[i].is_leaf()) {
      detached[i].requires_grad_(true);
    } else {
      arg_nodes[i] = make_segment_input(Edge(), torch::autograd::InputMetadata(args[i]));
      torch::autograd::impl::set_gradient_edge(detached[i], edge_to(arg_nodes[i]));
    }
  }

  const uint64_t first_seq = at::sequence_number::peek();
  std::vector<at::Tensor> outs;
  {
    NoCastCache no_cast_cache;
    outs = run_segment(*state, detached, /*recompute=*/false);
  }

  bool any_requires_grad = false;
  for (const auto& o : outs) any_requires_grad = any_requires_grad || o.requires_grad();
  if (!any_requires_grad) return outs;  // nothing to differentiate: no node, nothing held
  {
    SegmentGraph graph = SegmentGraph::walk(outs, first_seq, check);
    state->outside = outside_tensors(graph, outs, detached, arg_nodes);
    if (check) state->ops = std::move(graph.ops);
  }

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
        py::arg("check"), py::arg("args"),
        "Run a segment and wrap its outputs in the C++ checkpoint Function "
        "(use ckpt_ext.checkpoint instead of calling this directly).");
}

}  // namespace ckpt_ext
