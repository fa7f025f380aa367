//! A `--target-concurrency` slot held by one call at the target.
//!
//! Connectors are synchronous, so a call runs on a blocking thread, and gives its slot back
//! when it returns ([`Held`]). A call that outlives its request (the deadline passed, the
//! client went away, a stream went quiet) cannot be stopped from here; it is given one more
//! request timeout to return, and then the slot is given back without it, logged and counted,
//! the call left to end on its own ([`Watcher`]). Without this, a connector with no timeout of
//! its own (a third party's; the built-in `openai` one is capped at the request timeout) would
//! take one slot away for good with each hung call, until no chat request reached the target.

use crate::metrics::Metrics;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;

type Permit = Arc<Mutex<Option<OwnedSemaphorePermit>>>;

fn lock(p: &Permit) -> MutexGuard<'_, Option<OwnedSemaphorePermit>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The call's side: dropped when the call returns (or panics), which gives the slot back.
pub(crate) struct Held(Permit);

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.0).take();
    }
}

/// The request's side: dropped while the call still holds the slot, it gives the call `grace`
/// more, then takes the slot back.
pub(crate) struct Watcher {
    permit: Permit,
    grace: Duration,
    metrics: Arc<Metrics>,
}

/// Split a permit into the call's side and the request's.
pub(crate) fn hold(permit: OwnedSemaphorePermit, grace: Duration, metrics: Arc<Metrics>) -> (Held, Watcher) {
    let permit = Arc::new(Mutex::new(Some(permit)));
    (Held(permit.clone()), Watcher { permit, grace, metrics })
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if lock(&self.permit).is_none() {
            return;
        }
        // Outside a runtime (the server is stopping) nothing waits for the slot any more.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (permit, grace, metrics) = (self.permit.clone(), self.grace, self.metrics.clone());
        runtime.spawn(async move {
            tokio::time::sleep(grace).await;
            if lock(&permit).take().is_some() {
                metrics.count_reclaimed_slot();
                crate::log_line(&serde_json::json!({
                    "warning": format!(
                        "a call to the target is still running {:.0} s after its request gave up; its --target-concurrency slot is given back and the call left to end on its own (a connector without a timeout of its own?)",
                        grace.as_secs_f64()
                    )
                }));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    // Real time (paused time needs tokio's test-util, a second build of tokio and its users).
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn a_call_that_returns_gives_its_slot_back_at_once() {
        runtime().block_on(async {
            let slots = Arc::new(Semaphore::new(1));
            let metrics = Arc::new(Metrics::default());
            let (held, watcher) = hold(slots.clone().acquire_owned().await.unwrap(), Duration::from_millis(200), metrics.clone());
            assert_eq!(slots.available_permits(), 0);
            drop(held);
            assert_eq!(slots.available_permits(), 1);
            drop(watcher);
            tokio::time::sleep(Duration::from_millis(400)).await;
            assert_eq!(slots.available_permits(), 1);
            assert!(metrics.render().contains("rak_upstream_slots_reclaimed_total 0"));
        });
    }

    #[test]
    fn a_call_left_running_keeps_its_slot_for_the_grace_period_only() {
        runtime().block_on(async {
            let slots = Arc::new(Semaphore::new(1));
            let metrics = Arc::new(Metrics::default());
            let (held, watcher) = hold(slots.clone().acquire_owned().await.unwrap(), Duration::from_secs(2), metrics.clone());
            drop(watcher);
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(slots.available_permits(), 0, "given back before the grace period ended");
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert_eq!(slots.available_permits(), 1);
            assert!(metrics.render().contains("rak_upstream_slots_reclaimed_total 1"));
            // The call ending later gives nothing back twice.
            drop(held);
            assert_eq!(slots.available_permits(), 1);
        });
    }
}
