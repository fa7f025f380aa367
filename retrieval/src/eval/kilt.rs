//! KILT's page-level R-precision (`rprecision` in KILT's `kilt/eval_retrieval.py`).

/// Retrieved passages' pages, de-duplicated keeping the first (best) rank. Trimmed as KILT
/// trims ids.
pub fn ranked_pages<'a>(titles: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen = std::collections::HashSet::new();
    titles.into_iter().map(str::trim).filter(|t| seen.insert(*t)).collect()
}

/// For each gold set (its distinct pages, R of them) the share of it among the first R ranked
/// pages; the best set counts. No gold set, or only empty ones, gives 0 (as in KILT).
pub fn rprec_page(ranked: &[&str], gold_sets: &[Vec<&str>]) -> f64 {
    gold_sets
        .iter()
        .map(|set| {
            let gold: std::collections::HashSet<&str> = set.iter().map(|t| t.trim()).collect();
            let r = gold.len();
            if r == 0 {
                return 0.0;
            }
            ranked.iter().take(r).filter(|t| gold.contains(*t)).count() as f64 / r as f64
        })
        .fold(0.0, f64::max)
}
