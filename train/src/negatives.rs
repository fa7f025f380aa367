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

/// Save every example's negatives (`{"task": {"query id": [ids]}}`), atomically.
pub fn save(path: &Path, tasks: &[TaskData]) -> Result<()> {
    let map: BTreeMap<&str, BTreeMap<&str, &Vec<String>>> = tasks
        .iter()
        .map(|t| (t.name.as_str(), t.examples.iter().map(|e| (e.query_id.as_str(), &e.negatives)).collect()))
        .collect();
    rak_core::fsutil::write_atomically(path, |tmp| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        serde_json::to_writer(&mut f, &map)?;
        f.flush()?;
        Ok(())
    })
}

/// Load what [`save`] wrote into the examples; false when the file does not exist.
pub fn load(path: &Path, tasks: &mut [TaskData]) -> Result<bool> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    let mut map: BTreeMap<String, BTreeMap<String, Vec<String>>> =
        serde_json::from_str(&text).with_context(|| format!("{}: not a negatives file", path.display()))?;
    for t in tasks.iter_mut() {
        let mut by_query = map.remove(&t.name).with_context(|| format!("{}: no negatives for task {:?}", path.display(), t.name))?;
        for e in t.examples.iter_mut() {
            e.negatives = by_query
                .remove(&e.query_id)
                .with_context(|| format!("{}: no negatives for query {:?} of task {:?}", path.display(), e.query_id, t.name))?;
        }
    }
    Ok(true)
}
