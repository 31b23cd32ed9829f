// Ulysses sequence parallelism: the exchanges of the fused layer's attention (the option
// sequence_parallel, csrc/layer_spec.h; the math in csrc/layer_math.cpp).
//
// Each of the group's N ranks holds S tokens of every sequence (rank r the global positions
// r*S .. r*S + S - 1). The attention needs every key, so q/k/v go through one all-to-all each:
// a rank sends head block j of its tokens to rank j and receives its own head block of every
// rank's tokens, (B, H, S, D) -> (B, H/N, N*S, D); the output (and in the backward every
// gradient) goes back the same way. KV heads fewer than N are first repeated to N heads (each
// rank then holds the one its query heads read), and their gradients summed back.
//
// The exchanges are torch's functional collectives (_c10d_functional::all_to_all_single,
// all_gather_into_tensor, wait_tensor), called through the dispatcher: on gloo for CPU tensors,
// NCCL for CUDA ones. The group is the name it is registered under (torch.distributed's
// ProcessGroup.group_name).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/string_view.h>
#include <ATen/ops/empty.h>

#include <exception>
#include <string>
#include <vector>

#include "checks.h"

namespace ckpt_ext {
namespace ulysses {

struct Group {
  std::string name;
  int64_t rank = 0, size = 1;
};

// The registered group `name` (the op's sequence_parallel), its rank and size
// (csrc/ulysses.cpp).
Group resolve(c10::string_view name, const char* op);

// One field of a call that every rank of the group must pass alike (a fixed number of
// values, zeros where the rank could not read them): `what` names it in the error.
struct Field {
  const char* what;
  std::vector<int64_t> values;
};

// Every rank's verdict on a call, agreed by one all-gather before the call's first exchange,
// so that a refusal on one rank is a refusal on every rank (no rank left waiting in an
// exchange): `error` is what this rank's checks threw (null: none), `fields` what must match
// over the group (the same names and counts on every rank). Throws on every rank: the first
// refusing rank's error (its type and message, the rank named), or, when none refused, a
// ValueError naming the first field that differs and each rank's values (csrc/ulysses.cpp).
// `device`: the call's (the group's backend works on it).
void agree(const Group& g, const char* op, c10::Device device, std::exception_ptr error,
           const std::vector<Field>& fields);

// One functional collective, called boxed; its result waited for.
inline at::Tensor call(const char* name, std::vector<c10::IValue> args) {
  const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(std::move(args));
  op.callBoxed(&stack);
  const c10::OperatorHandle wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack w{stack[0]};
  wait.callBoxed(&w);
  return w[0].toTensor();
}

// send (N, ...) contiguous: block j goes to rank j; returns (N, ...) with block i from rank i.
inline at::Tensor all_to_all(const Group& g, const at::Tensor& send) {
  const std::vector<int64_t> splits(g.size, send.size(0) / g.size);
  return call("_c10d_functional::all_to_all_single",
              {send.contiguous(), c10::IValue(splits), c10::IValue(splits), c10::IValue(g.name)});
}

// Every rank's t concatenated on dim 0 (rank order).
inline at::Tensor all_gather(const Group& g, const at::Tensor& t) {
  return call("_c10d_functional::all_gather_into_tensor",
              {t.contiguous(), c10::IValue(g.size), c10::IValue(g.name)});
}

// (B, H, S, D) of this rank's tokens -> (B, H/N, N*S, D) of its heads over every rank's
// tokens, a view of (B, N*S, H/N, D) memory (the attention's layout).
inline at::Tensor to_heads(const Group& g, const at::Tensor& t) {
  const int64_t N = g.size, B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  // (N, B, H/N, S, D), block j: head block j; one copy into the send buffer
  at::Tensor send = at::empty({N, B, H / N, S, D}, t.options());
  send.copy_(t.unflatten(1, {N, H / N}).transpose(0, 1));
  const at::Tensor recv = all_to_all(g, send);  // block i: rank i's tokens
  at::Tensor out = at::empty({B, N * S, H / N, D}, t.options());
  out.view({B, N, S, H / N, D}).copy_(recv.permute({1, 0, 3, 2, 4}));
  return out.transpose(1, 2);
}

// The inverse of to_heads: (B, H/N, N*S, D) -> (B, H, S, D), a view of (B, S, H, D) memory.
inline at::Tensor to_tokens(const Group& g, const at::Tensor& t) {
  const int64_t N = g.size, B = t.size(0), Hn = t.size(1), S = t.size(2) / N, D = t.size(3);
  // (N, B, Hn, S, D), block i: the tokens of rank i; one copy into the send buffer
  at::Tensor send = at::empty({N, B, Hn, S, D}, t.options());
  send.copy_(t.unflatten(2, {N, S}).permute({2, 0, 1, 3, 4}));
  const at::Tensor recv = all_to_all(g, send);  // block j: heads j*Hn.. of this rank's tokens
  at::Tensor out = at::empty({B, S, N * Hn, D}, t.options());
  out.view({B, S, N, Hn, D}).copy_(recv.permute({1, 3, 0, 2, 4}));
  return out.transpose(1, 2);
}

// lse (B, H, S) <-> (B, H/N, N*S), contiguous.
inline at::Tensor lse_to_heads(const Group& g, const at::Tensor& lse) {
  return to_heads(g, lse.unsqueeze(-1)).squeeze(-1).contiguous();
}
inline at::Tensor lse_to_tokens(const Group& g, const at::Tensor& lse) {
  return to_tokens(g, lse.unsqueeze(-1)).squeeze(-1).contiguous();
}

// KV heads as exchanged: Hkv when N divides it, else (N a multiple of Hkv) N, each head
// repeated N / Hkv times.
inline int64_t kv_repeats(const Group& g, int64_t hkv) {
  return hkv % g.size == 0 ? 1 : g.size / hkv;
}
inline at::Tensor repeat_kv(const at::Tensor& t, int64_t rep) {  // (B, Hkv, S, D)
  return rep == 1 ? t : t.repeat_interleave(rep, 1);
}
// (B, Hkv * rep, S, D) -> (B, Hkv, S, D), a view of (B, S, Hkv, D) memory
inline at::Tensor sum_kv(const at::Tensor& t, int64_t rep) {
  if (rep == 1) return t;
  const at::Tensor s = t.reshape({t.size(0), t.size(1) / rep, rep, t.size(2), t.size(3)}).sum(2);
  at::Tensor out = at::empty({s.size(0), s.size(2), s.size(1), s.size(3)}, s.options());
  return out.transpose(1, 2).copy_(s);
}

// A (B, S) per-token tensor (padding mask, segment ids) of every rank: (B, N*S).
inline at::Tensor gather_tokens(const Group& g, const at::Tensor& t) {
  const bool is_bool = t.scalar_type() == at::kBool;
  const at::Tensor send = (is_bool ? t.to(at::kInt) : t).t().contiguous();  // (S, B)
  const at::Tensor all = all_gather(g, send).t();                             // (B, N*S)
  return (is_bool ? all.to(at::kBool) : all).contiguous();
}

}  // namespace ulysses
}  // namespace ckpt_ext
