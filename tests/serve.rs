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
    fn start(extra: &[&str], env: &[(&str, &str)]) -> Serve {
        let (idx, _) = flat_index();
        let log = slice().dir.join(format!("serve-{}.log", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()));
        let model = minilm_dir();
        let mut args = vec!["serve", "--index", p(idx), "--encoder", "dpr", "--model", p(&model), "--corpus", p(&slice().corpus), "--port", "0"];
        args.extend_from_slice(extra);
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
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
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
        assert_eq!(got.len(), 10);
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
        &["--base-url", &target.url, "--api-key-env", "SERVE_TEST_KEY", "--max-body-bytes", "20000", "--request-timeout-s", "2", "--k", "2"],
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
    assert_eq!(request(serve.addr(), "GET", "/metrics", &[("Authorization", &auth)], b"").status, 200);

    // Malformed requests: 400, OpenAI's error shape, the field named.
    assert_error(&call("/v1/embeddings", b"{not json"), 400, None, "not valid JSON");
    assert_error(&call("/v1/embeddings", b"[1, 2]"), 400, None, "JSON object");
    assert_error(&call("/v1/embeddings", br#"{"model": "all-MiniLM-L6-v2"}"#), 400, Some("input"), "needs `input`");
    assert_error(&call("/v1/embeddings", br#"{"input": [[101, 2054]]}"#), 400, Some("input"), "check_embedding_ctx_length=False");
    assert_error(&call("/v1/embeddings", br#"{"input": "x", "encoding_format": "int8"}"#), 400, Some("encoding_format"), "int8");
    assert_error(&call("/v1/embeddings", br#"{"input": "x", "model": "text-embedding-3-small"}"#), 404, Some("model"), "not served");
    assert_error(&call("/search", br#"{"query": "x", "k": 1000}"#), 400, Some("k"), "--max-k");
    assert_error(&call("/v1/chat/completions", br#"{"messages": "hi"}"#), 400, Some("messages"), "messages");
    assert_error(&call("/v1/chat/completions", br#"{"messages": [{"role": "user", "content": "x"}], "retrieval": {"k": "two"}}"#), 400, Some("retrieval.k"), "integer");
    // Oversized: 413, the limit named.
    let big = json!({"input": "word ".repeat(10_000)}).to_string();
    assert_error(&call("/v1/embeddings", big.as_bytes()), 413, None, "20000 bytes");

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
    let pid = serve.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let r = in_flight.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"].as_array().unwrap().len(), 600);
    eprintln!("the request SIGTERM met took {:?}", sent.elapsed());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = serve.child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "host serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}: {}", serve.log());
    assert!(TcpStream::connect(&addr).is_err(), "still listening after SIGTERM");
    assert!(serve.log().contains("\"event\":\"shutdown\""));
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
