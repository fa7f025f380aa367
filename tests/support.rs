//! Helpers shared by the end-to-end tests: where things are, how to run `host`, and how to
//! build the out-of-tree plugin.

#[path = "fake_openai.rs"]
pub mod fake_openai;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `target/release`, where `cargo build --release --workspace` puts `host` and the plugins.
pub fn release_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    dir.join("release")
}

/// The `host` binary; the tests need the workspace built first.
pub fn host_bin() -> PathBuf {
    let bin = release_dir().join("host");
    assert!(bin.exists(), "{} missing: run `cargo build --release --workspace` before the tests", bin.display());
    bin
}

/// A built-in plugin's file, e.g. `plugin_file("rak_optim_adamw")`.
pub fn plugin_file(lib: &str) -> PathBuf {
    let f = release_dir().join(format!("lib{lib}.so"));
    assert!(f.exists(), "{} missing: run `cargo build --release --workspace` before the tests", f.display());
    f
}

/// Run `host` with `args`, with no plugin path from the environment.
pub fn host(args: &[&str]) -> Output {
    Command::new(host_bin()).args(args).env_remove("RAK_PLUGIN_PATH").output().expect("run host")
}


pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The target dir for plugins the tests build out of tree (kept between runs). Their `.so`
/// files must not land in `target/release`, where `host` looks for plugins by itself.
pub fn plugin_target_dir() -> PathBuf {
    root().join("target").join("plugin-tests")
}

/// A `cargo build` of out-of-tree plugins: final files in `plugin_target_dir()`, intermediate
/// ones in the workspace's own build folder, so that the dependencies the workspace build
/// compiled (tch, torch-sys, tokenizers, ...) are reused rather than compiled a second time
/// (minutes on 2 cores). The third-party lockfile pins the same versions as the workspace's.
/// (`CARGO_BUILD_BUILD_DIR` needs cargo 1.91 or later; an older one ignores it and compiles
/// the dependencies again, slower but the same.)
pub fn plugin_build(manifest: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.args(["build", "--release", "--quiet", "--manifest-path"]).arg(manifest);
    let build_dir = std::env::var_os("CARGO_BUILD_BUILD_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| release_dir().parent().unwrap().to_path_buf());
    c.env("CARGO_TARGET_DIR", plugin_target_dir()).env("CARGO_BUILD_BUILD_DIR", build_dir);
    c
}

/// Build the out-of-tree plugin workspace `tests/third-party/` in release mode, once per test
/// process; returns its release folder.
fn third_party_release_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let manifest = root().join("tests/third-party/Cargo.toml");
            let status = plugin_build(&manifest).arg("--workspace").status().expect("run cargo");
            assert!(status.success(), "building {} failed", manifest.display());
            plugin_target_dir().join("release")
        })
        .clone()
}

fn third_party(lib_name: &str) -> PathBuf {
    let f = third_party_release_dir().join(format!("lib{lib_name}.so"));
    assert!(f.exists(), "{} missing after the build", f.display());
    f
}

/// The out-of-tree `hashbow` encoder plugin.
pub fn hashbow_plugin() -> PathBuf {
    third_party("hashbow_encoder")
}

/// The out-of-tree `minipipe` command plugin (the pipeline through the host's services).
pub fn minipipe_plugin() -> PathBuf {
    third_party("minipipe_command")
}

/// The out-of-tree `echo` connector plugin (replies with the request; a concurrency probe).
pub fn echo_plugin() -> PathBuf {
    third_party("echo_connector")
}

/// The out-of-tree `faulty` encoder plugin (misbehaves on request).
pub fn faulty_plugin() -> PathBuf {
    third_party("faulty_encoder")
}

/// A fresh temporary directory under `target/`, removed at drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = root().join("target").join("e2e-tmp").join(format!("{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The vendored mini-KILT benchmark.
pub fn minikilt() -> PathBuf {
    root().join("data/minikilt")
}

/// The real all-MiniLM-L6-v2 checkpoint (fetched by scripts/test.sh).
pub fn minilm_dir() -> PathBuf {
    let d = root().join(".cache/models/all-MiniLM-L6-v2");
    assert!(d.join("model.safetensors").exists(), "{} missing: run scripts/test.sh", d.display());
    d
}

/// A small real slice of mini-KILT: 40 squad dev queries, their gold passages and 260 others.
pub struct Slice {
    pub dir: PathBuf,
    pub corpus: PathBuf,
    pub queries: PathBuf,
    pub qrels: PathBuf,
}

pub fn slice() -> &'static Slice {
    static S: OnceLock<Slice> = OnceLock::new();
    S.get_or_init(|| {
        let dir = root().join("target").join(format!("e2e-slice-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let task = minikilt().join("tasks/squad");
        let queries: Vec<String> = std::fs::read_to_string(task.join("queries.dev.jsonl")).unwrap().lines().step_by(50).take(40).map(String::from).collect();
        let qids: Vec<String> = queries.iter().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["_id"].as_str().unwrap().to_string()).collect();
        let qrels_text = std::fs::read_to_string(task.join("qrels.dev.tsv")).unwrap();
        let mut qrels = vec!["query-id\tcorpus-id\tscore".to_string()];
        let mut gold = std::collections::HashSet::new();
        for line in qrels_text.lines().skip(1) {
            let cols: Vec<&str> = line.split('\t').collect();
            if qids.iter().any(|q| q == cols[0]) {
                gold.insert(cols[1].to_string());
                qrels.push(line.to_string());
            }
        }
        let corpus: Vec<String> = std::fs::read_to_string(minikilt().join("corpus.jsonl"))
            .unwrap()
            .lines()
            .enumerate()
            .filter(|(i, l)| i % 50 == 0 || gold.contains(serde_json::from_str::<serde_json::Value>(l).unwrap()["_id"].as_str().unwrap()))
            .map(|(_, l)| l.to_string())
            .collect();
        let s = Slice { corpus: dir.join("corpus.jsonl"), queries: dir.join("queries.jsonl"), qrels: dir.join("qrels.tsv"), dir };
        std::fs::write(&s.corpus, corpus.join("\n") + "\n").unwrap();
        std::fs::write(&s.queries, queries.join("\n") + "\n").unwrap();
        std::fs::write(&s.qrels, qrels.join("\n") + "\n").unwrap();
        s
    })
}

/// Training data in mini-KILT's layout under `dir`: each `(task, source, skip, take)` is a task
/// of `take` train queries of mini-KILT's `source` task (after skipping `skip`), with their
/// qrels; the corpus holds their gold passages and every 40th other passage. Returns the
/// recipe (`dpr`, `max_length = 64`) with `train` as its `[train]` section.
pub fn task_data(dir: &Path, tasks: &[(&str, &str, usize, usize)], train: &str) -> PathBuf {
    use std::collections::HashSet;
    let mut gold = HashSet::new();
    for (task, source, skip, take) in tasks {
        let src = minikilt().join("tasks").join(source);
        let dst = dir.join("tasks").join(task);
        std::fs::create_dir_all(&dst).unwrap();
        let lines: Vec<String> = std::fs::read_to_string(src.join("queries.train.jsonl")).unwrap().lines().skip(*skip).take(*take).map(String::from).collect();
        let ids: HashSet<String> =
            lines.iter().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["_id"].as_str().unwrap().to_string()).collect();
        std::fs::write(dst.join("queries.train.jsonl"), lines.join("\n") + "\n").unwrap();
        let mut qrels = vec!["query-id\tcorpus-id\tscore".to_string()];
        for line in std::fs::read_to_string(src.join("qrels.train.tsv")).unwrap().lines().skip(1) {
            let cols: Vec<&str> = line.split('\t').collect();
            if ids.contains(cols[0]) {
                gold.insert(cols[1].to_string());
                qrels.push(line.to_string());
            }
        }
        std::fs::write(dst.join("qrels.train.tsv"), qrels.join("\n") + "\n").unwrap();
    }
    let corpus: Vec<String> = std::fs::read_to_string(minikilt().join("corpus.jsonl"))
        .unwrap()
        .lines()
        .enumerate()
        .filter(|(i, l)| i % 40 == 0 || gold.contains(serde_json::from_str::<serde_json::Value>(l).unwrap()["_id"].as_str().unwrap()))
        .map(|(_, l)| l.to_string())
        .collect();
    std::fs::write(dir.join("corpus.jsonl"), corpus.join("\n") + "\n").unwrap();
    let names: Vec<String> = tasks.iter().map(|(t, ..)| format!("\"{t}\"")).collect();
    let recipe = dir.join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            "[model]\nencoder = \"dpr\"\nsettings = {{ max_length = 64 }}\n\n[data]\ncorpus = \"{}\"\ntask_dir = \"{}\"\ntasks = [{}]\n\n[train]\n{train}\n",
            dir.join("corpus.jsonl").display(),
            dir.join("tasks").display(),
            names.join(", ")
        ),
    )
    .unwrap();
    recipe
}

/// Two tasks of `queries` train queries each (squad, fever); see [`task_data`].
pub fn small_task_data(dir: &Path, queries: usize, train: &str) -> PathBuf {
    task_data(dir, &[("squad", "squad", 0, queries), ("fever", "fever", 0, queries)], train)
}

/// A llama-server of a test's own (`scripts/llama-server.sh start` with its own state folder,
/// named `state`, and `env`), stopped at drop.
pub struct LlamaServer {
    pub url: String,
    state: TempDir,
}

impl LlamaServer {
    pub fn start(state: &str, env: &[(&str, &str)]) -> Self {
        let state = TempDir::new(state);
        let out = Command::new(root().join("scripts/llama-server.sh")).arg("start").env("LLAMA_STATE_DIR", state.path()).envs(env.iter().copied()).output().unwrap();
        assert!(out.status.success(), "llama-server did not start: {}", stderr(&out));
        let url = stdout(&out).trim().to_string();
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        LlamaServer { url, state }
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/llama-server.sh")).arg("stop").env("LLAMA_STATE_DIR", self.state.path()).output();
    }
}

/// Keyed dropout through the plugin ABI (`encode_keyed`): each text's training embedding
/// depends on its key alone: the same encoded alone, in the whole batch, or in the batch
/// reversed (keys following their texts), within `tol`; and dropout is on (the same text under
/// another key, or in eval mode, comes out otherwise).
pub fn check_keyed_dropout(enc: &mut dyn rak_core::plugin::Encoder, texts: &[String], role: rak_core::abi::Role, task: Option<&str>, tol: f64) {
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let keys: Vec<u64> = (0..texts.len() as u64).map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1)).collect();
    let together = enc.encode_keyed(&refs, role, task, &keys).unwrap().detach();
    let (rev_texts, rev_keys): (Vec<&str>, Vec<u64>) = refs.iter().copied().zip(keys.iter().copied()).rev().unzip();
    let backwards = enc.encode_keyed(&rev_texts, role, task, &rev_keys).unwrap().detach();
    let eval = enc.encode(&refs, role, task, false).unwrap();
    let n = texts.len() as i64;
    let diff = |a: &tch::Tensor, b: &tch::Tensor| (a - b).abs().max().double_value(&[]);
    for i in 0..n {
        let alone = enc.encode_keyed(&refs[i as usize..=i as usize], role, task, &keys[i as usize..=i as usize]).unwrap().detach().get(0);
        let d = diff(&together.get(i), &alone).max(diff(&backwards.get(n - 1 - i), &alone));
        assert!(d < tol, "text {i}: keyed embedding in a batch vs alone differs by {d}");
        assert!(diff(&alone, &eval.get(i)) > 10.0 * tol, "text {i}: dropout made no difference");
        let other_key = enc.encode_keyed(&refs[i as usize..=i as usize], role, task, &[keys[i as usize] ^ 1]).unwrap().detach().get(0);
        assert!(diff(&alone, &other_key) > 10.0 * tol, "text {i}: another key drew the same masks");
    }
}

/// Tokenising ahead through the plugin ABI (`prepare`): `ahead` (made with `tokenize_ahead:
/// true`) encodes prepared batches, in training passes with keyed dropout and in eval, exactly
/// as `inline` (the same model, `tokenize_ahead: false`) does, including a batch prepared
/// under another task and encoded under this one.
pub fn check_tokenized_ahead(ahead: &mut dyn rak_core::plugin::Encoder, inline: &mut dyn rak_core::plugin::Encoder, texts: &[String], task: &str) {
    use rak_core::abi::Role;
    let passages: Vec<&str> = texts.iter().map(String::as_str).collect();
    let queries: Vec<&str> = texts.iter().map(|t| &t[..t.floor_char_boundary(40)]).collect();
    let keys: Vec<u64> = (1..=texts.len() as u64).map(|k| k * 0x9e37_79b9).collect();
    ahead.prepare(&queries, Role::Query, Some(task)).unwrap();
    ahead.prepare(&passages, Role::Passage, None).unwrap();
    ahead.prepare(&queries, Role::Query, Some("another task")).unwrap();
    let q = ahead.encode_keyed(&queries, Role::Query, Some(task), &keys).unwrap();
    let p = ahead.encode_keyed(&passages, Role::Passage, None, &keys).unwrap();
    let e = ahead.encode(&passages, Role::Passage, None, false).unwrap();
    assert!(q.equal(&inline.encode_keyed(&queries, Role::Query, Some(task), &keys).unwrap()), "queries prepared ahead");
    assert!(p.equal(&inline.encode_keyed(&passages, Role::Passage, None, &keys).unwrap()), "passages prepared ahead");
    assert!(e.equal(&inline.encode(&passages, Role::Passage, None, false).unwrap()), "passages not prepared again");
}
