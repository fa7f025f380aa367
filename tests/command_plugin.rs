//! Command plugins and the host's services, through plugins built out of tree: `minipipe`
//! runs the retrieval pipeline end to end through the services; `faulty` misbehaves on
//! request so the host's guards can be seen to work.

use rak_core::abi::Role;
use rak_core::plugin::Encoder;
use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::{json, Value};
use std::path::Path;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The pipeline through a command plugin's services equals the CLI's on the same inputs: the
/// same run file, byte for byte, and the same metrics; the tensor search from four threads
/// agrees with the service's.
#[test]
fn minipipe_through_the_services_equals_the_cli() {
    let s = slice();
    let dir = TempDir::new("minipipe");
    let plugin = minipipe_plugin();
    let settings = json!({"model": minilm_dir()}).to_string();
    let work = dir.path().join("work");
    let out = host(&[
        "--plugin", p(&plugin), "minipipe", "run", "--encoder", "dpr", "--settings", &settings, "--corpus", p(&s.corpus),
        "--queries", p(&s.queries), "--qrels", p(&s.qrels), "--work", p(&work), "--k", "20", "--task", "squad",
    ]);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let v: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["tensor_search_mismatches"], 0, "{v}");
    assert_eq!(v["queries"], 40);
    assert!(stderr(&out).contains("minipipe: thread 3 searching"), "log lines from several threads reach the user");

    let model = minilm_dir();
    let (emb, idx, run) = (dir.path().join("emb"), dir.path().join("idx"), dir.path().join("run.trec"));
    for args in [
        vec!["encode", "--encoder", "dpr", "--model", p(&model), "--input", p(&s.corpus), "--output", p(&emb), "--batch-size", "16"],
        vec!["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&idx)],
        vec!["search", "--index", p(&idx), "--encoder", "dpr", "--model", p(&model), "--queries", p(&s.queries), "--k", "20", "--task", "squad", "--output", p(&run)],
    ] {
        let o = host(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    }
    assert_eq!(std::fs::read(&run).unwrap(), std::fs::read(work.join("run.trec")).unwrap(), "same run file");
    let o = host(&["eval", "--run", p(&run), "--qrels", p(&s.qrels), "--corpus", p(&s.corpus), "--queries", p(&s.queries), "--task", "task"]);
    let cli: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(cli["tasks"]["task"]["metrics"], v["metrics"]["tasks"]["task"]["metrics"]);
    assert!(cli["tasks"]["task"]["metrics"]["mrr@10"].as_f64().unwrap() > 0.3);
}

/// Autograd crosses two ABI boundaries (command plugin -> host -> encoder plugin and back).
#[test]
fn gradients_reach_the_encoder_through_the_services() {
    let settings = json!({"model": minilm_dir()}).to_string();
    let out = host(&["--plugin", p(&minipipe_plugin()), "minipipe", "grad", "--encoder", "dpr", "--settings", &settings]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let with_grad: Vec<&str> = v["with_grad"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert!(v["loss"].as_f64().unwrap() > 0.0);
    for name in ["embeddings.word_embeddings.weight", "encoder.layer.5.output.dense.weight", "encoder.layer.0.attention.self.query.weight"] {
        assert!(with_grad.contains(&name), "{name} has no gradient: {v}");
    }
}

/// The reader service: `fid` on a fixture T5 through the command plugin gives what the reader
/// gives when loaded directly.
#[test]
fn the_reader_service_equals_the_reader() {
    let dir = root().join("tests/fixtures/t5/t5-v1_1");
    let settings = json!({"model": dir, "max_length": 64});
    let request = json!({"items": [{"prompt": "Where is Warsaw?", "passages": [{"title": "Warsaw", "text": "Warsaw is the capital of Poland."}]}], "max_new_tokens": 6});
    let out = host(&[
        "--plugin", p(&minipipe_plugin()), "minipipe", "read", "--name", "fid", "--settings", &settings.to_string(), "--request", &request.to_string(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let via_services: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let direct = Registry::discover(&[Source::Dir(release_dir())]).unwrap().reader("fid", &settings).unwrap().generate(request).unwrap();
    assert_eq!(via_services, direct);
    assert!(!direct["outputs"][0]["ids"].as_array().unwrap().is_empty());
}

/// The connector service carries calls from several threads at once: 32 calls from 8 threads,
/// each answered with its own request, several in flight together.
#[test]
fn the_connector_service_serves_threads_at_once() {
    let out = host(&[
        "--plugin", p(&minipipe_plugin()), "--plugin", p(&echo_plugin()), "minipipe", "connect", "--name", "echo", "--settings", "{\"delay_ms\": 100}",
        "--threads", "8", "--requests", "32",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["replies"], 32);
    assert_eq!(v["wrong"], 0);
    assert!(v["most_in_flight"].as_u64().unwrap() >= 4, "calls were serialised: {v}");
}

#[test]
fn exit_codes_out_of_range_fail() {
    let plugin = minipipe_plugin();
    for (code, want) in [("0", 0), ("7", 7), ("255", 255), ("-1", 1), ("256", 1), ("-255", 1)] {
        let out = host(&["--plugin", p(&plugin), "minipipe", "exit", code]);
        assert_eq!(out.status.code(), Some(want), "exit {code}: {}", stderr(&out));
        if want == 1 {
            assert!(stderr(&out).contains(&format!("returned exit code {code}")), "{}", stderr(&out));
        }
    }
    let out = host(&["--plugin", p(&plugin), "minipipe", "nonsense"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("unknown minipipe subcommand") && stderr(&out).contains("libminipipe_command.so"), "{}", stderr(&out));
}

fn faulty(settings: Value) -> Box<dyn Encoder> {
    Registry::discover(&[Source::File(faulty_plugin())]).unwrap().encoder("faulty", &settings).unwrap()
}

#[test]
fn undefined_tensors_and_wrong_row_counts_name_the_plugin() {
    let texts = ["a", "bb", "ccc"];
    let err = format!("{:#}", faulty(json!({"fault": "undefined"})).encode(&texts, Role::Passage, None, false).unwrap_err());
    assert!(err.contains("\"faulty\"") && err.contains("undefined tensor"), "{err}");
    let err = format!("{:#}", faulty(json!({"fault": "short"})).encode(&texts, Role::Passage, None, false).unwrap_err());
    assert!(err.contains("\"faulty\"") && err.contains("[2, 4]") && err.contains("3 texts"), "{err}");
    let ok = faulty(json!({})).encode(&texts, Role::Passage, None, false).unwrap();
    assert_eq!(ok.size(), vec![3, 4]);

    // Through the CLI: a clear error, no panic, no output.
    let dir = TempDir::new("faulty-encode");
    let corpus = dir.path().join("c.jsonl");
    std::fs::write(&corpus, "{\"_id\":\"1\",\"text\":\"one\"}\n{\"_id\":\"2\",\"text\":\"two two\"}\n").unwrap();
    for fault in ["undefined", "short"] {
        let settings = json!({"fault": fault}).to_string();
        let out_dir = dir.path().join(fault);
        let out = host(&[
            "--plugin", p(&faulty_plugin()), "encode", "--encoder", "faulty", "--model", p(dir.path()), "--input", p(&corpus),
            "--output", p(&out_dir), "--encoder-settings", &settings,
        ]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("faulty") && !err.contains("internal error") && !err.contains("panicked at"), "{err}");
        assert!(!out_dir.join("embeddings.npy").exists());
    }
}

#[test]
fn a_plugin_instance_that_panicked_is_poisoned() {
    let mut enc = faulty(json!({"fault": "panic", "panic_at": 2}));
    assert!(enc.encode(&["x"], Role::Query, None, false).is_ok());
    let first = format!("{:#}", enc.encode(&["x"], Role::Query, None, false).unwrap_err());
    assert!(first.contains("panicked: faulty: panic on call 2"), "{first}");
    // Before poisoning, the third call would run on the half-updated state (and trip its assert).
    let later = format!("{:#}", enc.encode(&["x"], Role::Query, None, false).unwrap_err());
    assert!(later.contains("unusable") && later.contains("panic on call 2"), "{later}");
    let info = format!("{:#}", enc.info().unwrap_err());
    assert!(info.contains("unusable"), "{info}");
    // A new instance works.
    assert!(faulty(json!({"fault": "panic", "panic_at": 9})).encode(&["x"], Role::Query, None, false).is_ok());
}

/// `--plugin NAME.so` (no slash) loads the file in the current folder that was checked, not
/// a same-named library on the loader's search path.
#[test]
fn a_plugin_named_without_a_slash_is_the_file_in_the_current_folder() {
    let dir = TempDir::new("noslash");
    let other = dir.path().join("elsewhere");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(hashbow_plugin(), dir.path().join("libthird.so")).unwrap();
    std::fs::copy(plugin_file("rak_optim_adamw"), other.join("libthird.so")).unwrap();
    let out = std::process::Command::new(host_bin())
        .args(["--plugin", "libthird.so", "plugins", "list"])
        .current_dir(dir.path())
        .env_remove("RAK_PLUGIN_PATH")
        .env("LD_LIBRARY_PATH", &other)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.starts_with("hashbow")).unwrap_or_else(|| panic!("hashbow listed:\n{text}"));
    assert!(line.contains(&format!("{}/libthird.so", dir.path().display())), "{line}");
}

/// A training run through the `train` service, with the plugin's own examples (the road
/// `aar-train` takes): handed the same positives and negatives `host train` mined, it trains to
/// the same model; with the multi-positive loss on queries of one positive each (where it is
/// the NCE loss), to the same losses.
#[test]
fn the_train_service_with_given_examples_equals_host_train() {
    let dir = TempDir::new("train-service");
    let train = "optim = \"adamw\"\nlearning_rate = 1e-4\nper_device_train_batch_size = 4\nmax_steps = 3\nlogging_steps = 1\nsave_steps = 100\nhard_negatives = 1\nnegative_depth = 10\nseed = 5";
    // squad queries have one gold passage each.
    let recipe = task_data(dir.path(), &[("squad-a", "squad", 0, 6), ("squad-b", "squad", 6, 6)], train);
    let cli = dir.path().join("cli");
    let o = host(&["train", "--model", p(&minilm_dir()), "--config", p(&recipe), "--output-dir", p(&cli)]);
    assert!(o.status.success(), "{}", stderr(&o));

    // The examples host train loaded and mined, in its order.
    let mined: Value = serde_json::from_str(&std::fs::read_to_string(cli.join("negatives-episode-0.json")).unwrap()).unwrap();
    let mut examples = Vec::new();
    for task in ["squad-a", "squad-b"] {
        let tdir = dir.path().join("tasks").join(task);
        let gold: std::collections::HashMap<String, String> = std::fs::read_to_string(tdir.join("qrels.train.tsv"))
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| {
                let c: Vec<&str> = l.split('\t').collect();
                (c[0].to_string(), c[1].to_string())
            })
            .collect();
        let list: Vec<Value> = std::fs::read_to_string(tdir.join("queries.train.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let q: Value = serde_json::from_str(l).unwrap();
                let id = q["_id"].as_str().unwrap();
                json!({"query_id": id, "query": q["text"], "positives": [gold[id]], "negatives": mined["negatives"][task][id]})
            })
            .collect();
        examples.push(json!({"name": task, "examples": list}));
    }
    let text = std::fs::read_to_string(&recipe).unwrap();
    let mut recipe_json: Value = serde_json::to_value(toml_to_json(&text)).unwrap();
    let mut run = |loss: &str, out: &Path| {
        recipe_json["train"]["loss"] = json!(loss);
        let request = json!({"recipe": recipe_json, "model": minilm_dir(), "output_dir": out, "examples": examples});
        let o = host(&["--plugin", p(&minipipe_plugin()), "minipipe", "train", "--request", &request.to_string()]);
        assert!(o.status.success(), "{loss}: {}", stderr(&o));
        let reply: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert_eq!(reply["steps"], 3, "{reply}");
        assert!(!out.join("negatives-episode-0.json").exists() && !out.join("bm25-index").exists(), "given negatives are not mined again");
    };
    let weights = |d: &Path| {
        let mut w = tch::Tensor::read_safetensors(d.join("model.safetensors")).unwrap();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    let log = |d: &Path| -> Vec<f64> {
        std::fs::read_to_string(d.join("trainer_log.jsonl"))
            .unwrap()
            .lines()
            .flat_map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).collect::<Vec<_>>())
            .collect()
    };
    let nce = dir.path().join("service-nce");
    run("nce", &nce);
    assert_eq!(log(&nce), log(&cli), "the same losses at every step");
    for ((n, a), (_, b)) in weights(&cli).iter().zip(weights(&nce).iter()) {
        assert!(a.equal(b), "{n}: the service's model differs from host train's");
    }
    let multi = dir.path().join("service-multi");
    run("multi_positive", &multi);
    // With one positive each, the multi-positive loss is NCE except that a copy of a query's
    // positive elsewhere in the batch (these squad questions share gold paragraphs) is not its
    // negative: at the first step (same weights) every task's loss is at most NCE's, and lower
    // where such a copy was left out of the softmax.
    let (nce0, multi0) = (&log(&cli)[..2], &log(&multi)[..2]);
    assert!(multi0.iter().all(|v| v.is_finite()), "{multi0:?}");
    assert!(nce0.iter().zip(multi0).all(|(n, m)| *m <= n + 1e-5), "multi-positive above NCE: {multi0:?} against {nce0:?}");
    assert!(nce0.iter().zip(multi0).any(|(n, m)| *m < n - 1e-4), "no copy of a positive was left out: {multi0:?} against {nce0:?}");
}

/// A TOML recipe as the JSON the `train` service takes.
fn toml_to_json(text: &str) -> Value {
    let v: toml::Value = toml::from_str(text).unwrap();
    serde_json::to_value(v).unwrap()
}
