//! The resolver against caches laid out as huggingface_hub lays them out (blobs, snapshots
//! of links into them, refs, `.no_exist` marks), built here from small files.

use super::*;
use std::collections::HashMap;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const OTHER: &str = "89abcdef0123456789abcdef0123456789abcdef";

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rak-hub-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn env_at(cache: &Path, offline: bool) -> HubEnv {
    // A port nothing listens on: "online" tests that reach for the Hub fail at once.
    HubEnv { cache: cache.into(), cache_from: "test".into(), endpoint: "http://127.0.0.1:9".into(), offline, token: None }
}

/// `files` (name, content) as blobs under `repo/blobs/` with `snapshots/commit/NAME` linking
/// to them (relative links, as huggingface_hub writes), and `refs/REF` naming the commit.
fn lay_out(repo: &Path, commit: &str, refs: &[&str], files: &[(&str, &str)]) {
    for (name, content) in files {
        let blob = format!("{:x}", fxhash(content.as_bytes()));
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs").join(&blob), content).unwrap();
        let link = repo.join("snapshots").join(commit).join(name);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = name.matches('/').count() + 2;
        let target = format!("{}blobs/{blob}", "../".repeat(depth));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(target, &link).unwrap();
    }
    for r in refs {
        let path = repo.join("refs").join(r);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, commit).unwrap();
    }
}

fn fxhash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3))
}

fn mark_absent(repo: &Path, commit: &str, names: &[&str]) {
    for n in names {
        let p = repo.join(".no_exist").join(commit).join(n);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "").unwrap();
    }
}

const MODEL: &[(&str, &str)] = &[("config.json", "{\"model_type\": \"bert\"}"), ("tokenizer.json", "{}"), ("model.safetensors", "weights")];

#[test]
fn names_are_told_apart() {
    let dir = tmp("names");
    assert_eq!(classify(&dir), Name::Local(dir.clone()));
    assert_eq!(classify(Path::new("google/flan-t5-base")), Name::Hub { id: "google/flan-t5-base".into(), alias: None });
    assert_eq!(classify(Path::new("FLAN-T5-base")), Name::Hub { id: "google/flan-t5-base".into(), alias: Some("flan-t5-base".into()) });
    assert_eq!(classify(Path::new("t5-base")), Name::Hub { id: "google-t5/t5-base".into(), alias: Some("t5-base".into()) });
    for path in ["./model", "/no/such/dir", "~/m", "a/b/c", "models/", "../x"] {
        match classify(Path::new(path)) {
            Name::NotAModel(why) => assert!(why.contains("no such folder"), "{path}: {why}"),
            other => panic!("{path}: {other:?}"),
        }
    }
    for bad in ["org/na me", "org/-x", "org/a--b", "org/a..b"] {
        assert!(matches!(classify(Path::new(bad)), Name::NotAModel(ref w) if w.contains("nor a Hugging Face Hub id")), "{bad}");
    }
    match classify(Path::new("openai")) {
        Name::NotAModel(why) => assert!(why.contains("no model name this toolkit knows") && why.contains("flan-t5-base"), "{why}"),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A mistyped path whose first component is a local folder (`runs/aar-typo` where `runs/`
/// exists; here `src/`, as unit tests run in the crate's folder) is a path: "no such folder"
/// at once, never a Hub lookup (offline: no "fetch it with"; online: no request). A Hub id
/// whose first component is no folder is still a Hub id; and an error saying a Hub model is
/// missing says there is no folder of that name either.
#[test]
fn a_mistyped_path_is_no_hub_id_and_a_missing_hub_model_is_no_folder_either() {
    assert!(Path::new("src").is_dir(), "unit tests run in the crate's folder");
    let cache = tmp("typo");
    match classify(Path::new("src/no-such-model")) {
        Name::NotAModel(why) => assert!(why.starts_with("src/no-such-model: no such folder") && why.contains("src/ is a folder"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(!names_a_model(Path::new("src/no-such-model"), Some(&env_at(&cache, true))));
    for offline in [true, false] {
        let t = std::time::Instant::now();
        let e = resolve_in(Path::new("src/no-such-model"), None, &env_at(&cache, offline)).unwrap_err().to_string();
        assert!(e.starts_with("src/no-such-model: no such folder"), "{e}");
        assert!(!e.contains("Hugging Face cache") && !e.contains("hf download") && !e.contains("cannot be reached"), "no Hub lookup: {e}");
        assert!(t.elapsed().as_secs() < 2);
    }
    assert!(!Path::new("org").exists());
    assert_eq!(classify(Path::new("org/m")), Name::Hub { id: "org/m".into(), alias: None });
    let cwd = std::env::current_dir().unwrap();
    for offline in [true, false] {
        let e = resolve_in(Path::new("org/m"), None, &env_at(&cache, offline)).unwrap_err().to_string();
        assert!(e.contains(&format!("nor is there a folder org/m (relative to {})", cwd.display())), "{e}");
        // A known bare name: the name as typed.
        let e = resolve_in(Path::new("FLAN-T5-base"), None, &env_at(&cache, offline)).unwrap_err().to_string();
        assert!(e.contains("google/flan-t5-base") && e.contains("nor is there a folder FLAN-T5-base"), "{e}");
    }
    let e = resolve_in(Path::new("openia"), None, &env_at(&cache, true)).unwrap_err().to_string();
    assert!(e.contains(&format!("is no folder (relative to {})", cwd.display())), "{e}");
    // `org/name` beside a local folder `org/` is still the Hub model when the cache holds it.
    let repo = cache.join("models--src--m");
    lay_out(&repo, COMMIT, &["main"], MODEL);
    mark_absent(&repo, COMMIT, OPTIONAL);
    assert!(names_a_model(Path::new("src/m"), Some(&env_at(&cache, true))));
    assert_eq!(resolve_in(Path::new("src/m"), None, &env_at(&cache, true)).unwrap().path, repo.join("snapshots").join(COMMIT));
    std::fs::remove_dir_all(&cache).unwrap();
}

/// Every bare name means a repo whose main has what the loaders read (tokenizer.json,
/// safetensors): not google/t5-v1_1-* (pytorch_model.bin and spiece.model only) nor
/// facebook/contriever* (pytorch_model.bin only).
#[test]
fn known_names_mean_repos_the_loaders_can_read() {
    for gone in ["t5-v1_1-small", "t5-v1_1-base", "t5-v1_1-large", "contriever", "contriever-msmarco"] {
        assert!(matches!(classify(Path::new(gone)), Name::NotAModel(_)), "{gone}");
    }
    for (_, id) in KNOWN {
        assert!(!id.starts_with("google/t5-v1_1") && !id.starts_with("facebook/contriever"), "{id}");
    }
}

#[test]
fn environment_is_read_as_huggingface_hub_reads_it() {
    let vars = |pairs: &[(&str, &str)]| {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        HubEnv::from_vars(move |k| m.get(k).cloned()).unwrap()
    };
    let e = vars(&[("HOME", "/h")]);
    assert_eq!(e.cache, PathBuf::from("/h/.cache/huggingface/hub"));
    assert_eq!(e.endpoint, "https://huggingface.co");
    assert!(!e.offline);
    let e = vars(&[("HOME", "/h"), ("HF_HOME", "/hf"), ("HF_ENDPOINT", "http://127.0.0.1:5/"), ("HF_HUB_OFFLINE", "true")]);
    assert_eq!(e.cache, PathBuf::from("/hf/hub"));
    assert_eq!(e.endpoint, "http://127.0.0.1:5");
    assert!(e.offline);
    let e = vars(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/c"), ("HF_HUB_OFFLINE", "0")]);
    assert_eq!(e.cache, PathBuf::from("/c"));
    assert!(!e.offline);
    assert_eq!(e.repo_folder("org/name"), PathBuf::from("/c/models--org--name"));
}

#[test]
fn a_cached_snapshot_of_links_into_blobs_resolves_by_ref_tag_and_commit() {
    let cache = tmp("cache");
    let repo = cache.join("models--org--m");
    lay_out(&repo, COMMIT, &["main", "v1.0"], MODEL);
    mark_absent(&repo, COMMIT, OPTIONAL);
    lay_out(&repo, OTHER, &["dev"], &[("config.json", "{\"model_type\": \"bert\", \"other\": 1}"), ("tokenizer.json", "{}"), ("model.safetensors", "other weights")]);
    mark_absent(&repo, OTHER, OPTIONAL);
    for offline in [true, false] {
        let env = env_at(&cache, offline);
        let r = resolve_in(Path::new("org/m"), None, &env).unwrap();
        assert_eq!(r.path, repo.join("snapshots").join(COMMIT));
        let h = r.hub.as_ref().unwrap();
        assert_eq!((h.id.as_str(), h.revision.as_str(), h.commit.as_str()), ("org/m", "main", COMMIT));
        assert!(h.downloaded.is_empty() && h.notes.is_empty(), "{h:?}");
        assert_eq!(std::fs::read(r.path.join("model.safetensors")).unwrap(), b"weights", "read through the link");
        assert_eq!(resolve_in(Path::new("org/m"), Some("v1.0"), &env).unwrap().path, r.path, "a tag");
        assert_eq!(resolve_in(Path::new("org/m"), Some(OTHER), &env).unwrap().path, repo.join("snapshots").join(OTHER), "a commit");
        assert_eq!(resolve_in(Path::new("org/m"), Some("dev"), &env).unwrap().path, repo.join("snapshots").join(OTHER), "a branch");
        let rec = r.record();
        assert_eq!(rec["hub_id"], "org/m");
        assert_eq!(rec["commit"], COMMIT);
    }
    // A local folder wins, and takes no revision.
    let local = cache.join("org/m");
    std::fs::create_dir_all(&local).unwrap();
    assert_eq!(resolve_in(&local, None, &env_at(&cache, true)).unwrap(), Resolved { path: local.clone(), hub: None });
    assert!(resolve_in(&local, Some("main"), &env_at(&cache, true)).unwrap_err().to_string().contains("is a local folder"));
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn offline_the_error_names_the_missing_files_where_it_looked_and_the_fetch_command() {
    let cache = tmp("offline");
    let repo = cache.join("models--org--m");
    // No weights, and a sentence-transformers modules.json whose pooling config is missing.
    let modules = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                      {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                      {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#;
    lay_out(&repo, COMMIT, &["main"], &[("config.json", "{}"), ("tokenizer.json", "{}"), ("modules.json", modules)]);
    let env = env_at(&cache, true);
    let e = resolve_in(Path::new("org/m"), None, &env).unwrap_err().to_string();
    assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
    assert!(e.contains("missing: model.safetensors, 1_Pooling/config.json"), "{e}");
    assert!(e.contains(&repo.join("snapshots").join(COMMIT).display().to_string()), "{e}");
    assert!(e.contains("hf download org/m --revision main"), "{e}");
    // A revision never fetched, and a repo never fetched.
    let e = resolve_in(Path::new("org/m"), Some("v2"), &env).unwrap_err().to_string();
    assert!(e.contains("no refs/v2") && e.contains("--revision v2"), "{e}");
    let e = resolve_in(Path::new("flan-t5-base"), None, &env).unwrap_err().to_string();
    assert!(e.contains("google/flan-t5-base") && e.contains("models--google--flan-t5-base (not there)") && e.contains("models--flan-t5-base (not there)"), "{e}");
    assert!(e.contains("hf download google/flan-t5-base --revision main"), "{e}");
    // Completed: the snapshot resolves.
    lay_out(&repo, COMMIT, &[], &[("model.safetensors", "w"), ("1_Pooling/config.json", "{\"pooling_mode_mean_tokens\": true}")]);
    let r = resolve_in(Path::new("org/m"), None, &env).unwrap();
    assert!(r.hub.unwrap().notes.is_empty(), "modules.json is there: no note");
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn offline_a_snapshot_without_modules_json_is_used_with_a_note_unless_the_cache_says_the_repo_lacks_it() {
    let cache = tmp("note");
    let repo = cache.join("models--org--m");
    lay_out(&repo, COMMIT, &["main"], MODEL);
    let env = env_at(&cache, true);
    let h = resolve_in(Path::new("org/m"), None, &env).unwrap().hub.unwrap();
    assert_eq!(h.notes.len(), 1, "{h:?}");
    assert!(h.notes[0].contains("modules.json") && h.notes[0].contains("hf download org/m"), "{:?}", h.notes);
    mark_absent(&repo, COMMIT, &["modules.json"]);
    assert!(resolve_in(Path::new("org/m"), None, &env).unwrap().hub.unwrap().notes.is_empty());
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn shards_and_the_folder_older_transformers_wrote_for_a_bare_name() {
    let cache = tmp("shards");
    // `t5-base` cached under its bare name, sharded.
    let repo = cache.join("models--t5-base");
    let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#;
    lay_out(&repo, COMMIT, &["main"], &[("config.json", "{\"model_type\": \"t5\"}"), ("tokenizer.json", "{}"), (WEIGHTS_INDEX, index), ("model-00001-of-00002.safetensors", "1")]);
    let env = env_at(&cache, true);
    let e = resolve_in(Path::new("t5-base"), None, &env).unwrap_err().to_string();
    assert!(e.contains("missing: model-00002-of-00002.safetensors"), "{e}");
    lay_out(&repo, COMMIT, &[], &[("model-00002-of-00002.safetensors", "2")]);
    let r = resolve_in(Path::new("t5-base"), None, &env).unwrap();
    assert_eq!(r.path, repo.join("snapshots").join(COMMIT));
    let h = r.hub.unwrap();
    assert_eq!(h.id, "t5-base");
    assert!(h.notes.is_empty(), "a T5 model gets no modules.json note: {:?}", h.notes);
    // A bare name the table does not know, cached as huggingface_hub would: a model.
    let gpt = cache.join("models--tiny");
    lay_out(&gpt, COMMIT, &["main"], MODEL);
    assert!(names_a_model(Path::new("tiny"), Some(&env)));
    assert!(!names_a_model(Path::new("tiny"), None));
    assert!(!names_a_model(Path::new("openai"), Some(&env)));
    assert_eq!(resolve_in(Path::new("tiny"), None, &env).unwrap().path, gpt.join("snapshots").join(COMMIT));
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn online_an_unreachable_hub_gives_the_offline_error_with_the_reason() {
    let cache = tmp("unreachable");
    let env = env_at(&cache, false);
    let t = std::time::Instant::now();
    let e = resolve_in(Path::new("org/m"), Some("v1"), &env).unwrap_err().to_string();
    assert!(e.contains("cannot be reached") && e.contains("http://127.0.0.1:9"), "{e}");
    assert!(e.contains("hf download org/m --revision v1"), "{e}");
    assert!(t.elapsed().as_secs() < 10, "fails fast");
    // A revision that would leave refs/ is refused before any request.
    let e = resolve_in(Path::new("org/m"), Some("../../x"), &env).unwrap_err().to_string();
    assert!(e.contains("not a branch, tag or commit"), "{e}");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// A server on 127.0.0.1 answering every request with `status` (and counting them).
fn failing_hub(status: &'static str) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = asked.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(2)));
            let _ = conn.read(&mut [0u8; 4096]);
            let body = "{\"error\": \"try later\"}";
            let _ = write!(conn, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    });
    (url, asked)
}

/// A snapshot holding every file the loaders need but no `.no_exist` marks for the optional
/// files (as `hf download` and transformers leave it): online with the Hub unreachable, or
/// answering 5xx or 429, it is used as it is, with a note naming what could not be checked;
/// a snapshot missing a needed file still fails.
#[test]
fn a_complete_snapshot_without_absence_marks_is_used_when_the_hub_cannot_answer() {
    let cache = tmp("fallback");
    let repo = cache.join("models--org--m");
    lay_out(&repo, COMMIT, &["main"], MODEL);
    mark_absent(&repo, COMMIT, &["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"]);
    let (busy, asked_busy) = failing_hub("503 Service Unavailable");
    let (limited, asked_limited) = failing_hub("429 Too Many Requests");
    for endpoint in ["http://127.0.0.1:9".to_string(), busy, limited] {
        let env = HubEnv { endpoint: endpoint.clone(), ..env_at(&cache, false) };
        let t = std::time::Instant::now();
        let r = resolve_in(Path::new("org/m"), None, &env).unwrap_or_else(|e| panic!("{endpoint}: {e:#}"));
        assert!(t.elapsed().as_secs() < 10, "{endpoint}: {:?}", t.elapsed());
        assert_eq!(r.path, repo.join("snapshots").join(COMMIT));
        let h = r.hub.unwrap();
        assert_eq!((h.commit.as_str(), h.downloaded.len()), (COMMIT, 0));
        assert_eq!(h.notes.len(), 1, "{endpoint}: {:?}", h.notes);
        let note = &h.notes[0];
        assert!(!note.contains('\n') && note.contains(&endpoint) && note.contains("spiece.model, generation_config.json, rak_encoder.json"), "{note}");
        assert!(!note.contains("modules.json"), "marked absent: {note}");
    }
    assert!(asked_busy.load(std::sync::atomic::Ordering::Relaxed) > 0 && asked_limited.load(std::sync::atomic::Ordering::Relaxed) > 0, "the Hub was asked first");
    // Without modules.json's mark, the note about it comes too.
    std::fs::remove_file(repo.join(".no_exist").join(COMMIT).join("modules.json")).unwrap();
    let h = resolve_in(Path::new("org/m"), None, &env_at(&cache, false)).unwrap().hub.unwrap();
    assert_eq!(h.notes.len(), 2, "{:?}", h.notes);
    assert!(h.notes[1].contains("modules.json") && h.notes[1].contains("hf download org/m"), "{:?}", h.notes);
    // A needed file missing: no fallback.
    std::fs::remove_file(repo.join("snapshots").join(COMMIT).join("model.safetensors")).unwrap();
    let e = resolve_in(Path::new("org/m"), None, &env_at(&cache, false)).unwrap_err().to_string();
    assert!(e.contains("cannot be reached") && e.contains("missing: model.safetensors"), "{e}");
    std::fs::remove_dir_all(&cache).unwrap();
}
