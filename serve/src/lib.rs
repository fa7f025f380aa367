//! `host serve`: a trained retriever behind HTTP. Routes:
//! - `POST /v1/embeddings` (OpenAI's shapes; queries or passages by `input_type` or a
//!   `-query`/`-passage` model suffix), `POST /search` (top-k passages with text and score);
//! - `POST /v1/chat/completions`, `POST /v1/completions`: the request passed on to the
//!   target LM through a connector plugin, after retrieving passages for the last user
//!   message and placing them before it (`"stream": true` passes the target's events through);
//! - `GET /v1/models`, `GET /info`, `GET /health`, `GET /metrics` (Prometheus), `GET /` (a
//!   page to try it).
//!
//! The library knows nothing of plugins or recipes: `host serve` hands it an encoder, an open
//! index, the corpus, a connector and the passage layout, made by the same services the other
//! commands use. Encoding runs on one thread that owns the encoder ([`batch`]); searches and
//! target calls run on tokio's blocking pool; the HTTP side is axum on a multi-threaded tokio
//! runtime.

mod api;
mod batch;
mod chat;
mod metrics;
mod routes;
mod slot;

pub use batch::BatchOptions;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::FutureExt;
use metrics::Metrics;
use rak_core::plugin::{Connector, Encoder};
use rak_retrieval::data::{Corpus, Passage};
use rak_retrieval::index::Index;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Address to bind (127.0.0.1 unless told otherwise).
    pub host: String,
    /// Port (0: any free one; the address bound is printed).
    pub port: u16,
    /// Every route but `/health` and `/` requires `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Largest request body read (larger: 413).
    pub max_body_bytes: usize,
    /// How long one request may take once its head is read (past it: 504); for a stream,
    /// until its first piece, and then between two pieces (past it, the stream is cut). A call
    /// to the target still running a request timeout after its request gave up loses its
    /// `target_concurrency` slot. Also how long its head may take to arrive (past it, the
    /// connection is closed), so the two bound a request from its first byte.
    pub request_timeout: Duration,
    /// After SIGTERM, how long requests in flight may still take before the server exits
    /// anyway (a second signal exits at once).
    pub shutdown_grace: Duration,
    /// Host names besides the server's own that requests may name (`Host`) or come from
    /// (`Origin`): a reverse proxy's, a site whose pages call the server.
    pub allowed_hosts: Vec<String>,
    /// Requests on their way to the target at once, streams included (more wait, within
    /// their deadline).
    pub target_concurrency: usize,
    /// Passages retrieved per query when a request does not say.
    pub default_k: usize,
    /// Most passages one request may ask for.
    pub max_k: usize,
    /// Most texts in one embeddings request (OpenAI's limit is 2048).
    pub max_inputs: usize,
    /// The task a query is encoded for when a request names none.
    pub default_task: Option<String>,
    /// Task names shown on the page.
    pub tasks: Vec<String>,
    /// The name the embedding model is served under (`/v1/models`, `model` in requests).
    pub model_name: String,
    pub batch: BatchOptions,
}

/// What the server serves; made by the caller.
pub struct Backend {
    /// Needed for dense indexes and `/v1/embeddings`; a BM25 index needs none.
    pub encoder: Option<Box<dyn Encoder>>,
    pub index: Index,
    /// Passage titles and texts by id (`/search` and the prompts).
    pub corpus: Corpus,
    /// The target LM for the completion routes.
    pub connector: Option<Box<dyn Connector>>,
    /// The target's model name (for `/v1/models`).
    pub target_model: Option<String>,
    /// The passages as a prompt shows them, before the user's message.
    pub format_passages: Box<dyn Fn(&[&Passage]) -> String + Send + Sync>,
}

/// Shared by every request.
pub(crate) struct AppState {
    opts: Options,
    batcher: Option<batch::Batcher>,
    index: Index,
    corpus: Corpus,
    connector: Option<Arc<dyn Connector>>,
    target_model: Option<String>,
    format_passages: Box<dyn Fn(&[&Passage]) -> String + Send + Sync>,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    /// Permits for calls to the target, held until a call (or its stream) ends, or a request
    /// timeout after its request gave up ([`slot`]).
    target_permits: Arc<tokio::sync::Semaphore>,
    /// Bound to a loopback address: requests must name a loopback host (DNS rebinding).
    loopback: bool,
}

type Shared = Arc<AppState>;

/// Serve until SIGTERM or SIGINT, then stop accepting, finish what is in flight and return.
/// `on_ready` gets the bound address once the server listens.
pub fn serve(opts: Options, backend: Backend, on_ready: impl FnOnce(SocketAddr) + Send) -> Result<()> {
    let metrics = Arc::new(Metrics::default());
    let (batcher, encoder_thread) = match backend.encoder {
        Some(encoder) => {
            let (b, t) = batch::Batcher::start(encoder, opts.batch.clone(), metrics.clone());
            (Some(b), Some(t))
        }
        None => (None, None),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("rak-serve").build().context("starting the async runtime")?;
    let addr = format!("{}:{}", opts.host, opts.port);
    let loopback = opts.host == "localhost" || opts.host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let grace = opts.shutdown_grace;
    let header_timeout = opts.request_timeout;
    let target_permits = Arc::new(tokio::sync::Semaphore::new(opts.target_concurrency.max(1)));
    let state = Arc::new(AppState {
        opts,
        batcher,
        index: backend.index,
        corpus: backend.corpus,
        connector: backend.connector.map(Arc::from),
        target_model: backend.target_model,
        format_passages: backend.format_passages,
        metrics,
        next_id: AtomicU64::new(1),
        target_permits,
        loopback,
    });
    // The last reference is dropped outside the runtime: a Milvus index owns a runtime of its
    // own, which must not be dropped inside another's async context.
    let keep = state.clone();
    let drained = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        // Signal handlers before the address is announced: a SIGTERM right after it must
        // drain, not kill.
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let (stopping, mut stop) = tokio::sync::watch::channel(0u32);
        tokio::spawn(count_signals(stopping, term));
        on_ready(listener.local_addr()?);
        let server = accept_until_stopped(listener, router(state), stop.clone(), header_timeout);
        // After the first signal the server drains; the grace period or a second signal ends
        // the wait (a stalled client must not keep a restart waiting forever).
        let deadline = async move {
            let _ = stop.wait_for(|&n| n >= 1).await;
            tokio::select! {
                _ = tokio::time::sleep(grace) => "the grace period passed",
                _ = stop.wait_for(|&n| n >= 2) => "a second signal came",
            }
        };
        tokio::select! {
            () = server => Ok::<bool, anyhow::Error>(true),
            why = deadline => {
                log_line(&serde_json::json!({"event": "shutdown", "message": format!("{why} before the requests in flight finished; exiting without them")}));
                Ok(false)
            }
        }
    })?;
    // Requests cut at the deadline may still hold blocking threads (a search, a call to the
    // target): they are not waited for.
    runtime.shutdown_timeout(Duration::from_millis(200));
    drop(keep);
    // Drained: the last `Batcher` went with the router, so the encoder thread finishes its round
    // and ends. Cut short: it is left to the process's exit.
    if let (true, Some(t)) = (drained, encoder_thread) {
        let give_up = std::time::Instant::now() + grace;
        while !t.is_finished() && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Accept connections and serve `app` on each (HTTP/1.1) until the first signal, then stop
/// accepting, let every connection finish the request it is in (an idle one closes at once)
/// and return when all have closed. A connection's request head must arrive within
/// `header_timeout` (the request timeout), and so must the next request on a kept-alive one:
/// a client that sends part of a head and stalls is closed then, so it can neither hold a
/// connection for ever nor keep SIGTERM's drain waiting for the grace period. (The
/// middleware's deadline only starts once the head is read.)
async fn accept_until_stopped(listener: tokio::net::TcpListener, app: Router, stop: tokio::sync::watch::Receiver<u32>, header_timeout: Duration) {
    // Every connection's task holds a receiver; the sender's `closed` is all of them ended.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    let mut stopped = stop.clone();
    loop {
        let (io, _peer) = tokio::select! {
            biased;
            _ = stopped.wait_for(|&n| n >= 1) => break,
            conn = listener.accept() => match conn {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait, rather than spin.
                    log_line(&serde_json::json!({"event": "accept", "message": format!("cannot accept a connection: {e}")}));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = io.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let (mut stop, open) = (stop.clone(), open_rx.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            let mut draining = false;
            let result = loop {
                tokio::select! {
                    r = conn.as_mut() => break r,
                    _ = stop.wait_for(|&n| n >= 1), if !draining => {
                        draining = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            };
            if let Err(e) = result {
                if e.is_timeout() {
                    log_line(&serde_json::json!({"event": "connection", "message": format!(
                        "closed a connection whose request head did not arrive within {:.0} s (--request-timeout-s)", header_timeout.as_secs_f64()
                    )}));
                }
            }
            drop(open);
        });
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
}

/// Counts SIGTERM and SIGINT into `count`.
async fn count_signals(count: tokio::sync::watch::Sender<u32>, mut term: Option<tokio::signal::unix::Signal>) {
    loop {
        let got_term = async {
            match term.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = got_term => {},
            _ = tokio::signal::ctrl_c() => {},
        }
        let n = *count.borrow() + 1;
        if n == 1 {
            log_line(&serde_json::json!({"event": "shutdown", "message": "stopping: no new connections; finishing the requests in flight (a second signal exits at once)"}));
        }
        let _ = count.send(n);
    }
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(routes::page))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/info", get(routes::info))
        .route("/v1/models", get(routes::models))
        .route("/v1/embeddings", post(routes::embeddings))
        .route("/search", post(routes::search))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .fallback(routes::not_found)
        // A known route asked with another method: 405 with the same error body as the rest
        // (axum's own has none), and axum's `Allow` header.
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), around_request))
        .with_state(state)
}

/// Around every request: its id, the key check, panics turned into 500s, the metrics and one
/// log line (never the key, never a body).
async fn around_request(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let id = format!("req-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let route = route_label(&path);
    let checked = same_origin(&state, &req).and_then(|_| authorize(&state, &req, &path));
    let mut resp = if let Err(e) = checked {
        e.into_response()
    } else {
        // One deadline for the whole request, reading its body included (a stream: until its
        // first piece, when the handler returns).
        let run = std::panic::AssertUnwindSafe(next.run(req)).catch_unwind();
        match tokio::time::timeout(state.opts.request_timeout, run).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(_)) => api::ApiError::internal(format!("internal error while answering {path} (request {id}); the server keeps running")).into_response(),
            Err(_) => api::ApiError::timeout(format!("the request took longer than the server's limit ({:.0} s, --request-timeout-s)", state.opts.request_timeout.as_secs_f64())).into_response(),
        }
    };
    if let Ok(v) = header::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    let secs = start.elapsed().as_secs_f64();
    let status = resp.status().as_u16();
    state.metrics.observe_request(&route, status, secs);
    log_line(&serde_json::json!({"id": id, "method": method.as_str(), "path": path, "status": status, "ms": (secs * 1e4).round() / 10.0}));
    resp
}

/// Refuse what a web page the user visits could send: a request from another origin (a
/// browser names it in `Origin`), and, on a loopback address, one naming another host (a page
/// whose DNS name was rebound to 127.0.0.1). Clients that are not browsers send no `Origin`.
fn same_origin(state: &AppState, req: &Request) -> Result<(), api::ApiError> {
    let forbidden = |why: String| api::ApiError::new(StatusCode::FORBIDDEN, "permission_error", why);
    let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    let allowed = |name: &str| state.opts.allowed_hosts.iter().any(|h| h.eq_ignore_ascii_case(name));
    if state.loopback {
        let name = host_name(host);
        if !["127.0.0.1", "localhost", "[::1]", ""].contains(&name) && !allowed(name) {
            return Err(forbidden(format!(
                "this server listens on a loopback address and answers only requests for it, not for host {name:?} (behind a reverse proxy: --allowed-host {name})"
            )));
        }
    }
    if let Some(origin) = req.headers().get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let authority = origin.split_once("://").map(|(_, a)| a).unwrap_or(origin);
        if authority != host && !allowed(host_name(authority)) {
            return Err(forbidden(format!(
                "requests from {origin} are not accepted: only from this server's own page, or a site named with --allowed-host {}",
                host_name(authority)
            )));
        }
    }
    Ok(())
}

/// `name` of `name:port` (`[::1]` of `[::1]:8080`).
fn host_name(authority: &str) -> &str {
    match authority.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && (!name.contains(':') || name.ends_with(']')) => name,
        _ => authority,
    }
}

fn authorize(state: &AppState, req: &Request, path: &str) -> Result<(), api::ApiError> {
    let Some(key) = &state.opts.api_key else { return Ok(()) };
    // The page holds no data (it asks for the key and sends it with its calls); /health is for
    // load balancers.
    if path == "/health" || path == "/" {
        return Ok(());
    }
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(api::ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "the API key given is not this server's").with_code("invalid_api_key")),
        None => Err(api::ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "this server requires an API key: send `Authorization: Bearer KEY`")),
    }
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's name is matched without
/// regard to case (RFC 7235: `bearer`, `BEARER`).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// Equality whose time does not depend on where the first difference is (only the length
/// shows).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The metrics label of a path: its route, or `other` (unknown paths must not grow the
/// metrics without bound).
fn route_label(path: &str) -> &'static str {
    const ROUTES: [&str; 9] = ["/", "/health", "/metrics", "/info", "/v1/models", "/v1/embeddings", "/search", "/v1/chat/completions", "/v1/completions"];
    ROUTES.iter().find(|r| **r == path).copied().unwrap_or("other")
}

/// One structured log line on stderr, with the time.
pub(crate) fn log_line(v: &serde_json::Value) {
    let mut v = v.clone();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    v["ts"] = serde_json::json!((now * 1000.0).round() / 1000.0);
    eprintln!("{v}");
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn host_names_lose_only_their_port() {
        assert_eq!(super::host_name("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(super::host_name("[::1]:8080"), "[::1]");
        assert_eq!(super::host_name("[::1]"), "[::1]");
        assert_eq!(super::host_name("localhost"), "localhost");
        assert_eq!(super::host_name("rag.example.com:443"), "rag.example.com");
    }

    #[test]
    fn the_bearer_scheme_is_matched_without_regard_to_case() {
        for v in ["Bearer k1", "bearer k1", "BEARER k1", "  Bearer   k1 ", "Bearer\tk1"] {
            assert_eq!(super::bearer_token(v), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "Bearer ", "k1", ""] {
            assert_eq!(super::bearer_token(v), None, "{v:?}");
        }
    }

    #[test]
    fn keys_are_compared_whole() {
        assert!(constant_time_eq(b"secret-key", b"secret-key"));
        assert!(!constant_time_eq(b"secret-ke", b"secret-key"));
        assert!(!constant_time_eq(b"secret-keyy", b"secret-key"));
        assert!(!constant_time_eq(b"", b"secret-key"));
        assert!(!constant_time_eq(b"Secret-key", b"secret-key"));
    }
}
