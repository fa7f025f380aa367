//! `rak-core`: the library behind the `host` binary and every plugin.
//!
//! - [`abi`]: the stable plugin ABI (compatibility header, one root module per plugin kind).
//! - [`plugin`]: the SDK plugin authors implement (traits + `export_*!` macros).
//! - [`optim`]: optimizer math shared by the optimizer plugins.
//! - [`models`]: BERT and T5 in tch with Hugging Face names; checkpoints; tokenizers.
//! - [`encoders`], [`readers`]: the models behind the built-in encoder and reader plugins.
//! - [`autograd`]: clearing gradients, bf16 autocast on the CPU and CUDA.
//! - [`profiler`]: libtorch's profiler (Chrome traces, named scopes) for measurement.
//! - [`dist`]: multi-process groups over libtorch's c10d (TCPStore + Gloo).
//! - [`fsutil`]: atomic writes.
//! - [`malloc`]: glibc allocator settings for tensor workloads.
//!
//! It is not the CLI (that is `rak-host`), not the retrieval pipeline (`rak-retrieval`), and
//! it loads no plugins itself.

pub mod autograd;
pub mod dist;
pub mod encoders;
pub mod fsutil;
pub mod malloc;
pub mod models;
pub mod optim;
pub mod plugin;
pub mod profiler;
pub mod readers;
pub mod rng;

/// The stable plugin ABI (the `rak-abi` crate).
pub use rak_abi as abi;
#[doc(hidden)]
pub use abi_stable;
#[doc(hidden)]
pub use anyhow;
pub use serde_json;
pub use tch;

pub use rak_abi::{LIBTORCH_VERSION, TARGET, TCH_VERSION};

// The C++ that this crate's `extern "C"` blocks call: named here so that its static libraries
// are linked even where no Rust item of the shim is used.
use rak_torch_shim as _;

#[cfg(test)]
mod tests {
    #[test]
    fn root_module_symbol_matches_abi_stable() {
        let src = include_str!("plugin/ffi.rs");
        let needle = format!("#[export_name = \"{}\"]", abi_stable::library::ROOT_MODULE_LOADER_NAME);
        assert!(src.contains(&needle), "update __rak_export_root!: abi_stable expects {needle}");
    }
}
