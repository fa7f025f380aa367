//! The `openai` connector plugin: a black-box target LM behind any OpenAI-compatible server
//! (OpenAI, vLLM, llama.cpp's `llama-server`, Ollama).
//!
//! `complete` takes one JSON request and answers it; the host calls it from several threads
//! at once (at most `concurrency` requests are on the wire). Operations (`"op"`):
//! - `complete` `{prompt, max_tokens?, stop?, temperature?, top_logprobs?}` →
//!   `{text, finish_reason, positions?: [{token, logprob, top: [[token, logprob]]}], cached}`
//! - `choice_logprobs` `{prompt, choices: ["A", ...]}` → `{logprobs: [..] | null, floored:
//!   [bool], floor, best, text, method, cached}`: the log-probabilities of candidate next tokens
//!   (answer letters) from the first generated position's top list; `A` and ` A` are one
//!   answer; a candidate missing from the top list gets the floor and is marked; `best` indexes
//!   the most likely listed one (null when no candidate is listed). `logprobs`
//!   is null when the server returns none (the caller then parses `text`).
//! - `continuation_logprob` `{prompt, continuation}` → `{logprob, tokens, method}`: log
//!   P(continuation | prompt), from the prompt's own log-probabilities where the server
//!   gives them: echoed by `/v1/completions` (`method: "echo"`, OpenAI legacy and vLLM) or
//!   as vLLM's `prompt_logprobs` (`"prompt_logprobs"`); otherwise by forcing each
//!   continuation token with a logit bias on llama.cpp's native `/completion`
//!   (`"forced_logit_bias"`).
//! - `stats` → request, retry, cache-hit and token totals.
//! - `describe` → `{model, requested, model_from, server}`: what the replies depend on, as
//!   the cache keys them: the model the server serves when it lists exactly one at
//!   `/v1/models` (else the one named) and the server without its port; `requested` is the
//!   model sent with requests (`model_from`: `setting`, or `server` when `model` is empty).
//!
//! Failures of one request come back as `{"error": {"kind", "message", ...}}`, never as a
//! failed call, so one bad item never fails a batch (`kind`: `context_length`, `rejected`,
//! `retries_exhausted`, `unreachable` when the last try could not even connect, `bad_reply`;
//! `forward` adds `timeout` and `rate_limited`, with `retry_after_s`). The API
//! key is read from the environment variable `api_key_env` names and is never returned,
//! logged or cached.

mod http;
mod logprobs;

use anyhow::{bail, Context, Result};
use http::{ApiError, ApiKey, ErrorKind, Http, HttpConfig, RetryPolicy};
use rak_core::plugin::{Connector, PluginInfo};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    base_url: String,
    #[serde(default)]
    model: String,
    endpoint: Option<String>,
    api_key_env: Option<String>,
    timeout_s: Option<f64>,
    connect_timeout_s: Option<f64>,
    concurrency: Option<usize>,
    max_retries: Option<u32>,
    retry_budget_s: Option<f64>,
    backoff_base_s: Option<f64>,
    backoff_max_s: Option<f64>,
    cache: Option<bool>,
    cache_dir: Option<PathBuf>,
    top_logprobs: Option<u32>,
    logprob_floor: Option<f64>,
    continuation_method: Option<String>,
    max_response_bytes: Option<u64>,
}

/// The largest reply body read by default: far above any completion, far below what would
/// exhaust memory on a runaway or hostile server.
const MAX_RESPONSE_BYTES: u64 = 16 << 20;

fn schema() -> Value {
    json!({
        "base_url": {"type": "string", "required": true, "help": "server root, e.g. http://127.0.0.1:8080 or https://api.openai.com (a trailing /v1 is accepted)"},
        "model": {"type": "string", "default": "", "help": "model name sent with every request; empty: the one model the server serves, asked of GET /v1/models at start (llama.cpp, vLLM), and an error if it cannot say"},
        "endpoint": {"type": "string", "default": "completions", "help": "completions (/v1/completions, raw prompt) or chat (/v1/chat/completions, the prompt as one user message)"},
        "api_key_env": {"type": "string", "default": null, "help": "environment variable holding the API key, e.g. OPENAI_API_KEY (sent as a Bearer token; never printed, logged or cached); unset = no key is sent"},
        "timeout_s": {"type": "float", "default": 60.0, "help": "seconds one request may take"},
        "connect_timeout_s": {"type": "float", "default": 10.0, "help": "seconds to connect"},
        "concurrency": {"type": "int", "default": 4, "help": "requests on the wire at once"},
        "max_retries": {"type": "int", "default": 6, "help": "retries of one request (429, 408, 5xx, timeouts, dropped connections, bodies that are not JSON)"},
        "retry_budget_s": {"type": "float", "default": 120.0, "help": "no retry starts later than this many seconds after the first attempt"},
        "backoff_base_s": {"type": "float", "default": 0.5, "help": "first backoff step; doubles per retry, with jitter (Retry-After wins when given)"},
        "backoff_max_s": {"type": "float", "default": 30.0, "help": "largest backoff step"},
        "cache": {"type": "bool", "default": true, "help": "keep replies the connector accepted on disk, keyed by (server without its port, model named or served, path, request body), so a rerun asks nothing twice and a local server restarted on another port keeps its replies"},
        "cache_dir": {"type": "path", "default": "$RAK_CACHE/openai (~/.cache/rak/openai)", "help": "where replies are cached"},
        "top_logprobs": {"type": "int", "default": 20, "help": "alternatives asked for per position when choosing among answer letters: at most 20 on chat (OpenAI's limit); on completions as many until the server refuses the number, then 5 (OpenAI's limit there)"},
        "logprob_floor": {"type": "float", "default": null, "help": "value for an answer letter missing from the top list (default: the list's lowest value)"},
        "max_response_bytes": {"type": "int", "default": MAX_RESPONSE_BYTES, "help": "largest reply body read (16 MiB); a larger one fails its request, unread past the limit"},
        "continuation_method": {"type": "string", "default": "auto", "help": "auto (tries each in this order and keeps the first that works), echo (prompt log-probabilities echoed by /v1/completions: OpenAI legacy, vLLM), prompt_logprobs (vLLM's prompt_logprobs, aligned with its /tokenize) or forced (llama.cpp: /tokenize + /completion with a logit bias per token)"},
    })
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The most alternatives per position the endpoint takes: OpenAI refuses more than 20 as
    /// `top_logprobs` on chat. On `/v1/completions` OpenAI's limit is 5, other servers' is
    /// higher: see `completions_logprobs_cap`.
    fn max_top_logprobs(self) -> u32 {
        match self {
            Endpoint::Completions => u32::MAX,
            Endpoint::Chat => 20,
        }
    }
}

/// OpenAI's limit on `logprobs` on `/v1/completions`.
const OPENAI_COMPLETIONS_LOGPROBS: u32 = 5;

/// Under this name in the cache: that the server refused more than OpenAI's limit.
const LOGPROBS_CAP: &str = "completions_logprobs_cap";

/// A refusal of the request's `logprobs` (OpenAI: 400, "... logprobs ... must be less than
/// or equal to 5").
fn refuses_logprobs(e: &ApiError) -> bool {
    e.kind == ErrorKind::Rejected && e.status == Some(400) && e.message.to_lowercase().contains("logprobs")
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ContinuationMethod {
    Echo,
    PromptLogprobs,
    Forced,
}

impl ContinuationMethod {
    fn name(self) -> &'static str {
        match self {
            ContinuationMethod::Echo => "echo",
            ContinuationMethod::PromptLogprobs => "prompt_logprobs",
            ContinuationMethod::Forced => "forced_logit_bias",
        }
    }
}

pub struct OpenAi {
    http: Http,
    /// The model sent with requests: named in the settings, or the one the server serves.
    model: String,
    /// The model replies come from: the server's one listed model, else the one named.
    served: String,
    model_from: &'static str,
    endpoint: Endpoint,
    top_logprobs: u32,
    floor: Option<f64>,
    /// Fixed by the settings, or found on first use (`auto`).
    continuation: Mutex<Option<ContinuationMethod>>,
    /// The most `logprobs` asked of `/v1/completions`: no limit until the server refuses a
    /// number by name (OpenAI's 5), in this run or an earlier one with the same cache.
    completions_logprobs_cap: AtomicU32,
}

impl PluginInfo for OpenAi {
    const NAME: &'static str = "openai";

    fn settings_schema() -> Value {
        schema()
    }

    fn create(settings: Value) -> Result<Self> {
        let s: Settings = serde_json::from_value(settings).context("openai connector settings")?;
        let base = s.base_url.trim_end_matches('/').trim_end_matches("/v1").trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("base_url {:?} must start with http:// or https://", s.base_url);
        }
        let endpoint = match s.endpoint.as_deref().unwrap_or("completions") {
            "completions" => Endpoint::Completions,
            "chat" => Endpoint::Chat,
            other => bail!("endpoint {other:?}: expected completions or chat"),
        };
        let continuation = match s.continuation_method.as_deref().unwrap_or("auto") {
            "auto" => None,
            "echo" => Some(ContinuationMethod::Echo),
            "prompt_logprobs" => Some(ContinuationMethod::PromptLogprobs),
            "forced" => Some(ContinuationMethod::Forced),
            other => bail!("continuation_method {other:?}: expected auto, echo, prompt_logprobs or forced"),
        };
        // A key is sent only when the recipe names its variable: a key in the environment is
        // never handed to a server the user did not mean it for.
        let key = match &s.api_key_env {
            Some(var) => match std::env::var(var) {
                Ok(k) if !k.trim().is_empty() => Some(ApiKey::new(k.trim().to_string())),
                Ok(_) => bail!("api_key_env names {var}, which is empty"),
                Err(_) => bail!("api_key_env names {var}, which is not set in the environment (or not valid UTF-8)"),
            },
            None => None,
        };
        let secs = |v: Option<f64>, d: f64, what: &str| -> Result<Duration> {
            let v = v.unwrap_or(d);
            if !(v.is_finite() && (0.0..=1e7).contains(&v)) {
                bail!("{what} must be between 0 and 1e7 seconds, not {v}");
            }
            Ok(Duration::from_secs_f64(v))
        };
        let cache_dir = match (s.cache.unwrap_or(true), s.cache_dir) {
            (false, _) => None,
            (true, Some(dir)) => Some(dir),
            (true, None) => Some(default_cache_dir()?),
        };
        let max_response_bytes = s.max_response_bytes.unwrap_or(MAX_RESPONSE_BYTES);
        if max_response_bytes == 0 {
            bail!("max_response_bytes must be positive");
        }
        let mut http = Http::new(HttpConfig {
            base,
            model: s.model.clone(),
            key,
            timeout: secs(s.timeout_s, 60.0, "timeout_s")?,
            connect_timeout: secs(s.connect_timeout_s, 10.0, "connect_timeout_s")?,
            concurrency: s.concurrency.unwrap_or(4).max(1),
            retry: RetryPolicy {
                max_retries: s.max_retries.unwrap_or(6),
                budget: secs(s.retry_budget_s, 120.0, "retry_budget_s")?,
                backoff_base: secs(s.backoff_base_s, 0.5, "backoff_base_s")?,
                backoff_max: secs(s.backoff_max_s, 30.0, "backoff_max_s")?,
            },
            cache_dir,
            max_response_bytes,
        })?;
        // What replies depend on is the model the server serves, not where it listens (the
        // cache and the host's resume are keyed on the server without its port): a server
        // that lists exactly one model at /v1/models (llama.cpp: its GGUF, vLLM: its one
        // served name) is keyed on that model, even when a name it ignores was given, so two
        // llama-servers run under one model name are told apart; a server that lists several
        // (OpenAI) or none is keyed on the model named, which is then what names the model.
        let listed = served_models(&http);
        let one_served = match &listed {
            Ok(ids) if ids.len() == 1 => Some(ids[0].clone()),
            _ => None,
        };
        let (model, model_from) = if s.model.trim().is_empty() {
            match (&one_served, &listed) {
                (Some(one), _) => (one.clone(), "server"),
                (None, Err(e)) if e.kind == ErrorKind::Unreachable => bail!(
                    "cannot connect to {} (GET /v1/models: {}); is the server running? (scripts/llama-server.sh start prints its URL), or correct base_url (--base-url)",
                    http.base,
                    e.message
                ),
                (None, Err(e)) => bail!(
                    "model is empty and the server at {} does not say which model it serves (GET /v1/models: {}); name the model in `model` (or --model)",
                    http.base,
                    e.message
                ),
                (None, Ok(ids)) if ids.is_empty() => bail!("model is empty and GET {}/v1/models lists no model; name the model in `model` (or --model)", http.base),
                (None, Ok(ids)) => bail!(
                    "model is empty and the server at {} serves {} models ({}{}); name one in `model` (or --model)",
                    http.base,
                    ids.len(),
                    ids.iter().take(8).cloned().collect::<Vec<_>>().join(", "),
                    if ids.len() > 8 { ", ..." } else { "" }
                ),
            }
        } else {
            (s.model, "setting")
        };
        let base_is_openai = http::server_of(&http.base).starts_with("https://api.openai.com");
        let served = one_served.unwrap_or_else(|| model.clone());
        http.set_identity(http::server_of(&http.base), served.clone());
        // OpenAI's own API is known to refuse more than 5; any other server is asked first,
        // unless it refused more on an earlier run (remembered in the cache when it did).
        let refused_before = http.recall(LOGPROBS_CAP).and_then(|v| v["logprobs"].as_u64()) == Some(OPENAI_COMPLETIONS_LOGPROBS as u64);
        let cap = if base_is_openai || refused_before { OPENAI_COMPLETIONS_LOGPROBS } else { u32::MAX };
        Ok(OpenAi {
            http,
            model,
            served,
            model_from,
            endpoint,
            top_logprobs: s.top_logprobs.unwrap_or(20),
            floor: s.logprob_floor,
            continuation: Mutex::new(continuation),
            completions_logprobs_cap: AtomicU32::new(cap),
        })
    }
}

/// The models the server lists at `GET /v1/models` (llama.cpp its GGUF file or alias, vLLM
/// its served model names, OpenAI every model the key may use).
fn served_models(http: &Http) -> Result<Vec<String>, ApiError> {
    let reply = http.get("/v1/models")?;
    Ok(reply["data"].as_array().map(|a| a.iter().filter_map(|m| m["id"].as_str()).filter(|id| !id.is_empty()).map(str::to_string).collect()).unwrap_or_default())
}

fn default_cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("RAK_CACHE") {
        return Ok(PathBuf::from(dir).join("openai"));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("rak/openai"));
    }
    let home = std::env::var_os("HOME").context("no HOME to put the response cache in; set cache_dir or cache = false")?;
    Ok(PathBuf::from(home).join(".cache/rak/openai"))
}

impl Connector for OpenAi {
    fn complete(&self, request: Value) -> Result<Value> {
        let op = request["op"].as_str().unwrap_or("complete");
        let out = match op {
            "complete" => self.complete_op(&request),
            "choice_logprobs" => self.choice_logprobs(&request),
            "continuation_logprob" => self.continuation_logprob(&request),
            "stats" => return Ok(self.http.stats.to_json()),
            "describe" => return Ok(json!({"model": self.served, "requested": self.model, "model_from": self.model_from, "server": self.http.key_server()})),
            "forward" => return Ok(self.forward(&request, None)),
            other => bail!("unknown op {other:?} (known: complete, choice_logprobs, continuation_logprob, stats, describe, forward)"),
        };
        // Replies are quoted into some messages; none may carry the key out.
        Ok(out.unwrap_or_else(|e| json!({"error": self.http.scrubbed(e).to_json()})))
    }

    fn stream(&self, request: Value, sink: &mut dyn FnMut(&str) -> bool) -> Result<Value> {
        match request["op"].as_str().unwrap_or("forward") {
            "forward" => Ok(self.forward(&request, Some(sink))),
            other => bail!("op {other:?} cannot stream (only forward can)"),
        }
    }
}

impl OpenAi {
    /// `forward` `{path: "chat/completions" | "completions", body}` → `{status, body}`: an
    /// OpenAI request passed on as it is, with this connector's model, key and timeout, tried
    /// once (a proxy in front of the target reports a failing upstream at once rather than
    /// after the retry budget). With a sink, `body.stream` is set and each server-sent event's
    /// data goes to the sink; the reply then has no body.
    fn forward(&self, request: &Value, sink: Option<&mut dyn FnMut(&str) -> bool>) -> Value {
        let path = match request["path"].as_str() {
            Some("chat/completions") => "/v1/chat/completions",
            Some("completions") => "/v1/completions",
            other => return json!({"error": {"kind": "rejected", "message": format!("forward: path {other:?}: expected \"chat/completions\" or \"completions\"")}}),
        };
        let mut body = request["body"].clone();
        let Some(fields) = body.as_object_mut() else {
            return json!({"error": {"kind": "rejected", "message": "forward: the request needs an object \"body\""}});
        };
        fields.insert("model".into(), json!(self.model));
        fields.insert("stream".into(), json!(sink.is_some()));
        let text = body.to_string();
        let out = match sink {
            Some(sink) => self.http.forward_stream(path, &text, sink),
            None => self.http.forward(path, &text),
        };
        match out {
            Ok((status, body)) if body.is_null() => json!({"status": status}),
            Ok((status, body)) => json!({"status": status, "body": body}),
            Err(e) => json!({"error": self.http.scrubbed(e).to_json()}),
        }
    }
}

/// A request field, or a clear refusal (the caller's bug, not the server's).
fn field<'a>(req: &'a Value, name: &str) -> Result<&'a str, ApiError> {
    req[name].as_str().ok_or_else(|| ApiError::new(ErrorKind::Rejected, format!("the request needs a string {name:?}")))
}

fn bad_reply(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::BadReply, message)
}

impl OpenAi {
    /// One generation request on the configured endpoint; `accept` checks the reply (only a
    /// reply it takes is cached). At most the endpoint's limit of alternatives is asked for.
    fn generate<T>(
        &self,
        prompt: &str,
        max_tokens: u64,
        stop: &Value,
        temperature: f64,
        top: Option<u32>,
        accept: impl Fn(&Value) -> Result<T, ApiError>,
    ) -> Result<(T, bool), ApiError> {
        let mut body = json!({"model": self.model, "max_tokens": max_tokens, "temperature": temperature});
        if !stop.is_null() {
            body["stop"] = stop.clone();
        }
        let top = top.map(|k| k.min(self.endpoint.max_top_logprobs()));
        match self.endpoint {
            Endpoint::Completions => {
                body["prompt"] = json!(prompt);
                let Some(k) = top else { return self.http.post("/v1/completions", &body, accept) };
                // OpenAI takes at most 5 as `logprobs` here; llama.cpp and vLLM take more. Ask
                // for what the recipe says until a server refuses it by name, then for 5.
                // The cap is learnt from the server's refusal only (and remembered for later
                // runs), never from a cached reply with 5: the recipe may have asked for 5.
                let cap = self.completions_logprobs_cap.load(Ordering::Relaxed);
                body["logprobs"] = json!(k.min(cap));
                match self.http.post("/v1/completions", &body, &accept) {
                    Err(e) if k.min(cap) > OPENAI_COMPLETIONS_LOGPROBS && refuses_logprobs(&e) => {
                        self.completions_logprobs_cap.store(OPENAI_COMPLETIONS_LOGPROBS, Ordering::Relaxed);
                        self.http.remember(LOGPROBS_CAP, &json!({"logprobs": OPENAI_COMPLETIONS_LOGPROBS}));
                        body["logprobs"] = json!(OPENAI_COMPLETIONS_LOGPROBS);
                        self.http.post("/v1/completions", &body, accept)
                    }
                    other => other,
                }
            }
            Endpoint::Chat => {
                body["messages"] = json!([{"role": "user", "content": prompt}]);
                if let Some(k) = top {
                    body["logprobs"] = json!(true);
                    body["top_logprobs"] = json!(k);
                }
                self.http.post("/v1/chat/completions", &body, accept)
            }
        }
    }

    /// The generated text of a reply; a reply without one is malformed.
    fn text_of(&self, reply: &Value) -> Result<String, ApiError> {
        logprobs::generated_text(reply).ok_or_else(|| bad_reply(format!("no choices[0].text or message.content in {}", self.short(reply))))
    }

    fn complete_op(&self, req: &Value) -> Result<Value, ApiError> {
        let prompt = field(req, "prompt")?;
        let top = req["top_logprobs"].as_u64().map(|k| k as u32);
        let max_tokens = req["max_tokens"].as_u64().unwrap_or(16);
        let (mut out, cached) = self.generate(prompt, max_tokens, &req["stop"], req["temperature"].as_f64().unwrap_or(0.0), top, |reply| {
            let text = self.text_of(reply)?;
            let mut out = json!({"text": text, "finish_reason": reply["choices"][0]["finish_reason"]});
            if top.is_some() {
                out["positions"] = match logprobs::generated_positions(reply) {
                    Some(ps) => ps.iter().map(|p| json!({"token": p.token, "logprob": p.logprob, "top": p.top})).collect(),
                    None => Value::Null,
                };
            }
            Ok(out)
        })?;
        out["cached"] = json!(cached);
        Ok(out)
    }

    fn choice_logprobs(&self, req: &Value) -> Result<Value, ApiError> {
        let prompt = field(req, "prompt")?;
        let choices: Vec<String> = req["choices"]
            .as_array()
            .map(|a| a.iter().filter_map(|c| c.as_str().map(str::to_string)).collect())
            .filter(|c: &Vec<String>| !c.is_empty())
            .ok_or_else(|| ApiError::new(ErrorKind::Rejected, "the request needs a non-empty string array \"choices\""))?;
        let (mut out, cached) = self.generate(prompt, 1, &Value::Null, 0.0, Some(self.top_logprobs), |reply| {
            // No log-probabilities is an answer (the caller reads the text); no text is not.
            let text = self.text_of(reply)?;
            let first = logprobs::generated_positions(reply).and_then(|ps| ps.into_iter().next());
            Ok(match first {
                Some(p) => {
                    let (values, floored, floor) = logprobs::candidate_logprobs(&p.top, &choices, self.floor);
                    let best = logprobs::best_candidate(&values, &floored);
                    json!({"logprobs": values, "floored": floored, "floor": floor, "best": best, "text": text, "method": "top_logprobs"})
                }
                None => json!({"logprobs": null, "text": text, "method": "none"}),
            })
        })?;
        out["cached"] = json!(cached);
        Ok(out)
    }

    fn continuation_logprob(&self, req: &Value) -> Result<Value, ApiError> {
        let prompt = field(req, "prompt")?;
        let continuation = field(req, "continuation")?;
        if continuation.is_empty() {
            return Err(ApiError::new(ErrorKind::Rejected, "the continuation is empty"));
        }
        let known = *self.continuation.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = known {
            return self.by(m, prompt, continuation)?.ok_or_else(|| {
                ApiError::new(ErrorKind::BadReply, format!("continuation_method is {}, but the server's reply does not carry it", m.name()))
            });
        }
        // `auto`: the prompt's own log-probabilities cost one request; forcing costs one per
        // continuation token, so it comes last.
        // A server that refuses a probe's parameter or route (400, 404, 405, 422) does not
        // support that method; any other failure (a bad key, retries exhausted, a prompt too
        // long, a reply that does not line up with the prompt) is the item's and ends it.
        let mut refused = Vec::new();
        for m in [ContinuationMethod::Echo, ContinuationMethod::PromptLogprobs] {
            match self.by(m, prompt, continuation) {
                Ok(Some(r)) => {
                    self.remember(m);
                    return Ok(r);
                }
                Ok(None) => {}
                Err(e) if e.kind == ErrorKind::Rejected && matches!(e.status, Some(400 | 404 | 405 | 422)) => {
                    refused.push(format!("{} refused: {}", m.name(), e.message));
                }
                Err(e) => return Err(e),
            }
        }
        let r = self.by_forcing(prompt, continuation).map_err(|mut e| {
            let probes = if refused.is_empty() { String::new() } else { format!(" ({})", refused.join("; ")) };
            e.message = format!("the server gives no prompt log-probabilities (echo or prompt_logprobs){probes}, and forcing tokens failed too: {}", e.message);
            e
        })?;
        self.remember(ContinuationMethod::Forced);
        Ok(r)
    }

    /// One method; `None` when the server's reply shows it does not support it.
    fn by(&self, m: ContinuationMethod, prompt: &str, continuation: &str) -> Result<Option<Value>, ApiError> {
        match m {
            ContinuationMethod::Echo => self.by_echo(prompt, continuation),
            ContinuationMethod::PromptLogprobs => self.by_prompt_logprobs(prompt, continuation),
            ContinuationMethod::Forced => self.by_forcing(prompt, continuation).map(Some),
        }
    }

    fn remember(&self, m: ContinuationMethod) {
        *self.continuation.lock().unwrap_or_else(|e| e.into_inner()) = Some(m);
    }

    /// `/v1/completions` with `echo`: `None` when the server ignored the flag.
    fn by_echo(&self, prompt: &str, continuation: &str) -> Result<Option<Value>, ApiError> {
        let body = json!({"model": self.model, "prompt": format!("{prompt}{continuation}"), "max_tokens": 1,
            "temperature": 0.0, "echo": true, "logprobs": 1});
        let prompt_chars = prompt.chars().count();
        let end = prompt_chars + continuation.chars().count();
        let (found, cached) = self.http.post("/v1/completions", &body, |reply| {
            self.text_of(reply)?;
            let Some(tokens) = logprobs::echoed_tokens(reply) else { return Ok(None) };
            // A real echo starts at the prompt's first character; a server that ignored `echo`
            // lists only the generated token (which starts at or after the end).
            if tokens.first().map(|t| t.2) != Some(0) {
                return Ok(None);
            }
            logprobs::continuation_from_echo(&tokens, prompt_chars, end).map(Some).map_err(bad_reply)
        })?;
        Ok(found.map(|(logprob, n)| json!({"logprob": logprob, "tokens": n, "method": ContinuationMethod::Echo.name(), "cached": cached})))
    }

    /// vLLM's `prompt_logprobs`: one `/v1/completions` of prompt + continuation, whose reply
    /// lists, per prompt token, a map from token id to log-probability that always holds the
    /// prompt's own token. vLLM's `/tokenize` of the prompt and of the whole text says which
    /// positions are the continuation and which id to read at each (the decoded token strings
    /// are not used: their spelling changed between vLLM versions). `None` when the reply has
    /// no `prompt_logprobs` (the server ignored the parameter).
    fn by_prompt_logprobs(&self, prompt: &str, continuation: &str) -> Result<Option<Value>, ApiError> {
        let full = format!("{prompt}{continuation}");
        let body = json!({"model": self.model, "prompt": full, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1});
        let ids = |text: &str| -> Result<Vec<i64>, ApiError> {
            Ok(self.http.post("/tokenize", &json!({"model": self.model, "prompt": text}), |r| self.token_ids(r))?.0)
        };
        // The reply is accepted (and cached) only once it lines up with the prompt's tokens.
        let (found, cached) = self.http.post("/v1/completions", &body, |reply| {
            self.text_of(reply)?;
            let Some(positions) = reply["choices"][0]["prompt_logprobs"].as_array() else { return Ok(None) };
            let (prompt_ids, full_ids) = (ids(prompt)?, ids(&full)?);
            logprobs::continuation_from_prompt_logprobs(positions, &prompt_ids, &full_ids).map(Some).map_err(bad_reply)
        })?;
        Ok(found.map(|(logprob, n)| json!({"logprob": logprob, "tokens": n, "method": ContinuationMethod::PromptLogprobs.name(), "cached": cached})))
    }

    /// llama.cpp: tokenize, then one `/completion` per continuation token with that token
    /// forced by a logit bias; the reported log-probability is the unbiased one (checked on
    /// this server: it equals the top-k value, and tokens outside the top-k get theirs).
    fn by_forcing(&self, prompt: &str, continuation: &str) -> Result<Value, ApiError> {
        let ids = |content: &str, special: bool| -> Result<Vec<i64>, ApiError> {
            Ok(self.http.post("/tokenize", &json!({"content": content, "add_special": special}), |r| self.token_ids(r))?.0)
        };
        let mut context = ids(prompt, true)?;
        let target = ids(continuation, false)?;
        let mut sum = 0.0;
        let mut all_cached = true;
        for &tok in &target {
            let body = json!({"prompt": context, "n_predict": 1, "n_probs": 1, "post_sampling_probs": false,
                "logit_bias": [[tok, 100.0]], "cache_prompt": true, "temperature": 0.0});
            // A reply that did not take the forced token is refused, so never cached.
            let (logprob, cached) = self.http.post("/completion", &body, |reply| {
                let p = &reply["completion_probabilities"][0];
                if p["id"].as_i64() != Some(tok) {
                    return Err(bad_reply(format!("/completion did not take the forced token {tok} (got {}); the server may not honour logit_bias", p["id"])));
                }
                p["logprob"].as_f64().ok_or_else(|| bad_reply(format!("no logprob in {}", self.short(reply))))
            })?;
            all_cached &= cached;
            sum += logprob;
            context.push(tok);
        }
        Ok(json!({"logprob": sum, "tokens": target.len(), "method": ContinuationMethod::Forced.name(), "cached": all_cached}))
    }

    /// A reply quoted in a message: scrubbed of the key, then cut.
    fn short(&self, v: &Value) -> String {
        self.http.quote(&v.to_string(), 300)
    }

    /// The token ids of a `/tokenize` reply (vLLM's and llama.cpp's alike).
    fn token_ids(&self, reply: &Value) -> Result<Vec<i64>, ApiError> {
        reply["tokens"]
            .as_array()
            .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad_reply(format!("/tokenize answered without token ids: {}", self.short(reply))))
    }
}

rak_core::export_connector!(OpenAi);
