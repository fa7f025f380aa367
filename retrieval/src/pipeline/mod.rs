//! The retrieval pipeline as library functions: `encode`, `index`, `search`, `eval`.
//!
//! `host encode|index|search|eval` are thin command-line wrappers over these, and the host's
//! services for command plugins call the same functions, as the trainer's ANCE episodes
//! (re-encode, re-index, search) will: each step is written once.

pub mod encode;
pub mod eval;
pub mod index;
pub mod search;

/// Where long work reports how far it got and what it noticed. The CLI draws a progress bar
/// on stderr; the host's services forward both to the command plugin that asked.
pub trait Progress: Sync {
    /// A new phase of `total` units, e.g. `("encode", 13_681)`.
    fn start(&self, _what: &str, _total: u64) {}
    /// `n` more units done.
    fn inc(&self, _n: u64) {}
    /// The phase is over.
    fn finish(&self) {}
    /// A short status shown beside the bar (losses, learning rate).
    fn message(&self, _text: &str) {}
    /// A line for the user ("resuming, 3 of 4 parts done").
    fn log(&self, line: &str) {
        eprintln!("{line}");
    }
}

/// Reports nothing but log lines (to stderr).
pub struct Quiet;

impl Progress for Quiet {}
