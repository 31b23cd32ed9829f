// Input checks shared by the ckpt_ext kernel ops (csrc/*_cpu.cpp) and the block Functions.
//
// Every message starts with the op name and names the offending argument, so that a user sees
// which tensor of which call is wrong, e.g.
//   "attention_fwd: k must have Hkv dividing Hq=32, got Hkv=5"
//   "rms_norm_fwd: weight must have shape (4096,) to match x's last dim, got (4095,)"
// Shapes are printed as Python tuples and dtypes with their torch names (float32, bfloat16).
//
// Exception types, as Python sees them:
//   CKPT_CHECK_TYPE   -> TypeError    (wrong dtype)
//   CKPT_CHECK_VALUE  -> ValueError   (wrong rank, shape, size, empty batch, bad option)
//   CKPT_CHECK        -> RuntimeError (tensors on different devices, anything else)
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>

// cond false -> raise with message "<op>: <message parts...>".
#define CKPT_CHECK(cond, op, ...) TORCH_CHECK(cond, op, ": ", __VA_ARGS__)
#define CKPT_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, op, ": ", __VA_ARGS__)
#define CKPT_CHECK_TYPE(cond, op, ...) TORCH_CHECK_TYPE(cond, op, ": ", __VA_ARGS__)

namespace ckpt_ext {
namespace checks {

// A shape as Python prints a tuple: "()", "(4095,)", "(2, 3)".
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) os << ", ";
    os << sizes[i];
  }
  os << (sizes.size() == 1 ? ",)" : ")");
  return os.str();
}

// The torch name of a dtype: "float32", "bfloat16", "bool"; c10's name for the rarer ones.
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBool: return "bool";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    default: return c10::toString(t);
  }
}

// The dtype the kernels compute in: float64 for float64 inputs, float32 for everything else
// (float16 / bfloat16 inputs are widened, their results rounded once at the end).
inline at::ScalarType compute_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The output of rope_fwd / rope_bwd for input t (every implementation, and the fakes in
// ckpt_ext/ops.py): t's strides when t is non-empty, non-overlapping and dense with a unit
// last stride (e.g. the (B, H, S, D) view of (B, S, H, D) memory that attention reads and
// returns, so the caller merges heads with a view), contiguous otherwise.
inline at::Tensor rope_out_like(const at::Tensor& t) {
  if (t.numel() > 0 && t.stride(-1) == 1 && t.is_non_overlapping_and_dense())
    return at::empty_strided(t.sizes(), t.strides(), t.options());
  return at::empty(t.sizes(), t.options());
}

// An optional tensor argument that "does not apply": None, or the empty (0,) placeholder an op
// returns for an output that does not apply (see csrc/ckpt_ext.cpp). Symbolic sizes (a
// decoder_layer traced with dynamic shapes) are read as SymInts.
inline bool absent(const std::optional<at::Tensor>& t) {
  return !t.has_value() || !t->defined() || (t->dim() == 1 && t->sym_numel() == 0);
}

// t is a defined tensor (an undefined one reaches C++ only from C++ callers).
inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  CKPT_CHECK_VALUE(t.defined(), op, name, " must be a defined tensor");
}

// t is float16, bfloat16, float32 or float64.
inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  CKPT_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat || s == at::kDouble,
                  op, name, " must be float16, bfloat16, float32 or float64, got ",
                  dtype_str(s));
}

// t is int32 or int64 (ids, indices).
inline void check_index_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  CKPT_CHECK_TYPE(s == at::kInt || s == at::kLong, op, name, " must be int32 or int64, got ",
                  dtype_str(s));
}

// t has exactly `dim` dims; `layout` names them, e.g. "(B, Hq, S, D)".
inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                      const char* layout) {
  CKPT_CHECK_VALUE(t.dim() == dim, op, name, " must have ", dim, " dims ", layout,
                   ", got shape ", shape_str(t.sizes()));
}

// t has exactly the shape `expected`; `why` says where it comes from ("(I, H)", "to match x's
// last dim"), e.g. "weight must have shape (4096,) to match x's last dim, got (4095,)".
inline void check_shape(const char* op, const char* name, const at::Tensor& t,
                        c10::IntArrayRef expected, const std::string& why) {
  CKPT_CHECK_VALUE(t.sizes().equals(expected), op, name, " must have shape ",
                   shape_str(expected), " ", why, ", got ", shape_str(t.sizes()));
}

// t has the dtype of ref (named ref_name).
inline void check_dtype_as(const char* op, const char* name, const at::Tensor& t,
                           const char* ref_name, const at::Tensor& ref) {
  CKPT_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, name, " must have the dtype of ",
                  ref_name, " (", dtype_str(ref.scalar_type()), "), got ",
                  dtype_str(t.scalar_type()));
}

// t has exactly the dtype `expected`; `why` explains the rule ("(the output dtype)").
inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        at::ScalarType expected, const char* why = "") {
  CKPT_CHECK_TYPE(t.scalar_type() == expected, op, name, " must be ", dtype_str(expected), why,
                  ", got ", dtype_str(t.scalar_type()));
}

// t lives on the device of ref (named ref_name).
inline void check_device_as(const char* op, const char* name, const at::Tensor& t,
                            const char* ref_name, const at::Tensor& ref) {
  CKPT_CHECK(t.device() == ref.device(), op, name, " is on ", t.device().str(), " but ",
             ref_name, " is on ", ref.device().str(), "; all tensors must be on one device");
}

// A scalar argument that must be a finite number > 0 (a softmax scale, a tolerance).
inline void check_positive_finite(const char* op, const char* name, double x) {
  CKPT_CHECK_VALUE(std::isfinite(x) && x > 0, op, name, " must be a finite number > 0, got ", x);
}

// The usual trio for a tensor that must match a reference tensor in dtype and device and have
// a given shape.
inline void check_like(const char* op, const char* name, const at::Tensor& t,
                       const char* ref_name, const at::Tensor& ref, c10::IntArrayRef shape,
                       const std::string& why) {
  check_defined(op, name, t);
  check_shape(op, name, t, shape, why);
  check_dtype_as(op, name, t, ref_name, ref);
  check_device_as(op, name, t, ref_name, ref);
}

// t is an in-place accumulator of shape `expected`: float32, or float64 when ref is float64,
// on ref's device; any strides.
inline void check_accumulator(const char* op, const char* name, const at::Tensor& t,
                              const char* ref_name, const at::Tensor& ref,
                              c10::IntArrayRef expected, const std::string& why) {
  check_defined(op, name, t);
  check_shape(op, name, t, expected, why);
  const auto s = t.scalar_type();
  CKPT_CHECK_TYPE(s == at::kFloat || (s == at::kDouble && ref.scalar_type() == at::kDouble), op,
                  name, " must be float32 (or float64 when ", ref_name, " is float64), got ",
                  dtype_str(s));
  check_device_as(op, name, t, ref_name, ref);
}

}  // namespace checks
}  // namespace ckpt_ext
