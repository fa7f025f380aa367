// libtorch's own c10d (the engine behind torch.distributed) for multi-process training:
// a TCPStore rendezvous and a Gloo process group over it, with the few collectives the trainer
// needs. Compiled only where Gloo's headers are found (Debian's libgloo-dev: the torch wheel
// ships c10d's headers and Gloo's code inside libtorch_cpu, not Gloo's headers); see build.rs.
// Where the CUDA and NCCL headers are found too (USE_C10D_NCCL), a group may also hold an
// NCCL process group, which then carries every CUDA tensor's collective, as torch's
// "cpu:gloo,cuda:nccl" backend does; CPU tensors and barriers stay on Gloo.
// Tensors cross as tch's `at::Tensor*`. No C++ exception may cross into Rust: each entry point
// runs its body inside `guarded`.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <stdexcept>
#include <string>
#include <memory>
#include <vector>

#include "guarded.h"

namespace {

using rak::guarded;

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  // The group's own keys (under its prefix), for the waits of rank-0-only phases.
  c10::intrusive_ptr<c10d::Store> scoped;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  // Null unless the group was joined with NCCL.
  c10::intrusive_ptr<c10d::Backend> nccl;

  // The backend that carries `t`'s collective.
  c10d::Backend& on(const at::Tensor& t) {
    if (nccl && t.is_cuda()) return *nccl;
    return *pg;
  }
};

Group* group(void* g) { return static_cast<Group*>(g); }

std::vector<at::Tensor> tensors(void** ts, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; i++) out.push_back(*static_cast<at::Tensor*>(ts[i]));
  return out;
}

}  // namespace

extern "C" {

// Joins a group of `world` processes: rank 0's TCPStore serves on `listen_fd`, a socket the
// caller bound to host:port and listens on (TCPStore alone binds every interface, `::` or
// 0.0.0.0, whatever `host` says), unless `store_is_client` (torchrun's agent already serves
// the store); the others connect. The server owns `listen_fd` from here on. Then a
// Gloo process group over the store under `prefix`. Its sockets bind to `bind`: "" this
// machine's hostname's address (Gloo's default), "iface:NAME" that interface, else that host
// or address. `timeout_ms` bounds the rendezvous and every collective (a rank that dies makes
// the others fail within it). With `nccl`, an NCCL group over the same store carries CUDA
// tensors' collectives (an error in a build without NCCL). Returns the group, or null with the
// message in `err`.
void* rak_dist_init(const char* host, int port, int listen_fd, int rank, int world, int store_is_client, const char* prefix,
                    const char* bind, long timeout_ms, int nccl, char* err, size_t len) {
  return guarded(err, len, static_cast<void*>(nullptr), [&]() -> void* {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = rank == 0 && store_is_client == 0;
    opts.numWorkers = world;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    if (opts.isServer) {
      if (listen_fd < 0) throw std::runtime_error("rank 0 serves the store but was given no listening socket");
      opts.masterListenFd = listen_fd;
    }
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    std::string where(bind);
    if (where.empty()) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    } else if (where.rfind("iface:", 0) == 0) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(where.substr(6)));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(where));
    }
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, world, options);
    c10::intrusive_ptr<c10d::Backend> nccl_pg;
    if (nccl) {
#ifdef USE_C10D_NCCL
      auto nccl_store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix) + "/nccl", store);
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      nccl_pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, rank, world, nccl_options);
#else
      throw std::runtime_error("this build has no NCCL (the CUDA and NCCL headers were not found when it was built)");
#endif
    }
    return new Group{store, scoped, pg, nccl_pg};
  });
}

// Whether this build can make NCCL groups.
int rak_dist_has_nccl() noexcept {
#ifdef USE_C10D_NCCL
  return 1;
#else
  return 0;
#endif
}

void rak_dist_free(void* g) noexcept {
  // NCCL's group is shut down before it is destroyed, as destroy_process_group does (its
  // destructor warns otherwise); a failure there changes nothing for a process leaving.
  if (auto nccl = group(g)->nccl) {
    try {
      nccl->shutdown();
    } catch (...) {
    }
  }
  delete group(g);
}

// Sums `t` in place across the group.
int rak_dist_allreduce_sum(void* g, void* t, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::vector<at::Tensor> v{*static_cast<at::Tensor*>(t)};
    group(g)->on(v[0]).allreduce(v)->wait();
    return 1;
  });
}

// Gathers `input` from every rank into `outputs` (world tensors of input's shape, this
// process's own slot included), in rank order.
int rak_dist_allgather(void* g, void* input, void** outputs, int world, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::vector<std::vector<at::Tensor>> out{tensors(outputs, world)};
    std::vector<at::Tensor> in{*static_cast<at::Tensor*>(input)};
    group(g)->on(in[0]).allgather(out, in)->wait();
    return 1;
  });
}

// Copies `root`'s tensor into every rank's.
int rak_dist_broadcast(void* g, void* t, int root, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::vector<at::Tensor> v{*static_cast<at::Tensor*>(t)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    group(g)->on(v[0]).broadcast(v, opts)->wait();
    return 1;
  });
}

// Sets `key` of the group's store to `value`.
int rak_dist_store_set(void* g, const char* key, const char* value, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    std::string v(value);
    group(g)->scoped->set(std::string(key), std::vector<uint8_t>(v.begin(), v.end()));
    return 1;
  });
}

// Whether `key` is set in the group's store, at once (1 or 0); -1 with the message in `err`
// when the store cannot be asked (its server, rank 0's process, is gone).
int rak_dist_store_check(void* g, const char* key, char* err, size_t len) {
  return guarded(err, len, -1, [&] { return group(g)->scoped->check({std::string(key)}) ? 1 : 0; });
}

int rak_dist_barrier(void* g, char* err, size_t len) {
  return guarded(err, len, 0, [&] {
    group(g)->pg->barrier()->wait();
    return 1;
  });
}

}  // extern "C"
