// Two autograd controls libtorch has and tch does not wrap:
// - clearing a parameter's gradient (`p.grad = None` in Python), so that a parameter a
//   backward pass did not reach has no gradient at all instead of a zero one (an optimizer
//   then leaves it alone, as torch's do);
// - autocast on the CPU as well as CUDA (tch's `autocast` only switches CUDA's), for bf16
//   mixed-precision training with float32 master weights.
// Tensors cross as tch's `at::Tensor*`. No C++ exception may cross into Rust: each entry point
// runs its body inside `guarded`.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>

#include "guarded.h"

namespace {

using rak::guarded;

at::DeviceType device_type(int device) { return device == 1 ? at::kCUDA : at::kCPU; }

}  // namespace

extern "C" {

// Drops the gradient of `t` (a leaf); 1 on success, 0 with the message in `err`.
int rak_clear_grad(void* t, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    static_cast<at::Tensor*>(t)->mutable_grad().reset();
    return 1;
  });
}

// Enters a bf16 autocast region on the CPU (`device` 0) or CUDA (1), as entering
// `torch.autocast(device, torch.bfloat16)` does. Writes the flag and dtype it found to
// `was_on` and `was_dtype` for `rak_autocast_exit`; 1 on success, 0 with the message in `err`.
int rak_autocast_enter(int device, int* was_on, int* was_dtype, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::DeviceType d = device_type(device);
    *was_on = at::autocast::is_autocast_enabled(d) ? 1 : 0;
    *was_dtype = static_cast<int>(at::autocast::get_autocast_dtype(d));
    at::autocast::set_autocast_enabled(d, true);
    at::autocast::set_autocast_dtype(d, at::kBFloat16);
    at::autocast::increment_nesting();
    return 1;
  });
}

// Leaves the region: restores what `rak_autocast_enter` found and, when the outermost region
// ends, clears the cache of cast weights (as `torch.autocast.__exit__`).
int rak_autocast_exit(int device, int was_on, int was_dtype, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::DeviceType d = device_type(device);
    at::autocast::set_autocast_enabled(d, was_on != 0);
    at::autocast::set_autocast_dtype(d, static_cast<at::ScalarType>(was_dtype));
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    return 1;
  });
}

}  // extern "C"
