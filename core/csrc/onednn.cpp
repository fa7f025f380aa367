// oneDNN inference GEMMs for the CPU encoder path, reached through the dispatcher.
//
// libtorch's `linear` runs MKL's sgemm, which repacks the weight on every call and leaves
// bias, GELU and the residual add to separate passes over memory. libtorch also ships the
// oneDNN kernels PyTorch's own CPU compiler (inductor) uses: `mkldnn::_reorder_linear_weight`
// packs a weight once per forward pass and `mkldnn::_linear_pointwise` runs the GEMM with the
// bias and a GELU or residual add fused. They are registered operators, not part of the C API
// that tch wraps, so this file calls them by name. Tensors cross as tch's `at::Tensor*`.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Scalar.h>

#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace {

struct Ops {
  std::optional<c10::OperatorHandle> pack, linear, linear_binary;
};

const Ops& ops() {
  static const Ops o = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{d.findSchema({"mkldnn::_reorder_linear_weight", ""}),
               d.findSchema({"mkldnn::_linear_pointwise", ""}),
               d.findSchema({"mkldnn::_linear_pointwise", "binary"})};
  }();
  return o;
}

void set_error(char* err, size_t len, const char* msg) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = '\0';
  }
}

const at::Tensor& tensor(const void* p) { return *static_cast<const at::Tensor*>(p); }

// Runs `op` on `stack`; a new heap tensor (tch frees it) or null with the message in `err`.
void* call(const std::optional<c10::OperatorHandle>& op, std::vector<c10::IValue> stack, char* err, size_t len) {
  if (!op) {
    set_error(err, len, "the oneDNN operators are not registered in this libtorch");
    return nullptr;
  }
  try {
    op->callBoxed(&stack);
    return new at::Tensor(stack.at(0).toTensor());
  } catch (const std::exception& e) {
    set_error(err, len, e.what());
    return nullptr;
  }
}

}  // namespace

extern "C" {

int rak_onednn_available() {
  const Ops& o = ops();
  return at::hasMKLDNN() && o.pack && o.linear && o.linear_binary;
}

int rak_grad_enabled() { return at::GradMode::is_enabled(); }

// `weight` [out, in] packed for about `rows` input rows.
void* rak_onednn_pack(const void* weight, int64_t rows, char* err, size_t len) {
  return call(ops().pack, {tensor(weight), c10::IValue(rows)}, err, len);
}

// x·Wᵀ + b, then `attr` ("none", "gelu", "relu"); `algorithm` picks GELU's form ("none" for
// erf, "tanh") and may be null.
void* rak_onednn_linear(const void* x, const void* packed, const void* bias, const char* attr,
                        const char* algorithm, char* err, size_t len) {
  std::vector<c10::IValue> stack{
      tensor(x), tensor(packed), bias ? c10::IValue(tensor(bias)) : c10::IValue(), std::string(attr),
      c10::IValue(c10::List<std::optional<at::Scalar>>()),
      algorithm ? c10::IValue(std::string(algorithm)) : c10::IValue()};
  return call(ops().linear, std::move(stack), err, len);
}

// x·Wᵀ + b + other (the residual add fused into the GEMM).
void* rak_onednn_linear_add(const void* x, const void* other, const void* packed, const void* bias,
                            char* err, size_t len) {
  std::vector<c10::IValue> stack{tensor(x), tensor(other), tensor(packed),
                                 bias ? c10::IValue(tensor(bias)) : c10::IValue(), std::string("add")};
  return call(ops().linear_binary, std::move(stack), err, len);
}

}  // extern "C"
