//! glibc allocator settings for tensor workloads.

/// Keep freed tensor buffers in the process heap instead of returning them to the kernel.
///
/// libtorch's CPU tensors come from `malloc`. By default glibc serves every allocation above a
/// moving threshold with a fresh `mmap` and unmaps it on `free`, and trims the heap top
/// eagerly, so each layer of each batch page-faults and zero-fills its activations again:
/// 1.8M minor faults and 4 s of kernel time for 1,280 MiniLM passages. glibc caps the mmap
/// threshold at 32 MiB, below a batch's feed-forward activations (64 × 128 tokens × 1536
/// floats = 50 MB), so mmap is turned off altogether and the trim threshold raised: every
/// buffer is then reused from the heap (0.26M faults, 0.7 s kernel time, about 10% faster
/// encoding; docs/BENCHMARKS.md). The price is that the heap keeps up to 1 GiB of freed memory
/// for reuse, and memory freed below the heap top is reused rather than returned.
///
/// Call it first thing in `main`, before other threads start. A no-op off glibc.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // Safety: mallopt only sets allocator parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
