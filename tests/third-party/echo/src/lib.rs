//! `echo`: a connector that replies `{"echo": REQUEST, "in_flight": N}` after `delay_ms`
//! (default 50), where `N` is how many calls were running at once when it started (to a
//! `forward`, as its body: `{"status": 200, "body": ...}`): a concurrency probe for the host's
//! connector service and `host serve`, not a language model. A request whose
//! JSON holds `stall_on` waits `stall_ms` instead (a call to a hung server, with no timeout of
//! its own). It streams too: a first piece, then the wait, then a second.

use anyhow::Result;
use rak_core::plugin::{Connector, PluginInfo};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub struct Echo {
    delay: Duration,
    stall_on: Option<String>,
    stall: Duration,
    in_flight: AtomicUsize,
}

impl PluginInfo for Echo {
    const NAME: &'static str = "echo";

    fn settings_schema() -> Value {
        json!({
            "delay_ms": {"type": "int", "default": 50, "help": "pause before replying"},
            "stall_on": {"type": "string", "default": null, "help": "a request whose JSON holds this text waits stall_ms instead"},
            "stall_ms": {"type": "int", "default": 0},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        let ms = |key: &str, default: u64| Duration::from_millis(settings[key].as_u64().unwrap_or(default));
        Ok(Echo { delay: ms("delay_ms", 50), stall_on: settings["stall_on"].as_str().map(str::to_string), stall: ms("stall_ms", 0), in_flight: AtomicUsize::new(0) })
    }
}

impl Echo {
    fn wait_for(&self, request: &Value) -> Duration {
        match &self.stall_on {
            Some(text) if request.to_string().contains(text.as_str()) => self.stall,
            _ => self.delay,
        }
    }
}

impl Connector for Echo {
    fn complete(&self, request: Value) -> Result<Value> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        std::thread::sleep(self.wait_for(&request));
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let forward = request["op"] == "forward";
        let reply = json!({"echo": request, "in_flight": n});
        Ok(if forward { json!({"status": 200, "body": reply}) } else { reply })
    }

    fn stream(&self, request: Value, sink: &mut dyn FnMut(&str) -> bool) -> Result<Value> {
        if sink(&json!({"piece": 1}).to_string()) {
            std::thread::sleep(self.wait_for(&request));
            sink(&json!({"piece": 2}).to_string());
        }
        Ok(json!({"status": 200}))
    }
}

rak_core::export_connector!(Echo);
