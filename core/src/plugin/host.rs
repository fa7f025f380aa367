//! The command plugin's side of the host services ([`HostApi`]): plain Rust types over the
//! host's service module. Objects the host makes for the plugin are released when dropped.
//! Everything here may be used from several threads at once.

use super::{Connector, Encoder, Reader};
use crate::abi::modules::{HostApi, HostModRef};
use crate::abi::{Handle, Role, TensorPtr};
use abi_stable::std_types::{RResult, RStr, RString};
use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use tch::Tensor;

/// The host, as a command plugin sees it.
#[derive(Clone)]
pub struct Host {
    inner: Arc<Api>,
}

struct Api {
    ctx: Handle,
    services: HostModRef,
}

// The host's services are thread-safe by contract (see `HostMod`): the context handle is only
// ever passed back to them.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

fn check<T>(what: &str, r: RResult<T, RString>) -> Result<T> {
    r.into_result().map_err(|e| anyhow!("host {what}: {e}"))
}

fn parse(what: &str, text: &str) -> Result<Value> {
    serde_json::from_str(text).with_context(|| format!("host {what}: the reply is not valid JSON"))
}

impl Host {
    /// Wrap what `run` received (done by the export macro). The host closes the services
    /// when `run` returns: a `Host` or an object kept past that gets errors, not crashes.
    pub(crate) fn new(api: HostApi) -> Self {
        Host { inner: Arc::new(Api { ctx: api.ctx, services: api.services }) }
    }

    /// Call a JSON service by name (see `docs/plugins.md`).
    pub fn call(&self, method: &str, request: Value) -> Result<Value> {
        let reply = (self.inner.services.call())(self.inner.ctx, method.into(), request.to_string().as_str().into());
        parse(method, &check(method, reply)?)
    }

    fn create(&self, kind: &str, name: &str, settings: &Value) -> Result<Object> {
        let r = (self.inner.services.create())(self.inner.ctx, kind.into(), name.into(), settings.to_string().as_str().into());
        let id = check(&format!("create {kind} {name:?}"), r)?;
        Ok(Object { api: self.inner.clone(), id })
    }

    /// A new encoder from the encoder plugin `name` (settings as for `host encode`, e.g.
    /// `{"model": DIR}`).
    pub fn encoder(&self, name: &str, settings: &Value) -> Result<HostEncoder> {
        Ok(HostEncoder(self.create("encoder", name, settings)?))
    }

    /// A new reader from the reader plugin `name`.
    pub fn reader(&self, name: &str, settings: &Value) -> Result<HostReader> {
        Ok(HostReader(self.create("reader", name, settings)?))
    }

    /// A new connector from the connector plugin `name`.
    pub fn connector(&self, name: &str, settings: &Value) -> Result<HostConnector> {
        Ok(HostConnector(self.create("connector", name, settings)?))
    }

    /// Open the index in `dir` (flat, HNSW or BM25).
    pub fn open_index(&self, dir: &Path) -> Result<HostIndex> {
        Ok(HostIndex(self.create("index", &dir.to_string_lossy(), &json!({}))?))
    }

    /// Encode a JSONL file into an embeddings directory with `encoder` (resumable; the request
    /// holds `input`, `output` and optionally `role`, `task`, `batch_size`, `part_size`).
    pub fn encode_corpus(&self, encoder: &HostEncoder, mut request: Value) -> Result<Value> {
        request["encoder"] = json!(encoder.0.id);
        self.call("encode_corpus", request)
    }

    /// Build an index (`{"kind": "flat"|"hnsw"|"bm25", "embeddings"|"corpus", "output", ...}`).
    pub fn build_index(&self, request: Value) -> Result<Value> {
        self.call("build_index", request)
    }

    /// Search `index` for queries (`{"queries": FILE or [{"_id","text"}], "k", "task",
    /// "output": TREC file}`); a dense index embeds them with `encoder`. Returns the run as
    /// `{qid: [[pid, score], ...]}`.
    pub fn search(&self, index: &HostIndex, encoder: Option<&HostEncoder>, mut request: Value) -> Result<Value> {
        request["index"] = json!(index.0.id);
        if let Some(e) = encoder {
            request["encoder"] = json!(e.0.id);
        }
        self.call("search", request)
    }

    /// Evaluate runs (`{"corpus", "runs": [{"run", "qrels", "queries", "name"}]}`), as `host eval`.
    pub fn eval(&self, request: Value) -> Result<Value> {
        self.call("eval", request)
    }

    /// A whole training run, as `host train` makes it: `{"recipe": RECIPE AS JSON, "output_dir",
    /// "encoder"?, "optim"?, "model"?, "device"?, "bf16"?, "resume"?, "overwrite"?, "examples"?}`.
    /// `examples` (`[{"name": TASK, "examples": [{"query_id", "query", "positives": [ids],
    /// "negatives": [ids]}]}]`) replaces the recipe's task files and mined negatives; with
    /// `recipe.train.loss = "multi_positive"` every positive of a query is trained on (AAR).
    /// Returns `{"output_dir", "steps", "episodes", "log"}`.
    pub fn train(&self, request: Value) -> Result<Value> {
        self.call("train", request)
    }

    /// A line for the user, printed by the host above any progress bar.
    pub fn log(&self, line: &str) -> Result<()> {
        self.call("log", json!({"message": line})).map(|_| ())
    }

    /// A progress bar for `total` units of `what`, drawn by the host; cleared when dropped.
    pub fn progress(&self, what: &str, total: u64) -> Result<HostProgress> {
        self.call("progress", json!({"event": "start", "what": what, "total": total}))?;
        Ok(HostProgress(self.clone()))
    }
}

/// A host-side object: released when the last reference goes.
struct Object {
    api: Arc<Api>,
    id: u64,
}

impl Object {
    fn call(&self, method: &str, request: Value) -> Result<Value> {
        let r = (self.api.services.object_call())(self.api.ctx, self.id, method.into(), request.to_string().as_str().into());
        parse(method, &check(method, r)?)
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let _ = (self.api.services.release())(self.api.ctx, self.id);
    }
}

/// An encoder the host made; usable like any [`Encoder`], gradients included.
pub struct HostEncoder(Object);

impl Encoder for HostEncoder {
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor> {
        let texts: Vec<RStr<'_>> = texts.iter().map(|s| (*s).into()).collect();
        let api = &self.0.api;
        let r = (api.services.encode())(api.ctx, self.0.id, texts.as_slice().into(), role, task.map(RStr::from).into(), train);
        Ok(unsafe { check("encode", r)?.take() })
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let api = &self.0.api;
        let list = check("parameters", (api.services.parameters())(api.ctx, self.0.id))?;
        Ok(list.into_iter().map(|nt| (nt.name.into_string(), unsafe { nt.tensor.take() })).collect())
    }

    fn info(&self) -> Result<Value> {
        self.0.call("info", json!({}))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        self.0.call("save", json!({"dir": dir})).map(|_| ())
    }

    fn token_lengths(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Option<Vec<usize>>> {
        let reply = self.0.call("token_lengths", json!({"texts": texts, "role": role, "task": task}))?;
        Ok(serde_json::from_value(reply)?)
    }
}

/// A reader the host made.
pub struct HostReader(Object);

impl Reader for HostReader {
    fn generate(&mut self, request: Value) -> Result<Value> {
        self.0.call("generate", request)
    }
    fn score_options(&mut self, request: Value) -> Result<Value> {
        self.0.call("score_options", request)
    }
    fn passage_preferences(&mut self, request: Value) -> Result<Value> {
        self.0.call("passage_preferences", request)
    }
}

/// A connector the host made; `complete` may be called from several threads at once.
pub struct HostConnector(Object);

impl Connector for HostConnector {
    fn complete(&self, request: Value) -> Result<Value> {
        self.0.call("complete", request)
    }
}

/// An index the host opened.
pub struct HostIndex(Object);

impl HostIndex {
    /// `index.json`: kind, dim, count, ...
    pub fn info(&self) -> Result<Value> {
        self.0.call("info", json!({}))
    }

    /// The top `k` `(passage id, score)` of each row of a `[n, dim]` query tensor (dense).
    pub fn search_vectors(&self, queries: &Tensor, k: usize) -> Result<Vec<Vec<(String, f32)>>> {
        let api = &self.0.api;
        let r = (api.services.search_vectors())(api.ctx, self.0.id, TensorPtr::lend(queries), k as u32);
        Ok(serde_json::from_str(&check("search_vectors", r)?)?)
    }

    /// The top `k` of each query text (BM25).
    pub fn search_text(&self, queries: &[&str], k: usize) -> Result<Vec<Vec<(String, f32)>>> {
        Ok(serde_json::from_value(self.0.call("search", json!({"texts": queries, "k": k}))?)?)
    }
}

/// A progress bar the host draws.
pub struct HostProgress(Host);

impl HostProgress {
    pub fn inc(&self, n: u64) -> Result<()> {
        self.0.call("progress", json!({"event": "inc", "n": n})).map(|_| ())
    }
}

impl Drop for HostProgress {
    fn drop(&mut self) {
        let _ = self.0.call("progress", json!({"event": "finish"}));
    }
}
