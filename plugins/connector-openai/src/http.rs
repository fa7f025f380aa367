//! POSTs of JSON to the server: a concurrency gate, bounded retries with backoff and jitter
//! that honour `Retry-After`, an on-disk response cache and usage totals.
//!
//! What is retried: 429, 408 and 5xx answers, timeouts, refused or dropped connections, and
//! 200 answers whose body is not JSON (a proxy's error page, a truncated body). Other 4xx
//! answers are the request's fault and come back at once, classified (a context overflow is
//! its own kind, so the caller can shorten the prompt). Retries stop at `max_retries` or when
//! the next wait would pass `retry_budget` since the first attempt, whichever comes first.
//! A body over `max_response_bytes` fails its request without being read further.
//!
//! Only replies the operation accepted are cached: `post` hands each reply to the caller's
//! check and caches it only when the check passes, so a malformed 2xx (`{"choices": []}`,
//! `null`, a forced token the server ignored) fails its item now and is asked again next time.
//! Bodies are parsed and cached as the server sent them (re-serialized); the API key is scrubbed from
//! error messages only (a 2xx body that quotes the key is refused, never stored).

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// An API key: its `Debug` never shows it, and it only ever goes into a sensitive header.
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: String) -> Self {
        ApiKey(key)
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The prompt does not fit the model's context (the caller may shorten it).
    ContextLength,
    /// A 4xx answer other than 408/429: the request itself is wrong.
    Rejected,
    /// Retryable failures that did not clear within the retry bounds.
    RetriesExhausted,
    /// The same, the last try unable even to connect: no server listens at the base URL (or
    /// none answers within `connect_timeout`). Callers stop asking rather than fail every item.
    Unreachable,
    /// The server answered, but not in a shape this connector understands.
    BadReply,
    /// A forwarded request (`forward`, `stream`: one try, no retries) ran past `timeout_s`.
    Timeout,
    /// A forwarded request met the server's rate limit (429); `retry_after` says how long it
    /// asked to wait.
    RateLimited,
}

impl ErrorKind {
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::ContextLength => "context_length",
            ErrorKind::Rejected => "rejected",
            ErrorKind::RetriesExhausted => "retries_exhausted",
            ErrorKind::Unreachable => "unreachable",
            ErrorKind::BadReply => "bad_reply",
            ErrorKind::Timeout => "timeout",
            ErrorKind::RateLimited => "rate_limited",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The HTTP status of a refusal (`Rejected`, `ContextLength`).
    pub status: Option<u16>,
    /// Token counts a context-overflow answer reported, when it did.
    pub prompt_tokens: Option<u64>,
    pub context_tokens: Option<u64>,
    /// The wait a rate-limited reply asked for.
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError { kind, message: message.into(), status: None, prompt_tokens: None, context_tokens: None, retry_after: None }
    }

    pub fn to_json(&self) -> Value {
        let mut v = json!({"kind": self.kind.name(), "message": self.message});
        if let Some(status) = self.status {
            v["status"] = json!(status);
        }
        if let Some(n) = self.prompt_tokens {
            v["prompt_tokens"] = json!(n);
        }
        if let Some(n) = self.context_tokens {
            v["context_tokens"] = json!(n);
        }
        if let Some(d) = self.retry_after.filter(|d| *d < Duration::from_secs(1 << 30)) {
            v["retry_after_s"] = json!(d.as_secs_f64());
        }
        v
    }
}

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub max_retries: u32,
    pub budget: Duration,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

/// Counters over the connector's life. Usage from cached replies is counted apart.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub in_flight: AtomicU64,
    pub retries: AtomicU64,
    pub failures: AtomicU64,
    pub cache_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub cached_completion_tokens: AtomicU64,
}

impl Stats {
    pub fn to_json(&self) -> Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "requests": g(&self.requests),
            "in_flight": g(&self.in_flight),
            "retries": g(&self.retries),
            "failed_requests": g(&self.failures),
            "cache_hits": g(&self.cache_hits),
            "prompt_tokens": g(&self.prompt_tokens),
            "completion_tokens": g(&self.completion_tokens),
            "cached_prompt_tokens": g(&self.cached_prompt_tokens),
            "cached_completion_tokens": g(&self.cached_completion_tokens),
        })
    }

    fn add_usage(&self, reply: &Value, cached: bool) {
        let usage = &reply["usage"];
        let (p, c) = (usage["prompt_tokens"].as_u64().unwrap_or(0), usage["completion_tokens"].as_u64().unwrap_or(0));
        // llama.cpp's native /completion reports `timings` instead of `usage`.
        let (p, c) = if usage.is_null() {
            (reply["tokens_evaluated"].as_u64().unwrap_or(0), reply["tokens_predicted"].as_u64().unwrap_or(0))
        } else {
            (p, c)
        };
        let (pc, cc) = if cached {
            (&self.cached_prompt_tokens, &self.cached_completion_tokens)
        } else {
            (&self.prompt_tokens, &self.completion_tokens)
        };
        pc.fetch_add(p, Ordering::Relaxed);
        cc.fetch_add(c, Ordering::Relaxed);
    }
}

/// At most `limit` requests on the wire at once; waiting callers queue here, not at the server.
struct Gate {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Gate {
    fn enter(&self) -> GatePass<'_> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
        GatePass(self)
    }
}

struct GatePass<'a>(&'a Gate);

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.freed.notify_one();
    }
}

/// Replies on disk, one JSON file per request, named by the SHA-256 of (server, model, path,
/// body): the body holds every sampling setting; the key is never part of it.
struct Cache {
    dir: PathBuf,
    writes: AtomicU64,
}

impl Cache {
    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(&key[..2]).join(format!("{key}.json"))
    }

    /// A cached reply; an unreadable or torn file is a miss (it is rewritten on success).
    fn get(&self, key: &str) -> Option<Value> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Written under a unique temporary name and renamed, so readers never see half a file.
    /// A cache that cannot be written is not an error: the reply is still good.
    fn put(&self, key: &str, reply: &Value) {
        let path = self.path(key);
        let Some(dir) = path.parent() else { return };
        if std::fs::create_dir_all(dir).is_err() {
            return;
        }
        let n = self.writes.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{key}.{}-{n}.tmp", std::process::id()));
        if std::fs::write(&tmp, reply.to_string()).is_ok() && std::fs::rename(&tmp, &path).is_ok() {
            return;
        }
        let _ = std::fs::remove_file(&tmp);
    }

    fn remove(&self, key: &str) {
        let _ = std::fs::remove_file(self.path(key));
    }
}

/// Keys shorter than this are placeholders, not secrets (vLLM's `EMPTY`, `none`, `1`): scrubbing
/// them would rewrite every message that holds the word or the digit.
pub const MIN_SECRET_CHARS: usize = 8;

pub struct Http {
    client: reqwest::blocking::Client,
    /// Server root, without a trailing `/` or `/v1`.
    pub base: String,
    /// The server and the model every cache key holds (see [`Http::set_identity`]; llama.cpp's
    /// native endpoints take no model in their bodies).
    key_server: String,
    model: String,
    max_body: u64,
    key: Option<ApiKey>,
    /// `Bearer KEY`, marked sensitive (reqwest then keeps it out of its Debug output).
    auth: Option<reqwest::header::HeaderValue>,
    retry: RetryPolicy,
    cache: Option<Cache>,
    gate: Gate,
    pub stats: Stats,
}

pub struct HttpConfig {
    pub base: String,
    pub model: String,
    pub key: Option<ApiKey>,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub concurrency: usize,
    pub retry: RetryPolicy,
    pub cache_dir: Option<PathBuf>,
    pub max_response_bytes: u64,
}

enum Attempt {
    Done(Value),
    /// `connect`: the try could not connect at all.
    Retry { why: String, after: Option<Duration>, connect: bool },
    Fail(ApiError),
}

impl Http {
    pub fn new(cfg: HttpConfig) -> anyhow::Result<Self> {
        let client = reqwest::blocking::Client::builder()
            .timeout(cfg.timeout)
            .connect_timeout(cfg.connect_timeout)
            .pool_max_idle_per_host(cfg.concurrency.max(1))
            .build()
            .map_err(|e| anyhow::anyhow!("cannot create the HTTP client: {e}"))?;
        let auth = match &cfg.key {
            Some(ApiKey(key)) => {
                let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| anyhow::anyhow!("the API key holds characters an HTTP header cannot carry (a line break?)"))?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        if let Some(dir) = &cfg.cache_dir {
            std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: cannot create the response cache: {e}", dir.display()))?;
        }
        Ok(Http {
            client,
            key_server: cfg.base.clone(),
            base: cfg.base,
            model: cfg.model,
            max_body: cfg.max_response_bytes,
            key: cfg.key,
            auth,
            retry: cfg.retry,
            cache: cfg.cache_dir.map(|dir| Cache { dir, writes: AtomicU64::new(0) }),
            gate: Gate { free: Mutex::new(cfg.concurrency.max(1)), freed: Condvar::new() },
            stats: Stats::default(),
        })
    }

    /// The server every cache key holds.
    pub fn key_server(&self) -> &str {
        &self.key_server
    }

    /// What every cache key holds besides the request: the server and the model (by default
    /// the base URL as given and the model setting; the connector sets the server without its
    /// port and the model the server says it serves).
    pub fn set_identity(&mut self, server: String, model: String) {
        self.key_server = server;
        self.model = model;
    }

    /// Keep `value` under `name` in the cache, beside the replies of this server and model:
    /// what the connector learnt about the server (a limit it refused a request over), so a
    /// later run knows it without asking again. Nothing without a cache.
    pub fn remember(&self, name: &str, value: &Value) {
        if let Some(c) = &self.cache {
            c.put(&cache_key(&self.key_server, &self.model, &format!("#{name}"), ""), value);
        }
    }

    /// What [`Http::remember`] kept under `name` for this server and model.
    pub fn recall(&self, name: &str) -> Option<Value> {
        self.cache.as_ref()?.get(&cache_key(&self.key_server, &self.model, &format!("#{name}"), ""))
    }

    /// POST `body` to `path` (e.g. `/v1/completions`) and hand the reply's JSON to `accept`,
    /// the operation's check: what it returns, and whether the reply came from the cache. Only
    /// a reply `accept` takes is cached; its error comes back as the request's. A cached reply
    /// it refuses (one an older version cached unchecked) is removed and asked afresh.
    pub fn post<T>(&self, path: &str, body: &Value, accept: impl Fn(&Value) -> Result<T, ApiError>) -> Result<(T, bool), ApiError> {
        let body_text = body.to_string();
        let key = cache_key(&self.key_server, &self.model, path, &body_text);
        if let Some(cache) = &self.cache {
            if let Some(reply) = cache.get(&key) {
                match accept(&reply) {
                    Ok(out) => {
                        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                        self.stats.add_usage(&reply, true);
                        return Ok((out, true));
                    }
                    Err(e) if e.kind == ErrorKind::BadReply => cache.remove(&key),
                    // Not the reply's fault (a request the check made failed): it stays.
                    Err(e) => return Err(self.scrubbed(e)),
                }
            }
        }
        let reply = self.fetch(path, Some(&body_text))?;
        match accept(&reply) {
            Ok(out) => {
                if let Some(cache) = &self.cache {
                    cache.put(&key, &reply);
                }
                Ok((out, false))
            }
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                Err(self.scrubbed(e))
            }
        }
    }

    /// GET `path` (e.g. `/v1/models`), retried as a POST is; never cached, and left out of
    /// the stats, which count what the operations asked.
    pub fn get(&self, path: &str) -> Result<Value, ApiError> {
        self.fetch(path, None)
    }

    /// One request with its retries: the reply's JSON. A GET when `body` is `None`.
    fn fetch(&self, path: &str, body: Option<&str>) -> Result<Value, ApiError> {
        let count = |n: &AtomicU64| {
            if body.is_some() {
                n.fetch_add(1, Ordering::Relaxed);
            }
        };
        // The retry budget runs from the first send, not from the wait for a free slot.
        let mut first: Option<Instant> = None;
        let mut attempt = 0u32;
        loop {
            let (outcome, sent) = self.attempt(path, body);
            let start = *first.get_or_insert(sent);
            match outcome {
                Attempt::Done(reply) => {
                    if body.is_some() {
                        self.stats.add_usage(&reply, false);
                    }
                    return Ok(reply);
                }
                Attempt::Fail(e) => {
                    count(&self.stats.failures);
                    return Err(self.scrubbed(e));
                }
                Attempt::Retry { why, after, connect } => {
                    let wait = after.unwrap_or_else(|| self.backoff(attempt));
                    let elapsed = start.elapsed();
                    if attempt >= self.retry.max_retries || elapsed.saturating_add(wait) > self.retry.budget {
                        count(&self.stats.failures);
                        return Err(self.scrubbed(ApiError::new(
                            if connect { ErrorKind::Unreachable } else { ErrorKind::RetriesExhausted },
                            format!("{path}: gave up after {} attempts in {:.1} s; last: {why}", attempt + 1, elapsed.as_secs_f64()),
                        )));
                    }
                    count(&self.stats.retries);
                    std::thread::sleep(wait);
                    attempt += 1;
                }
            }
        }
    }

    /// One try of a request forwarded as it came (a proxy's: `host serve`): no retries, no
    /// cache, so a failing upstream is reported at once. The reply's status and JSON body,
    /// refusals (4xx) included; a server error, a dropped connection or a timeout is an error.
    pub fn forward(&self, path: &str, body: &str) -> Result<(u16, Value), ApiError> {
        let resp = self.send_once(path, body)?;
        let status = resp.status().as_u16();
        let after = retry_after(resp.headers());
        let text = self.read_capped(path, resp)?;
        self.forwarded_reply(path, status, after, &text).map(|v| (status, v))
    }

    /// [`Http::forward`] for a streamed reply (server-sent events): each event's `data`
    /// goes to `sink` as it arrives (`[DONE]` included), its `data:` lines joined with "\n"
    /// as the SSE spec says (a JSON object may span several); a refusal comes back whole as
    /// in `forward`. Returns the status; a sink that says stop ends the read.
    pub fn forward_stream(&self, path: &str, body: &str, sink: &mut dyn FnMut(&str) -> bool) -> Result<(u16, Value), ApiError> {
        let resp = self.send_once(path, body)?;
        let status = resp.status().as_u16();
        let after = retry_after(resp.headers());
        let events = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|t| t.trim().to_ascii_lowercase().starts_with("text/event-stream"));
        if !resp.status().is_success() || !events {
            let text = self.read_capped(path, resp)?;
            if resp_is_success(status) {
                return Err(ApiError::new(
                    ErrorKind::BadReply,
                    format!("{path}: asked to stream, the server answered HTTP {status} with a whole reply, not server-sent events (does it stream?)"),
                ));
            }
            return self.forwarded_reply(path, status, after, &text).map(|v| (status, v));
        }
        // Lines are read through a window of what is left of the cap, so a server that never
        // sends a line break cannot grow one line past it.
        let mut reader = std::io::BufReader::new(resp);
        let mut line = Vec::new();
        let mut read = 0u64;
        let mut event = SseEvent::default();
        loop {
            line.clear();
            let left = self.max_body.saturating_sub(read).saturating_add(1);
            let done = match std::io::BufRead::read_until(&mut std::io::Read::take(&mut reader, left), b'\n', &mut line) {
                Ok(0) => true,
                Ok(n) => {
                    read += n as u64;
                    false
                }
                Err(e) => return Err(self.read_error(path, &e)),
            };
            if read > self.max_body {
                return Err(ApiError::new(ErrorKind::BadReply, format!("{path}: a streamed reply longer than max_response_bytes ({} bytes)", self.max_body)));
            }
            // At the end, an event not closed by a blank line is still passed on (servers that
            // end with `data: [DONE]` and no blank line exist).
            let data = if done { event.finish() } else { event.line(&String::from_utf8_lossy(&line)) };
            if let Some(data) = data {
                if self.quotes_key(&data) {
                    return Err(ApiError::new(ErrorKind::BadReply, format!("{path}: a streamed piece quotes the API key; the stream is cut")));
                }
                if !sink(&data) {
                    break;
                }
            }
            if done {
                break;
            }
        }
        Ok((status, Value::Null))
    }

    fn send_once(&self, path: &str, body: &str) -> Result<reqwest::blocking::Response, ApiError> {
        let _pass = self.gate.enter();
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let mut req = self.client.post(format!("{}{path}", self.base)).header(reqwest::header::CONTENT_TYPE, "application/json").body(body.to_string());
        if let Some(auth) = &self.auth {
            req = req.header(reqwest::header::AUTHORIZATION, auth.clone());
        }
        req.send().map_err(|e| {
            self.stats.failures.fetch_add(1, Ordering::Relaxed);
            let kind = if e.is_timeout() {
                ErrorKind::Timeout
            } else if e.is_connect() {
                ErrorKind::Unreachable
            } else {
                ErrorKind::RetriesExhausted
            };
            self.scrubbed(ApiError::new(kind, format!("{path}: {}", describe(&e))))
        })
    }

    fn read_capped(&self, path: &str, resp: reqwest::blocking::Response) -> Result<String, ApiError> {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(resp, self.max_body.saturating_add(1)), &mut bytes).map_err(|e| self.read_error(path, &e))?;
        if bytes.len() as u64 > self.max_body {
            return Err(ApiError::new(ErrorKind::BadReply, format!("{path}: a reply larger than max_response_bytes ({} bytes)", self.max_body)));
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn read_error(&self, path: &str, e: &std::io::Error) -> ApiError {
        let timed_out = e.kind() == std::io::ErrorKind::TimedOut || describe_io(e).contains("timed out");
        let kind = if timed_out { ErrorKind::Timeout } else { ErrorKind::RetriesExhausted };
        self.scrubbed(ApiError::new(kind, format!("{path}: the reply was cut: {}", describe_io(e))))
    }

    /// A forwarded reply's body as JSON: a success or a refusal (4xx) is handed back; a server
    /// error (5xx) or a body that is not JSON is an error.
    fn forwarded_reply(&self, path: &str, status: u16, after: Option<Duration>, text: &str) -> Result<Value, ApiError> {
        if self.quotes_key(text) {
            return Err(ApiError::new(ErrorKind::BadReply, format!("{path}: HTTP {status} with a body that quotes the API key; it is not passed on")));
        }
        let parsed = serde_json::from_str::<Value>(text);
        if status >= 500 || status == 429 || status == 408 {
            let mut e = classify(status, parsed.as_ref().unwrap_or(&Value::Null), &self.scrub(text.to_string()));
            e.kind = if status == 429 { ErrorKind::RateLimited } else { ErrorKind::RetriesExhausted };
            e.retry_after = after;
            return Err(e);
        }
        parsed.map_err(|e| ApiError::new(ErrorKind::BadReply, format!("{path}: HTTP {status} with a body that is not JSON ({e}): {}", self.quote(text, 200))))
    }

    /// A server may quote the request back (a proxy echoing headers, a 401 naming the key):
    /// no message leaves the connector with the key in it.
    pub fn scrubbed(&self, mut e: ApiError) -> ApiError {
        e.message = self.scrub(e.message);
        e
    }

    /// `text` with every occurrence of the API key replaced, and of the key as OpenAI's 401
    /// shows it (a prefix, a mask, the last four characters). For messages only: a body that
    /// is parsed or cached is never rewritten.
    pub fn scrub(&self, text: String) -> String {
        match &self.key {
            Some(ApiKey(key)) if key.chars().count() >= MIN_SECRET_CHARS => {
                let text = if text.contains(key.as_str()) { text.replace(key.as_str(), "<api key>") } else { text };
                scrub_masked(&text, key)
            }
            _ => text,
        }
    }

    /// At most `max` characters of `text` for a message, scrubbed before it is cut (a key cut
    /// in two would no longer be found).
    pub fn quote(&self, text: &str, max: usize) -> String {
        snippet_of(&self.scrub(text.to_string()), max)
    }

    /// Whether `text` holds the API key itself (a key too short to be a secret never counts).
    fn quotes_key(&self, text: &str) -> bool {
        matches!(&self.key, Some(ApiKey(key)) if key.chars().count() >= MIN_SECRET_CHARS && text.contains(key.as_str()))
    }

    /// Exponential backoff with "equal jitter": half the step fixed, half random, so clients
    /// that failed together do not come back together.
    fn backoff(&self, attempt: u32) -> Duration {
        let step = self.retry.backoff_base.saturating_mul(1u32 << attempt.min(20)).min(self.retry.backoff_max);
        step / 2 + step.mul_f64(rand::random::<f64>() / 2.0)
    }

    /// One try, after waiting for a free slot; also returns when it was sent.
    fn attempt(&self, path: &str, body: Option<&str>) -> (Attempt, Instant) {
        let _pass = self.gate.enter();
        let sent = Instant::now();
        let counted = body.is_some();
        if counted {
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        let out = self.send(path, body);
        if counted {
            self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        (out, sent)
    }

    fn send(&self, path: &str, body: Option<&str>) -> Attempt {
        let url = format!("{}{path}", self.base);
        let mut req = match body {
            Some(body) => self.client.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body.to_string()),
            None => self.client.get(url),
        };
        if let Some(auth) = &self.auth {
            req = req.header(reqwest::header::AUTHORIZATION, auth.clone());
        }
        let resp = match req.send() {
            Ok(r) => r,
            Err(e) => return Attempt::Retry { why: describe(&e), after: None, connect: e.is_connect() },
        };
        let status = resp.status();
        let after = retry_after(resp.headers());
        let too_big = |what: String| {
            Attempt::Fail(ApiError::new(
                ErrorKind::BadReply,
                format!("{path}: HTTP {status} with a body {what} than max_response_bytes ({} bytes); raise it if the server is right", self.max_body),
            ))
        };
        if let Some(n) = resp.content_length().filter(|&n| n > self.max_body) {
            return too_big(format!("of {n} bytes, larger"));
        }
        // Read to one byte past the cap: a body without a length is cut off there, not held whole.
        let mut bytes = Vec::new();
        if let Err(e) = std::io::Read::read_to_end(&mut std::io::Read::take(resp, self.max_body.saturating_add(1)), &mut bytes) {
            return Attempt::Retry { why: format!("HTTP {status}, body lost: {}", describe_io(&e)), after: None, connect: false };
        }
        if bytes.len() as u64 > self.max_body {
            return too_big("larger".into());
        }
        let text = String::from_utf8_lossy(&bytes);
        if status.is_success() {
            if self.quotes_key(&text) {
                return Attempt::Fail(ApiError::new(
                    ErrorKind::BadReply,
                    format!("{path}: HTTP {status} with a body that quotes the API key; it is neither used nor cached"),
                ));
            }
            return match serde_json::from_str::<Value>(&text) {
                Ok(v) if v.get("error").is_some_and(|e| !e.is_null()) => Attempt::Fail(classify(status.as_u16(), &v, &self.scrub(text.into_owned()))),
                // The body as it will be cached and quoted (JSON escapes such as `\/` undone).
                Ok(v) if self.quotes_key(&v.to_string()) => Attempt::Fail(ApiError::new(
                    ErrorKind::BadReply,
                    format!("{path}: HTTP {status} with a body that quotes the API key; it is neither used nor cached"),
                )),
                Ok(v) => Attempt::Done(v),
                Err(e) => Attempt::Retry { why: format!("HTTP {status} with a body that is not JSON ({e}): {}", self.quote(&text, 200)), after, connect: false },
            };
        }
        let code = status.as_u16();
        if code == 429 || code == 408 || status.is_server_error() {
            return Attempt::Retry { why: format!("HTTP {status}: {}", self.quote(&text, 200)), after, connect: false };
        }
        let v = serde_json::from_str::<Value>(&text).unwrap_or(Value::Null);
        Attempt::Fail(classify(code, &v, &self.scrub(text.into_owned())))
    }
}

/// One server-sent event being read, line by line: its `data` lines, joined with "\n" (the
/// SSE spec's rule; other fields and comments are ignored).
#[derive(Default)]
struct SseEvent {
    data: Option<String>,
}

impl SseEvent {
    /// Take one line (its line break included or not); at the blank line that ends an event,
    /// the event's data, if it had any.
    fn line(&mut self, line: &str) -> Option<String> {
        let line = line.trim_end_matches('\n').trim_end_matches('\r');
        if line.is_empty() {
            return self.data.take();
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
        None
    }

    /// What is left at the end of the stream.
    fn finish(&mut self) -> Option<String> {
        self.data.take()
    }
}

fn resp_is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// The server without its port: local servers draw a new port at each start (llama-server.sh
/// does), and what they serve is told apart by the model, not by where it listens.
pub fn server_of(base: &str) -> String {
    let (scheme, rest) = base.split_once("://").unwrap_or(("", base));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = match authority.rfind(':') {
        // Not inside an IPv6 literal ("[::1]" has colons but no port).
        Some(i) if !authority[i..].contains(']') && authority[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &authority[..i],
        _ => authority,
    };
    format!("{scheme}://{host}{path}")
}

/// `text` with the key as OpenAI's 401 shows it replaced: a prefix of the key (possibly
/// none), a mask (asterisks, dots, an ellipsis), the key's last four characters.
fn scrub_masked(text: &str, key: &str) -> String {
    let tail_at = key.char_indices().rev().nth(3).map(|(i, _)| i).unwrap_or(0);
    let (head, tail) = key.split_at(tail_at);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(tail) {
        let before = &rest[..at];
        let unmasked = before.trim_end_matches(['*', '.', '\u{2026}']);
        let mask = &before[unmasked.len()..];
        if mask.contains('\u{2026}') || mask.chars().count() >= 3 {
            // The longest prefix of the key right before the mask goes with it.
            let k = (1..=head.len()).rev().filter(|&k| head.is_char_boundary(k)).find(|&k| unmasked.ends_with(&head[..k])).unwrap_or(0);
            out.push_str(&unmasked[..unmasked.len() - k]);
            out.push_str("<api key>");
        } else {
            out.push_str(before);
            out.push_str(tail);
        }
        rest = &rest[at + tail.len()..];
    }
    out.push_str(rest);
    out
}

/// SHA-256 of what identifies a reply: the server, the model setting, the endpoint and the
/// body (which holds every sampling setting). The key is never part of it.
pub fn cache_key(base: &str, model: &str, path: &str, body: &str) -> String {
    let mut h = Sha256::new();
    for part in [base, model, path, body] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `Retry-After` as seconds or as an HTTP date (RFC 9110 §10.2.3).
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        // A huge value is longer than any retry budget (the request then fails), not a panic.
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// A 4xx (or an error object in a 200) as an [`ApiError`]; context overflows are told apart
/// by the shapes OpenAI, vLLM and llama.cpp use.
fn classify(status: u16, v: &Value, text: &str) -> ApiError {
    let err = if v["error"].is_object() { &v["error"] } else { v };
    let message = err["message"].as_str().or_else(|| v["error"].as_str()).map(str::to_string).unwrap_or_else(|| snippet_of(text, 200));
    let kind_text = format!("{} {} {}", err["type"].as_str().unwrap_or(""), err["code"].as_str().unwrap_or(""), message).to_lowercase();
    let overflow = kind_text.contains("context_length_exceeded")
        || kind_text.contains("exceed_context_size")
        || kind_text.contains("maximum context length")
        || (kind_text.contains("context") && (kind_text.contains("exceed") || kind_text.contains("too long")));
    let mut e = ApiError::new(
        if overflow { ErrorKind::ContextLength } else { ErrorKind::Rejected },
        format!("HTTP {status}: {message}"),
    );
    e.status = Some(status);
    if overflow {
        e.prompt_tokens = err["n_prompt_tokens"].as_u64();
        e.context_tokens = err["n_ctx"].as_u64();
    }
    e
}

fn describe_io(e: &std::io::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

fn describe(e: &reqwest::Error) -> String {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "connection failed"
    };
    // The URL is the base URL the user gave; reqwest's messages never include headers.
    let mut msg = format!("{what}: {e}");
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

/// At most `max` characters of `text`, for error messages.
pub fn snippet_of(text: &str, max: usize) -> String {
    let t: String = text.chars().take(max).collect();
    if t.len() < text.len() {
        format!("{t}...")
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        let later = SystemTime::now() + Duration::from_secs(30);
        h.insert(reqwest::header::RETRY_AFTER, httpdate::fmt_http_date(later).parse().unwrap());
        let d = retry_after(&h).unwrap();
        assert!(d > Duration::from_secs(27) && d <= Duration::from_secs(30), "{d:?}");
        h.insert(reqwest::header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&h), None);
        h.insert(reqwest::header::RETRY_AFTER, "1e300".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::MAX));
        h.insert(reqwest::header::RETRY_AFTER, "-1".parse().unwrap());
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn context_overflows_are_told_apart() {
        let llama = json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error", "n_prompt_tokens": 3000, "n_ctx": 2048}});
        let e = classify(400, &llama, "");
        assert_eq!(e.kind, ErrorKind::ContextLength);
        assert_eq!((e.prompt_tokens, e.context_tokens), (Some(3000), Some(2048)));
        let openai = json!({"error": {"message": "This model's maximum context length is 4097 tokens. However, you requested 5000 tokens.",
            "type": "invalid_request_error", "code": "context_length_exceeded"}});
        assert_eq!(classify(400, &openai, "").kind, ErrorKind::ContextLength);
        let other = json!({"error": {"message": "model not found", "type": "invalid_request_error"}});
        assert_eq!(classify(404, &other, "").kind, ErrorKind::Rejected);
    }

    #[test]
    fn cache_keys_differ_by_server_path_and_body() {
        let a = cache_key("http://a", "m", "/v1/completions", "{}");
        assert_ne!(a, cache_key("http://b", "m", "/v1/completions", "{}"));
        assert_ne!(a, cache_key("http://a", "n", "/v1/completions", "{}"));
        assert_ne!(a, cache_key("http://a", "m", "/v1/chat/completions", "{}"));
        assert_ne!(a, cache_key("http://a", "m", "/v1/completions", "{ }"));
        assert_eq!(a.len(), 64);
    }

    fn http_with_key(key: &str) -> Http {
        let retry = RetryPolicy { max_retries: 0, budget: Duration::ZERO, backoff_base: Duration::ZERO, backoff_max: Duration::ZERO };
        Http::new(HttpConfig {
            base: "http://127.0.0.1:1".into(),
            model: "m".into(),
            key: Some(ApiKey::new(key.into())),
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            concurrency: 1,
            retry,
            cache_dir: None,
            max_response_bytes: 1 << 24,
        })
        .unwrap()
    }

    #[test]
    fn messages_are_scrubbed_of_the_key_and_of_openais_masked_form() {
        let key = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789wxyz";
        let h = http_with_key(key);
        assert_eq!(h.scrub(format!("bad key {key}!")), "bad key <api key>!");
        assert_eq!(
            h.scrub("Incorrect API key provided: sk-proj-********************wxyz. You can find it".into()),
            "Incorrect API key provided: <api key>. You can find it"
        );
        assert_eq!(h.scrub("key sk-proj-\u{2026}wxyz here".into()), "key <api key> here");
        assert_eq!(h.scrub("key ...wxyz".into()), "key <api key>");
        assert_eq!(h.scrub("key sk-proj-abc****wxyz".into()), "key <api key>", "a prefix of the key, masked, its last four");
        assert_eq!(h.scrub("sk-other****wxyz".into()), "sk-other<api key>", "the mask and the last four go even after another prefix");
        // Without a mask the last four characters alone are not the key.
        assert_eq!(h.scrub("wxyz, HTTP 401".into()), "wxyz, HTTP 401");
        // Keys too short to be secrets (vLLM's EMPTY, "1") would rewrite any message.
        assert_eq!(http_with_key("1").scrub("HTTP 401: 1 error".into()), "HTTP 401: 1 error");
        assert_eq!(http_with_key("EMPTY").scrub("EMPTY".into()), "EMPTY");
    }

    #[test]
    fn an_event_s_data_lines_are_joined_as_the_sse_spec_says() {
        let stream = "data: {\n data:x\ndata:  \"a\": 1\r\ndata: }\n\n: a comment\nevent: message\nid: 7\ndata: [DONE]\n\nretry: 5\n\ndata\ndata: tail";
        let mut e = SseEvent::default();
        let mut got: Vec<String> = stream.split_inclusive('\n').filter_map(|l| e.line(l)).collect();
        got.extend(e.finish());
        // ` data:x` is a field named " data", not data: ignored, as a browser's EventSource does.
        assert_eq!(got, ["{\n \"a\": 1\n}", "[DONE]", "\ntail"]);
        assert_eq!(serde_json::from_str::<Value>(&got[0]).unwrap()["a"], 1);
    }

    #[test]
    fn the_server_is_named_without_its_port() {
        assert_eq!(server_of("http://127.0.0.1:8080"), "http://127.0.0.1");
        assert_eq!(server_of("https://api.openai.com"), "https://api.openai.com");
        assert_eq!(server_of("http://[::1]:9000/proxy"), "http://[::1]/proxy");
        assert_eq!(server_of("http://[::1]/proxy"), "http://[::1]/proxy");
    }

    #[test]
    fn key_is_hidden_from_debug() {
        assert!(!format!("{:?}", ApiKey::new("sk-secret".into())).contains("sk-secret"));
    }
}
