//! `host serve` as a client sees it: vectors and passages equal `host encode`'s and `host
//! search`'s; the real OpenAI Python client (embeddings, chat with and without streaming)
//! against it in front of a real llama-server; every fault (bad JSON, a missing field, token
//! ids, an oversized body, a full queue, a target that stalls, fails or is gone, a missing or
//! wrong key, SIGTERM under load) answered as documented; and the page, loaded in a real
//! browser (Debian's chromium driven by selenium), shows the passages of a typed question.

use rak_e2e::fake_openai::{FakeServer, Fault, Options};
use rak_e2e::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The slice's corpus encoded by `host encode` and indexed flat, once per test binary.
fn flat_index() -> &'static (PathBuf, PathBuf) {
    static I: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    I.get_or_init(|| {
        let s = slice();
        let emb = s.dir.join("serve-emb");
        let idx = s.dir.join("serve-flat");
        let out = host(&["encode", "--encoder", "dpr", "--model", p(&minilm_dir()), "--input", p(&s.corpus), "--output", p(&emb)]);
        assert!(out.status.success(), "{}", stderr(&out));
        let out = host(&["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&idx)]);
        assert!(out.status.success(), "{}", stderr(&out));
        (idx, emb)
    })
}

/// A `host serve` of a test's own on a free port, killed at drop.
struct Serve {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Serve {
    /// Over the slice's flat index and MiniLM, with `extra` flags.
    fn start(extra: &[&str], env: &[(&str, &str)]) -> Serve {
        let (idx, _) = flat_index();
        let model = minilm_dir();
        let mut args = vec!["--index", p(idx), "--encoder", "dpr", "--model", p(&model)];
        args.extend_from_slice(extra);
        Serve::launch(&args, env)
    }

    /// `host serve ARGS` over the slice's corpus, on a free port.
    fn launch(args: &[&str], env: &[(&str, &str)]) -> Serve {
        let log = slice().dir.join(format!("serve-{}.log", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()));
        let mut args: Vec<&str> = [&["serve"], args].concat();
        args.extend(["--corpus", p(&slice().corpus), "--port", "0"]);
        let mut child = Command::new(host_bin())
            .args(&args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            let _ = child.wait();
            panic!("host serve did not start: {}", std::fs::read_to_string(&log).unwrap());
        };
        Serve { child, url: v["listening"].as_str().unwrap().to_string(), log }
    }

    fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }

    /// Send it SIGTERM, as a service manager stops it.
    fn terminate(&self) {
        assert!(Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap().success());
    }

    /// Its exit status, failing the test if it is still running after `limit`.
    fn exit_within(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t.elapsed() < limit, "host serve still running {:?} after SIGTERM", t.elapsed());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response: status, headers (lower-cased names), body.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`), the body sent raw.
fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading the whole body and close: the rest is lost.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no response head: {text:?}"));
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(':')).map(|(n, v)| (n.trim().to_lowercase(), v.trim().to_string())).collect();
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    Reply { status, body: if chunked { dechunk(body) } else { body.to_string() }, headers }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(serve: &Serve, path: &str, body: &Value) -> Reply {
    request(serve.addr(), "POST", path, &[], body.to_string().as_bytes())
}

fn get(serve: &Serve, path: &str) -> Reply {
    request(serve.addr(), "GET", path, &[], b"")
}

fn assert_error(r: &Reply, status: u16, param: Option<&str>, says: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let e = &r.json()["error"];
    assert!(e["message"].as_str().unwrap().contains(says), "{}", r.body);
    assert!(e["type"].is_string(), "{}", r.body);
    // OpenAI's `code` is a string or null, never the status.
    assert!(e["code"].is_string() || e["code"].is_null(), "{}", r.body);
    if let Some(param) = param {
        assert_eq!(e["param"], param, "{}", r.body);
    }
}

fn npy_rows(dir: &Path) -> (Vec<String>, Vec<Vec<f32>>) {
    let npy = rak_retrieval::npy::NpyF32::open(&dir.join("embeddings.npy")).unwrap();
    let ids = rak_retrieval::npy::read_ids(&dir.join("ids.txt")).unwrap();
    let dim = npy.dim();
    (ids, npy.data().chunks(dim).map(<[f32]>::to_vec).collect())
}

#[test]
fn vectors_and_passages_equal_host_encode_and_host_search() {
    let serve = Serve::start(&[], &[]);
    let dir = TempDir::new("serve-parity");
    // Passages: the corpus as `host encode` embedded it (titled), sent as `title\x1ftext`.
    let (_, emb) = flat_index();
    let (ids, rows) = npy_rows(emb);
    let corpus = rak_retrieval::data::beir::load_corpus(&slice().corpus).unwrap();
    let texts: Vec<String> = ids[..6].iter().map(|id| corpus.get(id).unwrap()).map(|d| format!("{}\u{1f}{}", d.title, d.text)).collect();
    let r = post(&serve, "/v1/embeddings", &json!({"input": texts, "model": "all-MiniLM-L6-v2"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let got = r.json();
    assert_eq!(got["object"], "list");
    for (i, row) in rows[..6].iter().enumerate() {
        let v: Vec<f32> = got["data"][i]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        assert_eq!(got["data"][i]["index"], i);
        // Equal up to float rounding: batches of other lengths pad differently, and the GEMMs
        // then sum in another order (host encode's own batches differ the same way).
        close(&v, row, &format!("passage {i}"));
    }
    // Usage counts the encoder's tokens ([CLS] hello world [SEP], [CLS] a b c d e f [SEP]),
    // not an estimate from the bytes (22 / 4).
    let r = post(&serve, "/v1/embeddings", &json!({"input": ["hello world", "a b c d e f"]})).json();
    assert_eq!(r["usage"], json!({"prompt_tokens": 12, "total_tokens": 12}), "{r}");
    // base64: the same float32 bytes, little-endian.
    let b = post(&serve, "/v1/embeddings", &json!({"input": texts[0], "encoding_format": "base64", "model": "all-MiniLM-L6-v2-passage"})).json();
    let bytes = base64_decode(b["data"][0]["embedding"].as_str().unwrap());
    let v: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    close(&v, &rows[0], "base64");

    // Queries: `host encode --role query` of the slice's queries, and /search against `host search`.
    let qemb = dir.path().join("q");
    let out = host(&["encode", "--encoder", "dpr", "--model", p(&minilm_dir()), "--input", p(&slice().queries), "--output", p(&qemb), "--role", "query"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (qids, qrows) = npy_rows(&qemb);
    let queries: Vec<Value> = std::fs::read_to_string(&slice().queries).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let qtext = |id: &str| queries.iter().find(|q| q["_id"] == id).unwrap()["text"].as_str().unwrap().to_string();
    let r = post(&serve, "/v1/embeddings", &json!({"input": [qtext(&qids[0]), qtext(&qids[1])], "input_type": "query"})).json();
    for i in 0..2 {
        let v: Vec<f32> = r["data"][i]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        close(&v, &qrows[i], &format!("query {i}"));
    }
    let trec = dir.path().join("run.trec");
    let (idx, _) = flat_index();
    let out = host(&["search", "--index", p(idx), "--encoder", "dpr", "--model", p(&minilm_dir()), "--queries", p(&slice().queries), "--k", "10", "--output", p(&trec)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = std::fs::read_to_string(&trec).unwrap();
    let texts: Vec<String> = queries.iter().map(|q| q["text"].as_str().unwrap().to_string()).collect();
    let found = post(&serve, "/search", &json!({"query": texts, "k": 10})).json();
    for (q, res) in queries.iter().zip(found["results"].as_array().unwrap()) {
        let expected: Vec<(String, f64)> = run
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|c| c[0] == q["_id"].as_str().unwrap())
            .map(|c| (c[2].to_string(), c[4].parse().unwrap()))
            .collect();
        let got = res["passages"].as_array().unwrap();
        assert_eq!((expected.len(), got.len()), (10, 10), "{}", q["_id"]);
        for ((id, score), hit) in expected.iter().zip(got) {
            assert_eq!(hit["id"], id.as_str(), "{}", q["_id"]);
            assert!((hit["score"].as_f64().unwrap() - score).abs() < 1e-5, "{}: {hit} vs {score}", q["_id"]);
            assert_eq!(hit["text"], corpus.get(id).unwrap().text.as_str());
            assert_eq!(hit["title"], corpus.get(id).unwrap().title.as_str());
        }
    }
    // One query: the same answer, not in a list.
    let one = post(&serve, "/search", &json!({"query": texts[0], "k": 3})).json();
    let ids = |hits: &[Value]| hits.iter().map(|h| h["id"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert_eq!(ids(one["passages"].as_array().unwrap()), ids(&found["results"][0]["passages"].as_array().unwrap()[..3]));

    let models = get(&serve, "/v1/models").json();
    let names: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(names, ["all-MiniLM-L6-v2", "all-MiniLM-L6-v2-query", "all-MiniLM-L6-v2-passage"]);
    assert_eq!(get(&serve, "/health").json()["status"], "ok");
    let metrics = get(&serve, "/metrics");
    assert!(metrics.body.contains("rak_requests_total{route=\"/search\",status=\"200\"} 2"), "{}", metrics.body);
    assert!(metrics.body.contains("rak_batch_size_count"), "{}", metrics.body);
    // One structured line a request, with its id.
    let log = serve.log();
    let lines: Vec<Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).filter(|v: &Value| v["id"].is_string()).collect();
    assert!(lines.iter().any(|l| l["path"] == "/search" && l["status"] == 200), "{log}");
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-5, "{what}: /v1/embeddings differs from host encode by {worst}");
}

fn base64_decode(s: &str) -> Vec<u8> {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter(|&c| c != b'=') {
        acc = (acc << 6) | alphabet.iter().position(|&a| a == c).unwrap() as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[test]
fn the_openai_client_embeds_and_chats_through_it_in_front_of_llama_server() {
    let llama = LlamaServer::start("serve-llama", &[]);
    let cfg = root().join("configs/augment/chat.toml");
    let serve = Serve::start(&["--base-url", &llama.url, "--config", p(&cfg), "--k", "2"], &[]);
    let expected = post(&serve, "/v1/embeddings", &json!({"input": ["Who wrote Hamlet?"], "input_type": "query"})).json();
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/serve_client.py"))
        .arg(&serve.url)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let got: Value = serde_json::from_str(stdout(&out).lines().last().unwrap()).unwrap();
    // The client's vectors are the server's (float32 through base64, the client's default).
    let want: Vec<f64> = expected["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let have: Vec<f64> = got["query_embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(have, want);
    assert!(!got["chat"].as_str().unwrap().trim().is_empty(), "{got}");
    assert_eq!(got["chat_passages"].as_array().unwrap().len(), 2, "{got}");
    assert!(got["streamed_chunks"].as_u64().unwrap() >= 2, "{got}");
    assert!(!got["streamed"].as_str().unwrap().trim().is_empty(), "{got}");
    assert_eq!(got["closed_book_passages"].as_array().unwrap().len(), 0, "{got}");
}

#[test]
fn faults_are_answered_as_documented() {
    let key = "sk-serve-test-7a1f9c3e5b2d";
    // A target that stalls on prompts saying "stall", fails on "crash", answers the rest.
    let target = FakeServer::start(Options {
        plan: Box::new(|prompt, _| {
            if prompt.contains("stall") {
                Some(Fault::Stall(Duration::from_secs(8)))
            } else if prompt.contains("busy") {
                Some(Fault::TooMany("7".into()))
            } else if prompt.contains("crash") {
                Some(Fault::ServerError)
            } else {
                None
            }
        }),
        models: Some(vec!["fake".into()]),
        ..Options::default()
    });
    let serve = Serve::start(
        &["--base-url", &target.url, "--api-key-env", "SERVE_TEST_KEY", "--allowed-host", "rag.example.com", "--max-body-bytes", "1000000", "--request-timeout-s", "2", "--k", "2"],
        &[("SERVE_TEST_KEY", key)],
    );
    let auth = format!("Bearer {key}");
    let call = |path: &str, body: &[u8]| request(serve.addr(), "POST", path, &[("Authorization", &auth)], body);
    let chat = |content: &str| call("/v1/chat/completions", json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).to_string().as_bytes());

    // The key: required everywhere but /health (and the page); never logged.
    assert_eq!(get(&serve, "/health").status, 200);
    assert_error(&post(&serve, "/search", &json!({"query": "x"})), 401, None, "requires an API key");
    let wrong = request(serve.addr(), "POST", "/search", &[("Authorization", "Bearer sk-wrong")], br#"{"query": "x"}"#);
    assert_error(&wrong, 401, None, "not this server's");
    assert_eq!(wrong.json()["error"]["code"], "invalid_api_key");
    assert_eq!(request(serve.addr(), "GET", "/metrics", &[("Authorization", &auth)], b"").status, 200);
    // The scheme's name in any case (RFC 7235).
    for scheme in ["bearer", "BEARER"] {
        let r = request(serve.addr(), "GET", "/metrics", &[("Authorization", &format!("{scheme} {key}"))], b"");
        assert_eq!(r.status, 200, "{scheme}: {}", r.body);
    }
    // A known route asked with another method: 405, the same error body, and `Allow`.
    let r = request(serve.addr(), "GET", "/v1/embeddings", &[("Authorization", &auth)], b"");
    assert_error(&r, 405, None, "/v1/embeddings");
    assert_eq!(r.header("allow"), Some("POST"), "{:?}", r.headers);

    // Malformed requests: 400, OpenAI's error shape, the field named.
    assert_error(&call("/v1/embeddings", b"{not json"), 400, None, "not valid JSON");
    assert_error(&call("/v1/embeddings", b"[1, 2]"), 400, None, "JSON object");
    assert_error(&call("/v1/embeddings", br#"{"model": "all-MiniLM-L6-v2"}"#), 400, Some("input"), "needs `input`");
    assert_error(&call("/v1/embeddings", br#"{"input": [[101, 2054]]}"#), 400, Some("input"), "check_embedding_ctx_length=False");
    assert_error(&call("/v1/embeddings", br#"{"input": "x", "encoding_format": "int8"}"#), 400, Some("encoding_format"), "int8");
    let r = call("/v1/embeddings", br#"{"input": "x", "model": "text-embedding-3-small"}"#);
    assert_error(&r, 404, Some("model"), "not served");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_eq!(call("/v1/embeddings", b"{not json").json()["error"]["code"], Value::Null);
    assert_error(&call("/search", br#"{"query": "x", "k": 1000}"#), 400, Some("k"), "--max-k");
    assert_error(&call("/v1/chat/completions", br#"{"messages": "hi"}"#), 400, Some("messages"), "messages");
    assert_error(&call("/v1/chat/completions", br#"{"messages": [{"role": "user", "content": "x"}], "retrieval": {"k": "two"}}"#), 400, Some("retrieval.k"), "integer");
    // Oversized: 413, the limit named.
    let big = json!({"input": "word ".repeat(250_000)}).to_string();
    assert_error(&call("/v1/embeddings", big.as_bytes()), 413, None, "1000000 bytes");

    // What a web page the user visits could send: another origin, or another host name
    // rebound to 127.0.0.1.
    let evil = request(serve.addr(), "POST", "/search", &[("Authorization", &auth), ("Origin", "http://evil.example")], br#"{"query": "x"}"#);
    assert_error(&evil, 403, None, "evil.example");
    let rebound = request(serve.addr(), "GET", "/info", &[("Authorization", &auth), ("Host", "evil.example:80")], b"");
    assert_error(&rebound, 403, None, "loopback");
    // A reverse proxy's host name, and pages of that site, once allowed.
    let proxied = request(serve.addr(), "POST", "/search", &[("Authorization", &auth), ("Host", "rag.example.com"), ("Origin", "https://rag.example.com")], br#"{"query": "x"}"#);
    assert_eq!(proxied.status, 200, "{}", proxied.body);
    let own_page = format!("http://{}", serve.addr());
    assert_eq!(request(serve.addr(), "POST", "/search", &[("Authorization", &auth), ("Origin", &own_page)], br#"{"query": "x"}"#).status, 200);

    // A client that sends part of its body and stalls: answered at the deadline, not held.
    let t = Instant::now();
    let mut stalled = TcpStream::connect(serve.addr()).unwrap();
    write!(stalled, "POST /search HTTP/1.1\r\nHost: {}\r\nAuthorization: {auth}\r\nContent-Length: 100\r\n\r\n{{\"query\": ", serve.addr()).unwrap();
    let mut head = String::new();
    BufReader::new(&stalled).read_line(&mut head).unwrap();
    assert!(head.contains(" 504 "), "{head}");
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    // One that sends part of its request head and stalls: the connection is closed at the
    // request timeout, not held.
    let t = Instant::now();
    let mut stalled = TcpStream::connect(serve.addr()).unwrap();
    stalled.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(stalled, "POST /search HTTP/1.1\r\nHost: {}\r\nAuthorization: {auth}\r\n", serve.addr()).unwrap();
    let n = stalled.read(&mut [0u8; 256]).expect("closed, not left open");
    assert_eq!(n, 0, "closed without an answer");
    assert!(t.elapsed() >= Duration::from_millis(1500) && t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());

    // An embeddings request past its deadline: 504, and its texts are not encoded on behind
    // it (a search right after is answered at once, not after the abandoned work).
    let huge: Vec<String> = (0..2000).map(|i| format!("text number {i} about the long history of the Roman provinces and their cities. ").repeat(3)).collect();
    let t = Instant::now();
    let r = call("/v1/embeddings", json!({"input": huge}).to_string().as_bytes());
    assert_error(&r, 504, None, "");
    let r = call("/search", br#"{"query": "Roman Empire", "k": 2}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(t.elapsed() < Duration::from_secs(5), "the search waited for abandoned work: {:?}", t.elapsed());
    let metrics = request(serve.addr(), "GET", "/metrics", &[("Authorization", &auth)], b"").body;
    let abandoned: u64 = metrics.lines().find_map(|l| l.strip_prefix("rak_abandoned_texts_total ")).unwrap().parse().unwrap();
    assert!(abandoned > 500, "{metrics}");

    // The target gets the passages before the question, and the reply carries them.
    let ok = chat("Who founded the Roman Empire?");
    assert_eq!(ok.status, 200, "{}", ok.body);
    let reply = ok.json();
    let passages = reply["retrieval"]["passages"].as_array().unwrap();
    assert_eq!(passages.len(), 2);
    let sent = target.log().into_iter().find(|l| l.path == "/v1/chat/completions").unwrap();
    let content = sent.body["messages"][0]["content"].as_str().unwrap().to_string();
    let first = passages[0]["text"].as_str().unwrap();
    assert!(content.find(first).unwrap() < content.find("Who founded the Roman Empire?").unwrap(), "{content}");
    assert!(sent.body.get("retrieval").is_none(), "the retrieval field is ours, not the target's");
    let off = call("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "plain"}], "retrieval": {"k": 0}}).to_string().as_bytes()).json();
    assert_eq!(off["retrieval"]["passages"].as_array().unwrap().len(), 0);
    assert_eq!(target.log().last().unwrap().body["messages"][0]["content"], "plain");

    // A target that stalls: 504 at the request timeout; one that fails: 502 at once, not after
    // retries (the fake would have been asked again).
    let t = Instant::now();
    assert_error(&chat("please stall"), 504, None, "");
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    let t = Instant::now();
    assert_error(&chat("please crash"), 502, None, "target LM failed");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(target.log().iter().filter(|l| l.prompt.contains("crash")).count(), 1, "a forwarded request is tried once");

    // The target's rate limit is passed on with its wait; a target that answers a stream
    // with a whole reply is a 502 that says so, not a 200 a streaming client cannot read.
    let busy = chat("are you busy?");
    assert_error(&busy, 429, None, "rate-limiting");
    assert_eq!(busy.header("retry-after"), Some("7"));
    assert_eq!(busy.json()["error"]["code"], "rate_limit_exceeded");
    let streamed = call("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hello"}], "stream": true}).to_string().as_bytes());
    assert_error(&streamed, 502, None, "not server-sent events");

    // A target that is gone: 502 at once, saying so.
    target.shut_down();
    let t = Instant::now();
    assert_error(&chat("anyone there?"), 502, None, "target LM");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    // The server lived through all of it, and no line of its log holds the key.
    assert_eq!(get(&serve, "/health").status, 200);
    let metrics = request(serve.addr(), "GET", "/metrics", &[("Authorization", &auth)], b"").body;
    assert!(metrics.contains("rak_request_errors_total{route=\"/v1/embeddings\",status=\"400\"}"), "{metrics}");
    assert!(metrics.contains("rak_upstream_errors_total{kind=\"timeout\"}"), "{metrics}");
    assert!(!serve.log().contains(key), "the key reached the log");
}

#[test]
fn a_full_queue_answers_429_and_sigterm_finishes_what_is_in_flight() {
    let mut serve = Serve::start(&["--queue-size", "1", "--max-batch-tokens", "512", "--batch-size", "8"], &[]);
    let addr = serve.addr().to_string();
    // Many requests of many texts at once against a queue of one: some are refused at once.
    let texts: Vec<String> = (0..64).map(|i| format!("passage number {i} about the history of the Roman Empire and its provinces")).collect();
    let body = json!({"input": texts}).to_string();
    let handles: Vec<_> = (0..12)
        .map(|_| {
            let (addr, body) = (addr.clone(), body.clone());
            std::thread::spawn(move || request(&addr, "POST", "/v1/embeddings", &[], body.as_bytes()))
        })
        .collect();
    let replies: Vec<Reply> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let refused: Vec<&Reply> = replies.iter().filter(|r| r.status == 429).collect();
    assert!(!refused.is_empty(), "no request was refused: {:?}", replies.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 429));
    assert_eq!(refused[0].header("retry-after"), Some("1"));
    assert_eq!(refused[0].json()["error"]["type"], "rate_limit_error");

    // SIGTERM with a request in flight: it still gets its answer, then the server exits 0
    // and listens no more.
    let many: Vec<String> = (0..600).map(|i| format!("{} (copy {i})", texts[i % texts.len()])).collect();
    let body = json!({"input": many}).to_string();
    let sent = Instant::now();
    let in_flight = {
        let addr = addr.clone();
        std::thread::spawn(move || request(&addr, "POST", "/v1/embeddings", &[], body.as_bytes()))
    };
    std::thread::sleep(Duration::from_millis(300));
    serve.terminate();
    let r = in_flight.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"].as_array().unwrap().len(), 600);
    eprintln!("the request SIGTERM met took {:?}", sent.elapsed());
    let status = serve.exit_within(Duration::from_secs(30));
    assert!(status.success(), "{status:?}: {}", serve.log());
    assert!(TcpStream::connect(&addr).is_err(), "still listening after SIGTERM");
    // The request was answered after the signal: it was in flight when SIGTERM came.
    let log = serve.log();
    let shutdown = log.find("\"event\":\"shutdown\"").expect("no shutdown event in the log");
    let answered = log.rfind("\"path\":\"/v1/embeddings\",\"status\":200").unwrap();
    assert!(answered > shutdown, "the request finished before SIGTERM: the test tested nothing\n{log}");
}

#[test]
fn the_page_shows_the_passages_of_a_typed_question_in_a_real_browser() {
    let serve = Serve::start(&["--tasks", "squad,wikidata"], &[]);
    let out = Command::new(root().join(".venv/bin/python")).arg(root().join("tests/serve_page.py")).arg(&serve.url).output().unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let got: Value = serde_json::from_str(stdout(&out).lines().last().unwrap()).unwrap();
    let expected = post(&serve, "/search", &json!({"query": "Who founded the Roman Empire?", "k": 3})).json();
    let titles: Vec<&str> = expected["passages"].as_array().unwrap().iter().map(|h| h["title"].as_str().unwrap()).collect();
    let shown: Vec<&str> = got["titles"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(shown, titles, "{got}");
}

#[test]
fn a_bm25_index_is_served_without_an_encoder() {
    let dir = TempDir::new("serve-bm25");
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&slice().corpus), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let serve = Serve::launch(&["--index", p(&bm25)], &[]);
    let trec = dir.path().join("run.trec");
    let out = host(&["search", "--index", p(&bm25), "--queries", p(&slice().queries), "--k", "5", "--output", p(&trec)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = std::fs::read_to_string(&trec).unwrap();
    let first: Value = serde_json::from_str(std::fs::read_to_string(&slice().queries).unwrap().lines().next().unwrap()).unwrap();
    let expected: Vec<&str> = run.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()).filter(|c| c[0] == first["_id"].as_str().unwrap()).map(|c| c[2]).collect::<Vec<_>>();
    let got = post(&serve, "/search", &json!({"query": first["text"], "k": 5})).json();
    let ids: Vec<&str> = got["passages"].as_array().unwrap().iter().map(|h| h["id"].as_str().unwrap()).collect();
    assert_eq!(ids, expected);
    assert_error(&post(&serve, "/v1/embeddings", &json!({"input": "x"})), 400, None, "no encoder");
    assert_eq!(get(&serve, "/v1/models").json()["data"].as_array().unwrap().len(), 0);
    assert_eq!(get(&serve, "/health").status, 200);
    // A corpus without some of the index's passages is refused as for a dense index.
    let all = std::fs::read_to_string(&slice().corpus).unwrap();
    let lines: Vec<&str> = all.lines().collect();
    let partial = dir.path().join("partial.jsonl");
    std::fs::write(&partial, lines[1..].join("\n") + "\n").unwrap();
    let (code, e) = refused(&["--index", p(&bm25), "--corpus", p(&partial), "--port", "0"], &[], Duration::from_secs(60));
    assert_eq!(code, Some(1), "{e}");
    let dropped = serde_json::from_str::<Value>(lines[0]).unwrap()["_id"].as_str().unwrap().to_string();
    assert!(e.contains(&format!("lacks 1 of the {}", lines.len())) && e.contains(p(&bm25)) && e.contains(&format!("{dropped:?}")), "{e}");
}

#[test]
fn shutdown_waits_for_a_stalled_client_only_as_long_as_the_grace_period() {
    let mut serve = Serve::start(&["--shutdown-grace-s", "1", "--request-timeout-s", "120"], &[]);
    // Headers sent, the body never finished: a request in flight that will not end by itself.
    let mut stalled = TcpStream::connect(serve.addr()).unwrap();
    write!(stalled, "POST /search HTTP/1.1\r\nHost: {}\r\nContent-Length: 100\r\n\r\n{{\"query\": ", serve.addr()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    serve.terminate();
    let status = serve.exit_within(Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(serve.log().contains("grace period passed"), "{}", serve.log());
    drop(stalled);
}

/// `host serve ARGS` expected to refuse to start: its exit code and stderr (killed, and the
/// test failed, if it is still running after `limit`).
fn refused(args: &[&str], env: &[(&str, &str)], limit: Duration) -> (Option<i32>, String) {
    let log = slice().dir.join(format!("serve-refused-{}.log", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()));
    let mut child = Command::new(host_bin())
        .arg("serve")
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RAK_PLUGIN_PATH")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("host serve {args:?} still running after {limit:?}: {}", std::fs::read_to_string(&log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), std::fs::read_to_string(&log).unwrap())
}

/// A free port on 127.0.0.1 (nothing listens on it once this returns).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The README's recipe sets the target's timeout_s = 120, above --request-timeout-s: the
/// target call is capped at the request timeout, so a call answered 504 frees its
/// --target-concurrency slot then, and the next request is served at once rather than after
/// the stalled call's own timeout.
#[test]
fn a_call_that_timed_out_frees_its_target_slot_at_the_request_timeout() {
    let target = FakeServer::start(Options {
        plan: Box::new(|prompt, _| prompt.contains("stall").then(|| Fault::Stall(Duration::from_secs(15)))),
        models: Some(vec!["fake".into()]),
        ..Options::default()
    });
    let cfg = root().join("configs/augment/chat.toml");
    let serve = Serve::start(&["--base-url", &target.url, "--config", p(&cfg), "--request-timeout-s", "2", "--target-concurrency", "1", "--k", "1"], &[]);
    assert!(serve.log().contains("capped at --request-timeout-s"), "{}", serve.log());
    let chat = |content: &str| post(&serve, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4}));
    let t = Instant::now();
    assert_error(&chat("please stall"), 504, None, "");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let t = Instant::now();
    let r = chat("Who founded the Roman Empire?");
    assert_eq!(r.status, 200, "the slot was still held by the stalled call: {}", r.body);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// A third-party connector with no timeout of its own, in front of a target that hangs: the
/// request is answered 504 at its deadline, and a request timeout later the hung call's
/// --target-concurrency slot is taken back (logged, counted), so the next request reaches the
/// target while the hung call still runs. A stream that goes quiet after its first piece is
/// cut with an error event at the request timeout, and its slot comes back the same way.
/// Before, each hung call kept its slot for good.
#[test]
fn a_hung_connector_call_loses_its_target_slot_a_request_timeout_after_its_request_gave_up() {
    let dir = TempDir::new("serve-hung");
    let recipe = std::fs::read_to_string(root().join("configs/augment/chat.toml")).unwrap();
    let settings = recipe.lines().find(|l| l.starts_with("settings = ")).unwrap();
    let recipe = recipe.replacen("name = \"openai\"", "name = \"echo\"", 1).replacen(settings, "settings = { delay_ms = 0, stall_on = \"please stall\", stall_ms = 60000 }", 1);
    let cfg = dir.path().join("echo.toml");
    std::fs::write(&cfg, recipe).unwrap();
    let plugin = echo_plugin();
    let serve = Serve::start(&["--plugin", p(&plugin), "--config", p(&cfg), "--request-timeout-s", "1", "--target-concurrency", "1", "--k", "1"], &[]);
    let chat = |content: &str, stream: bool| post(&serve, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": content}], "stream": stream}));
    let reclaimed = || get(&serve, "/metrics").body.lines().find_map(|l| l.strip_prefix("rak_upstream_slots_reclaimed_total ")?.parse::<u32>().ok());

    assert_error(&chat("please stall", false), 504, None, "");
    std::thread::sleep(Duration::from_millis(1500));
    let r = chat("Who founded the Roman Empire?", false);
    assert_eq!(r.status, 200, "the hung call still held the only slot: {}\n{}", r.body, serve.log());
    assert_eq!(r.json()["echo"]["op"], "forward", "{}", r.body);
    assert_eq!(reclaimed(), Some(1));
    assert!(serve.log().contains("its --target-concurrency slot is given back"), "{}", serve.log());

    let t = Instant::now();
    let r = chat("please stall", true);
    assert_eq!(r.status, 200, "{}", r.body);
    let (events, _) = sse_events(&r.body);
    assert_eq!(events.first().map(String::as_str), Some(r#"{"piece":1}"#), "{}", r.body);
    assert!(events.last().is_some_and(|e| e.contains("so the stream was cut")), "{}", r.body);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(1500));
    let r = chat("Who founded the Roman Empire?", false);
    assert_eq!(r.status, 200, "the quiet stream's call still held the only slot: {}\n{}", r.body, serve.log());
    assert_eq!(reclaimed(), Some(2));
}

/// A corpus that does not hold the index's passages (another collection, a shard) is refused
/// at start, naming the first missing ids and both files, rather than serving passages
/// without text.
#[test]
fn a_corpus_without_the_index_s_passages_is_refused_at_start() {
    let dir = TempDir::new("serve-corpus");
    let (idx, _) = flat_index();
    let all = std::fs::read_to_string(&slice().corpus).unwrap();
    let lines: Vec<&str> = all.lines().collect();
    let dropped: Vec<String> = lines[..3].iter().map(|l| serde_json::from_str::<Value>(l).unwrap()["_id"].as_str().unwrap().to_string()).collect();
    let partial = dir.path().join("partial.jsonl");
    std::fs::write(&partial, lines[3..].join("\n") + "\n").unwrap();
    let (code, e) = refused(&["--index", p(idx), "--encoder", "dpr", "--model", p(&minilm_dir()), "--corpus", p(&partial), "--port", "0"], &[], Duration::from_secs(120));
    assert_eq!(code, Some(1), "{e}");
    assert!(e.contains(p(&partial)) && e.contains(p(&idx.join("ids.txt"))), "both files named: {e}");
    assert!(e.contains(&format!("lacks 3 of the {}", lines.len())), "{e}");
    for id in &dropped {
        assert!(e.contains(&format!("{id:?}")), "{id} named: {e}");
    }
    assert!(!e.contains("listening"), "{e}");
}

/// A target whose address is the server's own (the recipes' base_url 127.0.0.1:8080 is
/// serve's default --port) would have every chat request forwarded to itself: refused at
/// start, before anything loads or binds.
#[test]
fn a_target_at_the_server_s_own_address_is_refused_at_start() {
    let (idx, _) = flat_index();
    let dir = TempDir::new("serve-self");
    let port = free_port().to_string();
    let recipe = dir.path().join("self.toml");
    std::fs::write(&recipe, format!("[target]\nname = \"openai\"\nsettings = {{ base_url = \"http://127.0.0.1:{port}\", model = \"\" }}\n")).unwrap();
    let model = minilm_dir();
    let base = ["--index", p(idx), "--encoder", "dpr", "--model", p(&model), "--corpus", p(&slice().corpus)];
    let localhost = format!("http://localhost:{port}/");
    let chat_toml = root().join("configs/augment/chat.toml");
    let cases: Vec<Vec<&str>> = vec![
        vec!["--config", p(&recipe), "--port", &port],
        vec!["--base-url", &localhost, "--port", &port],
        // The README's recipe with serve's default port.
        vec!["--config", p(&chat_toml)],
    ];
    for extra in cases {
        let args = [&base[..], &extra[..]].concat();
        let t = Instant::now();
        let (code, e) = refused(&args, &[], Duration::from_secs(60));
        assert_eq!(code, Some(1), "{extra:?}: {e}");
        assert!(e.contains("this server's own") && e.contains("--base-url") && e.contains("another --port"), "{extra:?}: {e}");
        assert!(t.elapsed() < Duration::from_secs(10), "refused before loading anything: {:?}", t.elapsed());
    }
}

/// Listening beyond loopback without a key is warned about at start. (The server never
/// binds here: the index does not exist, which stops it after the warning.)
#[test]
fn a_non_loopback_address_without_a_key_is_warned_about() {
    let args = ["--index", "/no/such/index", "--host", "0.0.0.0", "--port", "0", "--corpus", p(&slice().corpus)];
    let (code, e) = refused(&args, &[], Duration::from_secs(30));
    assert_eq!(code, Some(1), "{e}");
    assert!(e.contains("warning: listening on 0.0.0.0") && e.contains("--api-key-env"), "{e}");
    let (_, e) = refused(&[&args[..], &["--api-key-env", "SERVE_WARN_KEY"]].concat(), &[("SERVE_WARN_KEY", "k-123456789")], Duration::from_secs(30));
    assert!(!e.contains("warning: listening"), "{e}");
    let (_, e) = refused(&["--index", "/no/such/index", "--host", "127.0.0.1", "--port", "0"], &[], Duration::from_secs(30));
    assert!(!e.contains("warning: listening"), "{e}");
}

/// A target that streams server-sent events whose JSON spans several `data:` lines (as the
/// SSE spec allows): `GET /v1/models`, and every chat completion answered with `events`.
fn sse_target(events: &'static str) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut out = conn;
                let mut first = String::new();
                if reader.read_line(&mut first).unwrap_or(0) == 0 {
                    return;
                }
                let mut len = 0;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
                let _ = reader.read_exact(&mut vec![0u8; len]);
                if first.starts_with("GET /v1/models") {
                    let body = r#"{"object":"list","data":[{"id":"fake-sse","object":"model"}]}"#;
                    let _ = write!(out, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                } else if !first.starts_with("POST /v1/chat/completions") {
                    let _ = write!(out, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                } else {
                    let _ = write!(out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n{events}");
                }
            });
        }
    });
    url
}

/// The events of an SSE body, read as the spec says: `data:` lines joined with "\n" up to
/// the blank line; comments (`:`) apart.
fn sse_events(body: &str) -> (Vec<String>, Vec<String>) {
    let (mut events, mut comments, mut data): (Vec<String>, Vec<String>, Option<String>) = (Vec::new(), Vec::new(), None);
    for line in body.split('\n').map(|l| l.trim_end_matches('\r')) {
        if line.is_empty() {
            events.extend(data.take());
        } else if let Some(c) = line.strip_prefix(':') {
            comments.push(c.trim().to_string());
        } else if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            data = Some(match data.take() {
                Some(d) => format!("{d}\n{v}"),
                None => v.to_string(),
            });
        }
    }
    events.extend(data);
    (events, comments)
}

/// An upstream event whose JSON spans several `data:` lines reaches the client as one event
/// (its lines joined), so every event parses, with the raw SSE read by the spec and with the
/// real OpenAI Python client.
#[test]
fn a_streamed_event_spanning_several_data_lines_reaches_the_client_whole() {
    const EVENTS: &str = "data: {\"id\": \"c1\", \"object\": \"chat.completion.chunk\", \"created\": 1, \"model\": \"fake-sse\",\n\
                          data:  \"choices\": [{\"index\": 0, \"delta\": {\"role\": \"assistant\", \"content\": \"Augustus\"}, \"finish_reason\": null}]}\n\n\
                          : a comment of the target's\n\n\
                          data: {\"id\": \"c1\", \"object\": \"chat.completion.chunk\", \"created\": 1, \"model\": \"fake-sse\",\n\
                          data:  \"choices\": [{\"index\": 0,\n\
                          data:   \"delta\": {\"content\": \" founded it\"}, \"finish_reason\": \"stop\"}]}\n\n\
                          data: [DONE]\n\n";
    let target = sse_target(EVENTS);
    let serve = Serve::start(&["--base-url", &target, "--k", "1"], &[]);
    let r = post(&serve, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Who founded the Roman Empire?"}], "stream": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    let (events, comments) = sse_events(&r.body);
    assert!(comments.iter().any(|c| c.starts_with("rak-retrieval ")), "{}", r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.body);
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("an event that is not JSON ({err}): {e:?}\n{}", r.body));
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!((events.len(), text.as_str()), (3, "Augustus founded it"), "{}", r.body);

    let script = "import sys\nfrom openai import OpenAI\nc = OpenAI(base_url=sys.argv[1] + '/v1', api_key='unused', max_retries=0, timeout=60)\n\
                  s = c.chat.completions.create(model='any', messages=[{'role': 'user', 'content': 'Who founded the Roman Empire?'}], stream=True)\n\
                  print(''.join(ch.choices[0].delta.content or '' for ch in s if ch.choices))\n";
    let out = Command::new(root().join(".venv/bin/python")).args(["-c", script, &serve.url]).output().unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).trim(), "Augustus founded it");
}

/// SIGTERM with a client that sent part of a request head and stalled: the connection is
/// closed at the request timeout (the head's limit), so the drain ends then, not after the
/// whole grace period.
#[test]
fn a_partial_request_head_holds_neither_its_connection_nor_the_drain() {
    let mut serve = Serve::start(&["--shutdown-grace-s", "60", "--request-timeout-s", "2"], &[]);
    let mut stalled = TcpStream::connect(serve.addr()).unwrap();
    write!(stalled, "POST /search HTTP/1.1\r\nHost: {}\r\nContent-Len", serve.addr()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    serve.terminate();
    let status = serve.exit_within(Duration::from_secs(20));
    assert!(status.success(), "{status:?}: {}", serve.log());
    assert!(t.elapsed() < Duration::from_secs(8), "the drain waited for the stalled head: {:?}", t.elapsed());
    assert!(!serve.log().contains("grace period passed"), "{}", serve.log());
    drop(stalled);
}
