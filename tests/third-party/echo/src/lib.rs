//! `echo`: a connector that replies `{"echo": REQUEST, "in_flight": N}` after `delay_ms`
//! (default 50), where `N` is how many calls were running at once when it started: a
//! concurrency probe for the host's connector service, not a language model.

use anyhow::Result;
use rak_core::plugin::{Connector, PluginInfo};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Echo {
    delay: std::time::Duration,
    in_flight: AtomicUsize,
}

impl PluginInfo for Echo {
    const NAME: &'static str = "echo";

    fn settings_schema() -> Value {
        json!({"delay_ms": {"type": "int", "default": 50, "help": "pause before replying"}})
    }

    fn create(settings: Value) -> Result<Self> {
        let ms = settings["delay_ms"].as_u64().unwrap_or(50);
        Ok(Echo { delay: std::time::Duration::from_millis(ms), in_flight: AtomicUsize::new(0) })
    }
}

impl Connector for Echo {
    fn complete(&self, request: Value) -> Result<Value> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        std::thread::sleep(self.delay);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        Ok(json!({"echo": request, "in_flight": n}))
    }
}

rak_core::export_connector!(Echo);
