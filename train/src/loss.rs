//! Contrastive losses over query and passage embeddings (REFERENCE §1, §6).
//!
//! Each loss takes the embeddings of the whole batch. In a data-parallel run the trainer
//! gathers them from every process first (`rak_core::dist::ProcessGroup::gather_rows`: the
//! local rows keep their graph), so every process computes the same loss over the global
//! batch and summing the processes' gradients gives its gradient.

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// NCE with in-batch and hard negatives: `q` is `[B, d]`; `p` is `[B·n, d]`, query `i`'s group
/// at rows `i·n .. (i+1)·n`, its positive first. Every passage in the (gathered) batch is a
/// candidate for every query; the loss is the mean cross-entropy with the query's positive as
/// target, over the scores `scale · <q, p>` (1: REFERENCE §1's raw dot product; unit-length
/// embeddings need a larger one, as sentence-transformers' 20, or cosines in [-1, 1] keep the
/// softmax nearly flat). `copies[i]` (empty, or one list per query) are rows left out of query
/// `i`'s candidates: other copies of its positive (see [`copies_of_positives`]), which would
/// otherwise be its negatives.
pub fn nce_loss(q: &Tensor, p: &Tensor, group: usize, scale: f64, copies: &[Vec<i64>]) -> Result<Tensor> {
    let (b, d) = q.size2()?;
    let (rows, pd) = p.size2()?;
    if group == 0 || rows != b * group as i64 || pd != d {
        bail!("nce_loss: {rows} passages of width {pd} for {b} queries of width {d} in groups of {group}");
    }
    let scores = q.matmul(&p.tr());
    let scores = if scale == 1.0 { scores } else { scores * scale };
    let targets = Tensor::arange(b, (Kind::Int64, q.device())) * group as i64;
    Ok(without(scores.to_kind(Kind::Float), copies)?.cross_entropy_for_logits(&targets))
}

/// `scores` (`[B, N]`) with each row `i`'s `copies[i]` set to −∞ (no copies: as it is).
fn without(scores: Tensor, copies: &[Vec<i64>]) -> Result<Tensor> {
    if copies.iter().all(Vec::is_empty) {
        return Ok(scores);
    }
    let (b, n) = scores.size2()?;
    if copies.len() != b as usize {
        bail!("{} lists of copies for {b} queries", copies.len());
    }
    let mut mask = vec![false; (b * n) as usize];
    for (i, rows) in copies.iter().enumerate() {
        for &j in rows {
            if j < 0 || j >= n {
                bail!("copy row {j} is outside the batch of {n} passages");
            }
            mask[i * n as usize + j as usize] = true;
        }
    }
    let mask = Tensor::from_slice(&mask).view([b, n]).to_device(scores.device());
    Ok(scores.masked_fill(&mask, f64::NEG_INFINITY))
}

/// NCE of queries `q` (`[B, d]`) against any candidate set `candidates` (`[N, d]`), query
/// `i`'s positive at row `first + i·group`: the loss with in-batch negatives from the whole
/// step (every task's passages) rather than the query's own task; `copies` as in [`nce_loss`],
/// rows of `candidates`. Single process.
pub fn nce_loss_against(q: &Tensor, candidates: &Tensor, first: i64, group: usize, scale: f64, copies: &[Vec<i64>]) -> Result<Tensor> {
    let (b, d) = q.size2()?;
    let (n, cd) = candidates.size2()?;
    if group == 0 || cd != d || first < 0 || first + b * group as i64 > n {
        bail!("nce_loss_against: {b} queries of width {d} in groups of {group} from row {first} of {n} candidates of width {cd}");
    }
    let scores = q.matmul(&candidates.tr());
    let scores = if scale == 1.0 { scores } else { scores * scale };
    let targets = Tensor::arange(b, (Kind::Int64, q.device())) * group as i64 + first;
    Ok(without(scores.to_kind(Kind::Float), copies)?.cross_entropy_for_logits(&targets))
}

/// AAR's multi-positive loss (REFERENCE §6): for each (query, positive) pair, cross-entropy of
/// that positive against every passage in the batch that is not one of the query's own
/// positives; the mean over pairs. `positives[i]` lists the rows of `p` that are query `i`'s
/// positives; `copies[i]` the other rows of `p` that hold one of them (another query's
/// positive or negative that is the same passage: never a negative of `i`; see
/// [`copies_of_positives`]). Scores are `scale · <q, p>` as in [`nce_loss`].
pub fn multi_positive_loss(q: &Tensor, p: &Tensor, positives: &[Vec<i64>], copies: &[Vec<i64>], scale: f64) -> Result<Tensor> {
    let (b, _) = q.size2()?;
    if positives.len() != b as usize || positives.iter().any(|ps| ps.is_empty()) {
        bail!("multi_positive_loss: every one of the {b} queries needs at least one positive");
    }
    if copies.len() != positives.len() {
        bail!("multi_positive_loss: {} lists of copies for {b} queries", copies.len());
    }
    let scores = q.matmul(&p.tr()).to_kind(Kind::Float);
    let scores = if scale == 1.0 { scores } else { scores * scale };
    let n = scores.size()[1];
    let mut losses = Vec::new();
    for (i, ps) in positives.iter().enumerate() {
        let mut own = vec![false; n as usize];
        for &r in ps.iter().chain(&copies[i]) {
            if r < 0 || r >= n {
                bail!("multi_positive_loss: positive row {r} is outside the batch of {n} passages");
            }
            own[r as usize] = true;
        }
        let row = scores.get(i as i64);
        for &r in ps {
            // The positive itself plus every passage that is not one of this query's positives.
            let keep: Vec<i64> = (0..n).filter(|&j| j == r || !own[j as usize]).collect();
            let target = keep.iter().position(|&j| j == r).unwrap() as i64;
            let logits = row.index_select(0, &Tensor::from_slice(&keep).to_device(row.device()));
            losses.push(-logits.log_softmax(0, Kind::Float).get(target));
        }
    }
    Ok(Tensor::stack(&losses, 0).mean(Kind::Float))
}

/// REPLUG's LM-supervised retrieval loss (REFERENCE §6, its end): query `i`'s scored passages
/// are the next `lm_scores[i].len()` rows of `p` (`[Σ n_i, d]`); over them the retriever's
/// distribution P_R = softmax(`scale` · <q_i, p>) (REPLUG's s/γ, γ = 1/`scale`) and the LM's
/// Q = softmax(`lm_scores[i]` / `lm_temperature`) (its β); the loss is the mean over queries of
/// KL(P_R ‖ Q), as REFERENCE and the REPLUG paper write it. Q is a constant (computed in f64,
/// so very negative log-likelihoods do not overflow float32): only the retriever learns. Each
/// query meets only its own passages.
pub fn lm_supervised_loss(q: &Tensor, p: &Tensor, lm_scores: &[Vec<f64>], scale: f64, lm_temperature: f64) -> Result<Tensor> {
    let (b, d) = q.size2()?;
    let (rows, pd) = p.size2()?;
    let total: usize = lm_scores.iter().map(Vec::len).sum();
    if lm_scores.len() != b as usize || total as i64 != rows || pd != d || lm_scores.iter().any(Vec::is_empty) {
        bail!("lm_supervised_loss: {rows} passages of width {pd} for {b} queries of width {d} with {} lists of {total} LM scores (none empty)", lm_scores.len());
    }
    if !(lm_temperature > 0.0) {
        bail!("lm_supervised_loss: lm_temperature {lm_temperature} is not positive");
    }
    let mut losses = Vec::with_capacity(lm_scores.len());
    let mut first = 0;
    for (i, scores) in lm_scores.iter().enumerate() {
        let n = scores.len() as i64;
        let logits = p.narrow(0, first, n).matmul(&q.get(i as i64)).to_kind(Kind::Float) * scale;
        let log_r = logits.log_softmax(0, Kind::Float);
        let log_q = (Tensor::from_slice(scores) / lm_temperature).log_softmax(0, Kind::Double).to_kind(Kind::Float).to_device(q.device());
        losses.push((log_r.exp() * (&log_r - log_q)).sum(Kind::Float));
        first += n;
    }
    Ok(Tensor::stack(&losses, 0).mean(Kind::Float))
}

/// For each query, the rows of `texts` other than its `positives` that hold the same passage
/// as one of them (two queries on one gold paragraph, or a query's negative that is another's
/// positive): what [`multi_positive_loss`] must not count as its negatives.
pub fn copies_of_positives(texts: &[&str], positives: &[Vec<i64>]) -> Vec<Vec<i64>> {
    copies_of_any_positive(texts, positives, &[])
}

/// [`copies_of_positives`], where a query's positives are also the texts `also[i]` (empty, or
/// one list per query): NCE puts one drawn positive of a query in the batch, and its other
/// gold passages, wherever they turn up (another query's positive or hard negative), are
/// positives of the query too, not its negatives.
pub fn copies_of_any_positive(texts: &[&str], positives: &[Vec<i64>], also: &[Vec<&str>]) -> Vec<Vec<i64>> {
    let mut rows_of: std::collections::HashMap<&str, Vec<i64>> = std::collections::HashMap::new();
    for (j, t) in texts.iter().enumerate() {
        rows_of.entry(t).or_default().push(j as i64);
    }
    positives
        .iter()
        .enumerate()
        .map(|(i, ps)| {
            let own = ps.iter().filter_map(|&r| texts.get(r as usize).copied());
            let extra = also.get(i).into_iter().flatten().copied();
            let mut copies: Vec<i64> =
                own.chain(extra).flat_map(|t| rows_of.get(t).into_iter().flatten().copied()).filter(|j| !ps.contains(j)).collect();
            copies.sort_unstable();
            copies.dedup();
            copies
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], rows: i64) -> Tensor {
        Tensor::from_slice(v).view([rows, -1])
    }

    /// Against the formula written out: scores = q·pᵀ, loss = mean_i −log softmax(scores_i)[i·n].
    #[test]
    fn nce_matches_the_formula() {
        let q = t(&[1.0, 0.0, 0.5, 0.5], 2);
        let p = t(&[1.0, 0.1, 0.0, 1.0, 0.3, 0.3, 0.2, 0.9], 4);
        for scale in [1.0, 20.0] {
        let loss = nce_loss(&q, &p, 2, scale, &[]).unwrap().double_value(&[]);
        let s = |a: [f64; 2], b: [f64; 2]| scale * (a[0] * b[0] + a[1] * b[1]);
        let qs = [[1.0, 0.0], [0.5, 0.5]];
        let ps = [[1.0, 0.1], [0.0, 1.0], [0.3, 0.3], [0.2, 0.9]];
        let mut want = 0.0;
        for (i, qi) in qs.iter().enumerate() {
            let scores: Vec<f64> = ps.iter().map(|pj| s(*qi, *pj)).collect();
            let lse = scores.iter().map(|x| x.exp()).sum::<f64>().ln();
            want += lse - scores[i * 2];
        }
        want /= 2.0;
        assert!((loss - want).abs() < 1e-5, "scale {scale}: {loss} vs {want}");
        }
        assert!(nce_loss(&q, &p, 3, 1.0, &[]).is_err());
    }

    /// Against `nce_loss` on a candidate block, and against the formula with candidates before
    /// and after the query's own group.
    #[test]
    fn nce_against_a_larger_candidate_set() {
        let q = t(&[1.0, 0.0, 0.5, 0.5], 2);
        let own = t(&[1.0, 0.1, 0.0, 1.0, 0.3, 0.3, 0.2, 0.9], 4);
        let same = nce_loss_against(&q, &own, 0, 2, 20.0, &[]).unwrap().double_value(&[]);
        assert!((same - nce_loss(&q, &own, 2, 20.0, &[]).unwrap().double_value(&[])).abs() < 1e-6);
        let other = t(&[0.9, 0.0, -1.0, 0.5], 2);
        let all = Tensor::cat(&[&other, &own], 0);
        let loss = nce_loss_against(&q, &all, 2, 2, 1.0, &[]).unwrap().double_value(&[]);
        let s = all.matmul(&q.tr()).tr().to_kind(Kind::Double);
        let want = (0..2).map(|i| s.get(i).logsumexp([0i64].as_slice(), false).double_value(&[]) - s.double_value(&[i, 2 + 2 * i])).sum::<f64>() / 2.0;
        assert!((loss - want).abs() < 1e-6, "{loss} vs {want}");
        assert!(nce_loss_against(&q, &all, 3, 2, 1.0, &[]).is_err(), "the groups run past the candidates");
    }

    /// Two queries on one passage: each one's positive is the other's in-batch negative. Masked,
    /// each query's loss is the loss over its candidates without that copy (checked against the
    /// formula, and against the batch with the copy's row dropped); unmasked, the copy scores as
    /// high as the positive, so the loss stays above ln 2 however well the model does.
    #[test]
    fn nce_leaves_copies_of_the_positive_out_of_the_negatives() {
        let q = t(&[1.0, 0.0, 0.8, 0.6], 2);
        // Query 0: positive "a" (row 0), hard negative "x" (row 1); query 1: positive "a" again
        // (row 2), hard negative "y" (row 3).
        let p = t(&[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.6, -0.8], 4);
        let texts = ["a", "x", "a", "y"];
        let copies = copies_of_positives(&texts, &[vec![0], vec![2]]);
        assert_eq!(copies, vec![vec![2], vec![0]]);
        for scale in [1.0, 20.0] {
            let masked = nce_loss(&q, &p, 2, scale, &copies).unwrap().double_value(&[]);
            let s = p.matmul(&q.tr()).tr().to_kind(Kind::Double) * scale;
            let lse = |i: i64, rows: &[i64]| rows.iter().map(|&j| s.double_value(&[i, j]).exp()).sum::<f64>().ln();
            let want = ((lse(0, &[0, 1, 3]) - s.double_value(&[0, 0])) + (lse(1, &[1, 2, 3]) - s.double_value(&[1, 2]))) / 2.0;
            assert!((masked - want).abs() < 1e-5, "scale {scale}: {masked} vs {want}");
            let against = nce_loss_against(&q, &p, 0, 2, scale, &copies).unwrap().double_value(&[]);
            assert!((against - masked).abs() < 1e-6);
        }
        let unmasked = nce_loss(&q, &p, 2, 100.0, &[]).unwrap().double_value(&[]);
        assert!(unmasked > 2f64.ln() - 1e-6 && nce_loss(&q, &p, 2, 100.0, &copies).unwrap().double_value(&[]) < 0.01, "{unmasked}");
        assert!(nce_loss(&q, &p, 2, 1.0, &[vec![4], vec![]]).is_err(), "a copy outside the batch");
        assert!(nce_loss(&q, &p, 2, 1.0, &[vec![2]]).is_err(), "one list for two queries");
    }

    /// NCE draws one of a query's gold passages; another of them elsewhere in the batch (here
    /// the other query's hard negative) is a positive of the query too, and is masked with the
    /// drawn one's copies.
    #[test]
    fn every_positive_of_the_query_is_masked_not_only_the_drawn_one() {
        // Query 0 drew "a" (row 0) and also has gold "b"; query 1: positive "c", negative "b".
        let texts = ["a", "x", "c", "b"];
        let drawn = vec![vec![0], vec![2]];
        assert_eq!(copies_of_positives(&texts, &drawn), vec![Vec::<i64>::new(), vec![]]);
        assert_eq!(copies_of_any_positive(&texts, &drawn, &[vec!["a", "b"], vec!["c"]]), vec![vec![3], vec![]]);
        assert_eq!(copies_of_any_positive(&texts, &drawn, &[vec!["zzz"], vec![]]), vec![Vec::<i64>::new(), vec![]], "a gold passage not in the batch");
    }

    #[test]
    fn multi_positive_excludes_the_query_s_other_positives() {
        let q = t(&[1.0, 0.0], 1);
        let p = t(&[1.0, 0.0, 0.9, 0.0, 0.0, 1.0], 3);
        let loss = multi_positive_loss(&q, &p, &[vec![0, 1]], &[vec![]], 1.0).unwrap().double_value(&[]);
        // Pair (0): candidates {0, 2}; pair (1): candidates {1, 2}.
        let l0 = -(1f64.exp() / (1f64.exp() + 1.0)).ln();
        let l1 = -(0.9f64.exp() / (0.9f64.exp() + 1.0)).ln();
        assert!((loss - (l0 + l1) / 2.0).abs() < 1e-6);
    }

    /// Against KL(P_R ‖ Q) written out in f64, two queries with 3 and 2 scored passages; zero
    /// where the retriever already agrees with the LM, and its gradient moves P_R toward Q.
    #[test]
    fn lm_supervised_matches_the_formula() {
        let q = t(&[1.0, 0.0, 0.6, 0.8], 2);
        let p = t(&[1.0, 0.0, 0.0, 1.0, 0.6, 0.8, 0.8, 0.6, -1.0, 0.0], 5);
        let lm = vec![vec![-1.0, -3.0, -2.0], vec![-0.5, -4.0]];
        let (scale, beta) = (5.0, 0.5);
        let loss = lm_supervised_loss(&q, &p, &lm, scale, beta).unwrap().double_value(&[]);
        let softmax = |x: &[f64]| {
            let m = x.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            x.iter().map(|v| (v - m).exp() / z).collect::<Vec<f64>>()
        };
        let qs = [[1.0, 0.0], [0.6, 0.8]];
        let ps = [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.8, 0.6], [-1.0, 0.0]];
        let groups = [0..3, 3..5];
        let mut want = 0.0;
        for (i, rows) in groups.iter().enumerate() {
            let s: Vec<f64> = rows.clone().map(|j| scale * (qs[i][0] * ps[j][0] + qs[i][1] * ps[j][1])).collect();
            let r = softmax(&s);
            let target = softmax(&lm[i].iter().map(|v| v / beta).collect::<Vec<_>>());
            want += r.iter().zip(&target).map(|(a, b)| a * (a / b).ln()).sum::<f64>();
        }
        want /= 2.0;
        assert!((loss - want).abs() < 1e-5, "{loss} vs {want}");

        // A retriever that already gives the LM's distribution: no loss.
        let q1 = t(&[1.0, 0.0], 1);
        let p1 = t(&[0.2, 0.0, 0.1, 0.0], 2);
        let agree = lm_supervised_loss(&q1, &p1, &[vec![0.2, 0.1]], 1.0, 1.0).unwrap().double_value(&[]);
        assert!(agree.abs() < 1e-7, "{agree}");

        // One gradient step on the passages lowers the loss (Q is the target, not learnt).
        let pv = p.copy().set_requires_grad(true);
        let l0 = lm_supervised_loss(&q, &pv, &lm, scale, beta).unwrap();
        l0.backward();
        let moved = tch::no_grad(|| &pv - pv.grad() * 0.05);
        let l1 = lm_supervised_loss(&q, &moved, &lm, scale, beta).unwrap().double_value(&[]);
        assert!(l1 < l0.double_value(&[]), "{l1} vs {}", l0.double_value(&[]));

        assert!(lm_supervised_loss(&q, &p, &[vec![0.0; 3], vec![0.0; 3]], 1.0, 1.0).is_err(), "the scores must cover the rows");
        assert!(lm_supervised_loss(&q, &p, &[vec![0.0; 5], vec![]], 1.0, 1.0).is_err(), "no query without scores");
        assert!(lm_supervised_loss(&q, &p, &lm, 1.0, 0.0).is_err());
    }

    /// Two queries on one gold passage: each one's copy of it in the other's rows is not its
    /// negative (REFERENCE §6: "every passage ... that is not one of the query's own positives").
    #[test]
    fn multi_positive_never_takes_a_copy_of_a_positive_as_a_negative() {
        // Rows: query 0's positive "g", its negative "n"; query 1's positive "g", its negative "m".
        let texts = ["g", "n", "g", "m"];
        let positives = vec![vec![0], vec![2]];
        let copies = copies_of_positives(&texts, &positives);
        assert_eq!(copies, vec![vec![2], vec![0]]);
        let q = t(&[1.0, 0.0, 0.0, 1.0], 2);
        let p = t(&[1.0, 0.0, 0.2, 0.1, 1.0, 0.0, 0.0, 0.3], 4);
        let loss = multi_positive_loss(&q, &p, &positives, &copies, 1.0).unwrap().double_value(&[]);
        // Query 0 (score 1 against "g"): candidates rows {0, 1, 3}; query 1 (score 0 against "g"): rows {2, 1, 3}.
        let l0 = -(1f64.exp() / (1f64.exp() + 0.2f64.exp() + 0f64.exp())).ln();
        let l1 = -(0f64.exp() / (0f64.exp() + 0.1f64.exp() + 0.3f64.exp())).ln();
        assert!((loss - (l0 + l1) / 2.0).abs() < 1e-6, "{loss}");
        // Without the copies, each query's own positive would also be its negative.
        let naive = multi_positive_loss(&q, &p, &positives, &[vec![], vec![]], 1.0).unwrap().double_value(&[]);
        assert!((naive - loss).abs() > 1e-3);
    }
}
