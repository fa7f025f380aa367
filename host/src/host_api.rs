//! The services the host offers command plugins, as JSON method calls.

use crate::registry::Registry;
use abi_stable::std_types::{RResult, RStr, RString};
use rak_core::abi::guard;
use rak_core::abi::modules::HostApi;
use rak_core::abi::Handle;
use serde_json::{json, Value};

/// Build the `HostApi` table for one command run. `registry` must outlive the run.
pub fn host_api(registry: &Registry) -> HostApi {
    HostApi { ctx: Handle::new(registry as *const Registry), call }
}

/// Release what [`host_api`] allocated.
pub fn release(api: HostApi) {
    unsafe { api.ctx.destroy::<*const Registry>() };
}

extern "C" fn call(ctx: Handle, method: RStr<'_>, request: RStr<'_>) -> RResult<RString, RString> {
    guard(|| {
        let registry: &Registry = unsafe { &**ctx.get::<*const Registry>() };
        let _request: Value = serde_json::from_str(request.as_str()).unwrap_or(Value::Null);
        let reply = match method.as_str() {
            "plugins" => Value::Array(
                registry
                    .iter()
                    .map(|p| json!({"name": p.header.name, "kind": p.header.kind, "version": p.header.version, "file": p.path}))
                    .collect(),
            ),
            "version" => json!({"host": env!("CARGO_PKG_VERSION"), "abi": rak_core::abi::ABI_VERSION}),
            other => anyhow::bail!("unknown host method {other:?} (known: plugins, version)"),
        };
        Ok(reply.to_string().into())
    })
}
