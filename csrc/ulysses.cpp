// The process group behind the op's sequence_parallel name (csrc/ulysses.h).
#include "ulysses.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>

namespace ckpt_ext {
namespace ulysses {

Group resolve(c10::string_view name, const char* op) {
  Group g;
  g.name = std::string(name);
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(g.name);
  } catch (const std::exception& e) {
    CKPT_CHECK_VALUE(false, op, "sequence_parallel='", g.name,
                     "' is not a registered process group name (pass group.group_name of a "
                     "torch.distributed group): ", e.what());
  }
  g.rank = pg->getRank();
  g.size = pg->getSize();
  return g;
}

namespace {

// The record one rank contributes: [error kind, the fields' values..., the message's bytes].
enum Kind : int64_t { kOk = 0, kValue, kType, kNotImplemented, kOther };
// Every record is kWords int64 words whatever the point (ckpt_ext/hf/sequence_parallel.py's
// too), so that ranks at different points still exchange the same bytes.
constexpr int64_t kWords = 128;
constexpr int64_t kMessageWords = 96;  // 768 bytes of the refusing rank's message

std::pair<int64_t, std::string> describe(std::exception_ptr error) {
  if (!error) return {kOk, ""};
  try {
    std::rethrow_exception(error);
  } catch (const c10::ValueError& e) {
    return {kValue, e.what_without_backtrace()};
  } catch (const c10::TypeError& e) {
    return {kType, e.what_without_backtrace()};
  } catch (const c10::NotImplementedError& e) {
    return {kNotImplemented, e.what_without_backtrace()};
  } catch (const c10::Error& e) {
    return {kOther, e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {kOther, e.what()};
  }
  return {kOther, "an unknown exception"};
}

}  // namespace

void agree(const Group& g, const char* op, c10::Device device, std::exception_ptr error,
           const std::vector<Field>& fields) {
  auto [kind, message] = describe(error);
  const int64_t width = kWords;
  int64_t used = 1;
  for (const Field& f : fields) used += static_cast<int64_t>(f.values.size());
  TORCH_CHECK(used <= kWords - kMessageWords, "ulysses::agree: too many field values");
  at::Tensor mine = at::zeros({width}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = kind;
  int64_t i = 1;
  for (const Field& f : fields)
    for (int64_t v : f.values) m[i++] = v;
  const size_t cap = kMessageWords * sizeof(int64_t) - 1;  // the last byte stays 0
  if (message.size() > cap) message = message.substr(0, cap - 3) + "...";
  std::memcpy(m + width - kMessageWords, message.data(), message.size());
  // the record on the call's device (CUDA for NCCL, the CPU for gloo), read on the host
  const at::Tensor all = all_gather(g, mine.to(device)).cpu().view({g.size, width});
  const int64_t* a = all.data_ptr<int64_t>();
  for (int64_t r = 0; r < g.size; ++r) {
    const int64_t* rec = a + r * width;
    if (rec[0] == kOk) continue;
    const std::string what(reinterpret_cast<const char*>(rec + width - kMessageWords));
    const std::string text = what + " [sequence_parallel: refused on rank " +
                             std::to_string(r) + " of the group's " + std::to_string(g.size) +
                             " ranks; every rank raises this]";
    switch (rec[0]) {
      case kValue: TORCH_CHECK_VALUE(false, text);
      case kType: TORCH_CHECK_TYPE(false, text);
      case kNotImplemented: TORCH_CHECK_NOT_IMPLEMENTED(false, text);
      default: TORCH_CHECK(false, text);
    }
  }
  int64_t off = 1;
  for (const Field& f : fields) {
    const int64_t n = static_cast<int64_t>(f.values.size());
    bool same = true;
    for (int64_t r = 1; r < g.size && same; ++r)
      same = std::equal(a + off, a + off + n, a + r * width + off);
    if (!same) {
      std::ostringstream ranks;
      for (int64_t r = 0; r < g.size; ++r) {
        ranks << (r ? "; " : "") << "rank " << r << " (";
        for (int64_t j = 0; j < n; ++j) ranks << (j ? ", " : "") << a[r * width + off + j];
        ranks << ")";
      }
      CKPT_CHECK_VALUE(false, op, "under sequence_parallel every rank passes ", f.what,
                       "; the ranks passed ", ranks.str());
    }
    off += n;
  }
}

}  // namespace ulysses
}  // namespace ckpt_ext
