//! The services the host offers command plugins (`rak_core::abi::modules::HostMod`).
//!
//! One [`Services`] lives for a command's run. Objects a plugin asks for (encoders, readers,
//! connectors, open indexes) are kept here under ids; each sits behind its own lock (a
//! connector behind none: it is called from several threads at once), and the table's lock is
//! held only to look an id up, so the services can be used from several threads. Every
//! service is a call into the same library functions the built-in subcommands use.

use rak_retrieval::digest::settings_identity;
use crate::commands::Bar;
use crate::registry::Registry;
use abi_stable::prefix_type::WithMetadata;
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use anyhow::{anyhow, bail, Context, Result};
use rak_core::abi::modules::{HostApi, HostMod, HostModRef};
use rak_core::abi::{guard, Handle, NamedTensor, Role, TensorPtr};
use rak_core::plugin::{Connector, Encoder, Reader};
use rak_retrieval::data::{beir, trec, Query};
use rak_retrieval::eval::MissingQueries;
use rak_retrieval::index::{self, Bm25Params, HnswParams, Index};
use rak_retrieval::pipeline::encode::{encode_file, EncodeJob, EncodeOutcome, EncoderSource};
use rak_retrieval::pipeline::eval::{evaluate_files, EvalInput};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use rak_retrieval::pipeline::search::{search_queries, search_vectors, SearchOptions};
use rak_retrieval::pipeline::Progress;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

type Res<T> = RResult<T, RString>;

/// An encoder with what identifies its embeddings apart from its current weights.
struct EncoderObject {
    encoder: Mutex<Box<dyn Encoder>>,
    identity: Value,
}

#[derive(Clone)]
enum Object {
    Encoder(Arc<EncoderObject>),
    Reader(Arc<Mutex<Box<dyn Reader>>>),
    Connector(Arc<dyn Connector>),
    Index(Arc<Index>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Encoder(_) => "encoder",
            Object::Reader(_) => "reader",
            Object::Connector(_) => "connector",
            Object::Index(_) => "index",
        }
    }
}

/// The services a context points to while the command runs (`None` after).
struct Gate(RwLock<Option<*const Services<'static>>>);

// The pointer is only dereferenced under the read lock while it is `Some`, and `Services` is
// `Sync` (checked below).
unsafe impl Send for Gate {}
unsafe impl Sync for Gate {}

const _: () = {
    fn sync<T: Sync>() {}
    let _ = sync::<Services<'static>>;
};

/// The host's side of one command run.
pub struct Services<'r> {
    registry: &'r Registry,
    objects: Mutex<HashMap<u64, Object>>,
    next_id: AtomicU64,
    /// The services' own work (encoding, indexing, ...).
    progress: Bar,
    /// The command plugin's bar (`progress` events), drawn beside the services'.
    plugin_progress: Bar,
}

impl<'r> Services<'r> {
    pub fn new(registry: &'r Registry) -> Self {
        let progress = Bar::default();
        let plugin_progress = progress.beside();
        Services { registry, objects: Mutex::new(HashMap::new()), next_id: AtomicU64::new(1), progress, plugin_progress }
    }

    /// Run `f` with the `HostApi` of these services. A plugin may keep the API (or objects
    /// made through it) past `f`, e.g. in a thread it did not join: the context is a gate that
    /// is closed when `f` returns, after every call in flight has finished, so a late call
    /// gets an error instead of reaching services that are gone. The gate itself (a few
    /// bytes) is never freed, for the same reason.
    pub fn with_api<R>(&self, f: impl FnOnce(HostApi) -> R) -> R {
        let gate: &'static Gate = Box::leak(Box::new(Gate(RwLock::new(Some(self as *const Services<'r> as *const Services<'static>)))));
        let ctx = Handle::new(gate as *const Gate);
        let out = f(HostApi { ctx, services: module() });
        *gate.0.write().unwrap_or_else(|e| e.into_inner()) = None;
        out
    }

    fn insert(&self, obj: Object) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.objects.lock().unwrap_or_else(|e| e.into_inner()).insert(id, obj);
        id
    }

    fn get(&self, id: u64) -> Result<Object> {
        let objects = self.objects.lock().unwrap_or_else(|e| e.into_inner());
        objects.get(&id).cloned().ok_or_else(|| anyhow!("no object with id {id} (released, or never created)"))
    }

    fn encoder(&self, id: u64) -> Result<Arc<EncoderObject>> {
        match self.get(id)? {
            Object::Encoder(e) => Ok(e),
            other => bail!("object {id} is a {}, not an encoder", other.kind()),
        }
    }

    fn index(&self, id: u64) -> Result<Arc<Index>> {
        match self.get(id)? {
            Object::Index(i) => Ok(i),
            other => bail!("object {id} is a {}, not an index", other.kind()),
        }
    }

    fn create(&self, kind: &str, name: &str, settings: Value) -> Result<u64> {
        let obj = match kind {
            "encoder" => {
                // The checkpoint's files are not hashed: `encode_corpus` keys on a digest of the
                // live weights, which also covers training after creation.
                let encoder = self.registry.encoder(name, &settings)?;
                Object::Encoder(Arc::new(EncoderObject { encoder: Mutex::new(encoder), identity: settings_identity(name, &settings) }))
            }
            "reader" => Object::Reader(Arc::new(Mutex::new(self.registry.reader(name, &settings)?))),
            "connector" => Object::Connector(Arc::from(self.registry.connector(name, &settings)?)),
            "index" => Object::Index(Arc::new(index::open(std::path::Path::new(name))?)),
            other => bail!("unknown object kind {other:?} (known: encoder, reader, connector, index)"),
        };
        Ok(self.insert(obj))
    }

    fn call(&self, method: &str, request: Value) -> Result<Value> {
        match method {
            "version" => Ok(json!({"host": env!("CARGO_PKG_VERSION"), "abi": rak_core::abi::ABI_VERSION})),
            "plugins" => Ok(Value::Array(
                self.registry
                    .iter()
                    .map(|p| json!({"name": p.header.name, "kind": p.header.kind, "version": p.header.version, "file": p.path}))
                    .collect(),
            )),
            "log" => {
                self.progress.log(request["message"].as_str().context("log: \"message\" (a string) is required")?);
                Ok(Value::Null)
            }
            "progress" => self.progress_event(&request),
            "checkpoint_digest" => {
                let path = request["path"].as_str().context("checkpoint_digest: \"path\" (a model folder) is required")?;
                Ok(json!({"sha256": rak_retrieval::digest::checkpoint_digest(std::path::Path::new(path))?}))
            }
            "encode_corpus" => self.encode_corpus(parse(request)?),
            "build_index" => self.build_index(parse(request)?),
            "search" => self.search(parse(request)?),
            "eval" => self.eval(parse(request)?),
            "train" => self.train(parse(request)?),
            other => bail!(
                "unknown host method {other:?} (known: version, plugins, log, progress, encode_corpus, build_index, search, eval, train, checkpoint_digest)"
            ),
        }
    }

    fn progress_event(&self, request: &Value) -> Result<Value> {
        match request["event"].as_str() {
            Some("start") => self.plugin_progress.start(request["what"].as_str().unwrap_or(""), request["total"].as_u64().unwrap_or(0)),
            Some("inc") => self.plugin_progress.inc(request["n"].as_u64().unwrap_or(1)),
            Some("finish") => self.plugin_progress.finish(),
            other => bail!("progress: unknown event {other:?} (known: start, inc, finish)"),
        }
        Ok(Value::Null)
    }

    fn encode_corpus(&self, r: EncodeCorpusRequest) -> Result<Value> {
        let obj = self.encoder(r.encoder)?;
        let mut encoder = obj.encoder.lock().unwrap_or_else(|e| e.into_inner());
        // The weights may have changed since the encoder was made (a command training it):
        // the embeddings' identity includes what they are now.
        let identity = json!({"encoder": obj.identity, "parameters": parameter_digest(encoder.as_ref())?});
        let defaults = EncodeJob::new(&r.input, &r.output, r.role.unwrap_or(Role::Passage), identity);
        let job = EncodeJob {
            task: r.task,
            batch_size: r.batch_size.unwrap_or(defaults.batch_size),
            part_size: r.part_size.unwrap_or(defaults.part_size),
            shard_id: r.shard_id.unwrap_or(0),
            shard_num: r.shard_num.unwrap_or(1),
            ..defaults
        };
        let outcome = encode_file(&job, EncoderSource::Ready(encoder.as_mut()), &self.progress)?;
        Ok(match outcome {
            EncodeOutcome::Complete { rows } => json!({"outcome": "complete", "rows": rows}),
            EncodeOutcome::AlreadyComplete { rows } => json!({"outcome": "already_complete", "rows": rows}),
            EncodeOutcome::ShardDone { present, parts } => json!({"outcome": "shard_done", "present": present, "parts": parts}),
        })
    }

    fn build_index(&self, r: BuildIndexRequest) -> Result<Value> {
        let defaults = HnswParams::default();
        let params = HnswParams {
            m: r.m.unwrap_or(defaults.m),
            ef_construction: r.ef_construction.unwrap_or(defaults.ef_construction),
            ef_search: r.ef_search.unwrap_or(defaults.ef_search),
        };
        let d = Bm25Params::default();
        let bm25 = Bm25Params { k1: r.k1.unwrap_or(d.k1), b: r.b.unwrap_or(d.b) };
        let spec = IndexSpec::from_kind(&r.kind, r.embeddings, r.corpus, params, Default::default(), bm25).context("build_index")?;
        Ok(serde_json::to_value(build_index(&spec, &r.output, &self.progress)?)?)
    }

    fn search(&self, r: SearchRequest) -> Result<Value> {
        let index = self.index(r.index)?;
        let queries: Vec<Query> = match r.queries {
            QueriesArg::File(path) => beir::read_queries(&path)?.collect::<Result<_>>()?,
            QueriesArg::List(list) => {
                list.into_iter().map(|q| Query { id: q.id, text: q.text, ..Default::default() }).collect()
            }
        };
        let defaults = SearchOptions::default();
        let opts =
            SearchOptions { k: r.k.unwrap_or(defaults.k), task: r.task, batch_size: r.batch_size.unwrap_or(defaults.batch_size) };
        let run = match r.encoder {
            Some(id) => {
                let obj = self.encoder(id)?;
                let mut encoder = obj.encoder.lock().unwrap_or_else(|e| e.into_inner());
                search_queries(&index, Some(encoder.as_mut()), &queries, &opts, &self.progress)?
            }
            None => search_queries(&index, None, &queries, &opts, &self.progress)?,
        };
        if let Some(path) = &r.output {
            trec::write_run(path, &run, r.tag.as_deref().unwrap_or("rak"), Some(opts.k))?;
        }
        let map: serde_json::Map<String, Value> = run.iter().map(|(q, docs)| (q.to_string(), json!(docs))).collect();
        Ok(Value::Object(map))
    }

    fn eval(&self, r: EvalRequest) -> Result<Value> {
        let missing: MissingQueries = r.missing.as_deref().unwrap_or("zero").parse().context("eval")?;
        let inputs: Vec<EvalInput> =
            r.runs.into_iter().map(|i| EvalInput { name: i.name, run: i.run, qrels: i.qrels, queries: i.queries }).collect();
        evaluate_files(&inputs, &r.corpus, missing, r.per_query.unwrap_or(false), &self.progress)
    }

    fn object_call(&self, id: u64, method: &str, request: Value) -> Result<Value> {
        match (self.get(id)?, method) {
            (Object::Encoder(e), "info") => e.encoder.lock().unwrap_or_else(|p| p.into_inner()).info(),
            (Object::Encoder(e), "save") => {
                let dir: PathBuf = serde_json::from_value(request["dir"].clone()).context("save: \"dir\" is required")?;
                e.encoder.lock().unwrap_or_else(|p| p.into_inner()).save(&dir)?;
                Ok(Value::Null)
            }
            (Object::Encoder(e), "token_lengths") => {
                let r: TokenLengthsRequest = parse(request)?;
                let texts: Vec<&str> = r.texts.iter().map(String::as_str).collect();
                let lengths = e.encoder.lock().unwrap_or_else(|p| p.into_inner()).token_lengths(&texts, r.role, r.task.as_deref())?;
                Ok(json!(lengths))
            }
            (Object::Reader(rd), "generate") => rd.lock().unwrap_or_else(|p| p.into_inner()).generate(request),
            (Object::Reader(rd), "score_options") => rd.lock().unwrap_or_else(|p| p.into_inner()).score_options(request),
            (Object::Reader(rd), "passage_preferences") => {
                rd.lock().unwrap_or_else(|p| p.into_inner()).passage_preferences(request)
            }
            (Object::Connector(c), "complete") => c.complete(request),
            (Object::Index(i), "info") => Ok(i.info()),
            (Object::Index(i), "search") => {
                let r: TextSearchRequest = parse(request)?;
                let Index::Bm25(bm25) = &*i else { bail!("search: a dense index is searched with search_vectors or the search service") };
                let hits: Vec<Vec<(String, f32)>> = r.texts.iter().map(|t| bm25.search(t, r.k)).collect::<Result<_>>()?;
                Ok(json!(hits))
            }
            (obj, m) => bail!("a {} has no method {m:?}", obj.kind()),
        }
    }

    fn encode(&self, id: u64, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<tch::Tensor> {
        let obj = self.encoder(id)?;
        let mut encoder = obj.encoder.lock().unwrap_or_else(|e| e.into_inner());
        encoder.encode(texts, role, task, train)
    }

    fn search_vectors(&self, id: u64, queries: &tch::Tensor, k: usize) -> Result<Value> {
        let index = self.index(id)?;
        if !queries.defined() {
            bail!("search_vectors: the queries tensor is undefined");
        }
        let size = queries.size();
        if size.len() != 2 {
            bail!("search_vectors: queries must be a [n, dim] tensor, got {size:?}");
        }
        let flat: Vec<f32> =
            Vec::<f32>::try_from(queries.detach().to_kind(tch::Kind::Float).to_device(tch::Device::Cpu).contiguous().view([-1]))?;
        Ok(json!(search_vectors(&index, &flat, size[1] as usize, k)?))
    }

    fn release(&self, id: u64) -> Result<()> {
        let removed = self.objects.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        removed.map(|_| ()).ok_or_else(|| anyhow!("no object with id {id} (released twice?)"))
    }
}

/// A content digest of an encoder's current weights (names, shapes and values).
fn parameter_digest(encoder: &dyn Encoder) -> Result<String> {
    let mut hasher = Sha256::new();
    for (name, t) in encoder.parameters()? {
        hasher.update(name.as_bytes());
        hasher.update(format!("{:?}{:?}", t.size(), t.kind()).as_bytes());
        let bytes: Vec<u8> = Vec::<u8>::try_from(t.detach().to_device(tch::Device::Cpu).contiguous().view([-1]).view_dtype(tch::Kind::Uint8))?;
        hasher.update(&bytes);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

impl Services<'_> {
    /// A whole training run, as `host train` makes it (`rak_train::run`), with the plugin's
    /// own examples when it gives them.
    fn train(&self, r: TrainRequest) -> Result<Value> {
        let recipe: rak_train::recipe::Recipe = serde_json::from_value(r.recipe).context("train: \"recipe\" (a recipe as `host train --config` reads it, as JSON)")?;
        let examples = r.examples.map(|tasks| {
            tasks
                .into_iter()
                .map(|t| rak_train::data::TaskData {
                    name: t.name,
                    examples: t
                        .examples
                        .into_iter()
                        .map(|e| rak_train::data::Example { query_id: e.query_id, query: e.query, positives: e.positives, negatives: e.negatives, answers: e.answers, lm_scores: e.lm_scores.unwrap_or_default() })
                        .collect(),
                })
                .collect()
        });
        let spec = rak_train::run::RunSpec {
            encoder: r.encoder.or(recipe.model.encoder.clone()).context("train: no encoder: give \"encoder\" or recipe.model.encoder")?,
            optim: r.optim.or(recipe.train.optim.clone()).context("train: no optimizer: give \"optim\" or recipe.train.optim")?,
            model: {
                // The recipe's revision goes with the recipe's model only: a "model" given in
                // the request is taken at main (or as the folder it is).
                let (model, revision) = recipe.model.choose(r.model.as_deref(), None).context("train: no model: give \"model\" or recipe.model.path")?;
                crate::commands::encode::resolve_model(&model, revision.as_deref(), "train")?
            },
            recipe,
            output_dir: r.output_dir,
            device: r.device.unwrap_or_else(|| "cpu".into()),
            bf16: r.bf16.unwrap_or(false),
            resume: rak_train::run::Resume::parse(r.resume.as_deref()),
            overwrite: r.overwrite.unwrap_or(false),
            examples,
            rendezvous: None,
        };
        rak_train::run::run(&spec, self.registry, &self.progress)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainRequest {
    /// The recipe (`host train --config`'s TOML structure, as JSON).
    recipe: Value,
    encoder: Option<String>,
    optim: Option<String>,
    model: Option<PathBuf>,
    output_dir: PathBuf,
    device: Option<String>,
    bf16: Option<bool>,
    /// `latest` or a checkpoint directory.
    resume: Option<String>,
    overwrite: Option<bool>,
    /// The plugin's own examples (instead of the recipe's task files and mined negatives).
    examples: Option<Vec<GivenTask>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GivenTask {
    name: String,
    examples: Vec<GivenExample>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GivenExample {
    query_id: String,
    query: String,
    positives: Vec<String>,
    #[serde(default)]
    negatives: Vec<String>,
    #[serde(default)]
    answers: Vec<String>,
    /// `[[passage id, score], ...]`: passages a language model scored, for `loss = "lm_supervised"`.
    lm_scores: Option<Vec<(String, f64)>>,
}

fn parse<T: serde::de::DeserializeOwned>(request: Value) -> Result<T> {
    serde_json::from_value(request).context("invalid request")
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EncodeCorpusRequest {
    encoder: u64,
    input: PathBuf,
    output: PathBuf,
    role: Option<Role>,
    task: Option<String>,
    batch_size: Option<usize>,
    part_size: Option<usize>,
    shard_id: Option<usize>,
    shard_num: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildIndexRequest {
    kind: String,
    embeddings: Option<PathBuf>,
    corpus: Option<PathBuf>,
    output: PathBuf,
    m: Option<usize>,
    ef_construction: Option<usize>,
    ef_search: Option<usize>,
    k1: Option<f32>,
    b: Option<f32>,
}

#[derive(Deserialize)]
struct QueryItem {
    #[serde(rename = "_id")]
    id: String,
    text: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum QueriesArg {
    File(PathBuf),
    List(Vec<QueryItem>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchRequest {
    index: u64,
    encoder: Option<u64>,
    queries: QueriesArg,
    k: Option<usize>,
    task: Option<String>,
    batch_size: Option<usize>,
    output: Option<PathBuf>,
    tag: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EvalRunArg {
    run: PathBuf,
    qrels: PathBuf,
    queries: Option<PathBuf>,
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EvalRequest {
    corpus: PathBuf,
    runs: Vec<EvalRunArg>,
    missing: Option<String>,
    per_query: Option<bool>,
}

#[derive(Deserialize)]
struct TokenLengthsRequest {
    texts: Vec<String>,
    role: Role,
    task: Option<String>,
}

#[derive(Deserialize)]
struct TextSearchRequest {
    texts: Vec<String>,
    k: usize,
}

// ------------------------------------------------------------------ the extern "C" table

/// Run `f` with the services behind `ctx`, or fail when the command has returned.
fn with_services<T>(ctx: Handle, f: impl FnOnce(&Services<'_>) -> Result<T>) -> Result<T> {
    let gate: &Gate = unsafe { &**ctx.get_ref::<*const Gate>() };
    let open = gate.0.read().unwrap_or_else(|e| e.into_inner());
    match *open {
        Some(services) => f(unsafe { &*services }),
        None => bail!("the host's services are closed: the command that received them has returned"),
    }
}

fn json_reply(v: Value) -> RString {
    v.to_string().into()
}

fn request_json(text: &str) -> Result<Value> {
    if text.trim().is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_str(text).context("the request is not valid JSON")
}

extern "C" fn call(ctx: Handle, method: RStr<'_>, request: RStr<'_>) -> Res<RString> {
    guard(|| with_services(ctx, |s| Ok(json_reply(s.call(method.as_str(), request_json(&request)?)?))))
}

extern "C" fn create(ctx: Handle, kind: RStr<'_>, name: RStr<'_>, settings: RStr<'_>) -> Res<u64> {
    guard(|| with_services(ctx, |s| s.create(kind.as_str(), name.as_str(), request_json(&settings)?)))
}

extern "C" fn object_call(ctx: Handle, id: u64, method: RStr<'_>, request: RStr<'_>) -> Res<RString> {
    guard(|| with_services(ctx, |s| Ok(json_reply(s.object_call(id, method.as_str(), request_json(&request)?)?))))
}

extern "C" fn encode(
    ctx: Handle,
    id: u64,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
    train: bool,
) -> Res<TensorPtr> {
    guard(|| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        with_services(ctx, |s| Ok(TensorPtr::give(s.encode(id, &texts, role, task, train)?)))
    })
}

extern "C" fn parameters(ctx: Handle, id: u64) -> Res<RVec<NamedTensor>> {
    guard(|| {
        with_services(ctx, |s| {
            let obj = s.encoder(id)?;
            let params = obj.encoder.lock().unwrap_or_else(|e| e.into_inner()).parameters()?;
            Ok(params.into_iter().map(|(name, t)| NamedTensor { name: name.into(), tensor: TensorPtr::give(t) }).collect())
        })
    })
}

extern "C" fn search_vectors_fn(ctx: Handle, id: u64, queries: TensorPtr, k: u32) -> Res<RString> {
    guard(|| {
        let queries = unsafe { queries.borrow() };
        with_services(ctx, |s| Ok(json_reply(s.search_vectors(id, &queries, k as usize)?)))
    })
}

extern "C" fn release(ctx: Handle, id: u64) -> Res<()> {
    guard(|| with_services(ctx, |s| s.release(id)))
}

/// The service table, made once.
fn module() -> HostModRef {
    static MODULE: std::sync::OnceLock<HostModRef> = std::sync::OnceLock::new();
    *MODULE.get_or_init(|| {
        let m: &'static WithMetadata<HostMod> = Box::leak(Box::new(WithMetadata::new(HostMod {
            call,
            create,
            object_call,
            encode,
            parameters,
            search_vectors: search_vectors_fn,
            release,
        })));
        HostModRef(m.static_as_prefix())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plugin that keeps the API past its `run` gets an error, not a dangling pointer.
    #[test]
    fn services_close_when_the_command_returns() {
        let registry = Registry::discover(&[]).unwrap();
        let services = Services::new(&registry);
        let kept = services.with_api(|api| {
            let reply = (api.services.call())(api.ctx, "version".into(), "{}".into()).into_result().unwrap();
            assert!(reply.contains("\"abi\""), "{reply}");
            api
        });
        drop(services);
        let late = (kept.services.call())(kept.ctx, "version".into(), "{}".into()).into_result();
        assert!(late.unwrap_err().contains("closed"));
        let late = (kept.services.release())(kept.ctx, 1).into_result();
        assert!(late.unwrap_err().contains("closed"));
    }
}
