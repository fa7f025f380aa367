//! `host eval`: TREC runs + qrels (+ queries with answers) → metrics JSON on stdout, per task
//! and their macro average when several runs are given.

use anyhow::{bail, Result};
use rak_retrieval::data::{beir, check_qrels_ids, trec, Corpus, Query};
use rak_retrieval::eval::{evaluate_tasks, mean_of, EvalOptions, MissingQueries};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// A TREC run (repeatable: one per task, paired in order with --qrels and --queries).
    #[arg(long = "run", required = true)]
    pub runs: Vec<PathBuf>,
    /// BEIR qrels TSV for each run.
    #[arg(long = "qrels", required = true)]
    pub qrels: Vec<PathBuf>,
    /// The corpus (maps passages to pages for page-level R-precision).
    #[arg(long)]
    pub corpus: PathBuf,
    /// Queries JSONL for each run (answers for answer_acc@k, gold pages).
    #[arg(long = "queries")]
    pub queries: Vec<PathBuf>,
    /// A name for each run (default: the run file's stem).
    #[arg(long = "task")]
    pub tasks: Vec<String>,
    /// Judged queries missing from a run: `zero` (trec_eval -c) or `skip` (pytrec_eval).
    #[arg(long, default_value = "zero")]
    pub missing: String,
    /// Include per-query values.
    #[arg(long)]
    pub per_query: bool,
    /// Also write the JSON here (atomically).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

/// Fact verification labels are not answer strings: answer accuracy is meaningless there.
fn has_answer_strings(queries: &[Query]) -> bool {
    queries.iter().flat_map(|q| &q.answers).any(|a| !matches!(a.as_str(), "SUPPORTS" | "REFUTES" | "NOT ENOUGH INFO"))
}

pub fn run(args: &EvalArgs) -> Result<Value> {
    let n = args.runs.len();
    if args.qrels.len() != n || (!args.queries.is_empty() && args.queries.len() != n) || (!args.tasks.is_empty() && args.tasks.len() != n) {
        bail!("give one --qrels (and, if any, one --queries and one --task) per --run: {n} runs");
    }
    let missing = match args.missing.as_str() {
        "zero" => MissingQueries::Zero,
        "skip" => MissingQueries::Skip,
        other => bail!("--missing {other:?}: expected zero or skip"),
    };
    let corpus = Corpus::from_passages(beir::read_corpus(&args.corpus)?.collect::<Result<Vec<_>>>()?)?;
    let mut loaded = Vec::new();
    for i in 0..n {
        let name = match args.tasks.get(i) {
            Some(t) => t.clone(),
            None => args.runs[i].file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| format!("run{i}")),
        };
        let run = trec::read_run(&args.runs[i])?;
        let qrels = beir::read_qrels(&args.qrels[i])?;
        let queries = match args.queries.get(i) {
            Some(p) => beir::load_queries(p)?,
            None => Vec::new(),
        };
        let query_ids: std::collections::HashSet<&str> = queries.iter().map(|q| q.id.as_str()).collect();
        let unknown = check_qrels_ids(
            &args.qrels[i].display().to_string(),
            &qrels,
            |q| queries.is_empty() || query_ids.contains(q),
            |p| corpus.contains(p),
        );
        if !unknown.is_empty() {
            eprintln!(
                "warning: {}: {} judgements name unknown ids ({} queries, {} passages); they count as relevant but cannot be retrieved",
                args.qrels[i].display(),
                unknown.judgements,
                unknown.queries,
                unknown.passages
            );
        }
        loaded.push((name, run, qrels, queries));
    }
    let mut out = json!({"tasks": {}, "macro": {}});
    let mut means = std::collections::BTreeMap::new();
    for (name, run, qrels, queries) in &loaded {
        let opts = EvalOptions { missing, answer_accuracy: has_answer_strings(queries) };
        let tasks = [(name.as_str(), run, qrels, queries.as_slice())];
        let ev = evaluate_tasks(&tasks, Some(&corpus), &opts);
        let e = &ev.tasks[name];
        let mut entry = json!({
            "queries": e.queries, "missing_queries": e.missing_queries, "unjudged_queries": e.unjudged_queries,
            "answer_queries": e.answer_queries, "metrics": e.mean,
        });
        if args.per_query {
            entry["per_query"] = json!(e.per_query);
        }
        out["tasks"][name] = entry;
        means.insert(name.clone(), e.mean.clone());
    }
    out["macro"] = json!(mean_of(&means));
    eprint!("{}", table(&out));
    if let Some(path) = &args.output {
        rak_core::fsutil::write_bytes(path, serde_json::to_string_pretty(&out)?.as_bytes())?;
    }
    Ok(out)
}

/// The human summary: one row per task (and the macro average), the headline measures.
pub fn table(out: &Value) -> String {
    const COLS: [&str; 8] = ["rprec_page", "rprec_passage", "recall@5", "recall@20", "recall@100", "mrr@10", "ndcg@10", "answer_acc@20"];
    let mut s = format!("{:<12}", "task");
    for c in COLS {
        s += &format!(" {c:>13}");
    }
    s.push('\n');
    let mut row = |name: &str, m: &Value| {
        s += &format!("{name:<12}");
        for c in COLS {
            s += &match m.get(c).and_then(Value::as_f64) {
                Some(v) => format!(" {v:>13.4}"),
                None => format!(" {:>13}", "-"),
            };
        }
        s.push('\n');
    };
    if let Some(tasks) = out["tasks"].as_object() {
        for (name, t) in tasks {
            row(name, &t["metrics"]);
        }
        if tasks.len() > 1 {
            row("macro", &out["macro"]);
        }
    }
    s
}
