//! Milvus as an index backend, for corpora that outgrow one machine's memory: the vectors live
//! in a Milvus collection (inner product; FLAT, IVF_FLAT or HNSW as the user picks) and the
//! index directory is small: `index.json` names the server and the collection, and `ids.txt`
//! maps Milvus's primary key (the row number) back to passage ids. Each build fills a
//! collection of its own, named after the collection asked for and the build
//! (`NAME_rak_BUILD`): an index directory never searches vectors another build wrote, even one
//! of the same name (Milvus's aliases could name the newest build, but milvus-lite has none). A
//! rebuild into the same directory drops the build it replaces only once it is complete, so a
//! rebuild that fails leaves the earlier one as it was. Every command that takes
//! `--index DIR` then works unchanged. The server the tests use (`scripts/milvus.sh`:
//! milvus-lite's) searches small collections exactly whatever their index; a standalone or
//! cluster Milvus builds the ANN at the parameters given (docs/BENCHMARKS.md).
//!
//! Through the official Rust client (`milvus-sdk-rust`, async over tonic) on a runtime of our
//! own, so callers stay synchronous like the other indexes. The API token is read from
//! `MILVUS_TOKEN` and is never written to the index directory nor printed.

use super::{check_ids, check_matrix, check_rows, IndexMeta};
use crate::npy::{self, NpyRows};
use crate::pipeline::Progress;
use anyhow::{bail, Context, Result};
use milvus::v2::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

const ROW_FIELD: &str = "row";
const VECTOR_FIELD: &str = "vec";
/// Collections this toolkit made say so (followed by their build's id): only those are
/// replaced by a rebuild.
const DESCRIPTION: &str = "rak-retrieval dense index (rows of an embeddings.npy; ids in the index directory)";
/// Bytes of vectors per write request (gRPC's default message limit is 64 MiB).
const INSERT_BYTES: usize = 4 << 20;
/// Queries per search request.
const SEARCH_BATCH: usize = 256;

/// How long a build waits for the server to index, or to load, a collection (12 hours).
const INDEX_BUILD_TIMEOUT_MS: i64 = 12 * 3600 * 1000;

/// The ANN structure Milvus builds, with its parameters (Milvus's names).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MilvusAnn {
    /// Exact search.
    Flat,
    /// Inverted lists: `nlist` clusters, `nprobe` of them searched.
    IvfFlat { nlist: usize, nprobe: usize },
    /// An HNSW graph, as our own `hnsw` index's parameters (faiss's names: M, efConstruction, ef).
    Hnsw { m: usize, ef_construction: usize, ef_search: usize },
}

impl MilvusAnn {
    fn index_type(&self) -> IndexType {
        match self {
            MilvusAnn::Flat => IndexType::Flat,
            MilvusAnn::IvfFlat { .. } => IndexType::IvfFlat,
            MilvusAnn::Hnsw { .. } => IndexType::Hnsw,
        }
    }
    fn build_params(&self) -> HashMap<String, String> {
        match *self {
            MilvusAnn::Flat => HashMap::new(),
            MilvusAnn::IvfFlat { nlist, .. } => HashMap::from([("nlist".into(), nlist.to_string())]),
            MilvusAnn::Hnsw { m, ef_construction, .. } => {
                HashMap::from([("M".into(), m.to_string()), ("efConstruction".into(), ef_construction.to_string())])
            }
        }
    }
    fn search_params(&self, k: usize) -> HashMap<String, String> {
        match *self {
            MilvusAnn::Flat => HashMap::new(),
            MilvusAnn::IvfFlat { nprobe, .. } => HashMap::from([("nprobe".into(), nprobe.to_string())]),
            // Milvus refuses ef below k, as hnswlib would return fewer hits.
            MilvusAnn::Hnsw { ef_search, .. } => HashMap::from([("ef".into(), ef_search.max(k).to_string())]),
        }
    }
    fn validate(&self) -> Result<()> {
        match *self {
            MilvusAnn::IvfFlat { nlist, nprobe } if nlist == 0 || nprobe == 0 || nprobe > nlist => {
                bail!("IVF_FLAT needs 0 < nprobe <= nlist (got nlist {nlist}, nprobe {nprobe})")
            }
            MilvusAnn::Hnsw { m, ef_construction, ef_search } if m < 2 || ef_construction == 0 || ef_search == 0 => {
                bail!("HNSW needs M >= 2 and positive efConstruction and ef (got {m}, {ef_construction}, {ef_search})")
            }
            _ => Ok(()),
        }
    }
}

/// Where the vectors live and how they are indexed: `index.json`'s `params`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MilvusParams {
    /// The server, e.g. `http://127.0.0.1:19530`.
    pub uri: String,
    pub collection: String,
    pub ann: MilvusAnn,
    /// Which build filled the collection (also in its description, and in the name of the
    /// collection that holds it: [`MilvusParams::stored_collection`]): a folder whose build
    /// was replaced by another, even with as many rows, is refused rather than searched.
    #[serde(default)]
    pub build: String,
}

impl MilvusParams {
    /// The collection that holds this build's vectors: `COLLECTION_rak_BUILD`. Builds made
    /// before each had its own (their ids hold a '-', which no Milvus name can) filled
    /// `collection` itself.
    pub fn stored_collection(&self) -> String {
        if self.build.is_empty() || self.build.contains('-') {
            self.collection.clone()
        } else {
            format!("{}{BUILD_INFIX}{}", self.collection, self.build)
        }
    }
}

/// Between a collection's name and a build's id in the name of the collection that holds the
/// build.
const BUILD_INFIX: &str = "_rak_";

/// A dense index whose vectors live in Milvus.
pub struct MilvusIndex {
    meta: IndexMeta,
    params: MilvusParams,
    ids: Vec<String>,
    client: Client,
}

/// A connection with its own runtime, so that callers stay synchronous.
struct Client {
    rt: tokio::runtime::Runtime,
    inner: ClientV2,
    uri: String,
}

impl Client {
    fn connect(uri: &str) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("cannot start the Milvus client's runtime")?;
        // Keepalive pings as pymilvus sends them (every 55 s, none while idle): the SDK's
        // default (every 10 s) makes a gRPC C++ server such as milvus-lite's close the
        // connection ("Too many pings") in the middle of a long insert.
        let mut config = ConnectConfig::new()
            .uri(uri)
            .connect_timeout(Duration::from_secs(10))
            .keepalive_time(Duration::from_secs(55))
            .keepalive_while_idle(false);
        if let Ok(token) = std::env::var("MILVUS_TOKEN") {
            config = config.token(token);
        }
        let inner = rt.block_on(ClientV2::new(&config)).map_err(|e| anyhow::anyhow!("cannot connect to Milvus at {uri}: {e}"))?;
        Ok(Client { rt, inner, uri: uri.to_string() })
    }

    /// Run one request, naming the server and what was asked in its error.
    fn call<T>(&self, what: &str, f: impl std::future::Future<Output = milvus::v2::error::Result<T>>) -> Result<T> {
        self.rt.block_on(f).map_err(|e| anyhow::anyhow!("Milvus at {}: {what}: {e}", self.uri))
    }

    fn exists(&self, collection: &str) -> Result<bool> {
        let req = HasCollectionRequest::builder().collection_name(collection).build()?;
        Ok(self.call("has collection", self.inner.has_collection(req))?.exists())
    }

    fn description(&self, collection: &str) -> Result<String> {
        let req = DescribeCollectionRequest::builder().collection_name(collection).build()?;
        Ok(self.call(&format!("describe {collection}"), self.inner.describe_collection(req))?.description().get_description().to_string())
    }

    fn drop(&self, collection: &str) -> Result<()> {
        let req = DropCollectionRequest::builder().collection_name(collection).build()?;
        self.call(&format!("drop {collection}"), self.inner.drop_collection(req))
    }

    /// Drop the collection of the build `params` describes, if it still holds that build (one
    /// already gone, or refilled by another build, is left as it is).
    fn drop_build(&self, params: &MilvusParams) -> Result<()> {
        let stored = params.stored_collection();
        if self.exists(&stored)? && self.description(&stored)? == format!("{DESCRIPTION} build {}", params.build) {
            self.drop(&stored)?;
        }
        Ok(())
    }

    /// Load the collection into the server's memory (searches and counts need it).
    fn load(&self, collection: &str) -> Result<()> {
        // As the index build, loading a large collection takes longer than the SDK's 60 s.
        let req = LoadCollectionRequest::builder().collection_name(collection).timeout_ms(INDEX_BUILD_TIMEOUT_MS).build()?;
        self.call(&format!("load {collection}"), self.inner.load_collection(req))
    }

    /// Rows the collection holds now (an exact count, which the statistics are not: they
    /// count deleted rows until a compaction).
    fn row_count(&self, collection: &str) -> Result<usize> {
        let req = QueryRequest::builder()
            .collection_name(collection)
            .output_fields(["count(*)"])
            .consistency_level(ConsistencyLevel::Strong)
            .build()?;
        let found = self.call(&format!("count the rows of {collection}"), self.inner.query(req))?;
        match found.results().get_output_field("count(*)") {
            Some(FieldData::Int64 { values, .. }) if values.len() == 1 && values[0] >= 0 => Ok(values[0] as usize),
            other => bail!("Milvus at {}: {collection}: count(*) gave {other:?}", self.uri),
        }
    }
}

impl MilvusIndex {
    /// Load the rows of `embeddings` (an `embeddings.npy`; row i is passage `ids[i]`), streamed
    /// in blocks, into a new collection of this build's own and write the index directory
    /// `dir` that points at it (replaced atomically, after the collection is complete). Then
    /// the build `dir` held before, on this server, is dropped; a failed build drops only its
    /// own. A collection of the name asked for that this toolkit did not make is refused (a
    /// user of that name would find theirs, not ours).
    pub fn build_from_npy(embeddings: &Path, ids: &[String], mut params: MilvusParams, dir: &Path, progress: &dyn Progress) -> Result<IndexMeta> {
        let mut rows = NpyRows::open(embeddings)?;
        let (n, dim) = (rows.rows(), rows.dim());
        let what = embeddings.display().to_string();
        if dim == 0 || n == 0 {
            bail!("{what}: no vectors (empty embeddings or dimension 0)");
        }
        check_ids(ids, n).with_context(|| what.clone())?;
        params.ann.validate()?;
        params.build = build_id();
        let client = Client::connect(&params.uri)?;
        let asked = params.collection.as_str();
        if client.exists(asked)? && !client.description(asked)?.starts_with(DESCRIPTION) {
            bail!("Milvus at {}: collection {asked} exists and was not made by this toolkit; drop it or choose another --collection", params.uri);
        }
        let stored = params.stored_collection();
        let name = stored.as_str();
        // The build this directory holds now, replaced below once the new one is complete.
        let replaced = IndexMeta::read(dir)
            .ok()
            .filter(|m| m.kind == "milvus")
            .and_then(|m| serde_json::from_value::<MilvusParams>(m.params).ok())
            .filter(|old| old.uri == params.uri);
        let description = format!("{DESCRIPTION} build {}", params.build);
        let schema = CollectionSchema::new().description(description.clone()).fields(vec![
            FieldSchema::new().name(ROW_FIELD).data_type(DataType::Int64).primary_key(true).auto_id(false),
            FieldSchema::new().name(VECTOR_FIELD).data_type(DataType::FloatVector).dimension(dim as u32),
        ]);
        let create = CreateCollectionRequest::builder().collection_name(name).description(description).schema(schema).build()?;
        client.call(&format!("create {name}"), client.inner.create_collection(create))?;
        if let Err(e) = fill(&client, &mut rows, &what, &params, progress) {
            // Leave no half-made collection behind (best effort: the error is what matters).
            let _ = client.drop(name);
            return Err(e);
        }
        let meta = IndexMeta::new("milvus", dim, n, "ip", serde_json::to_value(&params)?);
        if let Err(e) = super::write_dir_atomically(dir, |tmp| {
            npy::write_ids(&tmp.join("ids.txt"), ids)?;
            meta.write(tmp)
        }) {
            // A build kept under its temporary name (files appeared in `dir` meanwhile) still
            // points at this collection: it is kept with it.
            if e.downcast_ref::<super::KeptBuild>().is_none() {
                let _ = client.drop(name);
            }
            return Err(e);
        }
        // Only now that this build is complete and its folder written: the build it replaces.
        if let Some(old) = replaced.filter(|old| old.stored_collection() != name) {
            progress.log(&format!("index: dropping Milvus collection {}, the build {} held before", old.stored_collection(), dir.display()));
            client.drop_build(&old)?;
        }
        Ok(meta)
    }

    /// Drop the collection the index directory `dir` points at, if it still holds that
    /// directory's build (a collection already gone, or rebuilt by another build, is left as
    /// it is). The directory itself is the caller's to remove.
    pub fn drop_collection(dir: &Path) -> Result<()> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "milvus")?;
        let params: MilvusParams = serde_json::from_value(meta.params.clone()).with_context(|| format!("{}: params are not a Milvus index's", dir.join("index.json").display()))?;
        Client::connect(&params.uri)?.drop_build(&params)
    }

    /// Open the index directory `dir`: connect, check that the collection still holds what the
    /// directory says, and load it into the server's memory.
    pub fn load(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "milvus")?;
        let params: MilvusParams = serde_json::from_value(meta.params.clone()).with_context(|| format!("{}: params are not a Milvus index's", dir.join("index.json").display()))?;
        let ids = crate::npy::read_ids(&dir.join("ids.txt"))?;
        if ids.len() != meta.count {
            bail!("{}: {} ids but index.json says {} vectors", dir.join("ids.txt").display(), ids.len(), meta.count);
        }
        let client = Client::connect(&params.uri)?;
        let stored = params.stored_collection();
        let (asked, name) = (params.collection.as_str(), stored.as_str());
        if !client.exists(name)? {
            bail!("{}: its Milvus collection {name} is gone from {} (rebuild with host index build --kind milvus)", dir.display(), params.uri);
        }
        let description = client.description(name)?;
        if description != format!("{DESCRIPTION} build {}", params.build) {
            if name != asked {
                bail!("{}: Milvus collection {name} at {} is not the build this index was made with", dir.display(), params.uri);
            }
            // An earlier version's build, which filled the collection of the name asked for.
            bail!(
                "{}: Milvus collection {name} at {} was rebuilt by another build since this index was made; rebuild this one (host index build --kind milvus) or use the other's folder",
                dir.display(),
                params.uri
            );
        }
        client.load(name)?;
        let count = client.row_count(name)?;
        if count != meta.count {
            bail!("{}: Milvus collection {name} at {} holds {count} rows, not the {} this index was built with", dir.display(), params.uri, meta.count);
        }
        Ok(MilvusIndex { meta, params, ids, client })
    }

    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }

    /// Passage id of each row.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    pub fn params(&self) -> &MilvusParams {
        &self.params
    }

    /// The search-time effort (HNSW's ef, IVF's nprobe), as `host search --ef-search` sets
    /// it for our own HNSW.
    pub fn set_ef_search(&mut self, ef: usize) {
        match &mut self.params.ann {
            MilvusAnn::Hnsw { ef_search, .. } => *ef_search = ef,
            MilvusAnn::IvfFlat { nprobe, nlist } => *nprobe = ef.min(*nlist),
            MilvusAnn::Flat => {}
        }
    }

    /// Top-`k` rows of each query (`[n, dim]` row-major) by inner product, best first.
    pub fn search(&self, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<super::Hit>>> {
        let nq = check_matrix("queries", queries, dim)?;
        if dim != self.meta.dim {
            bail!("the index holds {}-d vectors but the queries are {dim}-d", self.meta.dim);
        }
        let k = k.min(self.meta.count);
        let stored = self.params.stored_collection();
        let name = stored.as_str();
        let mut out = Vec::with_capacity(nq);
        for chunk in queries.chunks(SEARCH_BATCH * dim) {
            let req = SearchRequest::builder()
                .collection_name(name)
                .vector_field(VECTOR_FIELD)
                .vectors(SearchVectors::Float(chunk.chunks(dim).map(<[f32]>::to_vec).collect()))
                .limit(k as i64)
                .metric_type(MetricType::Ip)
                .extra_params(self.params.ann.search_params(k))
                .build()?;
            let found = self.client.call(&format!("search {name}"), self.client.inner.search(req))?;
            let results = found.results().get_results();
            if results.len() != chunk.len() / dim {
                bail!("Milvus at {}: {} results for {} queries", self.params.uri, results.len(), chunk.len() / dim);
            }
            for r in results {
                let Ids::Int64(rows) = r.get_ids() else { bail!("Milvus at {}: {name} returned non-integer ids", self.params.uri) };
                let mut hits = Vec::with_capacity(rows.len());
                for (&row, &score) in rows.iter().zip(r.get_scores()) {
                    if row < 0 || row as usize >= self.ids.len() {
                        bail!("Milvus at {}: {name} returned row {row}, outside this index's {} rows", self.params.uri, self.ids.len());
                    }
                    hits.push(super::Hit { row: row as usize, score });
                }
                out.push(hits);
            }
        }
        Ok(out)
    }
}

/// Write every row of `rows` into the build's new collection, index it and load it.
fn fill(client: &Client, rows: &mut NpyRows, what: &str, params: &MilvusParams, progress: &dyn Progress) -> Result<()> {
    let stored = params.stored_collection();
    let name = stored.as_str();
    let (n, dim) = (rows.rows(), rows.dim());
    let block = (INSERT_BYTES / (4 * dim)).max(1);
    let mut buf = Vec::new();
    progress.start("milvus upsert", n as u64);
    loop {
        let first = rows.position();
        let got = rows.read_rows(block, &mut buf)?;
        if got == 0 {
            break;
        }
        check_rows(what, &buf, dim, first)?;
        let columns = vec![
            FieldData::Int64 { name: ROW_FIELD.into(), values: (first as i64..(first + got) as i64).collect() },
            FieldData::FloatVector { name: VECTOR_FIELD.into(), values: buf.chunks(dim).map(<[f32]>::to_vec).collect() },
        ];
        // An upsert, not an insert: a request sent again (the client retries some failures)
        // must not leave a row twice, and Milvus keeps duplicate primary keys from inserts.
        let insert = InsertRequest::builder().collection_name(name).columns(columns).build()?;
        let upsert = UpsertRequest::builder().insert(insert).build()?;
        let done = client.call(&format!("upsert rows {first}..{} into {name}", first + got), client.inner.upsert(upsert))?;
        if done.upsert_count() as usize != got {
            bail!("Milvus at {}: wrote {} of {got} rows into {name}", params.uri, done.upsert_count());
        }
        progress.inc(got as u64);
    }
    progress.finish();
    progress.log(&format!("index: flushing {name} and building its {:?} index", params.ann.index_type()));
    client.call(&format!("flush {name}"), client.inner.flush(FlushRequest::builder().collection_names([name]).build()?))?;
    let index = IndexParam::new()
        .field_name(VECTOR_FIELD)
        .index_type(params.ann.index_type())
        .metric_type(MetricType::Ip)
        .extra_params(params.ann.build_params());
    // The SDK waits 60 s for the index by default; HNSW over 100,000 vectors of 384 took
    // longer on 2 cores, and a large corpus takes hours.
    let create_index = CreateIndexRequest::builder().collection_name(name).index_param(index).sync(true).timeout_ms(INDEX_BUILD_TIMEOUT_MS).build()?;
    client.call(&format!("create the index of {name}"), client.inner.create_index(create_index))?;
    client.load(name)?;
    let count = client.row_count(name)?;
    if count != n {
        bail!("Milvus at {}: {name} holds {count} rows after loading {n}", params.uri);
    }
    Ok(())
}

/// A build's id: when and by which process, unique enough to tell two builds apart; letters,
/// digits and '_' only, as Milvus names need.
fn build_id() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:x}_{:x}", now.as_nanos(), std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_build_has_a_collection_of_its_own() {
        let p = |build: &str| MilvusParams { uri: String::new(), collection: "docs".into(), ann: MilvusAnn::Flat, build: build.into() };
        let id = build_id();
        assert_eq!(p(&id).stored_collection(), format!("docs_rak_{id}"));
        assert!(id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'), "{id} is no part of a Milvus name");
        assert_ne!(id, build_id(), "two builds, one id");
        // Builds made before kept their vectors in the collection itself.
        assert_eq!(p("18f3a-1c2").stored_collection(), "docs");
        assert_eq!(p("").stored_collection(), "docs");
    }
}
