//! rak-core's C++ (`csrc/`), compiled against libtorch's headers by `build.rs` and linked into
//! whatever links rak-core; rak-core declares the functions it calls next to their Rust side.
//!
//! A crate of its own so that one target folder compiles it once: the C++ takes about 30
//! seconds of the 45 a build of rak-core takes on 2 cores, and it depends on nothing but
//! libtorch, while rak-core is rebuilt by every change to its Rust, by each workspace that
//! resolves its dependencies' features otherwise (an out-of-tree plugin's) and by each copy
//! of it (the tests build plugins against copies with another ABI or crate version).

/// The keyed dropout kernel's CUDA source, which NVRTC compiles at run time, NUL-terminated
/// for the C side.
pub const KEYED_MASK_CUH: &str = concat!(include_str!("../csrc/keyed_mask.cuh"), "\0");
