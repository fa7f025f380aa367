//! rak-core's C++ (`csrc/`), compiled against libtorch's headers by `build.rs` and linked into
//! whatever links rak-core; rak-core declares the functions it calls next to their Rust side.
//!
//! A crate of its own so that its compile is shared: the C++ takes about 30 seconds of the 45
//! a build of rak-core takes on 2 cores, and it depends on nothing but libtorch, while
//! rak-core is rebuilt by every change to its Rust and by each copy of it (the tests build a
//! plugin against copies with another ABI or crate version, which reuse the shim the
//! out-of-tree plugins' workspace compiled). Cargo tells path packages apart by their path
//! relative to the workspace root, so a target folder shared by two workspaces (the main one
//! and the out-of-tree plugins') still compiles it once for each.

/// The keyed dropout kernel's CUDA source, which NVRTC compiles at run time, NUL-terminated
/// for the C side.
pub const KEYED_MASK_CUH: &str = concat!(include_str!("../csrc/keyed_mask.cuh"), "\0");
