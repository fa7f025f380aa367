//! `rak-host`: plugin discovery, loading and the host-side plugin wrappers, shared by the
//! `host` binary and the end-to-end tests.

pub mod augment;
pub mod commands;
pub mod elf;
pub mod errors;
pub mod host_api;
pub mod loader;
pub mod plot;
pub mod proxy;
pub mod registry;

pub use registry::{search_path, Registry, Source};
