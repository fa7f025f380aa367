//! Hard negatives: BM25's top passages for each query minus its gold ones (the warm-up of
//! DPR, MT-DPR and TACO), saved per episode so a restarted run reuses them.

use crate::data::TaskData;
use anyhow::{Context, Result};
use rak_retrieval::index::Bm25Index;
use rak_retrieval::pipeline::Progress;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;

/// For each example, the top `depth` BM25 passages that are not gold, best first.
pub fn bm25_negatives(index: &Bm25Index, tasks: &mut [TaskData], depth: usize, progress: &dyn Progress) -> Result<()> {
    let total: usize = tasks.iter().map(|t| t.examples.len()).sum();
    progress.start("bm25 negatives", total as u64);
    for task in tasks.iter_mut() {
        for ex in task.examples.iter_mut() {
            let gold: HashSet<&str> = ex.positives.iter().map(String::as_str).collect();
            let hits = index.search(&ex.query, depth + gold.len())?;
            ex.negatives = hits.into_iter().map(|(id, _)| id).filter(|id| !gold.contains(id.as_str())).take(depth).collect();
            progress.inc(1);
        }
    }
    progress.finish();
    Ok(())
}

/// Save every example's negatives (`{"depth": d, "negatives": {"task": {"query id": [ids]}}}`),
/// atomically.
pub fn save(path: &Path, tasks: &[TaskData], depth: usize) -> Result<()> {
    let map: BTreeMap<&str, BTreeMap<&str, &Vec<String>>> = tasks
        .iter()
        .map(|t| (t.name.as_str(), t.examples.iter().map(|e| (e.query_id.as_str(), &e.negatives)).collect()))
        .collect();
    let map = serde_json::json!({"depth": depth, "negatives": map});
    rak_core::fsutil::write_atomically(path, |tmp| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        serde_json::to_writer(&mut f, &map)?;
        f.flush()?;
        Ok(())
    })
}

/// Load what [`save`] wrote into the examples. False (nothing loaded) when the file does not
/// exist or was made for other data: another depth, other tasks or other queries.
pub fn load(path: &Path, tasks: &mut [TaskData], depth: usize) -> Result<bool> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    #[derive(serde::Deserialize)]
    struct Saved {
        depth: usize,
        negatives: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    }
    // A file of another format (an older version, a torn write) is simply recomputed.
    let Ok(saved) = serde_json::from_str::<Saved>(&text) else { return Ok(false) };
    let same_queries = saved.depth == depth
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
