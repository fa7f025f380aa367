//! Stage (a): the source task's queries with gold, and the starting retriever's top
//! `max(N, negatives_depth)` passages for each, through the host's services (the corpus
//! encoded with `encode_corpus`, a flat index, `search`).

use crate::config::Config;
use crate::data::{corpus_ids, read_qrels, read_queries, RecordLog, Retrieved};
use crate::select::spaced_subset;
use crate::stages::{Stages, Start};
use anyhow::{bail, Context, Result};
use rak_core::plugin::Host;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Queries searched per call of the search service.
const SEARCH_CHUNK: usize = 256;

const RESULT_FILE: &str = "retrieved.jsonl";
const PARTIAL_FILE: &str = "retrieved.part.jsonl";

/// Run (or resume, or skip) the stage; its queries and report.
pub fn run(cfg: &Config, host: &Host, stages: &Stages, key: &Value) -> Result<(Vec<Retrieved>, Value, &'static str)> {
    let folder = stages.folder("retrieve");
    let how = match stages.begin("retrieve", key)? {
        Start::Done(report) => {
            remove_work(&folder);
            return Ok((load(&folder.join(RESULT_FILE))?, report, "done earlier"));
        }
        Start::Resume => "resumed",
        Start::Fresh => "ran",
    };
    std::fs::create_dir_all(&folder).with_context(|| format!("{}: cannot create", folder.display()))?;

    let queries = read_queries(&cfg.queries_file())?;
    let mut ids = HashSet::new();
    if let Some(q) = queries.iter().find(|q| !ids.insert(q.id.as_str())) {
        bail!("{}: query id {:?} appears more than once", cfg.queries_file().display(), q.id);
    }
    let qrels = read_qrels(&cfg.qrels_file())?;
    let known = corpus_ids(&cfg.corpus)?;
    let (mut without_gold, mut gold_not_in_corpus) = (0usize, 0usize);
    let mut candidates = Vec::new();
    for q in queries.iter() {
        let judged = qrels.get(&q.id).map(Vec::as_slice).unwrap_or_default();
        let gold: Vec<String> = judged.iter().filter(|p| known.contains(*p)).cloned().collect();
        if judged.is_empty() {
            without_gold += 1;
        } else if gold.is_empty() {
            gold_not_in_corpus += 1;
        } else {
            candidates.push((q, gold));
        }
    }
    if candidates.is_empty() {
        bail!(
            "{}: no query has a relevant passage in {} ({} without judgements, {} whose judged passages are not in the corpus)",
            cfg.queries_file().display(),
            cfg.corpus.display(),
            without_gold,
            gold_not_in_corpus
        );
    }
    if without_gold + gold_not_in_corpus > 0 {
        host.log(&format!(
            "aar-train: dropped {without_gold} queries without relevant passages in {} and {gold_not_in_corpus} whose relevant passages are not in the corpus",
            cfg.qrels_file().display()
        ))?;
    }
    let with_gold = candidates.len();
    let chosen: Vec<(&crate::data::Query, Vec<String>)> = match cfg.max_queries {
        Some(n) => spaced_subset(candidates.len(), n).into_iter().map(|i| candidates[i].clone()).collect(),
        None => candidates,
    };

    let depth = cfg.depth();
    let encoder = host.encoder(&cfg.encoder, &cfg.encoder_settings_for(&cfg.model))?;
    let (emb, index_dir) = (folder.join("emb"), folder.join("index"));
    host.encode_corpus(&encoder, json!({"input": cfg.corpus, "output": emb}))?;
    if !index_dir.join("index.json").exists() {
        host.build_index(json!({"kind": "flat", "embeddings": emb, "output": index_dir}))?;
    }
    let index = host.open_index(&index_dir)?;
    let count = index.info()?["count"].as_u64().unwrap_or(0) as usize;
    if count < depth {
        host.log(&format!(
            "aar-train: the corpus has {count} passages, fewer than the {depth} asked for (aar.n, and aar.negatives_depth in AAR's mode); every query gets those {count}"
        ))?;
    }

    let (mut log, earlier) = RecordLog::open(&folder.join(PARTIAL_FILE))?;
    let mut found: HashMap<String, Retrieved> = HashMap::new();
    for r in &earlier {
        let r = Retrieved::from_json(r)?;
        found.insert(r.id.clone(), r);
    }
    // Chunks by fixed positions in the chosen queries: a resumed run searches whole chunks, so
    // every query is searched in the same batch (and padding) as in an uninterrupted run.
    let todo = chosen.iter().filter(|(q, _)| !found.contains_key(&q.id)).count();
    if !found.is_empty() {
        host.log(&format!("aar-train: retrieve: {} queries searched earlier, {todo} to go", chosen.len() - todo))?;
    }
    let task = cfg.task_names().then_some(cfg.task.as_str());
    let bar = host.progress("aar: retrieve", todo as u64)?;
    for chunk in chosen.chunks(SEARCH_CHUNK) {
        let pending = chunk.iter().filter(|(q, _)| !found.contains_key(&q.id)).count();
        if pending == 0 {
            continue;
        }
        let list: Vec<Value> = chunk.iter().map(|(q, _)| json!({"_id": q.id, "text": q.text})).collect();
        let run = host.search(&index, Some(&encoder), json!({"queries": list, "k": depth, "task": task}))?;
        let mut records = Vec::with_capacity(chunk.len());
        for (q, gold) in chunk {
            if found.contains_key(&q.id) {
                continue;
            }
            let Some(got) = run.get(&q.id) else {
                bail!("{}: the search service returned no ranking for query {:?}", cfg.queries_file().display(), q.id);
            };
            let hits: Vec<(String, f64)> =
                serde_json::from_value(got.clone()).with_context(|| format!("{}: the search service's ranking for query {:?} is not [[id, score], ...]", cfg.queries_file().display(), q.id))?;
            let r = Retrieved { id: q.id.clone(), query: q.text.clone(), answers: q.answers.clone(), gold: gold.clone(), hits: hits.into_iter().map(|(p, _)| p).collect() };
            records.push(r.to_json());
            found.insert(r.id.clone(), r);
        }
        log.append(&records)?;
        bar.inc(pending as u64)?;
    }
    drop(bar);
    drop(log);

    // The result in the queries' order, whole or not at all.
    let ordered: Vec<Retrieved> = chosen.iter().map(|(q, _)| found.remove(&q.id).expect("every chosen query searched")).collect();
    let result = folder.join(RESULT_FILE);
    rak_core::fsutil::write_atomically(&result, |tmp| {
        let mut text = String::new();
        for r in &ordered {
            text.push_str(&r.to_json().to_string());
            text.push('\n');
        }
        std::fs::write(tmp, text).with_context(|| format!("{}: cannot write", tmp.display()))
    })?;
    let n = cfg.aar.n;
    let short = ordered.iter().filter(|r| r.hits.len() < n).count();
    let gold_in_top_n = ordered.iter().filter(|r| r.hits.iter().take(n).any(|h| r.gold.contains(h))).count();
    let report = json!({
        "queries_read": queries.len(),
        "dropped_without_gold": without_gold,
        "dropped_gold_not_in_corpus": gold_not_in_corpus,
        "queries_with_gold": with_gold,
        "queries": ordered.len(),
        "max_queries": cfg.max_queries,
        "depth": depth,
        "corpus_passages": count,
        "fewer_than_n_retrieved": short,
        "fewest_retrieved": ordered.iter().map(|r| r.hits.len()).min(),
        "gold_in_top_n": gold_in_top_n,
    });
    stages.finish("retrieve", &report)?;
    let _ = std::fs::remove_file(folder.join(PARTIAL_FILE));
    remove_work(&folder);
    Ok((ordered, report, how))
}

/// The corpus embeddings and index are as large as the corpus; the ranking is what is kept.
fn remove_work(folder: &Path) {
    for d in ["emb", "index"] {
        let _ = std::fs::remove_dir_all(folder.join(d));
    }
}

fn load(path: &Path) -> Result<Vec<Retrieved>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read (remove the stages folder's retrieve.done.json to redo the stage)", path.display()))?;
    let mut seen = HashSet::new();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let r = Retrieved::from_json(&serde_json::from_str(l).with_context(|| format!("{}: a damaged record", path.display()))?)?;
            if !seen.insert(r.id.clone()) {
                bail!("{}: query {:?} twice", path.display(), r.id);
            }
            Ok(r)
        })
        .collect()
}
