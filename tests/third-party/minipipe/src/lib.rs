//! `host minipipe`: a command plugin that runs the retrieval pipeline end to end through the
//! host's services, as a third party's command (like `aar-train`) would.
//!
//! - `minipipe run --encoder E --settings JSON --corpus FILE --queries FILE --qrels FILE
//!   --work DIR [--k K] [--task T]`: encode the corpus, build a flat index, search (writing
//!   `DIR/run.trec`), evaluate; and search again with query embeddings computed here as
//!   tensors, from four threads at once, checking both searches agree. Prints JSON.
//! - `minipipe grad --encoder E --settings JSON`: one contrastive loss through the host's
//!   encoder, backward, and which parameters got gradients. Prints JSON.
//! - `minipipe read --name R --settings JSON --request JSON`: one `generate` through the
//!   host's reader service. Prints the reply.
//! - `minipipe connect --name C --settings JSON --threads N --requests M`: M connector calls
//!   from N threads through one host connector. Prints JSON.
//! - `minipipe train --request JSON`: a whole training run through the host's `train`
//!   service (its own examples when the request has them). Prints the service's reply.
//! - `minipipe exit N`: return N as the exit code.

use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_core::plugin::{Command, Connector, Encoder, Host, Reader};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

pub struct MiniPipe;

/// `--name value` pairs.
fn flags(args: &[String]) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let name = a.strip_prefix("--").with_context(|| format!("unexpected argument {a:?}"))?;
        let value = it.next().with_context(|| format!("--{name} needs a value"))?;
        out.insert(name.to_string(), value.clone());
    }
    Ok(out)
}

fn flag<'a>(f: &'a HashMap<String, String>, name: &str) -> Result<&'a str> {
    f.get(name).map(String::as_str).with_context(|| format!("--{name} is required"))
}

/// `(id, text)` of a queries JSONL file.
fn read_queries(path: &Path) -> Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l)?;
            Ok((v["_id"].as_str().context("_id")?.to_string(), v["text"].as_str().context("text")?.to_string()))
        })
        .collect()
}

fn run_pipeline(f: &HashMap<String, String>, host: &Host) -> Result<i32> {
    let settings: Value = serde_json::from_str(flag(f, "settings")?).context("--settings")?;
    let (corpus, queries_file, qrels) = (flag(f, "corpus")?, flag(f, "queries")?, flag(f, "qrels")?);
    let work = PathBuf::from(flag(f, "work")?);
    let k: usize = f.get("k").map(|k| k.parse()).transpose()?.unwrap_or(10);
    let task = f.get("task").cloned();
    let steps = host.progress("minipipe", 4)?;

    let mut encoder = host.encoder(flag(f, "encoder")?, &settings)?;
    let emb = work.join("emb");
    let encoded = host.encode_corpus(&encoder, json!({"input": corpus, "output": emb, "batch_size": 16}))?;
    host.log(&format!("minipipe: encoded {}", encoded["rows"]))?;
    steps.inc(1)?;
    let idx_dir = work.join("idx");
    host.build_index(json!({"kind": "flat", "embeddings": emb, "output": idx_dir}))?;
    let index = host.open_index(&idx_dir)?;
    steps.inc(1)?;
    let run_file = work.join("run.trec");
    let run = host.search(&index, Some(&encoder), json!({"queries": queries_file, "k": k, "task": task, "output": run_file}))?;
    steps.inc(1)?;

    // The same search with tensors crossing the ABI: embed the queries here, then search from
    // several threads at once.
    let queries = read_queries(Path::new(queries_file))?;
    let texts: Vec<&str> = queries.iter().map(|(_, t)| t.as_str()).collect();
    let emb_q = encoder.encode(&texts, Role::Query, task.as_deref(), false)?;
    let chunks: Vec<Tensor> = emb_q.chunk(4, 0);
    let results: Vec<Vec<Vec<(String, f32)>>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let (index, host) = (&index, host.clone());
                s.spawn(move || -> Result<Vec<Vec<(String, f32)>>> {
                    host.log(&format!("minipipe: thread {i} searching {} queries", c.size()[0]))?;
                    index.search_vectors(&c, k)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("search thread")).collect::<Result<_>>()
    })?;
    let mut mismatches = 0;
    for ((qid, _), hits) in queries.iter().zip(results.into_iter().flatten()) {
        let service: Vec<(String, f64)> = serde_json::from_value(run[qid].clone()).unwrap_or_default();
        let same = service.len() == hits.len()
            && service.iter().zip(&hits).all(|((a, sa), (b, sb))| a == b && (*sa as f32 - sb).abs() <= 1e-5);
        if !same {
            mismatches += 1;
        }
    }

    let metrics = host.eval(json!({"corpus": corpus, "runs": [{"run": run_file, "qrels": qrels, "queries": queries_file, "name": "task"}]}))?;
    steps.inc(1)?;
    drop(steps);
    println!("{}", json!({"rows": encoded["rows"], "queries": queries.len(), "tensor_search_mismatches": mismatches, "metrics": metrics}));
    Ok(if mismatches == 0 { 0 } else { 3 })
}

fn gradients(f: &HashMap<String, String>, host: &Host) -> Result<i32> {
    let settings: Value = serde_json::from_str(flag(f, "settings")?).context("--settings")?;
    let mut encoder = host.encoder(flag(f, "encoder")?, &settings)?;
    let params = encoder.parameters()?;
    let q = encoder.encode(&["who won super bowl 50?"], Role::Query, Some("squad"), true)?;
    let p = encoder.encode(&["Denver won Super Bowl 50.", "Tuscany is a region of Italy."], Role::Passage, None, true)?;
    let loss = q.matmul(&p.tr()).log_softmax(-1, Kind::Float).get(0).get(0).neg();
    loss.backward();
    let with_grad: Vec<&str> = params
        .iter()
        .filter(|(_, t)| {
            let g = t.grad();
            g.defined() && g.abs().sum(Kind::Float).double_value(&[]) > 0.0
        })
        .map(|(n, _)| n.as_str())
        .collect();
    println!("{}", json!({"loss": loss.double_value(&[]), "parameters": params.len(), "with_grad": with_grad}));
    Ok(0)
}

fn read(f: &HashMap<String, String>, host: &Host) -> Result<i32> {
    let settings: Value = serde_json::from_str(flag(f, "settings")?).context("--settings")?;
    let request: Value = serde_json::from_str(flag(f, "request")?).context("--request")?;
    let mut reader = host.reader(flag(f, "name")?, &settings)?;
    println!("{}", reader.generate(request)?);
    Ok(0)
}

fn connect(f: &HashMap<String, String>, host: &Host) -> Result<i32> {
    let settings: Value = serde_json::from_str(flag(f, "settings")?).context("--settings")?;
    let threads: usize = flag(f, "threads")?.parse()?;
    let requests: usize = flag(f, "requests")?.parse()?;
    let connector = host.connector(flag(f, "name")?, &settings)?;
    let replies: Vec<(usize, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let connector = &connector;
                s.spawn(move || -> Result<Vec<(usize, Value)>> {
                    (t..requests).step_by(threads).map(|i| Ok((i, connector.complete(json!({"i": i}))?))).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("connector thread")).collect::<Result<Vec<_>>>().map(|v| v.concat())
    })?;
    let wrong = replies.iter().filter(|(i, r)| r["echo"]["i"] != json!(i)).count();
    let most = replies.iter().filter_map(|(_, r)| r["in_flight"].as_u64()).max().unwrap_or(0);
    println!("{}", json!({"replies": replies.len(), "wrong": wrong, "most_in_flight": most}));
    Ok(0)
}

impl Command for MiniPipe {
    const NAME: &'static str = "minipipe";
    const ABOUT: &'static str = "The retrieval pipeline end to end through the host's services";

    fn settings_schema() -> Value {
        json!({})
    }

    fn run(args: &[String], host: &Host) -> Result<i32> {
        let Some((sub, rest)) = args.split_first() else { bail!("usage: host minipipe run|grad|read|connect|train|exit ...") };
        match sub.as_str() {
            "run" => run_pipeline(&flags(rest)?, host),
            "grad" => gradients(&flags(rest)?, host),
            "read" => read(&flags(rest)?, host),
            "connect" => connect(&flags(rest)?, host),
            "train" => {
                let request: Value = serde_json::from_str(flag(&flags(rest)?, "request")?).context("--request")?;
                println!("{}", host.train(request)?);
                Ok(0)
            }
            "exit" => Ok(rest.first().context("exit N")?.parse()?),
            other => bail!("unknown minipipe subcommand {other:?}"),
        }
    }
}

rak_core::export_command!(MiniPipe);
