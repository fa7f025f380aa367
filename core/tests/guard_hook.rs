//! The boundary guard silences panics only inside guarded calls: a panic elsewhere still
//! reaches the hook that was installed before (the host's "internal error" message). Its own
//! test binary, so that no other test installs hooks or guards first.

use rak_core::abi::guard;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[test]
fn the_hook_in_place_still_sees_panics_outside_guards() {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    std::panic::set_hook(Box::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let r = guard(|| -> anyhow::Result<()> { panic!("inside a plugin call") });
    assert!(r.is_err());
    assert_eq!(seen.load(Ordering::SeqCst), 0, "a guarded panic reports through the error, not the hook");
    // After a guarded call, a panic outside any guard must still reach the hook in place.
    let _ = std::panic::catch_unwind(|| panic!("a host bug"));
    assert_eq!(seen.load(Ordering::SeqCst), 1, "the earlier hook was replaced by the guard's");
    let _ = guard(|| -> anyhow::Result<()> { panic!("again inside") });
    let _ = std::panic::catch_unwind(|| panic!("another host bug"));
    assert_eq!(seen.load(Ordering::SeqCst), 2);
}
