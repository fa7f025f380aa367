//! `host serve`: a retriever (and optionally a target LM) behind an OpenAI-compatible HTTP
//! server. This module turns flags and an augment recipe into what `rak_serve` serves: the
//! encoder and connector from plugins, the open index, the corpus and the passage layout.

use super::encode::{encoder_settings, ModelArgs};
use crate::augment::config::{AugmentConfig, PassageConfig};
use crate::augment::prompt::Template;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_retrieval::data::{beir, Passage};
use rak_retrieval::index::{self, Index};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Index directory (from `host index build`: flat, hnsw, bm25 or milvus).
    #[arg(long)]
    pub index: PathBuf,
    /// Encoder plugin for a dense index and /v1/embeddings.
    #[arg(long)]
    pub encoder: Option<String>,
    /// The encoder's model (a folder, or a Hugging Face id).
    #[arg(long)]
    pub model: Option<String>,
    #[command(flatten)]
    pub model_args: ModelArgs,
    /// Passages JSONL ({"_id","title","text"}) the index was built from (default: the
    /// recipe's [retrieval] corpus).
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// Connector plugin of the target LM behind /v1/chat/completions and /v1/completions
    /// (default: the recipe's [target] name, when --base-url or a recipe is given).
    #[arg(long)]
    pub target: Option<String>,
    /// The target's server root (overrides the recipe's target.settings.base_url).
    #[arg(long)]
    pub base_url: Option<String>,
    /// The target's model (default: the one its server serves).
    #[arg(long)]
    pub target_model: Option<String>,
    /// An augment recipe (configs/augment/*.toml): its [target] settings, [retrieval] corpus,
    /// k and task, and [passages] layout.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on. Any but a loopback one (0.0.0.0, a LAN address) without
    /// --api-key-env is warned about: anyone who can reach it can use the server.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Environment variable holding the API key every route but /health and / then requires
    /// (`Authorization: Bearer KEY`).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Another host name requests may be addressed to (repeatable): the name a reverse proxy
    /// passes in `Host`, or the site whose pages call this server (`Origin`). Without it, a
    /// server on a loopback address answers only requests for localhost or its address, and
    /// browsers only from its own page.
    #[arg(long)]
    pub allowed_host: Vec<String>,
    /// Passages retrieved per request when it does not say (default: the recipe's k, else 3).
    #[arg(long)]
    pub k: Option<usize>,
    /// The most passages one request may ask for.
    #[arg(long, default_value_t = 100)]
    pub max_k: usize,
    /// The task queries are encoded for when a request names none (default: the recipe's).
    #[arg(long)]
    pub task: Option<String>,
    /// Task names the page offers (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub tasks: Vec<String>,
    /// The name the embedding model is served under (default: the model folder's name, or
    /// the Hub id as given).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body, in bytes (larger: 413).
    #[arg(long, default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request may take, from its first byte (a stream: until its first piece, then
    /// between pieces); past it: 504 (a stream is cut). Also the longest the request's head may
    /// take to arrive, and a call to an openai target's timeout at most (its `timeout_s` is
    /// capped at it, so a call that timed out here does not hold its --target-concurrency slot
    /// past it); any other connector's call still running this long after its request gave
    /// up loses its slot (logged, and counted in /metrics).
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_s: f64,
    /// After SIGTERM, seconds the requests in flight may still take before the server exits
    /// anyway (a second SIGTERM exits at once).
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace_s: f64,
    /// Requests waiting for the encoder at most (beyond: 429 with Retry-After).
    #[arg(long, default_value_t = 512)]
    pub queue_size: usize,
    /// Tokens the encoder takes in one round, over all the requests batched together.
    #[arg(long, default_value_t = 16384)]
    pub max_batch_tokens: usize,
    /// Milliseconds a round waits for more requests (0: takes what is queued).
    #[arg(long, default_value_t = 0)]
    pub batch_wait_ms: u64,
    /// Texts in one /v1/embeddings or /search request at most.
    #[arg(long, default_value_t = 2048)]
    pub max_inputs: usize,
    /// Requests to the target at once (more wait their turn).
    #[arg(long, default_value_t = 16)]
    pub target_concurrency: usize,
    /// HNSW candidate list size at search time (a Milvus IVF_FLAT index: clusters searched).
    #[arg(long)]
    pub ef_search: Option<usize>,
}

pub fn run(registry: &Registry, args: &ServeArgs) -> Result<()> {
    // Every argument is checked before anything slow (the index, the corpus, the model) loads.
    let cfg = args.config.as_ref().map(|p| AugmentConfig::read(p)).transpose()?;
    for (flag, v) in [("--request-timeout-s", args.request_timeout_s), ("--shutdown-grace-s", args.shutdown_grace_s)] {
        if !(v.is_finite() && (0.0..=1e6).contains(&v)) || (flag == "--request-timeout-s" && v == 0.0) {
            bail!("{flag} must be a number of seconds (positive for --request-timeout-s), not {v}");
        }
    }
    if args.target_concurrency == 0 {
        bail!("--target-concurrency must be at least 1");
    }
    let api_key = match &args.api_key_env {
        Some(var) => match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Some(k.trim().to_string()),
            _ => bail!("--api-key-env names {var}, which is not set (or empty) in the environment"),
        },
        None => None,
    };
    let corpus_path = args
        .corpus
        .clone()
        .or_else(|| cfg.as_ref().and_then(|c| c.retrieval.corpus.clone()))
        .context("no corpus: give --corpus (the passages JSONL the index was built from) or a recipe with [retrieval] corpus")?;
    let k = args.k.or(cfg.as_ref().and_then(|c| c.retrieval.k)).unwrap_or(3);
    if k > args.max_k {
        bail!("--k {k} is more than --max-k {}", args.max_k);
    }
    let task = args.task.clone().or_else(|| cfg.as_ref().and_then(|c| c.retrieval.task.clone()));
    let passages = cfg.as_ref().map(|c| &c.passages);
    let format_passages = passage_layout(passages.unwrap_or(&PassageConfig::default()))?;
    let target_name = match (&args.target, &cfg, &args.base_url) {
        (Some(t), _, _) => Some(t.clone()),
        (None, Some(c), _) => c.target.name.clone(),
        (None, None, Some(_)) => Some("openai".to_string()),
        (None, None, None) => None,
    };
    if let Some(name) = &target_name {
        match registry.kind_of(name) {
            Some("connector") => {}
            Some(other) => bail!("--target {name}: a {other} plugin; host serve's target is a connector (an LM behind HTTP)"),
            None => bail!("--target {name}: no plugin of that name (see `host plugins list`)"),
        }
        // A target at this server's own address would have every chat request forwarded to
        // itself, again and again (the recipes' base_url, 127.0.0.1:8080, is serve's default).
        let recipe_url = cfg.as_ref().map(|c| c.target_settings()).transpose()?.and_then(|t| t["base_url"].as_str().map(str::to_string));
        let (url, from) = match (&args.base_url, recipe_url) {
            (Some(u), _) => (Some(u.clone()), "--base-url".to_string()),
            (None, Some(u)) => (Some(u), format!("the recipe's target.settings.base_url ({})", args.config.as_deref().unwrap_or(std::path::Path::new("")).display())),
            (None, None) => (None, String::new()),
        };
        if let Some(url) = url.filter(|u| is_own_address(u, &args.host, args.port)) {
            bail!(
                "the target's address {url} ({from}) is this server's own (--host {} --port {}): every chat request would be forwarded to itself; pass --base-url with the target LM's address, or another --port",
                args.host,
                args.port
            );
        }
    }
    if !is_loopback(&args.host) && args.api_key_env.is_none() {
        eprintln!(
            "host serve: warning: listening on {} (not a loopback address) without --api-key-env: anyone who can reach it can search the corpus, embed and use the target; set a key with --api-key-env VAR",
            args.host
        );
    }

    let mut index = index::open(&args.index)?;
    match (&mut index, args.ef_search) {
        (Index::Hnsw(h), Some(ef)) => h.set_ef_search(ef)?,
        (Index::Milvus(m), Some(ef)) => m.set_ef_search(ef),
        (_, Some(_)) => bail!("--ef-search is for HNSW and Milvus indexes; {} is {}", args.index.display(), index.meta().kind),
        _ => {}
    }
    let dense = !matches!(index, Index::Bm25(_));
    let mut encoder = match (&args.encoder, &args.model) {
        (Some(name), Some(model)) => Some(registry.encoder(name, &encoder_settings(std::path::Path::new(model), &args.model_args)?)?),
        (None, None) if !dense => None,
        (None, _) if dense => bail!("{} is a {} index: give --encoder and --model to encode queries", args.index.display(), index.meta().kind),
        _ => bail!("give --encoder and --model together"),
    };
    // A model whose vectors are not the index's width would fail every search: found now.
    if let (Some(enc), true) = (encoder.as_mut(), dense) {
        let probe = enc.encode(&["probe"], rak_core::abi::Role::Query, task.as_deref(), false)?;
        let width = probe.size().last().copied().unwrap_or(0) as usize;
        if width != index.meta().dim {
            bail!("the model's vectors have {width} dimensions but the index {} holds {}-dimensional ones (built with another model?)", args.index.display(), index.meta().dim);
        }
    }
    let model_name = args.served_model_name.clone().or_else(|| args.model.as_ref().map(|m| served_name(m))).unwrap_or_else(|| "bm25".into());
    eprintln!("host serve: loading the corpus {}", corpus_path.display());
    let corpus = beir::load_corpus(&corpus_path)?;
    check_corpus_holds_index(&index, &args.index, &corpus, &corpus_path)?;

    let (connector, target_model) = match &target_name {
        Some(name) => {
            let mut settings = cfg.as_ref().map(|c| c.target_settings()).transpose()?.unwrap_or_else(|| json!({}));
            // A connector without a base_url setting (a third party's that finds its LM
            // otherwise) is given none.
            if registry.takes_setting(name, "base_url") {
                if let Some(url) = &args.base_url {
                    settings["base_url"] = json!(url);
                }
                if settings.get("base_url").is_none() {
                    bail!("the target needs --base-url (or target.settings.base_url in the recipe)");
                }
            } else if args.base_url.is_some() {
                bail!("--base-url: the target's connector {name:?} has no base_url setting (`host plugins inspect FILE` lists its settings)");
            }
            if let Some(m) = &args.target_model {
                settings["model"] = json!(m);
            }
            // The server holds at most --target-concurrency calls at the target itself; the
            // connector's own gate must not hold them back further. Its timeout is at most the
            // request's: a call the client was answered 504 for must not keep its permit (and
            // the target's slot) for the rest of a longer recipe timeout.
            if name == "openai" {
                let recipe_concurrency = settings["concurrency"].as_u64().unwrap_or(0) as usize;
                settings["concurrency"] = json!(recipe_concurrency.max(args.target_concurrency));
                match settings.get("timeout_s").map(|t| t.as_f64()) {
                    None => settings["timeout_s"] = json!(args.request_timeout_s),
                    Some(Some(t)) if t > args.request_timeout_s => {
                        eprintln!("host serve: note: the target's timeout_s ({t} s) is capped at --request-timeout-s ({} s)", args.request_timeout_s);
                        settings["timeout_s"] = json!(args.request_timeout_s);
                    }
                    // Shorter, or not a number (the connector says what is wrong with it).
                    Some(_) => {}
                }
            }
            let c = registry.connector(name, &settings)?;
            let described = c.complete(json!({"op": "describe"})).ok();
            let model = described.as_ref().and_then(|d| d["requested"].as_str().or(d["model"].as_str())).map(str::to_string).unwrap_or_else(|| name.clone());
            (Some(c), Some(model))
        }
        None => (None, None),
    };

    let opts = rak_serve::Options {
        host: args.host.clone(),
        port: args.port,
        api_key,
        max_body_bytes: args.max_body_bytes,
        request_timeout: Duration::from_secs_f64(args.request_timeout_s),
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace_s),
        allowed_hosts: args.allowed_host.clone(),
        target_concurrency: args.target_concurrency,
        default_k: k,
        max_k: args.max_k,
        max_inputs: args.max_inputs,
        default_task: task.clone(),
        tasks: if args.tasks.is_empty() { task.into_iter().collect() } else { args.tasks.clone() },
        model_name,
        batch: rak_serve::BatchOptions {
            queue_capacity: args.queue_size,
            max_batch_tokens: args.max_batch_tokens,
            max_batch_texts: args.model_args.batch_size,
            max_wait: Duration::from_millis(args.batch_wait_ms),
        },
    };
    let backend = rak_serve::Backend { encoder, index, corpus, connector, target_model, format_passages };
    rak_serve::serve(opts, backend, |addr| {
        // One line on stdout for scripts and tests; the log goes to stderr.
        println!("{}", json!({"listening": format!("http://{addr}")}));
        let _ = std::io::stdout().flush();
    })
}

/// The passages as prompts show them: the header, each passage by the template (its text cut
/// to max_chars), joined and followed by the separator, as `host augment` lays them out.
fn passage_layout(p: &PassageConfig) -> Result<Box<dyn Fn(&[&Passage]) -> String + Send + Sync>> {
    let template = Template::parse(&p.template, &["title", "text"], "passages.template")?;
    let (header, separator, max_chars) = (p.header.clone(), p.separator.clone(), p.max_chars);
    Ok(Box::new(move |passages: &[&Passage]| {
        let shown: Vec<String> = passages
            .iter()
            .map(|d| {
                let text: String = if max_chars > 0 { d.text.chars().take(max_chars).collect() } else { d.text.clone() };
                template.render(&[("title", &d.title), ("text", &text)])
            })
            .collect();
        format!("{header}{}{separator}", shown.join(&separator))
    }))
}

/// Whether `host` is a loopback address (or `localhost`).
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether `url` (an http or https URL) names the address this server binds (`host`:`port`):
/// the same port, and the same host, or a loopback one (`localhost` included) when the
/// server binds a loopback or unspecified (0.0.0.0, ::) address. Names that would need DNS
/// are not looked up. Port 0 (any free one) is never anyone's.
fn is_own_address(url: &str, host: &str, port: u16) -> bool {
    let Some((scheme, rest)) = url.trim().split_once("://") else { return false };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (name, their_port) = match authority.rsplit_once(':') {
        Some((n, p)) if !n.is_empty() && (n.starts_with('[') == n.ends_with(']')) && !p.contains(']') => match p.parse::<u16>() {
            Ok(p) => (n, p),
            Err(_) => return false,
        },
        _ => (authority, default_port),
    };
    if port == 0 || their_port != port {
        return false;
    }
    let ip = |h: &str| h.trim_matches(['[', ']']).parse::<std::net::IpAddr>().ok();
    let ours_open = ip(host).is_some_and(|a| a.is_unspecified());
    if name.eq_ignore_ascii_case(host) || (ip(name).is_some() && ip(name) == ip(host)) {
        return true;
    }
    let theirs_local = is_loopback(name) || ip(name).is_some_and(|a| a.is_unspecified());
    theirs_local && (is_loopback(host) || ours_open)
}

/// A model's served name: a local folder's name, or the Hub id as given.
fn served_name(model: &str) -> String {
    let path = std::path::Path::new(model);
    if path.is_dir() {
        if let Some(name) = path.canonicalize().ok().as_deref().and_then(|p| p.file_name()).and_then(|n| n.to_str()) {
            return name.to_string();
        }
    }
    model.to_string()
}

/// Every passage the index can return must have its text: a corpus of other ids (another
/// collection, a shard) would serve passages without text, silently. A corpus holding more
/// passages than the index is fine.
fn check_corpus_holds_index(index: &Index, index_dir: &Path, corpus: &rak_retrieval::data::Corpus, corpus_path: &Path) -> Result<()> {
    // The count of missing ids and the first few, not all of them (a corpus of another
    // collection lacks every one).
    let (mut first, mut missing, mut count) = (Vec::new(), 0usize, 0usize);
    let mut check = |id: &str| {
        count += 1;
        if !corpus.contains(id) {
            missing += 1;
            if first.len() < 5 {
                first.push(format!("{id:?}"));
            }
        }
    };
    match index {
        Index::Flat(i) => i.ids().iter().for_each(|id| check(id)),
        Index::Hnsw(i) => i.ids().iter().for_each(|id| check(id)),
        Index::Milvus(i) => i.ids().iter().for_each(|id| check(id)),
        Index::Bm25(i) => i.for_each_id(&mut check)?,
    }
    if missing == 0 {
        return Ok(());
    }
    let source = match index {
        Index::Bm25(_) => format!("the index {}", index_dir.display()),
        _ => format!("the index's {}", index_dir.join("ids.txt").display()),
    };
    bail!(
        "the corpus {} lacks {missing} of the {count} passage ids in {source} (first: {}{}): give --corpus the passages JSONL the index was built from",
        corpus_path.display(),
        first.join(", "),
        if missing > first.len() { ", ..." } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::is_own_address;

    #[test]
    fn a_target_at_the_server_s_own_address_is_told() {
        for (url, host, port) in [
            ("http://127.0.0.1:8080", "127.0.0.1", 8080),
            ("http://127.0.0.1:8080/", "127.0.0.1", 8080),
            ("http://localhost:8080/v1", "127.0.0.1", 8080),
            ("HTTP://LOCALHOST:8080", "localhost", 8080),
            ("http://127.0.0.1:8080", "0.0.0.0", 8080),
            ("http://[::1]:8080", "::", 8080),
            ("http://[::1]:8080", "[::1]", 8080),
            ("http://10.0.0.5:8080", "10.0.0.5", 8080),
            ("http://127.0.0.1", "127.0.0.1", 80),
            ("https://localhost", "127.0.0.1", 443),
            ("http://user:pw@127.0.0.1:8080", "127.0.0.1", 8080),
        ] {
            assert!(is_own_address(url, host, port), "{url} vs {host}:{port}");
        }
        for (url, host, port) in [
            ("http://127.0.0.1:8081", "127.0.0.1", 8080),
            ("http://127.0.0.1:8080", "127.0.0.1", 0),
            ("http://127.0.0.1:8080", "10.0.0.5", 8080),
            ("http://10.0.0.6:8080", "10.0.0.5", 8080),
            ("http://gpu-box:8080", "127.0.0.1", 8080),
            ("http://127.0.0.1", "127.0.0.1", 8080),
            ("https://127.0.0.1:8080", "127.0.0.1", 443),
            ("not a url", "127.0.0.1", 8080),
        ] {
            assert!(!is_own_address(url, host, port), "{url} vs {host}:{port}");
        }
    }
}
