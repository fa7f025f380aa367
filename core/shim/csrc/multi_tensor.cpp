// libtorch's multi-tensor operators, which tch does not bind (it leaves out operators on
// tensor lists): the optimizer step off the CPU's fused loops (issue 33). On a GPU each of
// these is a few kernel launches for all of a model's parameters, where one operator per
// parameter is one launch each (199 parameters in BERT-base: several thousand launches a
// step through AdamW, clipping, the gradient sum and the non-finite check).
// Tensors cross as tch's `at::Tensor*`. No C++ exception may cross into Rust: each entry point
// runs its body inside `guarded`.
// The operators' own headers, not ATen/ATen.h (every operator's: twice the compile time).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>

#include <vector>

#include "guarded.h"

namespace {

using rak::guarded;

std::vector<at::Tensor> list(void** ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; i++) out.push_back(*static_cast<at::Tensor*>(ts[i]));
  return out;
}

at::Tensor& one(void* t) { return *static_cast<at::Tensor*>(t); }

}  // namespace

extern "C" {

// torch.optim.AdamW(fused=True)'s update of `n` parameters sharing `lr` and `weight_decay`,
// in place: `steps` are each parameter's step count (float32 scalars on its device), already
// advanced to this step, as `torch.optim.adamw._fused_adamw` hands them.
int rak_fused_adamw(void** params, void** grads, void** exp_avgs, void** exp_avg_sqs, void** steps, int n, double lr, double beta1,
                    double beta2, double weight_decay, double eps, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n), {}, list(steps, n), lr, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    return 1;
  });
}

// `ts[i] += scalar` for every tensor (the step counts' advance).
int rak_foreach_add_scalar_(void** ts, int n, double scalar, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::_foreach_add_(list(ts, n), scalar);
    return 1;
  });
}

// `a[i] += b[i]` for every pair (a gradient sum).
int rak_foreach_add_(void** a, void** b, int n, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::_foreach_add_(list(a, n), list(b, n));
    return 1;
  });
}

// `dst[i] = src[i]` for every pair (shapes equal).
int rak_foreach_copy_(void** dst, void** src, int n, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::_foreach_copy_(list(dst, n), list(src, n));
    return 1;
  });
}

// `ts[i] *= factor` for every tensor, `factor` a one-element tensor on their device (a
// clipping coefficient that never visits the host).
int rak_foreach_mul_tensor_(void** ts, int n, void* factor, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::_foreach_mul_(list(ts, n), one(factor));
    return 1;
  });
}

// `out` (a float32 tensor of `n` elements on their device) <- the L2 norm of each tensor,
// as torch.nn.utils.clip_grad_norm_ takes them (`torch._foreach_norm`).
int rak_foreach_norm(void** ts, int n, void* out, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::vector<at::Tensor> norms = at::_foreach_norm(list(ts, n));
    one(out).copy_(at::stack(norms).to(at::kFloat));
    return 1;
  });
}

// `found` (a float32 one-element tensor on their device, zero before) <- 1 if any tensor holds
// a NaN or an infinity: the grad scaler's check (`_amp_foreach_non_finite_check_and_unscale_`)
// with a scale of 1, which leaves every value as it is.
int rak_foreach_non_finite(void** ts, int n, void* found, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::Tensor& f = one(found);
    at::_amp_foreach_non_finite_check_and_unscale_(list(ts, n), f, at::ones({1}, f.options()));
    return 1;
  });
}

}  // extern "C"
