//! A fault-injecting OpenAI-compatible server for the connector's fault tests (a test double:
//! the real path is tested against llama.cpp's server). It answers `/v1/completions` on
//! 127.0.0.1, and a plan decides, per prompt and attempt, whether to fail and how. Every
//! request is logged with its prompt, `Authorization` header, outcome and time.

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
}

/// Decides the fate of a request from its prompt and how many times that prompt was asked
/// before (0 for the first time).
pub type Plan = Box<dyn Fn(&str, usize) -> Option<Fault> + Send + Sync>;

#[derive(Debug, Clone)]
pub struct Logged {
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
}

impl Default for Options {
    fn default() -> Self {
        Options { plan: Box::new(|_, _| None), delay: Duration::ZERO, context_chars: None, logprobs: true }
    }
}

struct State {
    opts: Options,
    log: Mutex<Vec<Logged>>,
    asked: Mutex<HashMap<String, usize>>,
}

pub struct FakeServer {
    pub url: String,
    state: Arc<State>,
    stop: Arc<AtomicBool>,
}

impl FakeServer {
    pub fn start(opts: Options) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State { opts, log: Mutex::new(Vec::new()), asked: Mutex::new(HashMap::new()) });
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || serve(conn, &st));
            }
        });
        FakeServer { url, state, stop }
    }

    pub fn log(&self) -> Vec<Logged> {
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
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
    }
}

fn serve(conn: TcpStream, st: &State) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut head = String::new();
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
            head.push_str(&line);
        }
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let prompt = req["prompt"].as_str().unwrap_or("").to_string();
        let attempt = {
            let mut asked = st.asked.lock().unwrap();
            let n = asked.entry(prompt.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let fault = (st.opts.plan)(&prompt, attempt);
        let log = |outcome: &str| {
            st.log.lock().unwrap().push(Logged { prompt: prompt.clone(), auth: auth.clone(), outcome: outcome.to_string(), at: Instant::now() })
        };
        let reply = |out: &mut TcpStream, status: &str, extra: &str, body: &str| {
            let msg = format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}\r\n{body}", body.len());
            out.write_all(msg.as_bytes()).is_ok()
        };
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
            None => {
                if let Some(limit) = st.opts.context_chars.filter(|&l| prompt.chars().count() > l) {
                    log("context");
                    let body = json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
                        "type": "exceed_context_size_error", "n_prompt_tokens": prompt.chars().count() / 4, "n_ctx": limit / 4}});
                    if !reply(&mut out, "400 Bad Request", "", &body.to_string()) {
                        return;
                    }
                    continue;
                }
                std::thread::sleep(st.opts.delay);
                let body = answer(&req, &prompt, st.opts.logprobs);
                log("ok");
                if !reply(&mut out, "200 OK", "", &body.to_string()) {
                    return;
                }
            }
        }
    }
}

/// A deterministic answer: multiple choice picks a letter from the prompt's length; short
/// answers say the first word of the prompt's last line.
fn answer(req: &Value, prompt: &str, logprobs: bool) -> Value {
    let letters = ["A", "B"];
    let pick = letters[prompt.len() % 2];
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(16);
    let text = if max_tokens == 1 { format!(" {pick}") } else { format!(" {pick}\nsomething else") };
    let mut choice = json!({"index": 0, "text": text, "finish_reason": "length"});
    if logprobs && req.get("logprobs").is_some() {
        choice["logprobs"] = json!({"content": [{"token": format!(" {pick}"), "logprob": -0.3,
            "top_logprobs": [{"token": format!(" {pick}"), "logprob": -0.3}, {"token": " C", "logprob": -2.0}]}]});
    }
    json!({"id": "fake", "object": "text_completion", "model": req["model"], "choices": [choice],
        "usage": {"prompt_tokens": prompt.len() / 4, "completion_tokens": 1, "total_tokens": prompt.len() / 4 + 1}})
}
