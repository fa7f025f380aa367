//! The built-in subcommands, one module each: command-line parsing over the library
//! functions of `rak_retrieval::pipeline`.

pub mod analyze;
pub mod augment;
pub mod encode;
pub mod eval;
pub mod index;
pub mod search;
pub mod train;

use indicatif::{ProgressBar, ProgressStyle};
use rak_retrieval::pipeline::Progress;
use std::sync::Mutex;

/// A progress bar per phase on stderr (hidden when stderr is not a terminal); log lines are
/// printed above it.
#[derive(Default)]
pub struct Bar(Mutex<Option<ProgressBar>>);

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        let bar = progress(total, what);
        if let Some(old) = self.0.lock().unwrap_or_else(|e| e.into_inner()).replace(bar) {
            old.finish_and_clear();
        }
    }
    fn inc(&self, n: u64) {
        if let Some(bar) = &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            bar.inc(n);
        }
    }
    fn finish(&self) {
        if let Some(bar) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
    fn message(&self, text: &str) {
        if let Some(bar) = &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            bar.set_message(text.to_string());
        }
    }
    fn log(&self, line: &str) {
        match &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(bar) => bar.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix} {bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(what.to_string());
    bar
}
