//! AAR's training examples from the source LM's scores (REFERENCE §6, steps 4 and 5): the
//! merged positives (by default the authors' rule: gold ∪ the top K LM-preferred passages,
//! gold or not, less those that are gold) and the negatives (the starting retriever's top
//! `negatives_depth` minus the positives, a seeded sample of them kept); and the analysis of
//! how LM preferences and human labels overlap.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use rak_core::rng::Rng;

/// A stream for one purpose of a run: seeded with the first 8 bytes of SHA-256(seed, parts...),
/// so another seed or purpose gives an unrelated stream (purposes here are named by strings, as
/// query ids, where the trainer's [`Rng::derive`] takes numbers).
pub fn named_stream(seed: u64, parts: &[&str]) -> Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    let d = h.finalize();
    Rng(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")))
}

/// The indices of the top `k` scored passages, best first; ties keep the retriever's order
/// (the lower rank first), and passages without a score (failed items) are never picked.
pub fn top_by_score(scores: &[Option<f64>], k: usize, eligible: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut ranked: Vec<usize> = (0..scores.len()).filter(|&i| scores[i].is_some_and(f64::is_finite) && eligible(i)).collect();
    // A stable sort: equal scores stay in retrieval order.
    ranked.sort_by(|&a, &b| scores[b].unwrap().total_cmp(&scores[a].unwrap()));
    ranked.truncate(k);
    ranked
}

/// How the LM-preferred passages join the gold (`aar.positives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositivesRule {
    /// The authors' `tools/merge_qrels.py`: the top K of the N scored passages, gold or not,
    /// then those of them that are not gold; a query whose LM top K holds gold gains fewer.
    Authors,
    /// The top K among the scored passages that are not gold: every query gains K where N
    /// allows (this toolkit's rule before it followed the authors').
    TopKNonGold,
}

impl PositivesRule {
    pub const NAMES: [&'static str; 2] = ["authors", "top_k_non_gold"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "authors" => Some(PositivesRule::Authors),
            "top_k_non_gold" => Some(PositivesRule::TopKNonGold),
            _ => None,
        }
    }
}

/// One query's selection.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The LM-preferred passages that are not gold, by the rule (the positives AAR adds).
    pub added: Vec<String>,
    /// The top K LM-preferred passages, gold or not (for the overlap analysis).
    pub lm_top: Vec<String>,
    /// Gold, then the added ones.
    pub positives: Vec<String>,
}

/// Merged positives for a query whose top N passages `scored` got `scores`.
pub fn select_positives(gold: &[String], scored: &[String], scores: &[Option<f64>], k: usize, rule: PositivesRule) -> Selection {
    let is_gold = |i: usize| gold.iter().any(|g| *g == scored[i]);
    let lm_top: Vec<String> = top_by_score(scores, k, |_| true).into_iter().map(|i| scored[i].clone()).collect();
    let added: Vec<String> = match rule {
        PositivesRule::Authors => lm_top.iter().filter(|p| !gold.contains(p)).cloned().collect(),
        PositivesRule::TopKNonGold => top_by_score(scores, k, |i| !is_gold(i)).into_iter().map(|i| scored[i].clone()).collect(),
    };
    let mut positives = gold.to_vec();
    positives.extend(added.iter().cloned());
    Selection { added, lm_top, positives }
}

/// One query as the analysis sees it: its gold, its scored top N and their scores (all `None`
/// when the source scored nothing of it).
pub struct Scored<'a> {
    pub gold: &'a [String],
    pub top: &'a [String],
    pub scores: &'a [Option<f64>],
}

/// How the LM's preferences overlap the human labels, over every query of the run (those
/// later dropped from training too: the analysis is of the source, not of the examples).
/// LM-side counts are over the queries the source scored something of; a retrieval-side
/// count, `gold_in_retrieved_top_n`, is over every query, on both sides of its share.
pub fn analyse<'a>(queries: impl IntoIterator<Item = Scored<'a>>, k: usize) -> Value {
    let (mut total, mut with_scores, mut gold_in_n) = (0usize, 0usize, 0usize);
    let (mut picks, mut picks_gold, mut gold_passages, mut queries_lm_gold) = (0usize, 0usize, 0usize, 0usize);
    let (mut picks_where, mut picks_gold_where, mut gold_passages_where) = (0usize, 0usize, 0usize);
    for q in queries {
        total += 1;
        let gold_retrieved = q.top.iter().any(|p| q.gold.contains(p));
        gold_in_n += gold_retrieved as usize;
        // Scored as the selection counts it (a NaN is no score: `top_by_score` skips it, and
        // the selection drops a query with nothing else), so both report the same queries.
        if !q.scores.iter().any(|s| s.is_some_and(f64::is_finite)) {
            continue;
        }
        with_scores += 1;
        let lm_top = top_by_score(q.scores, k, |_| true);
        let g = lm_top.iter().filter(|&&i| q.gold.contains(&q.top[i])).count();
        picks += lm_top.len();
        picks_gold += g;
        gold_passages += q.gold.len();
        queries_lm_gold += (g > 0) as usize;
        if gold_retrieved {
            picks_where += lm_top.len();
            picks_gold_where += g;
            gold_passages_where += q.gold.len();
        }
    }
    let share = |a: usize, b: usize| if b == 0 { Value::Null } else { json!(a as f64 / b as f64) };
    json!({
        "source_k": k,
        "queries": total,
        "queries_with_lm_scores": with_scores,
        "lm_preferred": picks,
        "lm_preferred_gold": picks_gold,
        "gold_passages": gold_passages,
        "overlap_authors": share(picks_gold, gold_passages),
        "overlap_authors_help": "the AAR authors' overlap, as their code prints it: LM top-K passages that are gold / gold passages, summed over the queries the source scored; the paper reports about 13% (Flan-T5-base on MS MARCO)",
        "lm_preferred_gold_share": share(picks_gold, picks),
        "lm_preferred_gold_share_help": "share of the top K LM-preferred passages (gold or not) that are gold: LM top-K passages that are gold / LM top-K passages; not the authors' overlap (its denominator is the LM's picks, not the gold), so not comparable with the paper's figure",
        "queries_with_gold_in_lm_top_k": share(queries_lm_gold, with_scores),
        "gold_in_retrieved_top_n": share(gold_in_n, total),
        "overlap_authors_where_gold_in_top_n": share(picks_gold_where, gold_passages_where),
        "lm_preferred_gold_share_where_gold_in_top_n": share(picks_gold_where, picks_where),
    })
}

/// How many of source A's top `k` LM-preferred passages are also source B's, over the same
/// scored passages: (shared, A's top k).
pub fn shared_top_k(a: &[Option<f64>], b: &[Option<f64>], k: usize) -> (usize, usize) {
    let top_a = top_by_score(a, k, |_| true);
    let top_b = top_by_score(b, k, |_| true);
    (top_a.iter().filter(|i| top_b.contains(i)).count(), top_a.len())
}

/// Negatives: the retriever's top `depth` (`ranked`, best first) minus `positives`, then
/// `sampled` of them drawn from `rng` (all when fewer remain).
pub fn select_negatives(ranked: &[String], positives: &[String], depth: usize, sampled: usize, rng: &mut Rng) -> Vec<String> {
    let pool: Vec<String> = ranked.iter().take(depth).filter(|p| !positives.contains(p)).cloned().collect();
    rng.sample(&pool, sampled)
}

/// An evenly spaced subset of `n` of `total` items (all when `n >= total`): the same subset
/// for the same file, spread over all of it (training files are often grouped by article).
pub fn spaced_subset(total: usize, n: usize) -> Vec<usize> {
    if n >= total {
        return (0..total).collect();
    }
    (0..n).map(|i| i * total / n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The authors' rule (the default): the LM's top K, gold or not, less the gold; a query
    /// whose LM top K holds gold gains fewer than K.
    #[test]
    fn authors_positives_are_the_lm_top_k_less_the_gold() {
        let scored = ids(&["a", "g", "b", "c", "d"]);
        let scores = [Some(0.1), Some(0.9), Some(0.5), None, Some(0.5)];
        let s = select_positives(&ids(&["g", "x"]), &scored, &scores, 2, PositivesRule::Authors);
        // The LM's top 2 are g (gold) and b (b and d tie: the retriever's order decides).
        assert_eq!(s.lm_top, ids(&["g", "b"]));
        assert_eq!(s.added, ids(&["b"]));
        assert_eq!(s.positives, ids(&["g", "x", "b"]));
        // No gold in the LM's top 2: two added, three positives with one gold (the authors'
        // exactly-three queries).
        let s = select_positives(&ids(&["a"]), &scored, &scores, 2, PositivesRule::Authors);
        assert_eq!((s.added, s.positives.len()), (ids(&["g", "b"]), 3));
        // Both of the LM's top 2 gold: nothing added.
        let s = select_positives(&ids(&["g", "b"]), &scored, &scores, 2, PositivesRule::Authors);
        assert_eq!(s.added, Vec::<String>::new());
        // A failed item (c) is never picked; fewer scored passages than K: what there is.
        let s = select_positives(&ids(&["g"]), &ids(&["g", "a"]), &[Some(1.0), None], 2, PositivesRule::Authors);
        assert_eq!((s.lm_top, s.added), (ids(&["g"]), Vec::<String>::new()));
    }

    /// The named alternative: the top K among the passages that are not gold.
    #[test]
    fn top_k_non_gold_positives_skip_the_gold() {
        let scored = ids(&["a", "g", "b", "c", "d"]);
        let scores = [Some(0.1), Some(0.9), Some(0.5), None, Some(0.5)];
        let s = select_positives(&ids(&["g", "x"]), &scored, &scores, 2, PositivesRule::TopKNonGold);
        assert_eq!(s.added, ids(&["b", "d"]));
        assert_eq!(s.lm_top, ids(&["g", "b"]));
        assert_eq!(s.positives, ids(&["g", "x", "b", "d"]));
        let s = select_positives(&ids(&["g"]), &ids(&["g", "a"]), &[Some(1.0), None], 2, PositivesRule::TopKNonGold);
        assert_eq!(s.added, Vec::<String>::new());
        assert_eq!(PositivesRule::parse("authors"), Some(PositivesRule::Authors));
        assert_eq!(PositivesRule::parse("top_k"), None);
    }

    /// The authors' overlap divides by the gold passages, the other share by the LM's picks;
    /// a query the source scored nothing of counts on both sides of the retrieval's share.
    #[test]
    fn the_analysis_reports_the_authors_overlap_and_counts_every_query_once() {
        let (g1, t1) = (ids(&["g1", "h1"]), ids(&["g1", "a", "b"]));
        let (g2, t2) = (ids(&["g2"]), ids(&["c", "d", "g2"]));
        let (g3, t3) = (ids(&["g3"]), ids(&["e", "f", "g3"]));
        let (s1, s2, s3) = ([Some(0.9), Some(0.5), Some(0.1)], [Some(0.9), Some(0.5), Some(0.1)], [None, None, None]);
        let a = analyse(
            [
                Scored { gold: &g1, top: &t1, scores: &s1 },
                Scored { gold: &g2, top: &t2, scores: &s2 },
                // Unscored (every item failed), its gold retrieved.
                Scored { gold: &g3, top: &t3, scores: &s3 },
            ],
            2,
        );
        // LM top 2: {g1, a} and {c, d}: one gold of 4 picks, of 3 gold passages.
        assert_eq!((a["lm_preferred"].as_u64(), a["lm_preferred_gold"].as_u64(), a["gold_passages"].as_u64()), (Some(4), Some(1), Some(3)), "{a}");
        assert_eq!(a["overlap_authors"].as_f64(), Some(1.0 / 3.0), "{a}");
        assert_eq!(a["lm_preferred_gold_share"].as_f64(), Some(0.25), "{a}");
        assert_eq!(a["queries_with_gold_in_lm_top_k"].as_f64(), Some(0.5), "{a}");
        // Every query's gold is in its top 3, the unscored one's too: 3 of 3, not 2 of 3.
        assert_eq!(a["gold_in_retrieved_top_n"].as_f64(), Some(1.0), "{a}");
        assert_eq!((a["queries"].as_u64(), a["queries_with_lm_scores"].as_u64()), (Some(3), Some(2)), "{a}");
    }

    /// A query whose scores are all NaN is unscored for the analysis, as for the selection:
    /// its gold is in no LM-side denominator.
    #[test]
    fn a_query_scored_only_nan_is_unscored() {
        let (g, t) = (ids(&["g"]), ids(&["g", "a"]));
        let a = analyse([Scored { gold: &g, top: &t, scores: &[Some(f64::NAN), Some(f64::NAN)] }], 2);
        assert_eq!(a["queries_with_lm_scores"].as_u64(), Some(0), "{a}");
        assert_eq!(a["gold_passages"].as_u64(), Some(0), "{a}");
        assert!(a["overlap_authors"].is_null(), "{a}");
    }

    #[test]
    fn two_sources_share_their_top_k() {
        // A prefers 0 then 2; B prefers 2 then 1: one of A's two is B's too.
        assert_eq!(shared_top_k(&[Some(0.9), Some(0.1), Some(0.5)], &[Some(0.2), Some(0.6), Some(0.8)], 2), (1, 2));
        // A failed item is nobody's preference; with one scored passage A's top K is one.
        assert_eq!(shared_top_k(&[None, Some(0.1), None], &[Some(0.2), Some(0.6), Some(0.8)], 2), (1, 1));
        assert_eq!(shared_top_k(&[None, None], &[Some(1.0), Some(0.0)], 2), (0, 0));
    }

    #[test]
    fn negatives_exclude_positives_and_are_a_seeded_sample() {
        let ranked: Vec<String> = (0..50).map(|i| format!("p{i}")).collect();
        let positives = ids(&["p0", "p3"]);
        let a = select_negatives(&ranked, &positives, 20, 10, &mut named_stream(1, &["aar-negatives", "q1"]));
        let b = select_negatives(&ranked, &positives, 20, 10, &mut named_stream(1, &["aar-negatives", "q1"]));
        let c = select_negatives(&ranked, &positives, 20, 10, &mut named_stream(2, &["aar-negatives", "q1"]));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 10);
        let mut seen = std::collections::HashSet::new();
        for n in &a {
            assert!(!positives.contains(n) && seen.insert(n.clone()));
            assert!(ranked[..20].contains(n), "{n} is deeper than the depth");
        }
        // Fewer than asked: all of them.
        assert_eq!(select_negatives(&ranked[..4], &positives, 20, 10, &mut named_stream(0, &[])).len(), 2);
    }

    #[test]
    fn named_streams_are_those_earlier_runs_drew() {
        // The values a Python SHA-256 + SplitMix64 gives: a run resumed with a newer build
        // samples the negatives its first part sampled.
        let seed = named_stream(42, &["aar-negatives"]).next_u64();
        assert_eq!(seed, 0xdd4a_7296_cf06_26a5);
        assert_eq!(named_stream(seed, &["q1"]).0, 0xd8df_b521_0e82_2280);
        // And the draw itself (the shared generator's `sample` and `below`), from the same
        // Python: a change to rak_core's Rng made for the trainer must not move AAR's negatives.
        let ranked: Vec<String> = (0..50).map(|i| format!("p{i}")).collect();
        let drawn = select_negatives(&ranked, &ids(&["p0", "p3"]), 20, 10, &mut named_stream(seed, &["q1"]));
        assert_eq!(drawn, ids(&["p18", "p7", "p9", "p15", "p8", "p2", "p14", "p16", "p6", "p1"]));
    }

    #[test]
    fn subsets_are_spread_and_exact() {
        assert_eq!(spaced_subset(10, 3), vec![0, 3, 6]);
        assert_eq!(spaced_subset(3, 5), vec![0, 1, 2]);
        let mut r = named_stream(5, &[]);
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
