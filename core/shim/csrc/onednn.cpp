// oneDNN inference GEMMs for the CPU encoder path, reached through the dispatcher.
//
// libtorch's `linear` runs MKL's sgemm, which repacks the weight on every call and leaves
// bias, GELU and the residual add to separate passes over memory. libtorch also ships the
// oneDNN kernels PyTorch's own CPU compiler (inductor) uses: `mkldnn::_reorder_linear_weight`
// packs a weight once per forward pass and `mkldnn::_linear_pointwise` runs the GEMM with the
// bias and a GELU or residual add fused. They are registered operators, not part of the C API
// that tch wraps, so this file calls them by name. Tensors cross as tch's `at::Tensor*`.
//
// Two rules keep this safe:
// - The operators are private and their signatures may change between libtorch versions,
//   while the argument stacks below are built by hand for one signature. The Rust side
//   checks each schema once with `rak_onednn_check_schema` (against the lists in
//   `core/src/models/onednn.rs`, which mirror the stacks here) and does not use the path if one
//   differs.
// - No C++ exception may cross into Rust (undefined behaviour; in practice an abort). Every
//   entry point that can throw or allocate runs its whole body inside `guarded`, which also
//   catches exceptions that are not `std::exception`.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Scalar.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "guarded.h"

namespace {

struct Ops {
  std::optional<c10::OperatorHandle> pack, linear, linear_binary;
};

// Looked up once. The initialiser can throw (a throwing static initialiser is retried on the
// next call), so `ops()` is only called inside `guarded`.
const Ops& ops() {
  static const Ops o = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{d.findSchema({"mkldnn::_reorder_linear_weight", ""}),
               d.findSchema({"mkldnn::_linear_pointwise", ""}),
               d.findSchema({"mkldnn::_linear_pointwise", "binary"})};
  }();
  return o;
}

using rak::guarded;
using rak::set_error;

const at::Tensor& tensor(const void* p) { return *static_cast<const at::Tensor*>(p); }

// Runs `op` on `stack`; its output as a new heap tensor (tch frees it). Throws on failure,
// so only called inside `guarded`.
void* run(const std::optional<c10::OperatorHandle>& op, std::vector<c10::IValue>& stack) {
  if (!op) throw std::runtime_error("the oneDNN operators are not registered in this libtorch");
  op->callBoxed(&stack);
  return new at::Tensor(stack.at(0).toTensor());
}

// An argument as the Rust side's expected lists spell it: "type name", e.g. "Tensor? B".
std::string describe(const c10::Argument& a) { return a.type()->str() + " " + a.name(); }

}  // namespace

extern "C" {

// Whether this libtorch was built with oneDNN. Whether its operators have the signatures
// used here is `rak_onednn_check_schema`'s question.
int rak_onednn_available() {
  return guarded(nullptr, 0, 0, [] { return at::hasMKLDNN() ? 1 : 0; });
}

// A thread-local flag read; cannot throw.
int rak_grad_enabled() { return at::GradMode::is_enabled(); }

// Whether operator `name` (overload `overload`, "" for the default) takes exactly the
// arguments `expected` (`n` strings "type name", in order) and returns one tensor, which is
// what the stacks below assume: 1 if so, otherwise 0 with what differs in `err`.
int rak_onednn_check_schema(const char* name, const char* overload, const char* const* expected,
                            size_t n, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::string op = std::string(name) + (*overload ? "." + std::string(overload) : "");
    auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
    if (!handle) throw std::runtime_error(op + " is not registered in this libtorch");
    const c10::FunctionSchema& schema = handle->schema();
    const auto& args = schema.arguments();
    std::string why;
    if (args.size() != n) why = "takes " + std::to_string(args.size()) + " arguments, expected " + std::to_string(n) + "; ";
    for (size_t i = 0; i < std::max(n, args.size()); ++i) {
      std::string have = i < args.size() ? describe(args[i]) : "nothing";
      std::string want = i < n ? expected[i] : "nothing";
      if (have != want) {
        why += "argument " + std::to_string(i) + " is `" + have + "`, expected `" + want + "`";
        break;
      }
    }
    const auto& returns = schema.returns();
    if (why.empty() && (returns.size() != 1 || returns[0].type()->kind() != c10::TypeKind::TensorType))
      why = "does not return exactly one Tensor";
    if (why.empty()) return 1;
    std::ostringstream msg;
    msg << op << " " << why << " (its schema here: " << schema << ")";
    throw std::runtime_error(msg.str());
  });
}

// Test-only: throws something that is not a std::exception inside `guarded`, so a Rust test
// can check that it comes back as an error instead of unwinding into Rust.
int rak_onednn_test_throw(char* err, size_t len) {
  struct NotAStdException {};
  return guarded(err, len, 0, []() -> int { throw NotAStdException{}; });
}

// The stacks below supply every argument, in the order the Rust side's expected lists give.

// `weight` [out, in] packed for about `rows` input rows.
// mkldnn::_reorder_linear_weight(Tensor self, int? batch_size)
void* rak_onednn_pack(const void* weight, int64_t rows, char* err, size_t len) {
  return guarded<void*>(err, len, nullptr, [&] {
    std::vector<c10::IValue> stack{tensor(weight), c10::IValue(rows)};
    return run(ops().pack, stack);
  });
}

// x·Wᵀ + b, then `attr` ("none", "gelu", "relu"); `algorithm` picks GELU's form ("none" for
// erf, "tanh") and may be null.
// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm)
void* rak_onednn_linear(const void* x, const void* packed, const void* bias, const char* attr,
                        const char* algorithm, char* err, size_t len) {
  return guarded<void*>(err, len, nullptr, [&] {
    std::vector<c10::IValue> stack{
        tensor(x), tensor(packed), bias ? c10::IValue(tensor(bias)) : c10::IValue(), std::string(attr),
        c10::IValue(c10::List<std::optional<at::Scalar>>()),
        algorithm ? c10::IValue(std::string(algorithm)) : c10::IValue()};
    return run(ops().linear, stack);
  });
}

// x·Wᵀ + b + other (the residual add fused into the GEMM).
// mkldnn::_linear_pointwise.binary(Tensor X, Tensor other, Tensor W, Tensor? B, str attr)
void* rak_onednn_linear_add(const void* x, const void* other, const void* packed, const void* bias,
                            char* err, size_t len) {
  return guarded<void*>(err, len, nullptr, [&] {
    std::vector<c10::IValue> stack{tensor(x), tensor(other), tensor(packed),
                                   bias ? c10::IValue(tensor(bias)) : c10::IValue(), std::string("add")};
    return run(ops().linear_binary, stack);
  });
}

}  // extern "C"
