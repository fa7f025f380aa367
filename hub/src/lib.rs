//! Models by the names users type. Wherever the toolkit takes a model (`--model`,
//! `--encoder-model`, `--source`, a recipe's `[model] path`), the name resolves as
//! `transformers` resolves it:
//!
//! 1. a local folder that exists always wins; a name that can only be a path (`/`, `./`,
//!    `../`, `~`, more than one `/`, or a first component that is a local folder, as
//!    `runs/aar-typo` where `runs/` exists) and is no folder is an error at once ("no such
//!    folder"), never a Hub lookup;
//! 2. else a Hugging Face Hub id (`ORG/NAME`), or a well-known bare name ([`KNOWN`]:
//!    `flan-t5-base` is `google/flan-t5-base`), is looked up in the Hub cache
//!    (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), in the layout
//!    `huggingface_hub` writes: `models--ORG--NAME/refs/REVISION` holds the commit,
//!    `snapshots/COMMIT/FILE` the files (often links into `../../blobs/`), and
//!    `.no_exist/COMMIT/FILE` marks a file the repo does not have;
//! 3. files the loaders need that the cache lacks are downloaded from the Hub (`HF_ENDPOINT`)
//!    into that same layout, so `transformers` finds them too; offline (`HF_HUB_OFFLINE=1`, or
//!    the Hub unreachable) the error names the missing files, where they were looked for and
//!    the command that fetches them.
//!
//! Which files: what the encoders and readers in `rak_core` read ([`REQUIRED`], the weights,
//! [`OPTIONAL`], and a sentence-transformers model's pooling settings), nothing else: no
//! PyTorch `.bin`, TensorFlow or ONNX weights.
//!
//! A revision is a branch, a tag or a commit (40 hexadecimal digits, used directly as the
//! snapshot folder). A snapshot already complete in the cache is used without asking the Hub.
//! One with every file the loaders need whose optional files the cache does not all account
//! for (no `.no_exist` marks: `hf download` and transformers write none) is checked with the
//! Hub; when the Hub cannot be reached, or answers 5xx or 429, it is used as it is, with a
//! note naming the files that could not be checked (as transformers falls back to the cache).

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Component, Path, PathBuf};

/// Bare names and the Hub ids they mean (matched without regard to case): only repos whose
/// `main` has what the loaders read, `tokenizer.json` and safetensors weights (not
/// `google/t5-v1_1-*`, whose main has only `pytorch_model.bin` and `spiece.model`, nor
/// `facebook/contriever*`, `pytorch_model.bin` only).
pub const KNOWN: &[(&str, &str)] = &[
    ("flan-t5-small", "google/flan-t5-small"),
    ("flan-t5-base", "google/flan-t5-base"),
    ("flan-t5-large", "google/flan-t5-large"),
    ("flan-t5-xl", "google/flan-t5-xl"),
    ("flan-t5-xxl", "google/flan-t5-xxl"),
    ("t5-small", "google-t5/t5-small"),
    ("t5-base", "google-t5/t5-base"),
    ("t5-large", "google-t5/t5-large"),
    ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
    ("all-MiniLM-L12-v2", "sentence-transformers/all-MiniLM-L12-v2"),
    ("multi-qa-MiniLM-L6-cos-v1", "sentence-transformers/multi-qa-MiniLM-L6-cos-v1"),
    ("bert-base-uncased", "google-bert/bert-base-uncased"),
    ("bert-base-cased", "google-bert/bert-base-cased"),
    ("bert-large-uncased", "google-bert/bert-large-uncased"),
];

/// Files every model needs (besides its weights).
pub const REQUIRED: &[&str] = &["config.json", "tokenizer.json"];
/// The weights: one file, or an index of shards.
pub const WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Files the loaders read when a model has them (sentence-transformers settings, the
/// tokenizer's length limit, the toolkit's own encoder settings), or that saving a trained
/// model copies beside it. A sentence-transformers model's module configs (`1_Pooling/`)
/// come on top, as its `modules.json` lists them. These lists are `rak_core::encoders::files`'
/// (this crate does not link libtorch); `tests/hub.rs` checks that they agree.
pub const OPTIONAL: &[&str] = &[
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "spiece.model",
    "generation_config.json",
    "rak_encoder.json",
];

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where and how the Hub is reached: the environment `huggingface_hub` reads.
#[derive(Debug, Clone)]
pub struct HubEnv {
    /// The cache folder (holding `models--ORG--NAME/`).
    pub cache: PathBuf,
    /// Which setting gave `cache` (for messages).
    pub cache_from: String,
    pub endpoint: String,
    /// `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set true.
    pub offline: bool,
    pub token: Option<String>,
}

impl HubEnv {
    /// From this process's environment.
    pub fn from_env() -> Result<HubEnv> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// From `var` (a function, so tests need not change the process's environment).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<HubEnv> {
        let home = || -> Result<PathBuf> {
            let xdg = var("XDG_CACHE_HOME").map(PathBuf::from);
            let cache = match xdg {
                Some(x) => x,
                None => PathBuf::from(var("HOME").context("neither HF_HUB_CACHE, HF_HOME nor HOME is set: no Hugging Face cache folder to look in")?).join(".cache"),
            };
            Ok(cache.join("huggingface"))
        };
        let (hf_home, home_from) = match var("HF_HOME") {
            Some(h) => (Some(PathBuf::from(h)), "HF_HOME"),
            None => (None, ""),
        };
        let (cache, cache_from) = if let Some(c) = var("HF_HUB_CACHE") {
            (PathBuf::from(c), "HF_HUB_CACHE".to_string())
        } else if let Some(c) = var("HUGGINGFACE_HUB_CACHE") {
            (PathBuf::from(c), "HUGGINGFACE_HUB_CACHE".to_string())
        } else if let Some(h) = &hf_home {
            (h.join("hub"), format!("{home_from}/hub"))
        } else {
            (home()?.join("hub"), "the default, ~/.cache/huggingface/hub".to_string())
        };
        let truthy = |name: &str| var(name).is_some_and(|v| ["1", "ON", "YES", "TRUE"].contains(&v.trim().to_uppercase().as_str()));
        let offline = truthy("HF_HUB_OFFLINE") || truthy("TRANSFORMERS_OFFLINE");
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into()).trim_end_matches('/').to_string();
        let token = var("HF_TOKEN").or_else(|| {
            let path = var("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| hf_home.clone().or_else(|| home().ok()).map(|h| h.join("token")))?;
            std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        });
        Ok(HubEnv { cache, cache_from, endpoint, offline, token })
    }

    /// The cache folder of repo `id`.
    pub fn repo_folder(&self, id: &str) -> PathBuf {
        self.cache.join(format!("models--{}", id.replace('/', "--")))
    }
}

/// What a model name is, before anything is fetched.
#[derive(Debug, Clone, PartialEq)]
pub enum Name {
    /// A folder that exists.
    Local(PathBuf),
    /// A Hub repo: `id` as typed, or the id a known bare name means (`alias` then holds the
    /// bare name, whose own cache folder, `models--NAME`, older versions of `transformers`
    /// wrote, is looked in too).
    Hub { id: String, alias: Option<String> },
    /// Neither: why not.
    NotAModel(String),
}

/// What `name` is: a local folder, a Hub id, a known bare name, or none of them.
pub fn classify(name: &Path) -> Name {
    if name.is_dir() {
        return Name::Local(name.to_path_buf());
    }
    let Some(text) = name.to_str() else { return Name::NotAModel(format!("{}: no such folder", name.display())) };
    if let Some(why) = looks_like_path(text) {
        return Name::NotAModel(format!("{text}: no such folder{why}"));
    }
    if text.contains('/') {
        return match check_repo_id(text) {
            Ok(()) => Name::Hub { id: text.to_string(), alias: None },
            Err(e) => Name::NotAModel(format!("{text}: no such folder, nor a Hugging Face Hub id ({e})")),
        };
    }
    if let Some((bare, id)) = KNOWN.iter().find(|(bare, _)| bare.eq_ignore_ascii_case(text)) {
        return Name::Hub { id: id.to_string(), alias: Some(bare.to_string()) };
    }
    Name::NotAModel(unknown_bare(text))
}

fn unknown_bare(text: &str) -> String {
    let known: Vec<&str> = KNOWN.iter().map(|(b, _)| *b).collect();
    format!(
        "{text:?} is no folder (relative to {}), no Hugging Face Hub id (ORG/NAME) and no model name this toolkit knows (known: {}); give a checkpoint folder or the model's Hub id",
        current_dir(),
        known.join(", ")
    )
}

/// The current folder, for messages about relative names.
fn current_dir() -> String {
    std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| "the current folder".into())
}

/// For an error saying Hub model `typed` is missing: that no folder of that name exists either
/// (the user may have meant one).
fn no_folder_either(typed: &str) -> String {
    format!("\n  nor is there a folder {typed} (relative to {})", current_dir())
}

/// Whether `name` can only be a path, and if not plainly so, why (appended to "no such
/// folder"): absolute, `./`, `../`, `~`, or with an empty, `.` or `..` component, or more
/// than one `/`, or a first component that is a local folder (`runs/aar-typo` where `runs/`
/// exists: a mistyped path, not a Hub id).
fn looks_like_path(text: &str) -> Option<String> {
    if text.starts_with('/') || text.starts_with('.') || text.starts_with('~') || text.ends_with('/') || text.matches('/').count() > 1 || text.contains('\\') {
        return Some(String::new());
    }
    let (first, _) = text.split_once('/')?;
    Path::new(first).is_dir().then(|| format!(" (taken as a path, not a Hugging Face Hub id: {first}/ is a folder in {})", current_dir()))
}

/// The Hub's rules for a repo id, as far as they keep a cache path and a URL sound.
pub fn check_repo_id(id: &str) -> Result<()> {
    let parts: Vec<&str> = id.split('/').collect();
    if parts.len() > 2 {
        bail!("a Hub id is ORG/NAME");
    }
    if id.len() > 96 {
        bail!("longer than 96 characters");
    }
    for p in &parts {
        if p.is_empty() || !p.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
            bail!("{p:?}: letters, digits, '.', '_' and '-' only");
        }
        if p.starts_with(['.', '-']) || p.ends_with(['.', '-']) || p.contains("--") || p.contains("..") {
            bail!("{p:?}: no leading or trailing '.' or '-', no \"--\" or \"..\"");
        }
    }
    Ok(())
}

/// A revision (branch, tag or commit) becomes a path under `refs/`: its components must stay
/// inside.
fn check_revision(rev: &str) -> Result<()> {
    if rev.is_empty() || rev.split('/').any(|c| c.is_empty() || c == "." || c == "..") || rev.contains('\\') || rev.contains('\0') {
        bail!("revision {rev:?}: not a branch, tag or commit name");
    }
    Ok(())
}

fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

/// A model as resolved: the folder to load, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub path: PathBuf,
    pub hub: Option<HubModel>,
}

/// A model found in (or fetched into) the Hub cache.
#[derive(Debug, Clone, PartialEq)]
pub struct HubModel {
    pub id: String,
    /// The revision asked for (`main` by default).
    pub revision: String,
    pub commit: String,
    /// Files this resolution downloaded (empty: all were in the cache).
    pub downloaded: Vec<String>,
    /// Things the user should know (printed by the callers).
    pub notes: Vec<String>,
}

impl Resolved {
    /// A line for logs: the path, and for a Hub model its id and commit.
    pub fn describe(&self) -> String {
        match &self.hub {
            None => self.path.display().to_string(),
            Some(h) => {
                let got = if h.downloaded.is_empty() { "from the Hugging Face cache".to_string() } else { format!("downloaded {} files into the Hugging Face cache", h.downloaded.len()) };
                format!("{} at {} (revision {}), {got}: {}", h.id, h.commit, h.revision, self.path.display())
            }
        }
    }

    /// The record kept with a run: path, and for a Hub model id, revision and commit.
    pub fn record(&self) -> Value {
        match &self.hub {
            None => json!({"path": self.path}),
            Some(h) => json!({"path": self.path, "hub_id": h.id, "revision": h.revision, "commit": h.commit}),
        }
    }
}

/// Resolve `name` (with `revision`, a Hub model's branch, tag or commit; default `main`) with
/// the environment's settings; notes go to stderr, prefixed by `who`.
pub fn resolve(name: &Path, revision: Option<&str>, who: &str) -> Result<Resolved> {
    if revision.is_none() && name.is_dir() {
        // A folder needs no Hub settings (a process without HOME still loads it).
        return Ok(Resolved { path: name.to_path_buf(), hub: None });
    }
    let r = resolve_in(name, revision, &HubEnv::from_env()?)?;
    if let Some(h) = &r.hub {
        for note in &h.notes {
            eprintln!("{who}: note: {note}");
        }
    }
    Ok(r)
}

/// [`resolve`] with explicit settings.
pub fn resolve_in(name: &Path, revision: Option<&str>, env: &HubEnv) -> Result<Resolved> {
    match classify(name) {
        Name::Local(path) => {
            if let Some(rev) = revision {
                bail!("revision {rev:?} is for a Hugging Face Hub model; {} is a local folder", path.display());
            }
            Ok(Resolved { path, hub: None })
        }
        Name::NotAModel(why) => {
            // A name the cache holds is a model: a bare one (`gpt2`, as older transformers wrote
            // it), or `org/name` beside a local folder `org/` (taken as a path above).
            if let Some(text) = name.to_str().filter(|t| check_repo_id(t).is_ok()) {
                if env.repo_folder(text).is_dir() {
                    return resolve_hub(text, None, text, revision, env);
                }
            }
            bail!("{why}")
        }
        Name::Hub { id, alias } => resolve_hub(&id, alias.as_deref(), &name.to_string_lossy(), revision, env),
    }
}

/// Whether `name` names a model at all (a folder, a Hub id, a known bare name, or a bare name
/// the cache holds), without fetching anything: what `--source` tells from a connector's name.
/// `env` may be missing (no HOME): the cache is then not looked in.
pub fn names_a_model(name: &Path, env: Option<&HubEnv>) -> bool {
    match classify(name) {
        Name::Local(_) | Name::Hub { .. } => true,
        Name::NotAModel(_) => {
            env.is_some_and(|env| name.to_str().is_some_and(|t| check_repo_id(t).is_ok() && env.repo_folder(t).is_dir()))
        }
    }
}

/// Where a file stands in a cached snapshot.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Have {
    Yes,
    /// Marked absent from the repo at this commit (`.no_exist/COMMIT/FILE`).
    Absent,
    Unknown,
}

fn have(repo: &Path, commit: &str, file: &str) -> Have {
    if repo.join("snapshots").join(commit).join(file).is_file() {
        Have::Yes
    } else if repo.join(".no_exist").join(commit).join(file).exists() {
        Have::Absent
    } else {
        Have::Unknown
    }
}

/// A file name a repo's JSON gave (a shard, a module folder): relative, inside the repo.
fn safe_relative(name: &str) -> bool {
    let p = Path::new(name);
    !name.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))
}

/// The shards a `model.safetensors.index.json` lists.
fn shards(index: &Path) -> Result<Vec<String>> {
    let v = read_json(index)?;
    let map = v["weight_map"].as_object().with_context(|| format!("{}: no \"weight_map\" object", index.display()))?;
    let mut out: Vec<String> = map.values().filter_map(Value::as_str).map(String::from).collect();
    out.sort();
    out.dedup();
    if let Some(bad) = out.iter().find(|s| !safe_relative(s)) {
        bail!("{}: shard {bad:?} is not a file inside the model", index.display());
    }
    Ok(out)
}

/// The config files of the Pooling modules a `modules.json` lists (`1_Pooling/config.json`).
fn module_configs(modules: &Path) -> Result<Vec<String>> {
    let v = read_json(modules)?;
    let mut out = Vec::new();
    for m in v.as_array().into_iter().flatten() {
        let class = m["type"].as_str().unwrap_or_default().rsplit('.').next().unwrap_or_default();
        if class == "Pooling" {
            let path = m["path"].as_str().unwrap_or("1_Pooling");
            if !safe_relative(path) {
                bail!("{}: module path {path:?} is not a folder inside the model", modules.display());
            }
            out.push(format!("{path}/config.json"));
        }
    }
    Ok(out)
}

/// What a cached snapshot lacks: files needed and missing, and optional files whose presence
/// in the repo is unknown.
#[derive(Debug, Default)]
struct Gaps {
    missing: Vec<String>,
    unknown: Vec<String>,
}

fn gaps(repo: &Path, commit: &str) -> Result<Gaps> {
    let snap = repo.join("snapshots").join(commit);
    let mut g = Gaps::default();
    for f in REQUIRED {
        if have(repo, commit, f) != Have::Yes {
            g.missing.push(f.to_string());
        }
    }
    match (have(repo, commit, WEIGHTS), have(repo, commit, WEIGHTS_INDEX)) {
        (Have::Yes, _) => {}
        (_, Have::Yes) => {
            for s in shards(&snap.join(WEIGHTS_INDEX))? {
                if have(repo, commit, &s) != Have::Yes {
                    g.missing.push(s);
                }
            }
        }
        _ => g.missing.push(WEIGHTS.to_string()),
    }
    for f in OPTIONAL {
        if have(repo, commit, f) == Have::Unknown {
            g.unknown.push(f.to_string());
        }
    }
    if have(repo, commit, "modules.json") == Have::Yes {
        for f in module_configs(&snap.join("modules.json"))? {
            match have(repo, commit, &f) {
                Have::Yes => {}
                Have::Absent => bail!("{}: modules.json lists {f}, which the repo lacks", snap.display()),
                Have::Unknown => g.missing.push(f),
            }
        }
    }
    Ok(g)
}

/// The commit `revision` names in the cache, if it does.
fn cached_commit(repo: &Path, revision: &str) -> Option<String> {
    if is_commit(revision) {
        return Some(revision.to_string());
    }
    let c = std::fs::read_to_string(repo.join("refs").join(revision)).ok()?;
    let c = c.trim();
    is_commit(c).then(|| c.to_string())
}

/// Hub model `id` (`alias`: the bare name it was known by; `typed`: the name as given, for
/// messages).
fn resolve_hub(id: &str, alias: Option<&str>, typed: &str, revision: Option<&str>, env: &HubEnv) -> Result<Resolved> {
    let revision = revision.unwrap_or("main");
    check_revision(revision)?;
    // The cache folders to look in: the id's, then (a bare name) the one older versions wrote.
    let mut folders = vec![(id.to_string(), env.repo_folder(id))];
    if let Some(a) = alias {
        folders.push((a.to_string(), env.repo_folder(a)));
    }
    let mut looked = Vec::new();
    let mut first_gaps: Option<(String, Gaps)> = None;
    // A snapshot with every file the loaders need, whose optional files the cache does not
    // all account for (`hf download` and transformers write no `.no_exist` marks): asked about
    // online, and used as it is when the Hub cannot answer, as transformers falls back to it.
    let mut usable: Option<(String, String, PathBuf, Vec<String>)> = None;
    for (name, folder) in &folders {
        match cached_commit(folder, revision) {
            Some(commit) if folder.join("snapshots").join(&commit).is_dir() => {
                let g = gaps(folder, &commit)?;
                let snap = folder.join("snapshots").join(&commit);
                if g.missing.is_empty() && (g.unknown.is_empty() || env.offline) {
                    let notes = modules_note(&g.unknown, &snap, name, revision, "offline, not asked").into_iter().collect();
                    let hub = HubModel { id: name.clone(), revision: revision.to_string(), commit, downloaded: Vec::new(), notes };
                    return Ok(Resolved { path: snap, hub: Some(hub) });
                }
                if g.missing.is_empty() && usable.is_none() {
                    usable = Some((name.clone(), commit.clone(), snap.clone(), g.unknown.clone()));
                }
                looked.push(format!("{} (missing: {})", snap.display(), g.missing.join(", ")));
                if first_gaps.is_none() {
                    first_gaps = Some((commit.clone(), g));
                }
            }
            Some(commit) => looked.push(format!("{} (no such snapshot)", folder.join("snapshots").join(commit).display())),
            None if folder.is_dir() => looked.push(format!("{} (no refs/{revision}: this revision was never fetched)", folder.display())),
            None => looked.push(format!("{} (not there)", folder.display())),
        }
    }
    let missing_line = match &first_gaps {
        Some((_, g)) if !g.missing.is_empty() => g.missing.join(", "),
        Some((_, g)) => format!("nothing needed; unknown whether the repo has {}", g.unknown.join(", ")),
        None => format!("the whole model ({}, {WEIGHTS} or its shards, and the settings files it has)", REQUIRED.join(", ")),
    };
    let cache_line = format!("the Hugging Face cache {} ({})", env.cache.display(), env.cache_from);
    if env.offline {
        bail!(
            "model {id} (revision {revision}) is not complete in {cache_line}, and HF_HUB_OFFLINE forbids downloading it\n  looked in: {}\n  missing: {missing_line}\n  fetch it with: {}{}",
            looked.join("; "),
            fetch_command(id, revision),
            no_folder_either(typed)
        );
    }
    let fetched = download(id, typed, revision, env);
    if let (Err(Fetch::Unreachable(why) | Fetch::Unavailable(_, why)), Some((name, commit, snap, unknown))) = (&fetched, usable) {
        let mut notes = vec![format!(
            "the Hub at {} cannot be reached ({why}): using the cached snapshot {} as it is; whether {name} has {} could not be checked",
            env.endpoint,
            snap.display(),
            unknown.join(", ")
        )];
        notes.extend(modules_note(&unknown, &snap, &name, revision, "the Hub could not be asked"));
        let hub = HubModel { id: name, revision: revision.to_string(), commit, downloaded: Vec::new(), notes };
        return Ok(Resolved { path: snap, hub: Some(hub) });
    }
    fetched.map_err(|e| match e {
        Fetch::Unreachable(why) => anyhow!(
            "model {id} (revision {revision}) is not complete in {cache_line}, and the Hub at {} cannot be reached ({why})\n  looked in: {}\n  missing: {missing_line}\n  fetch it with: {}{}",
            env.endpoint,
            looked.join("; "),
            fetch_command(id, revision),
            no_folder_either(typed)
        ),
        Fetch::Unavailable(e, _) | Fetch::Other(e) => e,
    })
}

/// The note for a snapshot without `modules.json` whose repo may have one (`unknown` lists
/// the optional files the cache does not account for; `why` says why the Hub was not asked).
fn modules_note(unknown: &[String], snap: &Path, name: &str, revision: &str, why: &str) -> Option<String> {
    (unknown.iter().any(|f| f == "modules.json") && !is_t5(snap)).then(|| {
        format!(
            "{} has no modules.json, and the cache does not say whether {name} has one ({why}): a sentence-transformers model's pooling is in it; if {name} is one, fetch it with `{}`",
            snap.display(),
            fetch_command(name, revision)
        )
    })
}

fn is_t5(snapshot: &Path) -> bool {
    read_json(&snapshot.join("config.json")).is_ok_and(|c| c["model_type"].as_str().is_some_and(|t| t.contains("t5")))
}

/// The command that fetches what the toolkit reads of `id` into the cache (huggingface_hub's
/// CLI, honouring the same environment variables).
pub fn fetch_command(id: &str, revision: &str) -> String {
    format!("hf download {id} --revision {revision} --include '*.json' '*.safetensors' '*.txt' '*.model'")
}

enum Fetch {
    /// The Hub could not be reached at all (no network, a wrong HF_ENDPOINT).
    Unreachable(String),
    /// The Hub answered that it cannot serve now (5xx, 429): the error, and the short reason.
    Unavailable(anyhow::Error, String),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for Fetch {
    fn from(e: anyhow::Error) -> Self {
        Fetch::Other(e)
    }
}

/// Whether a request failed before any answer came (connection, DNS, TLS).
fn transport_error(e: &hf_hub::api::sync::ApiError) -> Option<String> {
    match e {
        hf_hub::api::sync::ApiError::RequestError(r) => match r.as_ref() {
            t @ ureq::Error::Transport(_) => Some(t.to_string()),
            ureq::Error::Status(..) => None,
        },
        _ => None,
    }
}

/// The HTTP status of a request the Hub refused.
fn status_of(e: &hf_hub::api::sync::ApiError) -> Option<u16> {
    match e {
        hf_hub::api::sync::ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    }
}

/// Ask the Hub for `id` (`typed` as given) at `revision` and download what the cache lacks.
fn download(id: &str, typed: &str, revision: &str, env: &HubEnv) -> std::result::Result<Resolved, Fetch> {
    use hf_hub::{api::sync::ApiBuilder, Cache, Repo, RepoType};
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let api = ApiBuilder::from_cache(Cache::new(env.cache.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(show_progress)
        .build()
        .map_err(|e| Fetch::Other(anyhow!("cannot set up the Hub client: {e}")))?;
    let info = api.repo(Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string())).info().map_err(|e| {
        if let Some(why) = transport_error(&e) {
            return Fetch::Unreachable(why);
        }
        if let Some(code @ (429 | 500..=599)) = status_of(&e) {
            return Fetch::Unavailable(anyhow!("{id} (revision {revision}): the Hub at {} answered: {e}", env.endpoint), format!("it answered HTTP {code}"));
        }
        Fetch::Other(match status_of(&e) {
            // The Hub may answer 401 for a repo that does not exist too (asked without a token).
            Some(401 | 403) => anyhow!(
                "{id} (revision {revision}) at {}: access refused ({e}); a gated or private model needs HF_TOKEN (or `hf auth login`), and the Hub may answer so for a model that does not exist{}",
                env.endpoint,
                no_folder_either(typed)
            ),
            Some(404) => anyhow!("{id} (revision {revision}): no such model or revision at {} (a private model also answers so without HF_TOKEN){}", env.endpoint, no_folder_either(typed)),
            _ => anyhow!("{id} (revision {revision}): the Hub at {} answered: {e}", env.endpoint),
        })
    })?;
    let commit = info.sha.trim().to_string();
    if !is_commit(&commit) {
        return Err(Fetch::Other(anyhow!("{id} (revision {revision}): the Hub at {} named commit {commit:?}, which is no commit hash", env.endpoint)));
    }
    let files: std::collections::HashSet<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let folder = env.repo_folder(id);
    let snap = folder.join("snapshots").join(&commit);
    // The files are fetched by commit, so a branch moving meanwhile cannot mix two snapshots;
    // hf-hub then writes `refs/COMMIT`, which huggingface_hub does not: removed below.
    let commit_ref = folder.join("refs").join(&commit);
    let commit_ref_was_there = commit_ref.exists();
    let at_commit = api.repo(Repo::with_revision(id.to_string(), RepoType::Model, commit.clone()));
    let mut downloaded = Vec::new();
    let mut get = |file: &str| -> std::result::Result<(), Fetch> {
        if snap.join(file).is_file() {
            return Ok(());
        }
        // Another process downloading the same file holds its lock (hf-hub gives up after
        // 5 s): wait for it (a lock dies with its process), or take over once it is free.
        let started = std::time::Instant::now();
        loop {
            match at_commit.download(file) {
                Ok(_) => break,
                Err(hf_hub::api::sync::ApiError::LockAcquisition(_)) if started.elapsed() < std::time::Duration::from_secs(4 * 3600) => {
                    if snap.join(file).is_file() {
                        return Ok(());
                    }
                }
                Err(e) => {
                    let failed = anyhow!("{id} at {commit}: cannot download {file} from {}: {e}", env.endpoint);
                    return Err(match (transport_error(&e), status_of(&e)) {
                        (Some(why), _) => Fetch::Unreachable(why),
                        (None, Some(code @ (429 | 500..=599))) => Fetch::Unavailable(failed, format!("it answered HTTP {code} for {file}")),
                        _ => Fetch::Other(failed),
                    });
                }
            }
        }
        downloaded.push(file.to_string());
        Ok(())
    };
    let mut wanted: Vec<String> = Vec::new();
    for f in REQUIRED {
        if !files.contains(*f) {
            return Err(Fetch::Other(anyhow!("{id} (revision {revision}, commit {commit}) has no {f}, which the toolkit needs (its loaders read {} and {WEIGHTS})", REQUIRED.join(", "))));
        }
        wanted.push(f.to_string());
    }
    if files.contains(WEIGHTS) {
        wanted.push(WEIGHTS.into());
    } else if files.contains(WEIGHTS_INDEX) {
        get(WEIGHTS_INDEX)?;
        wanted.extend(shards(&snap.join(WEIGHTS_INDEX))?);
    } else {
        let other: Vec<&String> = files.iter().filter(|f| f.ends_with(".bin") || f.ends_with(".h5") || f.ends_with(".msgpack") || f.ends_with(".pt")).collect();
        return Err(Fetch::Other(anyhow!(
            "{id} (revision {revision}, commit {commit}) has no {WEIGHTS} (nor {WEIGHTS_INDEX}); the toolkit reads safetensors weights only{}",
            if other.is_empty() { String::new() } else { format!(" (the repo has {}; a revision with safetensors, such as the conversion bot's refs/pr/N, may exist)", other.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")) }
        )));
    }
    let mut absent = Vec::new();
    for f in OPTIONAL {
        if files.contains(*f) {
            wanted.push(f.to_string());
        } else {
            absent.push(f.to_string());
        }
    }
    if files.contains("modules.json") {
        get("modules.json")?;
        for f in module_configs(&snap.join("modules.json"))? {
            if !files.contains(&f) {
                return Err(Fetch::Other(anyhow!("{id} at {commit}: modules.json lists {f}, which the repo lacks")));
            }
            wanted.push(f);
        }
    }
    for f in &wanted {
        get(f)?;
    }
    // As huggingface_hub does: the branch or tag's commit, and what the repo lacks at it.
    let write = |path: &Path, text: &str| -> Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("{}: cannot create", parent.display()))?;
        }
        let tmp = path.with_file_name(format!(".{}.tmp-{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("ref"), std::process::id()));
        std::fs::write(&tmp, text).with_context(|| format!("{}: cannot write", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot write", path.display()))
    };
    if revision != commit {
        write(&folder.join("refs").join(revision), &commit)?;
        if !commit_ref_was_there {
            let _ = std::fs::remove_file(&commit_ref);
        }
    }
    for f in &absent {
        let mark = folder.join(".no_exist").join(&commit).join(f);
        if !mark.exists() {
            write(&mark, "")?;
        }
    }
    let g = gaps(&folder, &commit)?;
    if !g.missing.is_empty() {
        return Err(Fetch::Other(anyhow!("{id} at {commit}: still missing after the download: {}", g.missing.join(", "))));
    }
    Ok(Resolved { path: snap, hub: Some(HubModel { id: id.to_string(), revision: revision.to_string(), commit, downloaded, notes: Vec::new() }) })
}

#[cfg(test)]
mod tests;
