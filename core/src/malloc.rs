//! glibc allocator settings for tensor workloads.

/// Keep freed tensor buffers in the process heap instead of returning them to the kernel.
///
/// libtorch's CPU tensors come from `malloc`. By default glibc serves every allocation above a
/// moving threshold with a fresh `mmap` and unmaps it on `free`, and trims the heap top
/// eagerly, so each layer of each batch page-faults and zero-fills its activations again:
/// 1.5M minor faults for 640 MiniLM passages. Fixing the mmap threshold at glibc's maximum
/// (32 MiB) and raising the trim threshold lets buffers up to 32 MiB be reused; encoding the
/// mini-KILT corpus on 2 cores got about 8% faster (docs/BENCHMARKS.md). The price is that
/// the heap keeps up to 1 GiB of freed memory for reuse.
///
/// Call it first thing in `main`, before other threads start. A no-op off glibc.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // Safety: mallopt only sets allocator parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
