//! Hard negatives: BM25's top passages for each query minus its gold ones (the warm-up of
//! DPR, MT-DPR and TACO), then ANCE's: the current model's own top passages minus gold,
//! retrieved from the whole corpus re-encoded with it. Saved per episode so a restarted run
//! reuses them, and while they are mined, per block of queries ([`Parts`]), so a run killed
//! while mining resumes where it was.

use crate::data::{Example, TaskData};
use anyhow::{Context, Result};
use rak_core::abi::Role;
use rak_core::plugin::Encoder;
use rak_retrieval::index::{self, Bm25Index, MilvusParams};
use rak_retrieval::pipeline::encode::{encode_file, encode_texts, EncodeJob, EncoderSource, DEFAULT_BATCH_SIZE};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use rak_retrieval::pipeline::search::search_vectors;
use rak_retrieval::pipeline::Progress;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;

/// Queries of one task per saved block of a mining pass: the most a killed run mines again.
pub const PART_QUERIES: usize = 1024;

/// Where a mining pass keeps its progress: each block of [`PART_QUERIES`] queries of a task,
/// once mined, is saved atomically as `dir/TASK-BLOCK.json` with `key` (everything the mined
/// lists depend on) and the block's query ids; a rerun with the same key takes the blocks it
/// finds instead of mining them again. The caller removes `dir` once the whole pass is saved.
pub struct Parts<'a> {
    pub dir: &'a Path,
    pub key: &'a str,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Part {
    key: String,
    task: String,
    queries: Vec<String>,
    negatives: Vec<Vec<String>>,
}

impl Parts<'_> {
    fn path(&self, task: usize, block: usize) -> std::path::PathBuf {
        self.dir.join(format!("{task}-{block}.json"))
    }

    /// The saved block, if it was mined under this key for exactly these queries (a part of
    /// another format, a torn write or other queries is mined again).
    fn load(&self, task: usize, block: usize, name: &str, examples: &[Example]) -> Option<Vec<Vec<String>>> {
        let part: Part = serde_json::from_slice(&std::fs::read(self.path(task, block)).ok()?).ok()?;
        let same = part.key == self.key
            && part.task == name
            && part.queries.len() == examples.len()
            && part.negatives.len() == examples.len()
            && part.queries.iter().zip(examples).all(|(q, e)| *q == e.query_id);
        same.then_some(part.negatives)
    }

    fn save(&self, task: usize, block: usize, name: &str, examples: &[Example]) -> Result<()> {
        let part = Part {
            key: self.key.to_string(),
            task: name.to_string(),
            queries: examples.iter().map(|e| e.query_id.clone()).collect(),
            negatives: examples.iter().map(|e| e.negatives.clone()).collect(),
        };
        rak_core::fsutil::write_atomically(&self.path(task, block), |tmp| {
            let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
            serde_json::to_writer(&mut f, &part)?;
            f.flush()?;
            Ok(())
        })
    }
}

/// Runs `mine` (task name, examples: fills their negatives) over every task's examples a block
/// of [`PART_QUERIES`] at a time, saving each block in `parts` as it is done and taking the
/// blocks a killed run saved instead of mining them again.
fn mine_in_parts(parts: &Parts, tasks: &mut [TaskData], what: &str, progress: &dyn Progress, mut mine: impl FnMut(&str, &mut [Example]) -> Result<()>) -> Result<()> {
    std::fs::create_dir_all(parts.dir).with_context(|| format!("{}: cannot create", parts.dir.display()))?;
    // Tests only: a pause after each block mined, so that a test on tiny data can outlast the
    // collective timeout, or kill a run between two blocks.
    let pause = std::env::var("RAK_TEST_SLOW_MINING_MS").ok().and_then(|v| v.parse().ok()).map(std::time::Duration::from_millis);
    let total: usize = tasks.iter().map(|t| t.examples.len()).sum();
    let blocks: usize = tasks.iter().map(|t| t.examples.len().div_ceil(PART_QUERIES)).sum();
    let mut resumed = 0;
    progress.start(what, total as u64);
    for (ti, task) in tasks.iter_mut().enumerate() {
        for (bi, block) in task.examples.chunks_mut(PART_QUERIES).enumerate() {
            if let Some(negatives) = parts.load(ti, bi, &task.name, block) {
                for (e, n) in block.iter_mut().zip(negatives) {
                    e.negatives = n;
                }
                resumed += 1;
            } else {
                mine(&task.name, block)?;
                parts.save(ti, bi, &task.name, block)?;
                if let Some(pause) = pause {
                    std::thread::sleep(pause);
                }
            }
            progress.inc(block.len() as u64);
        }
    }
    progress.finish();
    if resumed > 0 {
        progress.log(&format!("{what}: {resumed} of {blocks} blocks of queries were mined by an earlier run ({}); mined the rest", parts.dir.display()));
    }
    Ok(())
}

/// For each example, the top `depth` BM25 passages that are not gold, best first; queries are
/// searched on every core, a block at a time, each saved in `parts`.
pub fn bm25_negatives(index: &Bm25Index, tasks: &mut [TaskData], depth: usize, parts: &Parts, progress: &dyn Progress) -> Result<()> {
    use rayon::prelude::*;
    mine_in_parts(parts, tasks, "bm25 negatives", progress, |_, block| {
        block.par_iter_mut().try_for_each(|ex| -> Result<()> {
            let gold: HashSet<&str> = ex.positives.iter().map(String::as_str).collect();
            let hits = index.search(&ex.query, depth + gold.len())?;
            ex.negatives = hits.into_iter().map(|(id, _)| id).filter(|id| !gold.contains(id.as_str())).take(depth).collect();
            Ok(())
        })
    })
}

/// ANCE, first half: encode shard `shard` of `shards` of the corpus with `encoder` into
/// `work/corpus/` (resumable, and keyed on `identity`, so a rerun with the same model reuses
/// it). The processes of a data-parallel run each encode their shard; the last to finish joins
/// them (`encode_file`).
pub fn ance_encode_corpus(encoder: &mut dyn Encoder, identity: serde_json::Value, corpus: &Path, work: &Path, shard: (usize, usize), progress: &dyn Progress) -> Result<()> {
    let mut job = EncodeJob::new(corpus, &work.join("corpus"), Role::Passage, identity);
    (job.shard_id, job.shard_num) = shard;
    if job.shard_num > 1 {
        // At least four parts a process where the corpus allows (parts of 256 lines or more),
        // so that every process has a share of the work.
        let lines = std::io::BufRead::lines(std::io::BufReader::new(std::fs::File::open(corpus).with_context(|| format!("{}: cannot open", corpus.display()))?)).count();
        job.part_size = lines.div_ceil(4 * job.shard_num).clamp(256, job.part_size);
    }
    encode_file(&job, EncoderSource::Ready(encoder), progress)?;
    Ok(())
}

/// ANCE, second half, once the whole corpus is encoded: for each example, the top `depth`
/// passages of `encoder` that are not gold, best first, from `work/corpus/` indexed in
/// `work/index/`, exactly, or in the Milvus collection `milvus` names. Queries are encoded
/// with their task's name when `task_names` is on, as in training; a block at a time, each
/// saved in `parts`.
#[allow(clippy::too_many_arguments)]
pub fn ance_negatives(
    encoder: &mut dyn Encoder,
    work: &Path,
    tasks: &mut [TaskData],
    depth: usize,
    task_names: bool,
    milvus: Option<MilvusParams>,
    parts: &Parts,
    progress: &dyn Progress,
) -> Result<()> {
    let embeddings = work.join("corpus");
    let index_dir = work.join("index");
    if !index_dir.join("index.json").exists() {
        let spec = match milvus {
            None => IndexSpec::Flat { embeddings: embeddings.clone() },
            Some(params) => IndexSpec::Milvus { embeddings: embeddings.clone(), params },
        };
        build_index(&spec, &index_dir, progress)?;
    }
    let index = index::open(&index_dir)?;
    mine_in_parts(parts, tasks, "ance negatives", progress, |task, block| {
        let texts: Vec<&str> = block.iter().map(|e| e.query.as_str()).collect();
        let name = task_names.then_some(task);
        let (vectors, dim) = encode_texts(encoder, &texts, Role::Query, name, DEFAULT_BATCH_SIZE, &rak_retrieval::pipeline::Quiet)?;
        let most_gold = block.iter().map(|e| e.positives.len()).max().unwrap_or(0);
        drop(texts);
        let hits = search_vectors(&index, &vectors, dim, depth + most_gold)?;
        for (ex, hits) in block.iter_mut().zip(hits) {
            let gold: HashSet<&str> = ex.positives.iter().map(String::as_str).collect();
            ex.negatives = hits.into_iter().map(|(id, _)| id).filter(|id| !gold.contains(id.as_str())).take(depth).collect();
        }
        Ok(())
    })
}

/// Give each example its retriever found no negative for (every hit was gold, or the query
/// matched nothing: BM25 with stop words removed can) `count` gold passages of other queries,
/// drawn with `seed` (DPR falls back to random passages the same way). Returns how many
/// examples were filled.
pub fn fill_empty(tasks: &mut [TaskData], count: usize, seed: u64) -> usize {
    let pool: Vec<String> = {
        let all: std::collections::BTreeSet<&String> = tasks.iter().flat_map(|t| &t.examples).flat_map(|e| &e.positives).collect();
        all.into_iter().cloned().collect()
    };
    let mut filled = 0;
    for (ti, task) in tasks.iter_mut().enumerate() {
        for (ei, ex) in task.examples.iter_mut().enumerate() {
            if !ex.negatives.is_empty() || count == 0 {
                continue;
            }
            let mut rng = rak_core::rng::Rng::derive(seed, &[0xF111, ti as u64, ei as u64]);
            let gold: HashSet<&str> = ex.positives.iter().map(String::as_str).collect();
            // Bounded: a pool holding nothing but this query's gold leaves it empty.
            for _ in 0..count * 16 {
                if ex.negatives.len() == count || pool.len() <= gold.len() {
                    break;
                }
                let pick = &pool[rng.below(pool.len() as u64) as usize];
                if !gold.contains(pick.as_str()) && !ex.negatives.contains(pick) {
                    ex.negatives.push(pick.clone());
                }
            }
            filled += usize::from(!ex.negatives.is_empty());
        }
    }
    filled
}

/// Drop every negative that lies on a page of one of its query's gold passages: where pages
/// are judged (KILT), such a passage is relevant, and training against it pushes the query
/// away from its own page. Returns how many negatives were dropped.
pub fn drop_gold_pages(tasks: &mut [TaskData], pages: &std::collections::HashMap<String, u32>) -> usize {
    let mut dropped = 0;
    for ex in tasks.iter_mut().flat_map(|t| t.examples.iter_mut()) {
        let gold: HashSet<u32> = ex.positives.iter().filter_map(|p| pages.get(p).copied()).collect();
        let before = ex.negatives.len();
        ex.negatives.retain(|n| pages.get(n).is_none_or(|page| !gold.contains(page)));
        dropped += before - ex.negatives.len();
    }
    dropped
}

/// Drop every negative whose text holds one of its query's answers (DPR's `has_answer`:
/// token runs after NFD and lower-casing), then keep the first `depth` of what is left.
/// `texts` holds the text of every negative (a negative it lacks is kept). Returns how many
/// queries had an answer among their first `depth` negatives (which deeper ones replace).
pub fn drop_answer_holders(tasks: &mut [TaskData], texts: &std::collections::HashMap<String, String>, depth: usize) -> usize {
    use rak_retrieval::eval::answer::AnswerMatcher;
    let mut changed = 0;
    for ex in tasks.iter_mut().flat_map(|t| t.examples.iter_mut()) {
        let answers = AnswerMatcher::new(&ex.answers);
        let holds = |n: &String| texts.get(n).is_some_and(|text| answers.matches(text));
        changed += usize::from(ex.negatives.iter().take(depth).any(holds));
        ex.negatives.retain(|n| !holds(n));
        ex.negatives.truncate(depth);
    }
    changed
}

/// SHA-256 over every example's answers, in order: what `exclude_answer_negatives` adds to
/// the negatives' key.
pub fn answers_digest(tasks: &[TaskData]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for e in tasks.iter().flat_map(|t| &t.examples) {
        for a in &e.answers {
            h.update((a.len() as u64).to_le_bytes());
            h.update(a.as_bytes());
        }
        h.update(u64::MAX.to_le_bytes());
    }
    rak_retrieval::digest::hex(&h.finalize())
}

/// SHA-256 over every task's examples as negatives depend on them: task, query id, query text
/// and gold passages (which are left out of the negatives), in order.
pub fn examples_digest(tasks: &[TaskData]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in tasks {
        for e in &t.examples {
            // Each field framed by its length, so no two different lists hash alike.
            for field in [t.name.as_str(), e.query_id.as_str(), e.query.as_str()].into_iter().chain(e.positives.iter().map(String::as_str)) {
                h.update((field.len() as u64).to_le_bytes());
                h.update(field.as_bytes());
            }
            h.update(u64::MAX.to_le_bytes());
        }
    }
    rak_retrieval::digest::hex(&h.finalize())
}

/// SHA-256 over every task's examples and their negatives: what a run handed its own examples
/// trains on.
pub fn examples_and_negatives_digest(tasks: &[TaskData]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(examples_digest(tasks).as_bytes());
    for e in tasks.iter().flat_map(|t| &t.examples) {
        for n in &e.negatives {
            h.update((n.len() as u64).to_le_bytes());
            h.update(n.as_bytes());
        }
        h.update(u64::MAX.to_le_bytes());
    }
    // Only when some example has them, so that digests made before they existed stay the same.
    if tasks.iter().flat_map(|t| &t.examples).any(|e| !e.lm_scores.is_empty()) {
        h.update(b"lm_scores");
        for e in tasks.iter().flat_map(|t| &t.examples) {
            for (id, score) in &e.lm_scores {
                h.update((id.len() as u64).to_le_bytes());
                h.update(id.as_bytes());
                h.update(score.to_le_bytes());
            }
            h.update(u64::MAX.to_le_bytes());
        }
    }
    rak_retrieval::digest::hex(&h.finalize())
}

/// Save every example's negatives
/// (`{"source": s, "depth": d, "negatives": {"task": {"query id": [ids]}}}`), atomically.
/// `source` is the key of everything that produced them (the run's `negatives_key`: miner,
/// corpus, examples, fill), so [`load`] never serves them to a run made otherwise.
pub fn save(path: &Path, tasks: &[TaskData], depth: usize, source: &str) -> Result<()> {
    let map: BTreeMap<&str, BTreeMap<&str, &Vec<String>>> = tasks
        .iter()
        .map(|t| (t.name.as_str(), t.examples.iter().map(|e| (e.query_id.as_str(), &e.negatives)).collect()))
        .collect();
    let map = serde_json::json!({"source": source, "depth": depth, "negatives": map});
    rak_core::fsutil::write_atomically(path, |tmp| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        serde_json::to_writer(&mut f, &map)?;
        f.flush()?;
        Ok(())
    })
}

/// Load what [`save`] wrote into the examples. False (nothing loaded) when the file does not
/// exist or was made for other data: another source, another depth, other tasks or other
/// queries.
pub fn load(path: &Path, tasks: &mut [TaskData], depth: usize, source: &str) -> Result<bool> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    #[derive(serde::Deserialize)]
    struct Saved {
        source: String,
        depth: usize,
        negatives: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    }
    // A file of another format (an older version, a torn write) is simply recomputed.
    let Ok(saved) = serde_json::from_str::<Saved>(&text) else { return Ok(false) };
    let same_queries = saved.source == source
        && saved.depth == depth
        && saved.negatives.len() == tasks.len()
        && tasks.iter().all(|t| {
            saved.negatives.get(&t.name).is_some_and(|by_query| {
                by_query.len() == t.examples.len() && t.examples.iter().all(|e| by_query.contains_key(&e.query_id))
            })
        });
    if !same_queries {
        return Ok(false);
    }
    let mut map = saved.negatives;
    for t in tasks.iter_mut() {
        let by_query = map.get_mut(&t.name).expect("checked above");
        for e in t.examples.iter_mut() {
            e.negatives = by_query.remove(&e.query_id).expect("checked above");
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(id: &str, gold: &[&str], negs: &[&str]) -> Example {
        Example {
            query_id: id.into(),
            query: id.into(),
            positives: gold.iter().map(|s| s.to_string()).collect(),
            negatives: negs.iter().map(|s| s.to_string()).collect(),
            answers: Vec::new(),
            lm_scores: Vec::new(),
        }
    }

    #[test]
    fn negatives_holding_an_answer_are_dropped_and_the_rest_cut_to_depth() {
        let texts: std::collections::HashMap<String, String> = [
            ("n1", "The Broncos beat the Panthers."),
            ("n2", "Denver's team lost."),
            ("n3", "It was played in Santa Clara."),
            ("n4", "A stadium."),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let mut a = ex("q1", &["p1"], &["n1", "n2", "n3", "n4"]);
        a.answers = vec!["Panthers".into(), "santa clara".into()];
        // No answers (a label task's would not occur either): only cut to depth.
        let b = ex("q2", &["p2"], &["n1", "n2", "n3"]);
        let mut tasks = vec![TaskData { name: "a".into(), examples: vec![a, b] }];
        assert_eq!(drop_answer_holders(&mut tasks, &texts, 2), 1);
        assert_eq!(tasks[0].examples[0].negatives, vec!["n2".to_string(), "n4".to_string()]);
        assert_eq!(tasks[0].examples[1].negatives, vec!["n1".to_string(), "n2".to_string()]);
    }

    /// A mining pass killed after its first block resumes there: the blocks saved are taken,
    /// not mined again, and a block saved under another key or for other queries is mined.
    #[test]
    fn mining_resumes_from_the_blocks_saved() {
        let dir = std::env::temp_dir().join(format!("rak-parts-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let make = || {
            vec![
                TaskData { name: "a".into(), examples: (0..PART_QUERIES + 1).map(|i| ex(&format!("a{i}"), &["p"], &[])).collect() },
                TaskData { name: "b".into(), examples: vec![ex("b0", &["p"], &[])] },
            ]
        };
        let parts = Parts { dir: &dir, key: "k1" };
        let quiet = &rak_retrieval::pipeline::Quiet;
        let mark = |task: &str, block: &mut [Example]| {
            for e in block.iter_mut() {
                e.negatives = vec![format!("{task}-{}", e.query_id)];
            }
        };
        // Killed in the second block.
        let mut tasks = make();
        let mut calls = 0;
        let err = mine_in_parts(&parts, &mut tasks, "test", quiet, |task, block| {
            calls += 1;
            if calls == 2 {
                anyhow::bail!("killed");
            }
            mark(task, block);
            Ok(())
        });
        assert!(err.is_err());
        let mut tasks = make();
        let mut mined = Vec::new();
        mine_in_parts(&parts, &mut tasks, "test", quiet, |task, block| {
            mined.push((task.to_string(), block.len()));
            mark(task, block);
            Ok(())
        })
        .unwrap();
        assert_eq!(mined, vec![("a".to_string(), 1), ("b".to_string(), 1)], "the first block was mined again");
        assert!(tasks.iter().flat_map(|t| &t.examples).all(|e| e.negatives == vec![format!("{}-{}", &e.query_id[..1], e.query_id)]));
        // Another key, or other queries in a block: mined again.
        let mut again = Vec::new();
        mine_in_parts(&Parts { dir: &dir, key: "k2" }, &mut make(), "test", quiet, |task, block| {
            again.push(task.to_string());
            mark(task, block);
            Ok(())
        })
        .unwrap();
        assert_eq!(again.len(), 3);
        let mut other = make();
        other[1].examples[0].query_id = "b1".into();
        let mut again = Vec::new();
        mine_in_parts(&Parts { dir: &dir, key: "k2" }, &mut other, "test", quiet, |task, block| {
            again.push(task.to_string());
            mark(task, block);
            Ok(())
        })
        .unwrap();
        assert_eq!(again, vec!["b".to_string()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn negatives_on_a_gold_page_are_dropped() {
        // p1 and n1 share page 0; n2 is on page 1; n3 is on no known page.
        let pages: std::collections::HashMap<String, u32> = [("p1", 0), ("n1", 0), ("p2", 1), ("n2", 1)].iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let mut tasks = vec![TaskData { name: "a".into(), examples: vec![ex("q1", &["p1"], &["n1", "n2", "n3"]), ex("q2", &["p2"], &["n1", "n2"])] }];
        assert_eq!(drop_gold_pages(&mut tasks, &pages), 2);
        assert_eq!(tasks[0].examples[0].negatives, vec!["n2".to_string(), "n3".to_string()]);
        assert_eq!(tasks[0].examples[1].negatives, vec!["n1".to_string()]);
    }

    #[test]
    fn empty_negatives_are_filled_with_other_queries_gold() {
        let make = || {
            vec![
                TaskData { name: "a".into(), examples: vec![ex("q1", &["p1"], &[]), ex("q2", &["p2"], &["n1"])] },
                TaskData { name: "b".into(), examples: vec![ex("q3", &["p3", "p1"], &[]), ex("q4", &["p4"], &[])] },
            ]
        };
        let mut tasks = make();
        assert_eq!(fill_empty(&mut tasks, 2, 9), 3);
        for e in tasks.iter().flat_map(|t| &t.examples) {
            assert!(!e.negatives.is_empty() && e.negatives.len() <= 2, "{e:?}");
            assert!(e.negatives.iter().all(|n| !e.positives.contains(n)), "{e:?}");
        }
        assert_eq!(tasks[0].examples[1].negatives, vec!["n1".to_string()], "examples with negatives are left alone");
        let mut again = make();
        fill_empty(&mut again, 2, 9);
        assert_eq!(tasks, again, "seeded");
        // Nothing to draw from but the query's own gold: left empty, no endless loop.
        let mut lone = vec![TaskData { name: "a".into(), examples: vec![ex("q1", &["p1"], &[])] }];
        assert_eq!(fill_empty(&mut lone, 1, 0), 0);
    }
}
