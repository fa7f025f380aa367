//! `host eval`: TREC runs + qrels (+ queries with answers) → metrics JSON on stdout, per task
//! and their macro average when several runs are given (see `rak_retrieval::pipeline::eval`).

use super::Bar;
use anyhow::{bail, Context, Result};
use rak_retrieval::eval::MissingQueries;
use rak_retrieval::pipeline::eval::{evaluate_files, EvalInput};
use serde_json::Value;
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
    /// A name for each run (default: the run file's stem, or parent/stem where stems collide).
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

pub fn run(args: &EvalArgs) -> Result<Value> {
    let n = args.runs.len();
    if args.qrels.len() != n || (!args.queries.is_empty() && args.queries.len() != n) || (!args.tasks.is_empty() && args.tasks.len() != n) {
        bail!("give one --qrels (and, if any, one --queries and one --task) per --run: {n} runs");
    }
    let missing: MissingQueries = args.missing.parse().context("--missing")?;
    let inputs: Vec<EvalInput> = (0..n)
        .map(|i| EvalInput {
            name: args.tasks.get(i).cloned(),
            run: args.runs[i].clone(),
            qrels: args.qrels[i].clone(),
            queries: args.queries.get(i).cloned(),
        })
        .collect();
    let out = evaluate_files(&inputs, &args.corpus, missing, args.per_query, &Bar::default())?;
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
