// CPU implementation of lora_dropout (see csrc/lora_dropout.h for the mask).
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "lora_dropout.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "checks.h"

namespace ckpt_ext {
namespace dropout {

int64_t read_seed(const char* op, const char* name, const at::Tensor& seed) {
  CKPT_CHECK_VALUE(seed.defined(), op, name, " must be a tensor");
  CKPT_CHECK_VALUE(seed.device().is_cpu() && seed.numel() == 1 &&
                       at::isIntegralType(seed.scalar_type(), /*includeBool=*/false),
                   op, name, " must be a CPU integer tensor with one element (read without a "
                   "device sync), got a ", checks::dtype_str(seed.scalar_type()), " tensor of "
                   "shape ", checks::shape_str(seed.sizes()), " on ", seed.device());
  return seed.item<int64_t>();
}

void check_probability(const char* op, const char* name, double p) {
  CKPT_CHECK_VALUE(std::isfinite(p) && p >= 0.0 && p < 1.0, op, name,
                   " must be a probability in [0, 1), got ", p);
}

at::Tensor apply_cpu(const at::Tensor& x, uint32_t k, double p, int64_t row0) {
  at::Tensor src = x.contiguous();
  at::Tensor out = at::empty_like(src);
  if (src.numel() == 0) return out;
  const int64_t cols = src.size(-1), rows = src.numel() / cols;
  const uint32_t thr = threshold(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "lora_dropout",
                                  [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const acc_t inv = static_cast<acc_t>(1.0 / (1.0 - p));
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint32_t hr = mix32(static_cast<uint32_t>(row0 + r) ^ k);
        for (int64_t c = 0; c < cols; ++c) {
          const bool keep = mix32(hr ^ static_cast<uint32_t>(c)) >= thr;
          const acc_t v = static_cast<acc_t>(in[r * cols + c]) * inv;
          o[r * cols + c] = static_cast<scalar_t>(keep ? v : acc_t(0));
        }
      }
    });
  });
  return out;
}

}  // namespace dropout

namespace {

at::Tensor lora_dropout_cpu(const at::Tensor& x, const at::Tensor& seed, int64_t stream,
                            double p, int64_t row_offset) {
  const char* op = "lora_dropout";
  checks::check_defined(op, "x", x);
  checks::check_floating(op, "x", x);
  dropout::check_probability(op, "p", p);
  CKPT_CHECK_VALUE(row_offset >= 0, op, "row_offset must be >= 0, got ", row_offset);
  const int64_t s = dropout::read_seed(op, "seed", seed);
  if (x.dim() == 0) {
    // A 0-d tensor is one element, row 0 and column 0 (the (1, 1) view).
    return dropout::apply_cpu(x.reshape({1}), dropout::key(s, stream), p, row_offset)
        .reshape(c10::IntArrayRef{});
  }
  return dropout::apply_cpu(x, dropout::key(s, stream), p, row_offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) { m.impl("lora_dropout", &lora_dropout_cpu); }

}  // namespace ckpt_ext
