// Shared by the C++ files of rak-core: no C++ exception may cross into Rust (undefined
// behaviour; in practice an abort), so every entry point runs its body inside `guarded`.
#pragma once

#include <cstring>
#include <exception>

namespace rak {

// Cannot throw: it only copies into the caller's buffer.
inline void set_error(char* err, size_t len, const char* msg) noexcept {
  if (err != nullptr && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = '\0';
  }
}

// Runs `body` and returns its result; if it throws anything at all, returns `failed` with the
// message in `err`. `noexcept` so that a mistake here ends in std::terminate, never in an
// exception unwinding into Rust.
template <typename T, typename F>
T guarded(char* err, size_t len, T failed, F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    set_error(err, len, e.what());
  } catch (...) {
    set_error(err, len, "unknown C++ exception (not a std::exception)");
  }
  return failed;
}

}  // namespace rak
