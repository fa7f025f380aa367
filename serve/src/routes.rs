//! The retrieval routes (`/v1/embeddings`, `/search`) and the small ones (`/`, `/health`,
//! `/metrics`, `/info`, `/v1/models`).

use crate::api::{json_body, opt_str, opt_usize, ApiError};
use crate::Shared;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use base64::Engine;
use rak_core::abi::Role;
use rak_retrieval::index::Index;
use serde_json::{json, Map, Value};

const PAGE: &str = include_str!("page.html");

pub async fn page() -> Html<&'static str> {
    Html(PAGE)
}

/// 200 while the server can answer; 503 once its encoder cannot (its thread ended, or the
/// plugin instance was poisoned by a panic), so a load balancer takes it out.
pub async fn health(State(state): State<Shared>) -> Response {
    match &state.batcher {
        Some(b) if !b.healthy() => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unhealthy", "reason": "the encoder can no longer encode (see the log)"}))).into_response(),
        _ => Json(json!({"status": "ok"})).into_response(),
    }
}

pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "no such route (see GET /v1/models, POST /v1/embeddings, POST /search, POST /v1/chat/completions, POST /v1/completions)")
}

pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{} does not take {method} (see the Allow header)", uri.path()))
}

pub async fn metrics(State(state): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render()).into_response()
}

/// What the page needs to draw itself.
pub async fn info(State(state): State<Shared>) -> Json<Value> {
    let o = &state.opts;
    Json(json!({
        "model": o.model_name,
        "index": state.index.info(),
        "passages": state.corpus.len(),
        "tasks": o.tasks,
        "default_task": o.default_task,
        "default_k": o.default_k,
        "max_k": o.max_k,
        "target": state.target_model,
        "embeddings": state.batcher.is_some(),
    }))
}

/// The embedding model under its three names, and the target behind the completion routes.
pub async fn models(State(state): State<Shared>) -> Json<Value> {
    let model = |id: &str, what: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "rak", "rak": what});
    let mut data = Vec::new();
    if state.batcher.is_some() {
        let name = &state.opts.model_name;
        data.push(model(name, "embeddings (passages unless input_type says query)"));
        data.push(model(&format!("{name}-query"), "embeddings of queries"));
        data.push(model(&format!("{name}-passage"), "embeddings of passages"));
    }
    if let Some(target) = &state.target_model {
        data.push(model(target, "chat and completions, augmented with retrieved passages"));
    }
    Json(json!({"object": "list", "data": data}))
}

/// `POST /v1/embeddings`.
pub async fn embeddings(State(state): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let req = json_body(body, state.opts.max_body_bytes).await?;
    let batcher = state.batcher.as_ref().ok_or_else(|| ApiError::bad_request("this server has no encoder (a BM25 index): it serves no embeddings"))?;
    let texts = embedding_inputs(&req, state.opts.max_inputs)?;
    let name = &state.opts.model_name;
    let model = opt_str(&req, "model")?.unwrap_or(name);
    let role_of_model = if model == name.as_str() {
        None
    } else if model == format!("{name}-query") {
        Some(Role::Query)
    } else if model == format!("{name}-passage") {
        Some(Role::Passage)
    } else {
        return Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("model {model:?} is not served here (served: {name}, {name}-query, {name}-passage)")).with_code("model_not_found")
        });
    };
    let role = match (opt_str(&req, "input_type")?, role_of_model) {
        (None, role) => role.unwrap_or(Role::Passage),
        (Some(t), role) => {
            let given = match t {
                "query" => Role::Query,
                "passage" | "document" => Role::Passage,
                other => return Err(ApiError::field("input_type", format!("input_type {other:?}: expected \"query\" or \"passage\""))),
            };
            if role.is_some_and(|r| r != given) {
                return Err(ApiError::field("input_type", format!("input_type {t:?} contradicts the model name {model:?}")));
            }
            given
        }
    };
    let base64 = match opt_str(&req, "encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::field("encoding_format", format!("encoding_format {other:?}: expected \"float\" or \"base64\""))),
    };
    let task = opt_str(&req, "task")?.map(str::to_string).or_else(|| state.opts.default_task.clone());
    let task = if role == Role::Query { task } else { None };
    // The encoder's width is a dense index's (checked when the server started); beside a BM25
    // index it is known once encoded.
    let wrong_width = |dim: usize, d: usize| ApiError::field("dimensions", format!("this model's vectors have {dim} dimensions, not {d}"));
    let asked = opt_usize(&req, "dimensions")?;
    let index_dim = (!matches!(state.index, Index::Bm25(_))).then(|| state.index.meta().dim);
    if let (Some(d), Some(dim)) = (asked, index_dim) {
        if d != dim {
            return Err(wrong_width(dim, d));
        }
    }
    let chars: usize = texts.iter().map(|t| t.len()).sum();
    let crate::batch::Encoded { rows, dim, tokens } = encode(batcher, texts, role, task, true).await?;
    if let Some(d) = asked.filter(|&d| d != dim) {
        return Err(wrong_width(dim, d));
    }
    let data: Vec<Value> = rows
        .into_iter()
        .enumerate()
        .map(|(i, row)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(row)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    // The encoder's own token counts (special tokens included, after truncation); an encoder
    // that cannot tell them gets an estimate, bytes / 4 (OpenAI's rule of thumb).
    let tokens = tokens.unwrap_or(chars.div_ceil(4));
    Ok(Json(json!({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})))
}

/// `input`: a string or a list of strings. Token ids (what LangChain's OpenAIEmbeddings sends
/// unless told otherwise) are refused with the way out.
fn embedding_inputs(req: &Map<String, Value>, max: usize) -> Result<Vec<String>, ApiError> {
    let token_ids = || {
        ApiError::field(
            "input",
            "`input` holds token ids; this server embeds text. LangChain's OpenAIEmbeddings sends tiktoken ids unless created with check_embedding_ctx_length=False",
        )
    };
    let texts = match req.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.is_empty() => return Err(ApiError::field("input", "`input` is an empty list")),
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => out.push(s.clone()),
                    Value::Number(_) | Value::Array(_) => return Err(token_ids()),
                    _ => return Err(ApiError::field("input", "`input` must be a string or a list of strings")),
                }
            }
            out
        }
        Some(Value::Number(_)) => return Err(token_ids()),
        Some(_) => return Err(ApiError::field("input", "`input` must be a string or a list of strings")),
        None => return Err(ApiError::field("input", "the request needs `input`")),
    };
    if texts.len() > max {
        return Err(ApiError::field("input", format!("`input` has {} texts; at most {max} per request", texts.len())));
    }
    Ok(texts)
}

/// Texts through the shared encoder queue: their rows, width and (with `count_tokens`, when
/// the encoder tells) tokens (429 when the queue is full).
pub(crate) async fn encode(batcher: &crate::batch::Batcher, texts: Vec<String>, role: Role, task: Option<String>, count_tokens: bool) -> Result<crate::batch::Encoded, ApiError> {
    let rx = batcher.submit(texts, role, task, count_tokens).map_err(|e| match e {
        crate::batch::Refused::Full => ApiError::busy("the encoder queue is full; retry after a moment"),
        crate::batch::Refused::Gone => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the encoder has stopped; this server cannot encode"),
    })?;
    // The request's deadline (the middleware's) bounds this wait; dropping `rx` abandons the texts.
    match rx.await {
        Err(_) => Err(ApiError::internal("the encoder thread stopped")),
        Ok(Err(e)) => Err(ApiError::internal(format!("encoding failed: {e}"))),
        Ok(Ok(rows)) => Ok(rows),
    }
}

/// One retrieved passage.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Hit {
    pub id: String,
    pub title: String,
    pub text: String,
    pub score: f32,
}

/// The top `k` passages of each query (dense: through the encoder queue, as queries of
/// `task`; BM25: by text).
pub(crate) async fn retrieve(state: &Shared, queries: Vec<String>, k: usize, task: Option<String>) -> Result<Vec<Vec<Hit>>, ApiError> {
    let found: Vec<Vec<(String, f32)>> = match &state.index {
        Index::Bm25(_) => {
            let s = state.clone();
            blocking(move || {
                let Index::Bm25(bm25) = &s.index else { unreachable!("matched above") };
                queries.iter().map(|q| bm25.search(q, k)).collect::<anyhow::Result<Vec<_>>>()
            })
            .await?
        }
        _ => {
            let batcher = state.batcher.as_ref().ok_or_else(|| ApiError::internal("a dense index without an encoder"))?;
            let crate::batch::Encoded { rows, dim, .. } = encode(batcher, queries, Role::Query, task, false).await?;
            let s = state.clone();
            blocking(move || {
                let flat: Vec<f32> = rows.concat();
                rak_retrieval::pipeline::search::search_vectors(&s.index, &flat, dim, k)
            })
            .await?
        }
    };
    Ok(found
        .into_iter()
        .map(|hits| {
            hits.into_iter()
                .map(|(id, score)| {
                    let (title, text) = state.corpus.get(&id).map(|p| (p.title.clone(), p.text.clone())).unwrap_or_default();
                    Hit { id, title, text, score }
                })
                .collect()
        })
        .collect())
}

/// Run `f` on the blocking pool (the request's deadline bounds the wait).
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> anyhow::Result<T> + Send + 'static) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(f).await {
        Err(_) => Err(ApiError::internal("a search failed unexpectedly")),
        Ok(Err(e)) => Err(ApiError::internal(format!("{e:#}"))),
        Ok(Ok(v)) => Ok(v),
    }
}

/// `k` and `task` of a request, checked.
pub(crate) fn k_and_task(state: &Shared, req: &Map<String, Value>, what: &str) -> Result<(usize, Option<String>), ApiError> {
    let k = opt_usize(req, "k").map_err(|e| ApiError { param: Some(format!("{what}k")), ..e })?.unwrap_or(state.opts.default_k);
    if k > state.opts.max_k {
        return Err(ApiError::field(&format!("{what}k"), format!("k = {k} is more than this server's limit ({}, --max-k)", state.opts.max_k)));
    }
    let task = opt_str(req, "task").map_err(|e| ApiError { param: Some(format!("{what}task")), ..e })?.map(str::to_string).or_else(|| state.opts.default_task.clone());
    Ok((k, task))
}

/// `POST /search`: `{"query": "..." | ["...", ...], "k": 10, "task": "squad"}`.
pub async fn search(State(state): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let req = json_body(body, state.opts.max_body_bytes).await?;
    let (queries, many) = match req.get("query") {
        Some(Value::String(q)) => (vec![q.clone()], false),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_string) => {
            (items.iter().map(|q| q.as_str().unwrap_or_default().to_string()).collect::<Vec<_>>(), true)
        }
        Some(_) => return Err(ApiError::field("query", "`query` must be a string or a non-empty list of strings")),
        None => return Err(ApiError::field("query", "the request needs `query`")),
    };
    if queries.len() > state.opts.max_inputs {
        return Err(ApiError::field("query", format!("{} queries; at most {} per request", queries.len(), state.opts.max_inputs)));
    }
    let (k, task) = k_and_task(&state, &req, "")?;
    if k == 0 {
        return Err(ApiError::field("k", "k must be positive"));
    }
    let results = retrieve(&state, queries.clone(), k, task.clone()).await?;
    let answer = |q: &str, hits: &[Hit]| json!({"query": q, "passages": hits});
    Ok(Json(if many {
        json!({"results": queries.iter().zip(&results).map(|(q, h)| answer(q, h)).collect::<Vec<_>>(), "k": k, "task": task})
    } else {
        json!({"query": queries[0], "passages": results[0], "k": k, "task": task})
    }))
}
