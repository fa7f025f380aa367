// CUDA code of our own without a CUDA compiler at build time: keyed_mask.cuh is compiled by
// NVRTC (the CUDA runtime compiler the torch wheel ships) the first time a GPU needs it, and
// launched through the CUDA driver API on torch's current stream. Both libraries are opened
// with dlopen and their few functions declared here, so this file builds against any libtorch,
// CPU-only ones included, and needs no CUDA headers: the path simply reports that it cannot
// run, and models/dropout.rs keeps its tensor form.
// The mask kernel is compiled for the device's own architecture when NVRTC knows it (a CUBIN:
// no JIT by the driver), else as PTX for the newest architecture NVRTC knows below it.
// No C++ exception may cross into Rust: each entry point runs its body inside `guarded`.
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "guarded.h"
#include "keyed_mask.cuh"

namespace {

using rak::guarded;

// The C types of cuda.h and nvrtc.h that cross these calls (enums are ints, handles pointers).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;
using nvrtcResult = int;
using nvrtcProgram = void*;
constexpr int kComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kComputeCapabilityMinor = 76;

template <typename F>
F symbol(void* lib, const char* name, const std::string& from) {
  void* f = dlsym(lib, name);
  if (f == nullptr) throw std::runtime_error(from + " has no " + name);
  return reinterpret_cast<F>(f);
}

// The folder of libtorch's libraries (where libc10 was loaded from).
std::filesystem::path torch_lib_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) == 0 || info.dli_fname == nullptr) return {};
  return std::filesystem::path(info.dli_fname).parent_path();
}

// NVRTC: the copy this process already loaded (torch's, when it compiled kernels of its own),
// else the newest in the pip layout beside torch (site-packages/nvidia/<package>/lib/
// libnvrtc.so.<major>: the one built with this torch), else by name on the loader's path.
void* open_nvrtc(std::string* where) {
  const char* names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  for (const char* name : names) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
      *where = name;
      return lib;
    }
  }
  std::error_code ec;
  const std::filesystem::path torch_lib = torch_lib_dir();
  std::filesystem::path nvidia = torch_lib.empty() ? std::filesystem::path() : torch_lib.parent_path().parent_path() / "nvidia";
  std::vector<std::filesystem::path> found;
  for (const auto& package : std::filesystem::directory_iterator(nvidia, ec)) {
    for (const auto& file : std::filesystem::directory_iterator(package.path() / "lib", ec)) {
      std::string name = file.path().filename().string();
      // libnvrtc.so.13, not libnvrtc-builtins.so.13.0 nor libnvrtc.alt.so.13.
      if (name.rfind("libnvrtc.so.", 0) == 0) found.push_back(file.path());
    }
  }
  // The newest first, by the version after "libnvrtc.so." (as numbers: 13 after 12).
  auto version = [](const std::filesystem::path& p) { return std::atoi(p.filename().string().c_str() + std::strlen("libnvrtc.so.")); };
  std::sort(found.begin(), found.end(), [&](const auto& a, const auto& b) { return version(a) < version(b); });
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    // NVRTC opens its builtins (libnvrtc-builtins.so.<version>) by name when it compiles, and
    // its own folder is not on the loader's path: loaded first from there, they are found.
    for (const auto& file : std::filesystem::directory_iterator(it->parent_path(), ec)) {
      std::string name = file.path().filename().string();
      if (name.rfind("libnvrtc-builtins.so.", 0) == 0) dlopen(file.path().c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
    if (void* lib = dlopen(it->c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *where = it->string();
      return lib;
    }
  }
  for (const char* name : names) {
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      *where = name;
      return lib;
    }
  }
  throw std::runtime_error("NVRTC (libnvrtc.so) not found beside libtorch (under " + nvidia.string() + ") nor by name");
}

struct Nvrtc {
  std::string where;
  const char* (*error)(nvrtcResult);
  nvrtcResult (*num_archs)(int*);
  nvrtcResult (*archs)(int*);
  nvrtcResult (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  nvrtcResult (*destroy)(nvrtcProgram*);
  nvrtcResult (*compile)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*log_size)(nvrtcProgram, size_t*);
  nvrtcResult (*log)(nvrtcProgram, char*);
  nvrtcResult (*cubin_size)(nvrtcProgram, size_t*);
  nvrtcResult (*cubin)(nvrtcProgram, char*);
  nvrtcResult (*ptx_size)(nvrtcProgram, size_t*);
  nvrtcResult (*ptx)(nvrtcProgram, char*);

  static const Nvrtc& get() {
    static const Nvrtc n = [] {
      Nvrtc n;
      void* lib = open_nvrtc(&n.where);
      n.error = symbol<decltype(n.error)>(lib, "nvrtcGetErrorString", n.where);
      n.num_archs = symbol<decltype(n.num_archs)>(lib, "nvrtcGetNumSupportedArchs", n.where);
      n.archs = symbol<decltype(n.archs)>(lib, "nvrtcGetSupportedArchs", n.where);
      n.create = symbol<decltype(n.create)>(lib, "nvrtcCreateProgram", n.where);
      n.destroy = symbol<decltype(n.destroy)>(lib, "nvrtcDestroyProgram", n.where);
      n.compile = symbol<decltype(n.compile)>(lib, "nvrtcCompileProgram", n.where);
      n.log_size = symbol<decltype(n.log_size)>(lib, "nvrtcGetProgramLogSize", n.where);
      n.log = symbol<decltype(n.log)>(lib, "nvrtcGetProgramLog", n.where);
      n.cubin_size = symbol<decltype(n.cubin_size)>(lib, "nvrtcGetCUBINSize", n.where);
      n.cubin = symbol<decltype(n.cubin)>(lib, "nvrtcGetCUBIN", n.where);
      n.ptx_size = symbol<decltype(n.ptx_size)>(lib, "nvrtcGetPTXSize", n.where);
      n.ptx = symbol<decltype(n.ptx)>(lib, "nvrtcGetPTX", n.where);
      return n;
    }();
    return n;
  }

  void check(nvrtcResult r, const char* what) const {
    if (r != 0) throw std::runtime_error(std::string("NVRTC ") + what + ": " + error(r));
  }
};

// `source` compiled for compute capability major.minor: a CUBIN for that architecture when
// NVRTC knows it, else PTX for the newest architecture it knows below it (the driver then
// compiles the PTX when loading it).
std::string compile(const std::string& source, int major, int minor) {
  const Nvrtc& n = Nvrtc::get();
  int count = 0;
  n.check(n.num_archs(&count), "supported architectures");
  std::vector<int> archs(count);
  n.check(n.archs(archs.data()), "supported architectures");
  const int arch = major * 10 + minor;
  const bool exact = std::find(archs.begin(), archs.end(), arch) != archs.end();
  int target = arch;
  if (!exact) {
    target = -1;
    for (int a : archs) {
      if (a <= arch) target = std::max(target, a);
    }
    if (target < 0) throw std::runtime_error("NVRTC (" + n.where + ") compiles for no architecture at or below sm_" + std::to_string(arch));
  }
  const std::string flag = std::string("--gpu-architecture=") + (exact ? "sm_" : "compute_") + std::to_string(target);
  const char* options[] = {flag.c_str()};
  nvrtcProgram prog = nullptr;
  n.check(n.create(&prog, source.c_str(), "keyed_mask.cu", 0, nullptr, nullptr), "create program");
  struct Destroy {
    const Nvrtc& n;
    nvrtcProgram* p;
    ~Destroy() { n.destroy(p); }
  } destroy{n, &prog};
  if (n.compile(prog, 1, options) != 0) {
    size_t size = 0;
    n.log_size(prog, &size);
    std::string log(size, '\0');
    n.log(prog, log.data());
    throw std::runtime_error("NVRTC could not compile the keyed dropout kernel (" + flag + "): " + log);
  }
  size_t size = 0;
  n.check(exact ? n.cubin_size(prog, &size) : n.ptx_size(prog, &size), "binary size");
  std::string binary(size, '\0');
  n.check(exact ? n.cubin(prog, binary.data()) : n.ptx(prog, binary.data()), "binary");
  return binary;
}

struct Driver {
  CUresult (*error)(CUresult, const char**);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*attribute)(int*, int, CUdevice);
  CUresult (*primary_retain)(CUcontext*, CUdevice);
  CUresult (*get_current)(CUcontext*);
  CUresult (*set_current)(CUcontext);
  CUresult (*load)(CUmodule*, const void*);
  CUresult (*function)(CUfunction*, CUmodule, const char*);
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**, void**);

  static const Driver& get() {
    static const Driver d = [] {
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) throw std::runtime_error("the CUDA driver (libcuda.so.1) cannot be opened");
      const std::string from = "libcuda.so.1";
      Driver d;
      d.error = symbol<decltype(d.error)>(lib, "cuGetErrorString", from);
      d.device_get = symbol<decltype(d.device_get)>(lib, "cuDeviceGet", from);
      d.attribute = symbol<decltype(d.attribute)>(lib, "cuDeviceGetAttribute", from);
      d.primary_retain = symbol<decltype(d.primary_retain)>(lib, "cuDevicePrimaryCtxRetain", from);
      d.get_current = symbol<decltype(d.get_current)>(lib, "cuCtxGetCurrent", from);
      d.set_current = symbol<decltype(d.set_current)>(lib, "cuCtxSetCurrent", from);
      d.load = symbol<decltype(d.load)>(lib, "cuModuleLoadData", from);
      d.function = symbol<decltype(d.function)>(lib, "cuModuleGetFunction", from);
      d.launch = symbol<decltype(d.launch)>(lib, "cuLaunchKernel", from);
      return d;
    }();
    return d;
  }

  void check(CUresult r, const char* what) const {
    if (r == 0) return;
    const char* text = nullptr;
    error(r, &text);
    throw std::runtime_error(std::string("CUDA driver ") + what + ": " + (text ? text : std::to_string(r)));
  }
};

// The kernel loaded on one device, in the device's primary context (the one torch's runtime
// uses).
struct Loaded {
  CUcontext context;
  CUfunction kernel;
};

Loaded& loaded(int index, const char* source) {
  static std::mutex lock;
  static std::map<int, Loaded> by_device;
  static std::map<int, std::string> binaries;  // by architecture: several devices share one
  std::lock_guard<std::mutex> guard(lock);
  auto it = by_device.find(index);
  if (it != by_device.end()) return it->second;
  const Driver& d = Driver::get();
  CUdevice device = 0;
  d.check(d.device_get(&device, index), "device");
  int major = 0, minor = 0;
  d.check(d.attribute(&major, kComputeCapabilityMajor, device), "compute capability");
  d.check(d.attribute(&minor, kComputeCapabilityMinor, device), "compute capability");
  std::string& binary = binaries[major * 10 + minor];
  if (binary.empty()) binary = compile(source, major, minor);
  Loaded l{};
  d.check(d.primary_retain(&l.context, device), "primary context");
  CUcontext previous = nullptr;
  d.check(d.get_current(&previous), "current context");
  d.check(d.set_current(l.context), "set context");
  CUmodule module = nullptr;
  CUresult r = d.load(&module, binary.data());
  if (r == 0) r = d.function(&l.kernel, module, "rak_keyed_mask");
  d.set_current(previous);
  d.check(r, "load the keyed dropout kernel");
  return by_device.emplace(index, l).first->second;
}

}  // namespace

extern "C" {

// Fills `out` (a contiguous bool tensor of shape [B, m1, m2, n] on a CUDA device) with the
// keyed mask of `keys` (B int64 example keys on that device) for dropout call `call`, on
// torch's current stream there. `source` is keyed_mask.cuh's text.
int rak_keyed_mask_cuda(void* out, void* keys, unsigned m1, unsigned m2, unsigned n, unsigned call, unsigned threshold, const char* source,
                        char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    at::Tensor& o = *static_cast<at::Tensor*>(out);
    at::Tensor& k = *static_cast<at::Tensor*>(keys);
    if (!o.is_cuda() || !o.is_contiguous() || o.scalar_type() != at::kBool) throw std::runtime_error("the mask must be a contiguous bool CUDA tensor");
    if (!k.is_cuda() || k.device() != o.device() || !k.is_contiguous() || k.scalar_type() != at::kLong) throw std::runtime_error("the keys must be contiguous int64 on the mask's device");
    const int64_t runs = n == 0 ? 0 : o.numel() / n;
    if (runs == 0) return 1;
    if (runs > 0x7fffffff || k.numel() * int64_t(m1) * int64_t(m2) != runs) throw std::runtime_error("keyed mask: shape and keys disagree, or too many runs for one grid");
    const int index = o.device().index();
    Loaded& l = loaded(index, source);
    const Driver& d = Driver::get();
    c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(o.device());
    CUcontext previous = nullptr;
    d.check(d.get_current(&previous), "current context");
    if (previous != l.context) d.check(d.set_current(l.context), "set context");
    void* out_ptr = o.data_ptr();
    void* keys_ptr = k.data_ptr();
    void* args[] = {&out_ptr, &keys_ptr, &m1, &m2, &n, &call, &threshold};
    // One block a run; up to 256 threads, a whole number of warps.
    const unsigned threads = std::min(256u, (n + 31) / 32 * 32);
    CUresult r = d.launch(l.kernel, unsigned(runs), 1, 1, threads, 1, 1, 0, stream.native_handle(), args, nullptr);
    if (previous != l.context) d.set_current(previous);
    d.check(r, "launch the keyed dropout kernel");
    return 1;
  });
}

// Compiles `source` with NVRTC for compute capability major.minor, without a GPU (the tests'
// check that the kernel a GPU would run compiles); 1 on success.
int rak_keyed_mask_compile(int major, int minor, const char* source, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    compile(source, major, minor);
    return 1;
  });
}

// 1 if this libtorch is a CUDA build (libtorch_cuda.so beside libc10), whether or not a GPU is
// here: where NVRTC is to be found.
int rak_torch_is_cuda_build() {
  std::error_code ec;
  return std::filesystem::exists(torch_lib_dir() / "libtorch_cuda.so", ec) ? 1 : 0;
}

// The kernel's arithmetic on the host, over a [b, m1, m2, n] mask (row-major, one byte an
// element): the reference the tests hold to the Rust CPU fill.
void rak_keyed_mask_host(unsigned char* out, const uint64_t* keys, unsigned b, unsigned m1, unsigned m2, unsigned n, unsigned call, unsigned threshold) {
  const auto* k = reinterpret_cast<const unsigned long long*>(keys);
  for (unsigned run = 0; run < b * m1 * m2; run++) rak_fill_run(out, k, m1, m2, n, run, 0, 1, call, threshold);
}

}  // extern "C"
