// libtorch's own profiler (Kineto, what `torch.profiler.profile` drives from Python) for the
// Rust side: on, off with a Chrome trace written, and named scopes (`record_function`). The
// trace of `host train` and the one `torch.profiler` writes for a PyTorch loop are then the
// same format, read by the same script (bench/trace_table.py). Kineto keeps its state per
// process and propagates it to autograd's threads as Python's profiler does; operators a
// plugin dispatches are recorded too (one libtorch per process).
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <memory>
#include <set>
#include <string>

#include "guarded.h"

namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// As Python's `profile(activities=...)` with its defaults: no shapes, memory or stacks.
ProfilerConfig config() { return ProfilerConfig(ProfilerState::KINETO, false, false, false, false, false); }

std::set<ActivityType> activities(int cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda != 0) {
    a.insert(ActivityType::CUDA);
  }
  return a;
}

}  // namespace

extern "C" {

// Starts recording on this thread (and the autograd threads its work reaches), CUDA kernels
// too when `cuda`; 1 on success, 0 with the message in `err`.
int rak_profiler_start(int cuda, char* err, size_t len) {
  return rak::guarded(err, len, 0, [&] {
    profiler::prepareProfiler(config(), activities(cuda));
    profiler::enableProfiler(config(), activities(cuda));
    return 1;
  });
}

// Stops recording; writes the Chrome trace to `path` unless it is null; 1 on success, 0 with
// the message in `err`.
int rak_profiler_stop(const char* path, char* err, size_t len) {
  return rak::guarded(err, len, 0, [&] {
    std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
    if (path != nullptr && result) {
      result->save(path);
    }
    return 1;
  });
}

// Opens a named scope (`torch.profiler.record_function(name)`), to be closed by
// `rak_scope_end` on the same thread; null (nothing to close) if it cannot be made.
void* rak_scope_begin(const char* name) {
  char unused[1];
  return rak::guarded(unused, 0, static_cast<void*>(nullptr), [&] {
    auto scope = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (scope->isActive()) {
      scope->before(std::string(name));
    }
    return static_cast<void*>(scope.release());
  });
}

// Closes a scope `rak_scope_begin` opened (its end is recorded as it is destroyed).
void rak_scope_end(void* scope) {
  char unused[1];
  rak::guarded(unused, 0, 0, [&] {
    delete static_cast<at::RecordFunction*>(scope);
    return 0;
  });
}

}  // extern "C"
