//! The built-in subcommands, one module each: command-line parsing over the library
//! functions of `rak_retrieval::pipeline`.

pub mod analyze;
pub mod augment;
pub mod encode;
pub mod eval;
pub mod index;
pub mod search;
pub mod serve;
pub mod train;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use rak_retrieval::pipeline::Progress;
use std::sync::Mutex;

/// A progress bar per phase on stderr (hidden when stderr is not a terminal); log lines are
/// printed above it. Bars made with [`Bar::beside`] share one display: a command plugin's own
/// bar and the bar of a service it calls are drawn one above the other, neither replacing the
/// other.
pub struct Bar {
    display: MultiProgress,
    bar: Mutex<Option<ProgressBar>>,
}

impl Default for Bar {
    fn default() -> Self {
        Bar { display: MultiProgress::new(), bar: Mutex::new(None) }
    }
}

impl Bar {
    /// Another bar on the same display as `self`.
    pub fn beside(&self) -> Bar {
        Bar { display: self.display.clone(), bar: Mutex::new(None) }
    }

    /// The current phase's name and position (for tests and diagnostics).
    pub fn current(&self) -> Option<(String, u64)> {
        self.slot().as_ref().map(|b| (b.prefix(), b.position()))
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<ProgressBar>> {
        self.bar.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remove(&self, bar: ProgressBar) {
        bar.finish_and_clear();
        self.display.remove(&bar);
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        let bar = self.display.add(progress(total, what));
        if let Some(old) = self.slot().replace(bar) {
            self.remove(old);
        }
    }
    fn inc(&self, n: u64) {
        if let Some(bar) = &*self.slot() {
            bar.inc(n);
        }
    }
    fn finish(&self) {
        if let Some(bar) = self.slot().take() {
            self.remove(bar);
        }
    }
    fn message(&self, text: &str) {
        if let Some(bar) = &*self.slot() {
            bar.set_message(text.to_string());
        }
    }
    fn log(&self, line: &str) {
        self.display.suspend(|| eprintln!("{line}"));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A command plugin's bar stays, and keeps counting, while a service it calls runs a
    /// bar of its own (they once shared one slot, and the service's replaced the plugin's).
    #[test]
    fn bars_beside_each_other_do_not_replace_each_other() {
        let plugin = Bar::default();
        let service = plugin.beside();
        plugin.start("aar: score passages", 10);
        plugin.inc(3);
        service.start("encode", 100);
        service.inc(100);
        assert_eq!(plugin.current(), Some(("aar: score passages".to_string(), 3)));
        service.finish();
        plugin.inc(1);
        assert_eq!(plugin.current(), Some(("aar: score passages".to_string(), 4)));
        assert_eq!(service.current(), None);
    }
}
