//! A fault-injecting OpenAI-compatible server for the connector's fault tests (a test double:
//! the real path is tested against llama.cpp's server). It answers on 127.0.0.1, by path:
//! `/v1/completions` (replies in the chat shape of log-probabilities, as llama.cpp does, and
//! OpenAI's limit of 5 on `logprobs`), `/v1/chat/completions` (OpenAI's limit of 20 on
//! `top_logprobs`), `GET /v1/models` (when it has models to list), and llama.cpp's native
//! `/tokenize` (one token per character) and `/completion` (the token a logit bias forces).
//! Stop sequences are honoured. A plan decides, per prompt and attempt, whether to fail and
//! how. Every request is logged with its path, body, prompt, `Authorization` header, outcome
//! and time.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How one request fails.
#[derive(Debug, Clone)]
pub enum Fault {
    /// 429 with this `Retry-After` value.
    TooMany(String),
    /// 500.
    ServerError,
    /// 200 with a body that is not JSON.
    Garbage,
    /// No answer for this long, then the connection is dropped.
    Stall(Duration),
    /// The connection closed without an answer.
    Close,
    /// 401 quoting the request's `Authorization` header back, as careless servers and proxies do.
    EchoAuth,
    /// 401 naming the key as OpenAI does: its first 8 characters, asterisks, its last 4.
    PartialKey,
    /// 200 with this well-formed JSON body of the wrong shape (`{"choices": []}`, `null`).
    Shape(Value),
    /// 200 whose generated text quotes the request's `Authorization` header.
    QuoteKey,
    /// 200 announcing a whole answer's length, cut off after half of it.
    Truncated,
    /// 200 with a valid answer whose text is this many bytes; `Content-Length` announced.
    Huge(usize),
    /// The same without `Content-Length`: the body ends when the connection closes.
    HugeUnannounced(usize),
    /// `/completion` answers with another token than the logit bias forced.
    IgnoreBias,
}

/// Decides the fate of a request from its prompt and how many times that prompt was asked
/// before (0 for the first time).
pub type Plan = Box<dyn Fn(&str, usize) -> Option<Fault> + Send + Sync>;

#[derive(Debug, Clone)]
pub struct Logged {
    pub path: String,
    pub body: Value,
    pub prompt: String,
    pub auth: Option<String>,
    pub outcome: String,
    pub at: Instant,
}

pub struct Options {
    pub plan: Plan,
    /// Added before every successful answer.
    pub delay: Duration,
    /// Prompts longer than this many characters get llama.cpp's context-overflow answer.
    pub context_chars: Option<usize>,
    /// Whether answers carry log-probabilities when asked for.
    pub logprobs: bool,
    /// The text generated for a prompt when more than one token is asked for (before stop
    /// sequences apply); by default " A\nsomething else" or " B\n...", by the prompt's length.
    pub text: Option<Box<dyn Fn(&str) -> String + Send + Sync>>,
    /// What `GET /v1/models` lists; `None`: 404, as a server without the route.
    pub models: Option<Vec<String>>,
    /// The log-probability of a token forced on `/completion`, from the prompt it follows;
    /// by default -0.5 whatever the prompt ([`distinct_logprob`] gives each prompt its own).
    pub forced_logprob: Option<Box<dyn Fn(&str) -> f64 + Send + Sync>>,
    /// The most `logprobs` `/v1/completions` takes (OpenAI's 5 by default); `None`: any
    /// number, as llama.cpp and vLLM.
    pub completions_logprobs: Option<u64>,
}

/// A forced token's log-probability that differs by the prompt it follows (FNV-1a of it, spread
/// over [-2.0, -0.1)): a continuation scored after each of several passages gets a different
/// log-likelihood after each, so a test can tell which passages an LM prefers (with the
/// default's one value for every prompt, any choice among them is "the best scored").
pub fn distinct_logprob(prompt: &str) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prompt.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    -0.1 - 1.9 * ((h >> 11) as f64 / (1u64 << 53) as f64)
}

impl Options {
    /// The default server, but with [`distinct_logprob`] for forced tokens.
    pub fn distinct_scores() -> Self {
        Options { forced_logprob: Some(Box::new(distinct_logprob)), ..Options::default() }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            plan: Box::new(|_, _| None),
            delay: Duration::ZERO,
            context_chars: None,
            logprobs: true,
            text: None,
            models: None,
            forced_logprob: None,
            completions_logprobs: Some(5),
        }
    }
}

struct State {
    opts: Options,
    /// Set by `shut_down`: the port is closed and open connections are dropped at their next
    /// request, as when a server process dies.
    stopped: AtomicBool,
    log: Mutex<Vec<Logged>>,
    asked: Mutex<HashMap<String, usize>>,
}

pub struct FakeServer {
    pub url: String,
    state: Arc<State>,
}

impl FakeServer {
    pub fn start(opts: Options) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State { opts, stopped: AtomicBool::new(false), log: Mutex::new(Vec::new()), asked: Mutex::new(HashMap::new()) });
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stopped.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || serve(conn, &st));
            }
        });
        FakeServer { url, state }
    }

    /// Goes away as a killed server does: nothing listens on its port any more (a connection
    /// is refused), and a connection a client keeps open is closed at its next request.
    pub fn shut_down(&self) {
        self.state.stopped.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag and drops the listener.
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
    }

    /// Every request but `GET /v1/models` (which the connector sends once at start, to learn
    /// what the server serves): what the items asked.
    pub fn log(&self) -> Vec<Logged> {
        self.log_all().into_iter().filter(|l| l.path != "/v1/models").collect()
    }

    /// Every request, `GET /v1/models` included.
    pub fn log_all(&self) -> Vec<Logged> {
        self.state.log.lock().unwrap().clone()
    }

    /// How many successful answers each prompt got.
    pub fn answered(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for l in self.log() {
            if l.outcome == "ok" {
                *m.entry(l.prompt).or_default() += 1;
            }
        }
        m
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// The prompt a request carries, as the plan and the log see it: the completions prompt, the
/// chat's first message, `/tokenize`'s content, or `/completion`'s token ids as characters.
fn prompt_of(path: &str, req: &Value) -> String {
    match path {
        "/v1/chat/completions" => req["messages"][0]["content"].as_str().unwrap_or("").to_string(),
        "/tokenize" => req["content"].as_str().unwrap_or("").to_string(),
        "/completion" => req["prompt"].as_array().map(|ids| ids.iter().filter_map(|t| char::from_u32(t.as_u64()? as u32)).collect()).unwrap_or_default(),
        _ => req["prompt"].as_str().unwrap_or("").to_string(),
    }
}

fn serve(conn: TcpStream, st: &State) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 || st.stopped.load(Ordering::Relaxed) {
            return;
        }
        let mut words = request_line.split_whitespace();
        let (method, path) = (words.next().unwrap_or("").to_string(), words.next().unwrap_or("").to_string());
        let mut auth = None;
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("authorization:") {
                auth = Some(line["authorization:".len()..].trim().to_string());
            }
        }
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let prompt = prompt_of(&path, &req);
        let log = |outcome: &str| {
            st.log.lock().unwrap().push(Logged {
                path: path.clone(),
                body: req.clone(),
                prompt: prompt.clone(),
                auth: auth.clone(),
                outcome: outcome.to_string(),
                at: Instant::now(),
            })
        };
        let reply = |out: &mut TcpStream, status: &str, extra: &str, body: &str| {
            let msg = format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}\r\n{body}", body.len());
            out.write_all(msg.as_bytes()).is_ok()
        };
        if method == "GET" {
            let ok = match (&path[..], &st.opts.models) {
                ("/v1/models", Some(models)) => {
                    log("ok");
                    let data: Vec<Value> = models.iter().map(|m| json!({"id": m, "object": "model", "owned_by": "llamacpp"})).collect();
                    reply(&mut out, "200 OK", "", &json!({"object": "list", "data": data}).to_string())
                }
                _ => {
                    log("404");
                    reply(&mut out, "404 Not Found", "", r#"{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}"#)
                }
            };
            if !ok {
                return;
            }
            continue;
        }
        if !["/v1/completions", "/v1/chat/completions", "/tokenize", "/completion"].contains(&path.as_str()) {
            log("404");
            if !reply(&mut out, "404 Not Found", "", r#"{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}"#) {
                return;
            }
            continue;
        }
        let attempt = {
            let mut asked = st.asked.lock().unwrap();
            let n = asked.entry(prompt.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let fault = (st.opts.plan)(&prompt, attempt);
        match fault {
            Some(Fault::TooMany(after)) => {
                log("429");
                if !reply(&mut out, "429 Too Many Requests", &format!("Retry-After: {after}\r\n"), r#"{"error":{"message":"slow down"}}"#) {
                    return;
                }
            }
            Some(Fault::ServerError) => {
                log("500");
                if !reply(&mut out, "500 Internal Server Error", "", r#"{"error":{"message":"boom"}}"#) {
                    return;
                }
            }
            Some(Fault::Garbage) => {
                log("garbage");
                if !reply(&mut out, "200 OK", "", "<html>upstream error</html>") {
                    return;
                }
            }
            Some(Fault::Stall(d)) => {
                log("stall");
                std::thread::sleep(d);
                return;
            }
            Some(Fault::Close) => {
                log("close");
                return;
            }
            Some(Fault::EchoAuth) => {
                log("401");
                let body = json!({"error": {"message": format!("invalid credentials: {}", auth.clone().unwrap_or_default()), "type": "invalid_request_error"}});
                if !reply(&mut out, "401 Unauthorized", "", &body.to_string()) {
                    return;
                }
            }
            Some(Fault::PartialKey) => {
                log("401");
                let key: Vec<char> = auth.clone().unwrap_or_default().trim_start_matches("Bearer ").chars().collect();
                let shown = format!("{}{}{}", key.iter().take(8).collect::<String>(), "*".repeat(key.len().saturating_sub(12)), key[key.len().saturating_sub(4)..].iter().collect::<String>());
                let body = json!({"error": {"message": format!("Incorrect API key provided: {shown}. You can find your API key at https://platform.openai.com/account/api-keys."),
                    "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
                if !reply(&mut out, "401 Unauthorized", "", &body.to_string()) {
                    return;
                }
            }
            Some(Fault::Shape(v)) => {
                log("shape");
                if !reply(&mut out, "200 OK", "", &v.to_string()) {
                    return;
                }
            }
            Some(Fault::QuoteKey) => {
                log("quote");
                let body = answer(&path, &req, &prompt, &st.opts, Some(format!(" your key is {}", auth.clone().unwrap_or_default())));
                if !reply(&mut out, "200 OK", "", &body.to_string()) {
                    return;
                }
            }
            Some(Fault::Truncated) => {
                log("truncated");
                let body = answer(&path, &req, &prompt, &st.opts, None).to_string();
                let head = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
                let _ = out.write_all(head.as_bytes()).and_then(|_| out.write_all(&body.as_bytes()[..body.len() / 2])).and_then(|_| out.flush());
                return;
            }
            Some(Fault::Huge(n)) => {
                log("huge");
                let body = answer(&path, &req, &prompt, &st.opts, Some("x".repeat(n))).to_string();
                if !reply(&mut out, "200 OK", "", &body) {
                    return;
                }
            }
            Some(Fault::HugeUnannounced(n)) => {
                log("huge");
                let body = answer(&path, &req, &prompt, &st.opts, Some("x".repeat(n))).to_string();
                let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n";
                let _ = out.write_all(head.as_bytes()).and_then(|_| out.write_all(body.as_bytes()));
                return;
            }
            Some(Fault::IgnoreBias) if path == "/completion" => {
                log("ignored_bias");
                let forced = req["logit_bias"][0][0].as_i64().unwrap_or(0);
                if !reply(&mut out, "200 OK", "", &forced_answer(forced + 1, prompt.chars().count(), -0.5).to_string()) {
                    return;
                }
            }
            Some(Fault::IgnoreBias) | None => {
                if let Some(limit) = st.opts.context_chars.filter(|&l| prompt.chars().count() > l) {
                    log("context");
                    let body = json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
                        "type": "exceed_context_size_error", "n_prompt_tokens": prompt.chars().count() / 4, "n_ctx": limit / 4}});
                    if !reply(&mut out, "400 Bad Request", "", &body.to_string()) {
                        return;
                    }
                    continue;
                }
                // OpenAI's limits on alternatives per position: 5 on completions, 20 on chat.
                let (param, asked, max) = match &path[..] {
                    "/v1/completions" => ("logprobs", req["logprobs"].as_u64(), st.opts.completions_logprobs.unwrap_or(u64::MAX)),
                    "/v1/chat/completions" => ("top_logprobs", req["top_logprobs"].as_u64(), 20),
                    _ => ("", None, 0),
                };
                if asked.is_some_and(|k| k > max) {
                    log("400");
                    let body = json!({"error": {"message": format!("Invalid value for '{param}': must be less than or equal to {max}."),
                        "type": "invalid_request_error", "param": param, "code": null}});
                    if !reply(&mut out, "400 Bad Request", "", &body.to_string()) {
                        return;
                    }
                    continue;
                }
                std::thread::sleep(st.opts.delay);
                let body = match &path[..] {
                    "/tokenize" => {
                        let mut ids: Vec<u32> = if req["add_special"].as_bool().unwrap_or(false) { vec![1] } else { vec![] };
                        ids.extend(prompt.chars().map(|c| c as u32));
                        json!({"tokens": ids})
                    }
                    "/completion" => {
                        let logprob = st.opts.forced_logprob.as_ref().map_or(-0.5, |f| f(&prompt));
                        forced_answer(req["logit_bias"][0][0].as_i64().unwrap_or(0), prompt.chars().count(), logprob)
                    }
                    _ => answer(&path, &req, &prompt, &st.opts, None),
                };
                log("ok");
                if !reply(&mut out, "200 OK", "", &body.to_string()) {
                    return;
                }
            }
        }
    }
}

/// llama.cpp's native `/completion` reply for one generated token.
fn forced_answer(id: i64, context: usize, logprob: f64) -> Value {
    let token = char::from_u32(id as u32).map(String::from).unwrap_or_default();
    json!({"content": token, "completion_probabilities": [{"id": id, "token": token, "logprob": logprob, "top_logprobs": []}],
        "tokens_evaluated": context, "tokens_predicted": 1})
}

/// A deterministic answer: multiple choice picks a letter from the prompt's length; short
/// answers say the first word of the prompt's last line. `text` replaces the generated text.
/// Chat requests get the chat shape; stop sequences cut the text.
fn answer(path: &str, req: &Value, prompt: &str, opts: &Options, text: Option<String>) -> Value {
    let letters = ["A", "B"];
    let pick = letters[prompt.len() % 2];
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(16);
    let mut text = text.unwrap_or_else(|| match &opts.text {
        _ if max_tokens == 1 => format!(" {pick}"),
        Some(f) => f(prompt),
        None => format!(" {pick}\nsomething else"),
    });
    let stops: Vec<String> = match &req["stop"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect(),
        _ => vec![],
    };
    let mut finish = "length";
    if let Some(at) = stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(at);
        finish = "stop";
    }
    let chat = path == "/v1/chat/completions";
    let mut choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
    } else {
        json!({"index": 0, "text": text, "finish_reason": finish})
    };
    let asked = if chat { req["logprobs"].as_bool() == Some(true) } else { req.get("logprobs").is_some() };
    if opts.logprobs && asked {
        choice["logprobs"] = json!({"content": [{"token": format!(" {pick}"), "logprob": -0.3,
            "top_logprobs": [{"token": format!(" {pick}"), "logprob": -0.3}, {"token": " C", "logprob": -2.0}]}]});
    }
    json!({"id": "fake", "object": if chat { "chat.completion" } else { "text_completion" }, "model": req["model"], "choices": [choice],
        "usage": {"prompt_tokens": prompt.len() / 4, "completion_tokens": 1, "total_tokens": prompt.len() / 4 + 1}})
}
