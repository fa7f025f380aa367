//! Per-query measures computed as trec_eval computes them (relevant = grade >= 1), on a ranking
//! already in trec_eval's order ([`crate::data::trec_order`]).

use std::collections::BTreeMap;

fn rel_of(rels: &BTreeMap<String, i32>, doc: &str) -> i32 {
    rels.get(doc).copied().unwrap_or(0)
}

/// Number of relevant passages (grade >= 1).
pub fn num_rel(rels: &BTreeMap<String, i32>) -> usize {
    rels.values().filter(|&&g| g >= 1).count()
}

fn relevant_in_top(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>, k: usize) -> usize {
    ranking.iter().take(k).filter(|(d, _)| rel_of(rels, d) >= 1).count()
}

/// trec_eval `Rprec`: precision at rank R, R = number of relevant passages (0 when R = 0).
pub fn rprec(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>) -> f64 {
    let r = num_rel(rels);
    if r == 0 {
        return 0.0;
    }
    relevant_in_top(ranking, rels, r) as f64 / r as f64
}

/// trec_eval `recall_k`: relevant passages in the top k over all relevant ones.
pub fn recall_at(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>, k: usize) -> f64 {
    let r = num_rel(rels);
    if r == 0 {
        return 0.0;
    }
    relevant_in_top(ranking, rels, k) as f64 / r as f64
}

/// trec_eval `recip_rank` on the ranking cut to `k`: 1 / rank of the first relevant passage.
pub fn recip_rank_at(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>, k: usize) -> f64 {
    ranking.iter().take(k).position(|(d, _)| rel_of(rels, d) >= 1).map_or(0.0, |i| 1.0 / (i + 1) as f64)
}

/// trec_eval `ndcg_cut_k`: gain = grade (grades <= 0 give nothing), discount log2(rank + 1),
/// normalised by the ideal ordering of all judged grades, both cut at k.
pub fn ndcg_cut(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>, k: usize) -> f64 {
    let discount = |i: usize| 1.0 / ((i + 2) as f64).log2();
    let dcg: f64 = ranking.iter().take(k).enumerate().map(|(i, (d, _))| rel_of(rels, d).max(0) as f64 * discount(i)).sum();
    let mut ideal: Vec<i32> = rels.values().copied().filter(|&g| g > 0).collect();
    ideal.sort_unstable_by(|a, b| b.cmp(a));
    let idcg: f64 = ideal.iter().take(k).enumerate().map(|(i, &g)| g as f64 * discount(i)).sum();
    if idcg > 0.0 {
        dcg / idcg
    } else {
        0.0
    }
}
