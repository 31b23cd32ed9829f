// The mixture-of-experts MLP's routed part (csrc/moe_math.h).
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "moe_math.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checks.h"
#include "chunking.h"

namespace ckpt_ext {
namespace moe {
namespace {

// The T * k token copies sorted by expert (stable: a token's copies keep their order, and
// tokens within an expert theirs).
struct Groups {
  at::Tensor pos;    // (N,) int64: the slot of the flattened (T, k) routing of sorted copy i
  at::Tensor token;  // (N,) int64: its token row, pos / k
  at::Tensor offs;   // (E,) int32: each expert's end in the sorted order
  int64_t num_experts;
  // The ends on the host, for the per-expert path (read once, on first use).
  mutable std::vector<int64_t> ends;

  const std::vector<int64_t>& host_ends() const {
    if (ends.empty()) {
      const at::Tensor e = offs.to(at::kLong).cpu();
      const int64_t* p = e.data_ptr<int64_t>();
      ends.assign(p, p + num_experts);
    }
    return ends;
  }
};

Groups group(const at::Tensor& idx, int64_t num_experts) {
  const at::Tensor flat = idx.reshape({-1}).to(at::kLong);
  Groups g;
  g.num_experts = num_experts;
  g.pos = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  g.token = g.pos.div(idx.size(1), "floor");
  g.offs = flat.bincount(/*weights=*/{}, num_experts).cumsum(0).to(at::kInt);
  return g;
}

bool aligned(at::ScalarType dt, int64_t n) {
  return (n * static_cast<int64_t>(c10::elementSize(dt))) % 16 == 0;
}

}  // namespace

bool grouped_mm_applies(at::ScalarType dt, int64_t hidden, int64_t intermediate) {
  return (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && aligned(dt, hidden) &&
         aligned(dt, intermediate);
}

namespace {

// a (N, K) sorted by expert, b (E, K, M) (any strides): row block e of a times b[e], (N, M).
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const Groups& g, bool grouped) {
  if (grouped) return at::_grouped_mm(a, b, g.offs);
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options());
  int64_t start = 0;
  const auto& ends = g.host_ends();
  for (int64_t e = 0; e < g.num_experts; ++e) {
    const int64_t n = ends[e] - start;
    if (n > 0) {
      at::Tensor o = out.narrow(0, start, n);
      at::mm_out(o, a.narrow(0, start, n), b[e]);
    }
    start = ends[e];
  }
  return out;
}

// a (N, P), b (N, Q) sorted by expert: per expert e the sum over its rows a_e^T b_e, (E, P, Q)
// (zero for an expert with no rows). A weight's gradient.
at::Tensor grouped_outer(const at::Tensor& a, const at::Tensor& b, const Groups& g,
                         bool grouped) {
  if (grouped) return at::_grouped_mm(a.t(), b, g.offs);
  at::Tensor out = at::zeros({g.num_experts, a.size(1), b.size(1)}, a.options());
  int64_t start = 0;
  const auto& ends = g.host_ends();
  for (int64_t e = 0; e < g.num_experts; ++e) {
    const int64_t n = ends[e] - start;
    if (n > 0) {
      at::Tensor o = out[e];
      at::mm_out(o, a.narrow(0, start, n).t(), b.narrow(0, start, n));
    }
    start = ends[e];
  }
  return out;
}

// acc (E, P, Q) += the per-expert sums a_e^T b_e, so that a gradient summed over token chunks
// never has a second (E, P, Q) tensor beside it: with grouped GEMMs a block of experts at a
// time, the block's (G, P, Q) products within the byte cap of the token chunks (one grouped
// GEMM and one add a block, not two launches an expert: 128 experts, 256 launches a weight);
// else one expert's product at a time.
void grouped_outer_add(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                       const Groups& g, bool grouped) {
  const auto& ends = g.host_ends();
  const int64_t E = g.num_experts;
  const int64_t block =
      grouped ? std::min(E, chunking::chunk_rows(a.size(1) * b.size(1) * a.element_size()))
              : 1;
  for (int64_t e0 = 0; e0 < E; e0 += block) {
    const int64_t ne = std::min(block, E - e0);
    const int64_t start = e0 == 0 ? 0 : ends[e0 - 1], n = ends[e0 + ne - 1] - start;
    if (n == 0) continue;
    const at::Tensor ab = a.narrow(0, start, n), bb = b.narrow(0, start, n);
    if (grouped) {  // the block's ends, counted from its first row
      acc.narrow(0, e0, ne).add_(at::_grouped_mm(ab.t(), bb, g.offs.narrow(0, e0, ne) - start));
    } else {
      acc[e0].add_(at::mm(ab.t(), bb));
    }
  }
}

// A weight gradient: added into *acc when given (a later token chunk), else a new tensor.
at::Tensor weight_grad(at::Tensor* acc, const at::Tensor& a, const at::Tensor& b,
                       const Groups& g, bool grouped) {
  if (acc == nullptr) return grouped_outer(a, b, g, grouped);
  grouped_outer_add(*acc, a, b, g, grouped);
  return at::Tensor();
}

at::Tensor scores_of(const at::Tensor& logits, Router router) {
  const at::Tensor l = logits.to(at::promote_types(logits.scalar_type(), at::kFloat));
  return router == Router::kSoftmax ? l.softmax(-1) : l.sigmoid();
}

}  // namespace

Router parse_router(c10::string_view name, const char* op) {
  if (name == "softmax") return Router::kSoftmax;
  if (name == "sigmoid") return Router::kSigmoid;
  CKPT_CHECK_VALUE(false, op, "router must be one of 'softmax', 'sigmoid', got '",
                   std::string(name), "'");
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t k, Router router,
                                         bool norm_topk_prob) {
  auto [w, idx] = scores_of(logits, router).topk(k, -1);
  if (norm_topk_prob) w = w / w.sum(-1, /*keepdim=*/true);
  return {idx.to(at::kInt), w};
}

at::Tensor route_backward(const at::Tensor& logits, const at::Tensor& idx, const at::Tensor& dw,
                          Router router, bool norm_topk_prob) {
  const at::Tensor p = scores_of(logits, router);
  const at::Tensor i64 = idx.to(at::kLong);
  at::Tensor dsel = dw.to(p.scalar_type());
  if (norm_topk_prob) {  // w = s / sum(s): ds_j = (dw_j - sum_i dw_i w_i) / sum(s)
    const at::Tensor sel = p.gather(1, i64);
    const at::Tensor sum = sel.sum(-1, true);
    dsel = (dsel - (dsel * (sel / sum)).sum(-1, true)) / sum;
  }
  const at::Tensor dp = at::zeros_like(p).scatter_(1, i64, dsel);
  if (router == Router::kSoftmax) return p * (dp - (dp * p).sum(-1, true));
  return dp * p * (1 - p);
}

// ---- LoRA on the expert weights (ExpertLora) ---------------------------------------------------

namespace {

// One weight's factors as per-expert stacks: a3 (E, r, in) = A.view(E, r, in), b3 (E, out, r)
// with b3[e] = B_e (a small contiguous copy of B, so that each expert's block is a plain
// matrix for the GEMMs).
struct Factors {
  at::Tensor a3, b3;
  double s = 0.0;
  int64_t r = 0;
  bool gm = false;  // whether the low-rank GEMMs go through torch._grouped_mm
  bool defined() const { return a3.defined(); }
};

Factors factors(const at::Tensor& a, const at::Tensor& b, double s, int64_t E, bool gm) {
  Factors f;
  if (!a.defined()) return f;
  f.r = a.size(0) / E;
  f.s = s;
  f.a3 = a.reshape({E, f.r, a.size(1)});
  f.b3 = b.reshape({b.size(0), f.r, E}).permute({2, 0, 1}).contiguous();
  f.gm = gm && aligned(a.scalar_type(), f.r);
  return f;
}

// y (N, out) += s (x_e A_e^T) B_e^T for the sorted rows x (N, in); returns u = x_e A_e^T (N, r).
at::Tensor lora_add(at::Tensor& y, const at::Tensor& x, const Factors& f, const Groups& g) {
  at::Tensor u = grouped_mm(x, f.a3.transpose(1, 2), g, f.gm);
  y.add_(grouped_mm(u, f.b3.transpose(1, 2), g, f.gm), f.s);
  return u;
}

// dB in lora_B's layout (out, r E) from the per-expert dB_e (E, out, r).
at::Tensor b_layout(const at::Tensor& db3) {
  return db3.permute({1, 2, 0}).reshape({db3.size(1), db3.size(2) * db3.size(0)});
}

// The factors' gradients of y = x_e W_e^T + s (x_e A_e^T) B_e^T for dy (N, out): dB_e =
// s dy_e^T u_e, dA_e = s (dy_e B_e)^T x_e, in the factors' layouts; dyb = dy_e B_e (N, r).
void factor_grads(const Factors& f, const at::Tensor& dy, const at::Tensor& dyb,
                  const at::Tensor& u, const at::Tensor& x, const Groups& g, bool need_a,
                  bool need_b, at::Tensor& da, at::Tensor& db) {
  if (need_b) db = b_layout(grouped_outer(dy, u, g, f.gm).mul_(f.s));
  if (need_a)
    da = grouped_outer(dyb, x, g, f.gm).mul_(f.s).reshape({g.num_experts * f.r, x.size(1)});
}

}  // namespace

at::Tensor router_stats(const at::Tensor& logits, int64_t k, const at::Tensor& weight) {
  const at::Tensor p = scores_of(logits, Router::kSoftmax);  // (T, E), float32 or wider
  const int64_t T = p.size(0), E = p.size(1);
  at::Tensor stats = at::zeros({3, E}, p.options());
  const at::Tensor w = weight.defined() ? weight.to(p.scalar_type()) : at::ones({T}, p.options());
  const at::Tensor sel = std::get<1>(p.topk(k, -1)).reshape({-1});  // (T * k,)
  stats[0].scatter_add_(0, sel, w.unsqueeze(1).expand({T, k}).reshape({-1}));
  stats[1].copy_(w.unsqueeze(0).mm(p).squeeze(0));
  stats[2].fill_(w.sum());
  return stats;
}

at::Tensor router_stats_backward(const at::Tensor& logits, const at::Tensor& dprob,
                                 const at::Tensor& weight) {
  const at::Tensor p = scores_of(logits, Router::kSoftmax);
  const at::Tensor g = dprob.to(p.scalar_type()).unsqueeze(0);  // (1, E)
  at::Tensor d = p * (g - (p * g).sum(-1, true));
  if (weight.defined()) d.mul_(weight.to(p.scalar_type()).unsqueeze(1));
  return d;
}

at::Tensor experts_forward(const at::Tensor& m, const at::Tensor& idx, const at::Tensor& w,
                           const at::Tensor& gate_up, const at::Tensor& down, Activation act,
                           const ExpertLora& lora) {
  const int64_t T = m.size(0), H = m.size(1), I = down.size(2), E = down.size(0);
  const bool gm = grouped_mm_applies(m.scalar_type(), H, I);
  const Groups g = group(idx, E);
  const Factors fgu = factors(lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale, E, gm);
  const Factors fd = factors(lora.down_a, lora.down_b, lora.down_scale, E, gm);
  // Each sorted (N, *) tensor is released as soon as the next one is made.
  at::Tensor xs = m.index_select(0, g.token);                      // (N, H)
  at::Tensor gu = grouped_mm(xs, gate_up.transpose(1, 2), g, gm);  // (N, 2I)
  if (fgu.defined()) lora_add(gu, xs, fgu, g);
  xs.reset();
  at::Tensor a = swiglu_product(gu.narrow(1, 0, I), gu.narrow(1, I, I), m.scalar_type(), act);
  gu.reset();
  at::Tensor o = grouped_mm(a, down.transpose(1, 2), g, gm);       // (N, H)
  if (fd.defined()) lora_add(o, a, fd, g);
  a.reset();
  // times the routing weight, rounded once (Mixtral's float32 product cast to the output)
  o.mul_(w.reshape({-1}).index_select(0, g.pos).unsqueeze(1));
  return at::zeros({T, H}, m.options()).index_add_(0, g.token, o);
}

// The working set of experts_backward per sorted row, at its largest: the copies xs and their
// gate/up (H + 2I) beside either dy's copies (H, and a transposed copy _grouped_mm may make
// for the down gradient, H) with the product, its gradient and their float product (3I), or
// beside the gate/up gradient (2I) with da and two (N, I) temporaries (3I): 3H + 5I, or
// H + 7I (ckpt_ext's layer chunk rule counts the larger). Expert LoRA adds a few (N, r)
// low-rank rows (u and dy B per weight), r far below H and I.
ExpertGrads experts_backward(const at::Tensor& dy, const at::Tensor& m, const at::Tensor& idx,
                             const at::Tensor& w, const at::Tensor& gate_up,
                             const at::Tensor& down, Activation act, const ExpertNeeds& needs,
                             at::Tensor* acc_gate_up, at::Tensor* acc_down,
                             const ExpertLora& lora) {
  const int64_t T = m.size(0), H = m.size(1), I = down.size(2), E = down.size(0);
  const at::ScalarType dt = m.scalar_type(), cdt = checks::compute_dtype(dt);
  const at::ScalarType wide = w.scalar_type();
  const bool gm = grouped_mm_applies(dt, H, I);
  const Groups g = group(idx, E);
  const Factors fgu = factors(lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale, E, gm);
  const Factors fd = factors(lora.down_a, lora.down_b, lora.down_scale, E, gm);
  const at::Tensor ws = w.reshape({-1}).index_select(0, g.pos).unsqueeze(1);  // (N, 1)
  // the forward's sorted rows again: the copies and their gate/up (the adapter's term too)
  at::Tensor xs = m.index_select(0, g.token);                                 // (N, H)
  at::Tensor gu = grouped_mm(xs, gate_up.transpose(1, 2), g, gm);             // (N, 2I)
  at::Tensor u_gu;  // xs_e A_e^T of the gate/up adapter (N, r)
  if (fgu.defined()) u_gu = lora_add(gu, xs, fgu, g);
  if (!needs.gate_up_b) u_gu.reset();
  ExpertGrads r;
  at::Tensor da;  // d of the product act(gate) * up, (N, I)
  {
    at::Tensor dos = dy.index_select(0, g.token);                             // (N, H)
    const at::Tensor a = swiglu_product(gu.narrow(1, 0, I), gu.narrow(1, I, I), dt, act);
    da = grouped_mm(dos, down, g, gm);  // dy_t down_e: before the routing weight
    at::Tensor dob;  // dy_t B_e of the down adapter (N, r)
    if (fd.defined()) {
      dob = grouped_mm(dos, fd.b3, g, fd.gm);
      da.add_(grouped_mm(dob, fd.a3, g, fd.gm), fd.s);
    }
    // d w_j = dy_t . down_e(a) = (dy_t down_e) . a
    const at::Tensor dws = (da.to(wide) * a.to(wide)).sum(1);
    r.dw = at::zeros({T * idx.size(1)}, w.options()).index_copy_(0, g.pos, dws)
               .view(idx.sizes());
    const bool lora_d = fd.defined() && (needs.down_a || needs.down_b);
    if (needs.down || lora_d) dos.mul_(ws);  // the weights' gradients see the routing weight
    if (needs.down) r.ddown = weight_grad(acc_down, dos, a, g, gm);
    if (lora_d) {
      const at::Tensor u_d =
          needs.down_b ? grouped_mm(a, fd.a3.transpose(1, 2), g, fd.gm) : at::Tensor();
      factor_grads(fd, dos, needs.down_a ? dob.mul_(ws) : dob, u_d, a, g, needs.down_a,
                   needs.down_b, r.ddown_a, r.ddown_b);
    }
  }
  da = da.to(cdt).mul_(ws);
  const at::Tensor gate = gu.narrow(1, 0, I).to(cdt), up = gu.narrow(1, I, I).to(cdt);
  at::Tensor dgu = at::empty({gu.size(0), 2 * I}, gu.options());
  dgu.narrow(1, I, I).copy_(da * activate(gate, act));                         // d up
  dgu.narrow(1, 0, I).copy_(activate_backward(da.mul_(up), gate, act));        // d gate
  da.reset();
  gu.reset();
  if (needs.gate_up) r.dgate_up = weight_grad(acc_gate_up, dgu, xs, g, gm);
  at::Tensor dgb;  // dgu_e B_e of the gate/up adapter (N, r)
  if (fgu.defined()) {
    dgb = grouped_mm(dgu, fgu.b3, g, fgu.gm);
    factor_grads(fgu, dgu, dgb, u_gu, xs, g, needs.gate_up_a, needs.gate_up_b, r.dgate_up_a,
                 r.dgate_up_b);
  }
  xs.reset();
  u_gu.reset();
  at::Tensor dxs = grouped_mm(dgu, gate_up, g, gm);                            // (N, H)
  dgu.reset();
  if (fgu.defined()) dxs.add_(grouped_mm(dgb, fgu.a3, g, fgu.gm), fgu.s);
  r.dm = at::zeros({T, H}, dy.options()).index_add_(0, g.token, dxs);
  return r;
}

}  // namespace moe
}  // namespace ckpt_ext
