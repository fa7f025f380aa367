//! Models by Hugging Face Hub id (`rak_hub`), end to end through `host`: a Hub cache laid out
//! exactly as huggingface_hub lays it out (blobs, snapshots of relative links into them, refs
//! for a branch and a tag, a second commit), built here from the real all-MiniLM-L6-v2 files;
//! a download from a local server that answers as the Hub's file endpoints do (`HF_ENDPOINT`),
//! landing in that layout; the offline error; and `host aar-train --source` taking a model's
//! name as a white-box source and refusing what cannot resolve before any work.

use rak_e2e::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REPO: &str = "sentence-transformers/all-MiniLM-L6-v2";
const MAIN: &str = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf";
const CLS: &str = "1111111111111111111111111111111111111111";

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The files of the local MiniLM checkpoint, by path relative to it.
fn minilm_files() -> Vec<String> {
    let root = minilm_dir();
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let path = e.path();
            let rel = path.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
            if rel.starts_with('.') {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

fn sha256(path: &Path) -> String {
    rak_retrieval::digest::file_digest(path).unwrap()
}

/// `bytes` as blob `name` of `repo` (a hard link to `from` when given and possible: the blob
/// is then the real file, as the Hub's), and `snapshots/commit/rel` a relative link to it.
fn put(repo: &Path, commit: &str, rel: &str, from: Option<&Path>, bytes: Option<&[u8]>) {
    let blobs = repo.join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob_name = match (from, bytes) {
        (Some(f), _) => sha256(f),
        (None, Some(b)) => {
            let tmp = repo.join(".tmp-blob");
            std::fs::write(&tmp, b).unwrap();
            let name = sha256(&tmp);
            std::fs::remove_file(tmp).unwrap();
            name
        }
        _ => unreachable!(),
    };
    let blob = blobs.join(&blob_name);
    if !blob.exists() {
        match (from, bytes) {
            (Some(f), _) => {
                if std::fs::hard_link(f, &blob).is_err() {
                    std::fs::copy(f, &blob).unwrap();
                }
            }
            (None, Some(b)) => std::fs::write(&blob, b).unwrap(),
            _ => unreachable!(),
        }
    }
    let link = repo.join("snapshots").join(commit).join(rel);
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    let up = "../".repeat(rel.matches('/').count() + 2);
    std::os::unix::fs::symlink(format!("{up}blobs/{blob_name}"), &link).unwrap();
}

/// A Hub cache holding MiniLM as huggingface_hub would: commit MAIN (the real files) named by
/// `refs/main` and the tag `refs/v1.0`, and commit CLS (the same but CLS pooling), named by no
/// ref (only by its hash).
fn hub_cache(dir: &Path) -> PathBuf {
    let cache = dir.join("hub");
    let repo = cache.join("models--sentence-transformers--all-MiniLM-L6-v2");
    for rel in minilm_files() {
        let f = minilm_dir().join(&rel);
        put(&repo, MAIN, &rel, Some(&f), None);
        if rel == "1_Pooling/config.json" {
            let mut cfg: Value = serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap();
            cfg["pooling_mode_cls_token"] = json!(true);
            cfg["pooling_mode_mean_tokens"] = json!(false);
            put(&repo, CLS, &rel, None, Some(cfg.to_string().as_bytes()));
        } else {
            put(&repo, CLS, &rel, Some(&f), None);
        }
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), MAIN).unwrap();
    std::fs::write(repo.join("refs/v1.0"), MAIN).unwrap();
    cache
}

fn passages(dir: &Path) -> PathBuf {
    let f = dir.join("passages.jsonl");
    let lines = [
        json!({"_id": "a", "title": "Paris", "text": "Paris is the capital and largest city of France."}),
        json!({"_id": "b", "title": "", "text": "The mitochondrion is the powerhouse of the cell."}),
        json!({"_id": "c", "title": "Rust", "text": "Rust is a systems programming language focused on safety."}),
    ];
    std::fs::write(&f, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    f
}

/// `host encode` of the passages with `model`, in an environment that knows no Hub but `env`.
fn encode(dir: &Path, model: &str, out: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    encode_cmd(dir, model, out, extra, env).output().unwrap()
}

/// The [`encode`] command, to run elsewhere than in the tests' folder.
fn encode_cmd(dir: &Path, model: &str, out: &str, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(host_bin());
    c.args(["encode", "--encoder", "dpr", "--model", model, "--input", p(&passages(dir)), "--output", p(&dir.join(format!("out-{out}"))), "--batch-size", "4"])
        .args(extra)
        .env_remove("RAK_PLUGIN_PATH");
    for v in ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"] {
        c.env_remove(v);
    }
    // No real Hub from a test, whatever the environment: a port nothing listens on.
    c.env("HF_ENDPOINT", "http://127.0.0.1:9");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn embeddings(dir: &Path, out: &str) -> Vec<u8> {
    std::fs::read(dir.join(format!("out-{out}")).join("embeddings.npy")).unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "host failed:\n{}", stderr(o));
}

#[test]
fn a_hub_id_from_the_cache_gives_the_local_folder_s_embeddings_by_branch_tag_and_commit() {
    let dir = TempDir::new("hub-cache");
    let cache = hub_cache(dir.path());
    let env = [("HF_HUB_CACHE", p(&cache)), ("HF_HUB_OFFLINE", "1")];
    ok(&encode(dir.path(), p(&minilm_dir()), "local", &[], &[]));
    let local = embeddings(dir.path(), "local");

    let o = encode(dir.path(), REPO, "hub", &[], &env);
    ok(&o);
    assert_eq!(embeddings(dir.path(), "hub"), local, "byte-identical to the local folder's");
    let said = stderr(&o);
    assert!(said.contains(REPO) && said.contains(MAIN), "the model's id and commit are named: {said}");
    // The bare name means the same repo.
    ok(&encode(dir.path(), "all-MiniLM-L6-v2", "bare", &[], &env));
    assert_eq!(embeddings(dir.path(), "bare"), local);
    // A tag, and a commit given by hash (a snapshot no ref names, with CLS pooling).
    ok(&encode(dir.path(), REPO, "tag", &["--revision", "v1.0"], &env));
    assert_eq!(embeddings(dir.path(), "tag"), local);
    ok(&encode(dir.path(), REPO, "commit", &["--revision", CLS], &env));
    ok(&encode(dir.path(), p(&minilm_dir()), "local-cls", &["--encoder-settings", "{\"pooling\": \"cls\"}"], &[]));
    assert_ne!(embeddings(dir.path(), "commit"), local);
    assert_eq!(embeddings(dir.path(), "commit"), embeddings(dir.path(), "local-cls"), "the commit's own snapshot");
    // A local folder always wins over the cache, and takes no revision.
    let o = encode(dir.path(), p(&minilm_dir()), "never", &["--revision", "main"], &env);
    assert!(!o.status.success() && stderr(&o).contains("is a local folder"), "{}", stderr(&o));
}

#[test]
fn offline_with_files_missing_the_error_names_them_where_it_looked_and_the_fetch_command() {
    let dir = TempDir::new("hub-offline");
    let cache = hub_cache(dir.path());
    let snapshot = cache.join("models--sentence-transformers--all-MiniLM-L6-v2/snapshots").join(MAIN);
    std::fs::remove_file(snapshot.join("model.safetensors")).unwrap();
    std::fs::remove_file(snapshot.join("1_Pooling/config.json")).unwrap();
    let t = Instant::now();
    let o = encode(dir.path(), REPO, "out", &[], &[("HF_HUB_CACHE", p(&cache)), ("HF_HUB_OFFLINE", "1")]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("HF_HUB_OFFLINE") && e.contains("missing: model.safetensors, 1_Pooling/config.json"), "{e}");
    assert!(e.contains(p(&snapshot)), "where it looked: {e}");
    assert!(e.contains(&format!("hf download {REPO} --revision main")), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    // Not offline, but the Hub cannot be reached: the same, with the reason.
    let o = encode(dir.path(), "google/flan-t5-base", "out", &[], &[("HF_HUB_CACHE", p(&cache))]);
    let e = stderr(&o);
    assert!(e.contains("cannot be reached") && e.contains("hf download google/flan-t5-base --revision main"), "{e}");
    // A bare name nobody knows: what was tried.
    let o = encode(dir.path(), "no-such-model-name", "out", &[], &[("HF_HUB_CACHE", p(&cache))]);
    let e = stderr(&o);
    assert!(e.contains("no Hugging Face Hub id") && e.contains("known: ") && e.contains("flan-t5-base"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(20), "fails fast");
    assert!(!dir.path().join("out-out").exists(), "nothing written");
}

/// A mistyped local path (`runs/aar-typo` where `runs/` exists) is no Hub id: "no such
/// folder" at once, offline or online, and the Hub is never asked; a Hub id from the same
/// folder still resolves; a Hub id neither cached nor a folder says there is no such folder
/// either.
#[test]
fn a_mistyped_local_path_is_no_such_folder_and_never_a_hub_lookup() {
    let dir = TempDir::new("hub-typo");
    let cwd = dir.path().join("work");
    std::fs::create_dir_all(cwd.join("runs/aar-real")).unwrap();
    let cache = hub_cache(dir.path());
    let hub = FakeHub::start(REPO, MAIN, HashMap::new(), Vec::new());
    let endpoint = hub.endpoint();
    let offline = [("HF_HUB_CACHE", p(&cache)), ("HF_HUB_OFFLINE", "1")];
    let online = [("HF_HUB_CACHE", p(&cache)), ("HF_ENDPOINT", endpoint.as_str())];
    for env in [&offline[..], &online[..]] {
        let t = Instant::now();
        let o = encode_cmd(dir.path(), "runs/aar-typo", "typo", &[], env).current_dir(&cwd).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("runs/aar-typo: no such folder"), "{e}");
        assert!(!e.contains("Hugging Face cache") && !e.contains("hf download") && !e.contains("panicked"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }
    assert_eq!(hub.requested(), Vec::<String>::new(), "the Hub was asked");
    // From the same folder (no `sentence-transformers/` in it) a Hub id is still one.
    ok(&encode_cmd(dir.path(), REPO, "hub", &[], &offline).current_dir(&cwd).output().unwrap());
    ok(&encode(dir.path(), p(&minilm_dir()), "local", &[], &[]));
    assert_eq!(embeddings(dir.path(), "hub"), embeddings(dir.path(), "local"));
    // A Hub id that is neither cached nor a folder: the error says both.
    for env in [&offline[..], &online[..]] {
        let o = encode_cmd(dir.path(), "org/typo", "none", &[], env).current_dir(&cwd).output().unwrap();
        let e = stderr(&o);
        assert!(!o.status.success() && e.contains("org/typo") && e.contains(&format!("nor is there a folder org/typo (relative to {})", cwd.display())), "{e}");
    }
}

/// A recipe's `[model] revision` is for its `[model] path` only: `host train --model` takes
/// the command line's `--revision` or none (a folder is not refused for the recipe's
/// revision, another Hub id is not taken at the recipe's commit); without `--model`, the
/// recipe's path is taken at the recipe's revision. (The runs stop at the missing corpus,
/// after the model was resolved.)
#[test]
fn host_train_applies_the_recipe_s_revision_to_the_recipe_s_model_only() {
    let dir = TempDir::new("hub-train-revision");
    let cache = hub_cache(dir.path());
    let recipe = dir.path().join("train.toml");
    let write = |path: &str| {
        std::fs::write(
            &recipe,
            format!(
                "[model]\nencoder = \"dpr\"\npath = \"{path}\"\nrevision = \"{CLS}\"\n\n[data]\ncorpus = \"{}\"\ntask_dir = \"{}\"\ntasks = [\"squad\"]\n\n[train]\noptim = \"adamw\"\nmax_steps = 1\n",
                dir.path().join("no-such-corpus.jsonl").display(),
                dir.path().join("tasks").display()
            ),
        )
        .unwrap()
    };
    let train = |extra: &[&str], out: &str| {
        let mut c = Command::new(host_bin());
        c.args(["train", "--config", p(&recipe), "--output-dir", p(&dir.path().join(out))])
            .args(extra)
            .env_remove("RAK_PLUGIN_PATH")
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_ENDPOINT", "http://127.0.0.1:9");
        let o = c.output().unwrap();
        assert!(!o.status.success(), "the corpus is missing");
        stderr(&o)
    };
    write("org/pinned");
    // A folder on the command line.
    let e = train(&["--model", p(&minilm_dir())], "folder");
    assert!(!e.contains("is a local folder"), "{e}");
    assert!(e.contains("no-such-corpus.jsonl"), "it went on to the data: {e}");
    assert!(e.contains("revision") && e.contains("left out"), "a note says the recipe's revision was left out: {e}");
    // Another Hub id on the command line: its main, not the recipe's commit.
    let e = train(&["--model", REPO], "hub");
    assert!(e.contains(&format!("{REPO} at {MAIN} (revision main)")), "{e}");
    assert!(!e.contains(&format!("at {CLS}")), "{e}");
    // ... or the command line's own revision.
    let e = train(&["--model", REPO, "--revision", "v1.0"], "hub-tag");
    assert!(e.contains(&format!("{REPO} at {MAIN} (revision v1.0)")), "{e}");
    // The recipe's own model: at the recipe's revision.
    write(REPO);
    let e = train(&[], "recipe");
    assert!(e.contains(&format!("{REPO} at {CLS} (revision {CLS})")), "{e}");
    assert!(!e.contains("left out"), "{e}");
}

/// A server answering as the Hub's file endpoints do, over `files` (repo path → bytes) at one
/// commit: `GET /api/models/REPO/revision/REV` (the commit and the file list), and
/// `GET /REPO/resolve/REV/FILE` with `Range` (206, `Content-Range`), `X-Repo-Commit`, `ETag`
/// (`X-Linked-Etag` for large files, as the Hub's LFS files). Every request path is logged.
struct FakeHub {
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl FakeHub {
    fn start(repo: &'static str, commit: &'static str, files: HashMap<String, Vec<u8>>, listed_only: Vec<String>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let files = Arc::new(files);
        let (log2, listed) = (log.clone(), Arc::new(listed_only));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (files, log, listed) = (files.clone(), log2.clone(), listed.clone());
                std::thread::spawn(move || serve(conn, repo, commit, &files, &listed, &log));
            }
        });
        FakeHub { port, log }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requested(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

fn serve(conn: TcpStream, repo: &str, commit: &str, files: &HashMap<String, Vec<u8>>, listed: &[String], log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_lowercase(), v.trim().to_string());
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    log.lock().unwrap().push(path.clone());
    let mut out = conn;
    let reply = |out: &mut TcpStream, status: &str, extra: &[(String, String)], body: &[u8]| {
        let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(body);
    };
    let not_found = |out: &mut TcpStream| reply(out, "404 Not Found", &[("X-Error-Code".into(), "EntryNotFound".into())], b"{\"error\": \"Entry not found\"}");
    if let Some(rev) = path.strip_prefix(&format!("/api/models/{repo}/revision/")) {
        if rev != "main" && rev != commit {
            return reply(&mut out, "404 Not Found", &[], b"{\"error\": \"Revision Not Found\"}");
        }
        let mut names: Vec<&String> = files.keys().chain(listed.iter()).collect();
        names.sort();
        let body = json!({"id": repo, "sha": commit, "siblings": names.iter().map(|n| json!({"rfilename": n})).collect::<Vec<_>>()});
        return reply(&mut out, "200 OK", &[("Content-Type".into(), "application/json".into())], body.to_string().as_bytes());
    }
    let Some(rest) = path.strip_prefix(&format!("/{repo}/resolve/")) else { return not_found(&mut out) };
    let Some((rev, file)) = rest.split_once('/') else { return not_found(&mut out) };
    if rev != commit && rev != "main" {
        return not_found(&mut out);
    }
    let Some(bytes) = files.get(file) else { return not_found(&mut out) };
    let tmp = std::env::temp_dir().join(format!("fake-hub-{}-{}", std::process::id(), file.replace('/', "_")));
    std::fs::write(&tmp, bytes).unwrap();
    let etag = sha256(&tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut extra = vec![("X-Repo-Commit".to_string(), commit.to_string()), ("ETag".to_string(), format!("\"{etag}\""))];
    if bytes.len() > 1_000_000 {
        extra.push(("X-Linked-Etag".into(), format!("\"{etag}\"")));
        extra.push(("X-Linked-Size".into(), bytes.len().to_string()));
    }
    let size = bytes.len();
    let (start, end) = match headers.get("range").and_then(|r| r.strip_prefix("bytes=")).and_then(|r| r.split_once('-')) {
        Some((a, b)) => (a.parse::<usize>().unwrap_or(0), b.parse::<usize>().map(|b| b.min(size - 1)).unwrap_or(size - 1)),
        None => {
            return reply(&mut out, "200 OK", &extra, bytes);
        }
    };
    extra.push(("Content-Range".into(), format!("bytes {start}-{end}/{size}")));
    reply(&mut out, "206 Partial Content", &extra, &bytes[start..=end]);
    let _ = reader.read(&mut [0u8; 0]);
}

#[test]
fn a_model_missing_from_the_cache_is_downloaded_from_hf_endpoint_into_the_cache_layout() {
    let dir = TempDir::new("hub-download");
    let files: HashMap<String, Vec<u8>> = minilm_files().into_iter().map(|rel| (rel.clone(), std::fs::read(minilm_dir().join(&rel)).unwrap())).collect();
    // Listed but never served: weights and files the toolkit does not read must not be asked for.
    let hub = FakeHub::start(REPO, MAIN, files, vec!["pytorch_model.bin".into(), "onnx/model.onnx".into()]);
    let cache = dir.path().join("hub");
    let endpoint = hub.endpoint();
    let env = [("HF_HUB_CACHE", p(&cache)), ("HF_ENDPOINT", endpoint.as_str())];
    ok(&encode(dir.path(), p(&minilm_dir()), "local", &[], &[]));
    let o = encode(dir.path(), REPO, "hub", &[], &env);
    ok(&o);
    assert_eq!(embeddings(dir.path(), "hub"), embeddings(dir.path(), "local"), "byte-identical to the local folder's");
    assert!(stderr(&o).contains("downloaded"), "{}", stderr(&o));

    // The layout huggingface_hub writes: refs/main, snapshot links into blobs named by etag,
    // `.no_exist` marks for what the repo lacks.
    let repo = cache.join("models--sentence-transformers--all-MiniLM-L6-v2");
    assert_eq!(std::fs::read_to_string(repo.join("refs/main")).unwrap(), MAIN);
    assert!(!repo.join("refs").join(MAIN).exists(), "no ref named by the commit");
    let snapshot = repo.join("snapshots").join(MAIN);
    for rel in ["config.json", "tokenizer.json", "model.safetensors", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json"] {
        let link = std::fs::read_link(snapshot.join(rel)).unwrap_or_else(|e| panic!("{rel}: not a link ({e})"));
        let blob = snapshot.join(rel).parent().unwrap().join(&link);
        assert!(link.is_relative() && link.to_str().unwrap().contains("blobs/"), "{rel} -> {}", link.display());
        assert_eq!(std::fs::read(&blob).unwrap(), std::fs::read(minilm_dir().join(rel)).unwrap(), "{rel}");
        assert_eq!(blob.file_name().unwrap().to_str().unwrap(), sha256(&minilm_dir().join(rel)), "{rel}: blob named by its etag");
    }
    for absent in ["spiece.model", "generation_config.json"] {
        assert!(repo.join(".no_exist").join(MAIN).join(absent).exists(), "{absent} marked absent");
    }
    let asked = hub.requested();
    assert!(asked.iter().all(|a| !a.contains("pytorch_model.bin") && !a.contains("onnx") && !a.contains("README")), "{asked:?}");
    assert!(!snapshot.join("README.md").exists());

    // Now complete: resolved from the cache without asking the Hub, offline too.
    let before = hub.requested().len();
    ok(&encode(dir.path(), REPO, "again", &[], &env));
    assert_eq!(hub.requested().len(), before, "the Hub asked again: {:?}", &hub.requested()[before..]);
    ok(&encode(dir.path(), REPO, "offline", &[], &[("HF_HUB_CACHE", p(&cache)), ("HF_HUB_OFFLINE", "1")]));
    assert_eq!(embeddings(dir.path(), "offline"), embeddings(dir.path(), "local"));
    // A revision the Hub does not have: its answer, named.
    let o = encode(dir.path(), REPO, "never", &["--revision", "no-such-branch"], &env);
    assert!(!o.status.success() && stderr(&o).contains("no such model or revision"), "{}", stderr(&o));
}

/// The mission's line: `--source flan-t5-base` offline fails in seconds with the resolver's
/// error, before any work (no stages written); a model's name (a T5 checkpoint folder, or a
/// Hub id in the cache) is a white-box source even under a recipe whose source is black-box,
/// and an unknown name or a missing plugin is refused before any work.
#[test]
fn aar_train_takes_a_model_source_as_white_box_and_checks_everything_before_any_work() {
    let dir = TempDir::new("hub-aar");
    let t5 = root().join("tests/fixtures/t5/t5-v1_1");
    let recipe = dir.path().join("aar.toml");
    let write_recipe = |corpus: &Path| {
        std::fs::write(
            &recipe,
            format!(
                "[source]\nkind = \"black-box\"\nconnector = \"openai\"\nsettings = {{ base_url = \"http://127.0.0.1:9\", model = \"\" }}\ntemplate = \"{{title}} {{passage}} Q: {{question}} A:\"\nworkers = 2\n\n\
                 [data]\ncorpus = \"{}\"\ntask_dir = \"{}\"\ntask = \"squad\"\n\n[train]\nmax_steps = 1\n\n[model]\nencoder = \"dpr\"\n",
                corpus.display(),
                dir.path().join("tasks").display()
            ),
        )
        .unwrap()
    };
    write_recipe(&dir.path().join("no-such-corpus.jsonl"));
    let cache = dir.path().join("hub");
    let run = |source: &str, out: &str, env: &[(&str, &str)]| {
        let mut c = Command::new(host_bin());
        c.args(["aar-train", "--source", source, "--encoder", "dpr", "--model", p(&minilm_dir()), "--config", p(&recipe), "--output-dir", p(&dir.path().join(out))])
            .env_remove("RAK_PLUGIN_PATH")
            .env("HF_HUB_CACHE", &cache)
            .env("HF_ENDPOINT", "http://127.0.0.1:9")
            .env_remove("HF_HUB_OFFLINE");
        for (k, v) in env {
            c.env(k, v);
        }
        let t = Instant::now();
        let o = c.output().unwrap();
        assert!(t.elapsed() < Duration::from_secs(30), "{source}: took {:?}", t.elapsed());
        o
    };
    // Offline, and with the Hub unreachable: the resolver's error, nothing written.
    for env in [&[("HF_HUB_OFFLINE", "1")][..], &[]] {
        let o = run("flan-t5-base", "offline", env);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("google/flan-t5-base") && e.contains("hf download google/flan-t5-base --revision main") && e.contains("--source"), "{e}");
        assert!(!e.contains("no connector plugin"), "{e}");
        assert!(!dir.path().join("offline").exists(), "no work before the check");
    }
    // A name that is neither a connector nor a model; a missing encoder plugin.
    let o = run("openia", "typo", &[]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("no connector plugin of that name (the host has: openai)") && e.contains("no model name this toolkit knows"), "{e}");
    assert!(!dir.path().join("typo").exists());

    // A T5 checkpoint folder under this black-box recipe: white-box (the recipe's black-box
    // settings left out, with a notice). The missing corpus then stops it, after the source
    // was taken.
    let o = run(p(&t5), "folder", &[]);
    let e = stderr(&o);
    assert!(e.contains(&format!("source white-box fid:{}", t5.display())), "{e}");
    assert!(e.contains("is a white-box source") && e.contains("left out") && e.contains("source.template"), "{e}");
    assert!(e.contains("no-such-corpus.jsonl"), "{e}");
    // The same checkpoint as google/flan-t5-base in the Hub cache, by its bare name, offline.
    let repo = cache.join("models--google--flan-t5-base");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        put(&repo, MAIN, f, Some(&t5.join(f)), None);
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), MAIN).unwrap();
    let snapshot = repo.join("snapshots").join(MAIN);
    let o = run("flan-t5-base", "cached", &[("HF_HUB_OFFLINE", "1")]);
    let e = stderr(&o);
    assert!(e.contains(&format!("source white-box fid:{}", snapshot.display())), "{e}");
    assert!(e.contains(&format!("google/flan-t5-base at {MAIN}")), "{e}");
}

/// What the Hub download fetches is what the encoders read and save (`rak-hub` keeps its own
/// copy of the list, since it does not link libtorch).
#[test]
fn the_hub_fetches_the_files_the_encoders_read() {
    use rak_core::encoders::files;
    assert_eq!(rak_hub::REQUIRED, files::REQUIRED);
    assert_eq!(rak_hub::WEIGHTS, files::WEIGHTS);
    let mut hub: Vec<&str> = rak_hub::OPTIONAL.to_vec();
    let mut core = files::optional();
    hub.sort_unstable();
    core.sort_unstable();
    assert_eq!(hub, core);
}

/// A snapshot as `hf download` leaves it (every file the loaders read, no `.no_exist` marks
/// for the optional files the repo lacks): with the Hub unreachable, or answering 503 or 429,
/// `host encode` uses it as transformers does, with a one-line note naming what could not be
/// checked; the embeddings are the local folder's.
#[test]
fn a_complete_cached_snapshot_is_used_when_the_hub_cannot_be_reached() {
    let dir = TempDir::new("hub-fallback");
    let cache = hub_cache(dir.path());
    assert!(!cache.join("models--sentence-transformers--all-MiniLM-L6-v2/.no_exist").exists());
    ok(&encode(dir.path(), p(&minilm_dir()), "local", &[], &[]));
    let local = embeddings(dir.path(), "local");
    let down = |status: &'static str| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = conn.read(&mut [0u8; 4096]);
                let _ = write!(conn, "HTTP/1.1 {status}\r\nContent-Length: 2\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{{}}");
            }
        });
        url
    };
    for (i, endpoint) in ["http://127.0.0.1:1".to_string(), down("503 Service Unavailable"), down("429 Too Many Requests")].into_iter().enumerate() {
        let t = Instant::now();
        let out = format!("fallback-{i}");
        let o = encode(dir.path(), REPO, &out, &[], &[("HF_HUB_CACHE", p(&cache)), ("HF_ENDPOINT", endpoint.as_str())]);
        ok(&o);
        assert!(t.elapsed() < Duration::from_secs(30), "{endpoint}: {:?}", t.elapsed());
        assert_eq!(embeddings(dir.path(), &out), local, "{endpoint}");
        let e = stderr(&o);
        let note = e.lines().find(|l| l.contains("could not be checked")).unwrap_or_else(|| panic!("{endpoint}: no note: {e}"));
        assert!(note.contains(&endpoint) && note.contains("spiece.model") && note.contains("generation_config.json") && note.contains("rak_encoder.json"), "{note}");
    }
}
