//! Retrieval-augmented answering with target LMs (`host augment`): prompts from templates,
//! one record per item from a connector (HTTP, many items at once) or a local reader (FiD,
//! batches), and the resumable results file.

pub mod answer;
pub mod config;
pub mod prompt;
pub mod results;

use anyhow::Result;
use config::{Task, TaskPrompts};
use rak_core::plugin::{Connector, Reader};
use rak_core::readers::fid::char_prefix;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// One question of either task.
#[derive(Debug, Clone)]
pub struct Probe {
    pub id: String,
    pub subject: String,
    pub question: String,
    /// Multiple choice: the options and the right one.
    pub choices: Vec<String>,
    pub answer: usize,
    /// Short answers: the accepted aliases.
    pub aliases: Vec<String>,
}

/// A retrieved passage.
#[derive(Debug, Clone)]
pub struct Passage {
    pub id: String,
    pub title: String,
    pub text: String,
}

/// An item ready to ask: its prompt pieces and the prompt's digest.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub probe: Probe,
    pub passages: Vec<Passage>,
    /// Few-shot demonstrations, already rendered (with their trailing separator).
    pub demos: String,
    /// The passages as the prompt shows them, without the trailing separator.
    pub passage_block: String,
    /// Where each passage starts in `passage_block`, in characters.
    passage_starts: Vec<usize>,
    /// SHA-256 of what the target is given in full (before any cut for the context).
    pub prompt_sha256: String,
}

impl Prepared {
    pub fn new(p: &TaskPrompts, probe: Probe, passages: Vec<Passage>, demos: String, reader: bool) -> Self {
        let rendered: Vec<String> = passages.iter().map(|d| p.passage.render(&[("title", &d.title), ("text", shown_text(p, &d.text))])).collect();
        let separator = p.separator.chars().count();
        let passage_starts = rendered
            .iter()
            .scan(0, |start, r| {
                let at = *start;
                *start += r.chars().count() + separator;
                Some(at)
            })
            .collect();
        let passage_block = rendered.join(&p.separator);
        let mut prep = Prepared { probe, passages, demos, passage_block, passage_starts, prompt_sha256: String::new() };
        let full = if reader {
            let mut s = prep.reader_prompt(p);
            for d in &prep.passages {
                s.push('\0');
                s.push_str(&d.title);
                s.push('\0');
                s.push_str(&d.text);
            }
            s
        } else {
            prep.prompt(p, None)
        };
        prep.prompt_sha256 = sha256(&full);
        prep
    }

    fn vars(&self, p: &TaskPrompts) -> (String, String, String) {
        let letters = answer::letters(self.probe.choices.len());
        let choices = letters
            .iter()
            .zip(&self.probe.choices)
            .map(|(l, c)| p.choice.render(&[("letter", l), ("choice", c)]))
            .collect::<Vec<_>>()
            .join("\n");
        (choices, self.probe.choices.len().to_string(), letters.join(", "))
    }

    /// The prompt for an API target, its passages cut to `passage_chars` characters if given.
    pub fn prompt(&self, p: &TaskPrompts, passage_chars: Option<usize>) -> String {
        let (choices, n, letters) = self.vars(p);
        let block = match passage_chars {
            Some(n) => char_prefix(&self.passage_block, n),
            None => &self.passage_block,
        };
        let passages = if block.is_empty() { String::new() } else { format!("{}{block}{}", p.passages_header, p.separator) };
        let body = p.template.render(&[
            ("passages", &passages),
            ("question", &self.probe.question),
            ("choices", &choices),
            ("n_choices", &n),
            ("letters", &letters),
            ("demonstrations", &self.demos),
        ]);
        if p.template.uses("demonstrations") {
            body
        } else {
            format!("{}{body}", self.demos)
        }
    }

    /// The ids of the passages a prompt cut to `passage_chars` characters still shows, in
    /// part or in full (a passage is gone when the cut falls before its first character).
    pub fn shown_passages(&self, passage_chars: usize) -> Vec<&str> {
        self.passages.iter().zip(&self.passage_starts).take_while(|(_, &start)| start < passage_chars).map(|(d, _)| d.id.as_str()).collect()
    }

    /// The prompt for a local reader (the passages go to it apart).
    pub fn reader_prompt(&self, p: &TaskPrompts) -> String {
        let (choices, n, letters) = self.vars(p);
        let body = p.reader_template.render(&[
            ("question", &self.probe.question),
            ("choices", &choices),
            ("n_choices", &n),
            ("letters", &letters),
            ("demonstrations", &self.demos),
        ]);
        if p.reader_template.uses("demonstrations") {
            body
        } else {
            format!("{}{body}", self.demos)
        }
    }
}

/// Few-shot demonstrations, each followed by the demonstration separator (an item is never
/// its own): each as the task's `demonstration` template, or, without one, as the demo item's
/// prompt without passages or demonstrations, a space, then its answer.
pub fn render_demos(task: Task, p: &TaskPrompts, demos: &[Probe], exclude: &str, reader: bool) -> String {
    let mut out = String::new();
    for d in demos.iter().filter(|d| d.id != exclude).take(p.demonstrations) {
        let a = match task {
            Task::Mc => answer::letters(d.choices.len())[d.answer].clone(),
            Task::ShortQa => d.aliases[0].clone(),
        };
        let prep = Prepared::new(p, d.clone(), Vec::new(), String::new(), reader);
        let shown = match &p.demonstration {
            Some(t) => {
                let (choices, n, letters) = prep.vars(p);
                t.render(&[("question", &d.question), ("answer", &a), ("choices", &choices), ("n_choices", &n), ("letters", &letters)])
            }
            None if reader => format!("{} {a}", prep.reader_prompt(p)),
            None => format!("{} {a}", prep.prompt(p, None)),
        };
        out.push_str(&shown);
        out.push_str(p.demonstration_separator());
    }
    out
}

pub fn sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// The record of one item (the `results.jsonl` line); `error` set means not answered.
pub fn record(item: &Prepared, raw: Value, answer: Value, method: &str, correct: bool, error: Option<String>, extra: Value) -> Value {
    let mut r = json!({
        "_id": item.probe.id,
        "subject": item.probe.subject,
        "prompt_sha256": item.prompt_sha256,
        "passages": item.passages.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
        "raw": raw,
        "answer": answer,
        "method": method,
        "correct": correct,
        "error": error,
    });
    if let (Some(r), Some(extra)) = (r.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            r.insert(k.clone(), v.clone());
        }
    }
    r
}

/// Judges a kept record's answer again against the item's gold answers as they are now (an
/// earlier run judged it against those of its day: a corrected alias or answer key must
/// count). Returns whether the verdict changed.
pub fn rejudge(task: Task, p: &TaskPrompts, item: &Prepared, rec: &mut Value) -> bool {
    let answer = rec["answer"].as_str();
    let correct = match task {
        Task::ShortQa => answer.is_some_and(|a| p.answer_match.judge(a, &item.probe.aliases)),
        Task::Mc => answer.and_then(|a| answer::letters(item.probe.choices.len()).iter().position(|l| l == a)) == Some(item.probe.answer),
    };
    let changed = rec["correct"].as_bool() != Some(correct);
    rec["correct"] = json!(correct);
    changed
}

fn error_record(item: &Prepared, method: &str, message: String, extra: Value) -> Value {
    record(item, Value::Null, Value::Null, method, false, Some(message), extra)
}

/// The message of a connector's error reply, if it is one.
fn reply_error(reply: &Value) -> Option<(String, String)> {
    let e = reply.get("error").filter(|e| !e.is_null())?;
    Some((e["kind"].as_str().unwrap_or("error").to_string(), e["message"].as_str().map(str::to_string).unwrap_or_else(|| e.to_string())))
}

/// Ask a connector for one item. Never fails: errors become error records. A prompt over the
/// model's context has its passages cut from the end (with a warning) and is asked again.
pub fn ask_connector(conn: &dyn Connector, task: Task, p: &TaskPrompts, item: &Prepared) -> Value {
    let mut limit: Option<usize> = None;
    let mut warnings: Vec<String> = Vec::new();
    let full_chars = item.passage_block.chars().count();
    for _ in 0..8 {
        let prompt = item.prompt(p, limit);
        let (reply, method) = match task {
            Task::Mc if p.by_logprobs => {
                let letters = answer::letters(item.probe.choices.len());
                (conn.complete(json!({"op": "choice_logprobs", "prompt": prompt, "choices": letters})), "letter_logprobs")
            }
            _ => (conn.complete(text_request(p, &prompt)), "text"),
        };
        let reply = match reply {
            Ok(r) => r,
            Err(e) => return error_record(item, method, format!("{e:#}"), json!({})),
        };
        if let Some((kind, message)) = reply_error(&reply) {
            if kind == "context_length" {
                let now = limit.unwrap_or(full_chars);
                if now == 0 {
                    return error_record(item, method, format!("the prompt does not fit the model's context even without passages: {message}"), json!({}));
                }
                let next = shrink(now, prompt.chars().count(), &reply["error"]);
                warnings.push(format!("prompt over the model's context; passages cut from {now} to {next} characters"));
                limit = Some(next);
                continue;
            }
            return error_record(item, method, format!("{kind}: {message}"), json!({}));
        }
        // A cut prompt's record says which passages the target still saw (`passages` keeps
        // every retrieved id, as the prompt digest does).
        let extra = match limit {
            None => json!({}),
            Some(n) => json!({"warning": warnings.join("; "), "passages_shown": item.shown_passages(n)}),
        };
        return match task {
            Task::Mc => mc_record(conn, p, item, &reply, method, limit, extra),
            Task::ShortQa => {
                let text = reply["text"].as_str().unwrap_or("").to_string();
                let ans = answer::first_line(&text);
                let ok = p.answer_match.judge(&ans, &item.probe.aliases);
                record(item, json!(text), json!(ans), method, ok, None, extra)
            }
        };
    }
    error_record(item, "text", "the prompt still did not fit the model's context after 8 attempts, each with shorter passages".into(), json!({}))
}

/// A passage's text as prompts show it: cut to `[passages].max_chars` when that is set.
fn shown_text<'a>(p: &TaskPrompts, text: &'a str) -> &'a str {
    if p.passage_chars > 0 {
        char_prefix(text, p.passage_chars)
    } else {
        text
    }
}

/// A greedy generation request for `prompt` with the task's length and stop settings.
fn text_request(p: &TaskPrompts, prompt: &str) -> Value {
    json!({"op": "complete", "prompt": prompt, "max_tokens": p.max_tokens, "stop": p.stop, "temperature": 0.0})
}

/// A multiple-choice record from a `choice_logprobs` or `complete` reply; a server without
/// log-probabilities is asked again for text.
fn mc_record(conn: &dyn Connector, p: &TaskPrompts, item: &Prepared, reply: &Value, method: &str, limit: Option<usize>, mut extra: Value) -> Value {
    let letters = answer::letters(item.probe.choices.len());
    let text = reply["text"].as_str().unwrap_or("").to_string();
    let gold = item.probe.answer;
    if method == "letter_logprobs" {
        let best = reply["best"].as_u64().map(|b| b as usize).filter(|&b| b < letters.len());
        if let (true, Some(best)) = (reply["logprobs"].is_array(), best) {
            extra["logprobs"] = reply["logprobs"].clone();
            extra["floored"] = reply["floored"].clone();
            return record(item, json!(text), json!(letters[best]), method, best == gold, None, extra);
        }
        // No log-probabilities from this server, or no answer letter among the likely next
        // tokens: ask for text and read the answer out of it.
        let prompt = item.prompt(p, limit);
        return match conn.complete(text_request(p, &prompt)) {
            Ok(r) if reply_error(&r).is_none() => mc_from_text(item, &letters, r["text"].as_str().unwrap_or(""), extra),
            Ok(r) => error_record(item, "text", reply_error(&r).map(|(k, m)| format!("{k}: {m}")).unwrap_or_default(), json!({})),
            Err(e) => error_record(item, "text", format!("{e:#}"), json!({})),
        };
    }
    mc_from_text(item, &letters, &text, extra)
}

/// The choice named on the reply's first non-empty line (the rest, with no stop sequence, is
/// the model going on past its answer).
fn mc_from_text(item: &Prepared, letters: &[String], text: &str, extra: Value) -> Value {
    match answer::parse_choice(&answer::first_line(text), letters, &item.probe.choices) {
        Some(k) => record(item, json!(text), json!(letters[k]), "text", k == item.probe.answer, None, extra),
        // Answered, but with no recognisable choice: wrong, not failed.
        None => record(item, json!(text), Value::Null, "text", false, None, extra),
    }
}

/// The next passage length after a context overflow: scaled by what the server said fits
/// when it said so (with 10% to spare), else halved.
fn shrink(passage_chars: usize, prompt_chars: usize, err: &Value) -> usize {
    let (Some(have), Some(ctx)) = (err["prompt_tokens"].as_u64(), err["context_tokens"].as_u64()) else { return passage_chars / 2 };
    if have == 0 || ctx >= have {
        return passage_chars / 2;
    }
    let over_chars = (prompt_chars as f64 * (1.0 - ctx as f64 / have as f64) * 1.1).ceil() as usize + 64;
    passage_chars.saturating_sub(over_chars).min(passage_chars / 2 + passage_chars / 4)
}

/// Ask a local reader for a batch of items (FiD: the passages go to the encoder, one each).
/// Multiple choice is rank classification over the answer letters, short answers greedy
/// generation. A failed call fails its batch's items as error records, not the run.
pub fn ask_reader(reader: &mut dyn Reader, task: Task, p: &TaskPrompts, items: &[&Prepared]) -> Vec<Value> {
    let passages = |it: &Prepared| -> Vec<Value> {
        it.passages
            .iter()
            .map(|d| {
                let text = shown_text(p, &d.text);
                json!({"title": d.title, "text": text})
            })
            .collect()
    };
    let reply: Result<Value> = match task {
        Task::Mc => reader.score_options(json!({"items": items.iter().map(|it| json!({
            "prompt": it.reader_prompt(p), "passages": passages(it), "options": answer::letters(it.probe.choices.len())
        })).collect::<Vec<_>>()})),
        Task::ShortQa => reader.generate(json!({"max_new_tokens": p.max_tokens, "items": items.iter().map(|it| json!({
            "prompt": it.reader_prompt(p), "passages": passages(it)
        })).collect::<Vec<_>>()})),
    };
    let (key, method) = match task {
        Task::Mc => ("items", "rank_classification"),
        Task::ShortQa => ("outputs", "generate"),
    };
    let outs = match reply.and_then(|r| r[key].as_array().cloned().filter(|a| a.len() == items.len()).ok_or_else(|| anyhow::anyhow!("the reader returned {r}"))) {
        Ok(o) => o,
        Err(e) => return items.iter().map(|it| error_record(it, method, format!("{e:#}"), json!({}))).collect(),
    };
    items
        .iter()
        .zip(outs)
        .map(|(it, out)| match task {
            Task::Mc => {
                let letters = answer::letters(it.probe.choices.len());
                match out["best"].as_u64().map(|b| b as usize).filter(|&b| b < letters.len()) {
                    Some(best) => record(it, out["losses"].clone(), json!(letters[best]), method, best == it.probe.answer, None, json!({})),
                    None => error_record(it, method, format!("the reader's reply has no valid \"best\": {out}"), json!({})),
                }
            }
            Task::ShortQa => {
                let text = out["text"].as_str().unwrap_or("").to_string();
                let ans = answer::first_line(&text);
                let ok = p.answer_match.judge(&ans, &it.probe.aliases);
                record(it, json!(text), json!(ans), method, ok, None, json!({}))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::config::{AugmentConfig, TaskPrompts};
    use super::*;
    use std::path::Path;

    fn probe() -> Probe {
        Probe {
            id: "q1".into(),
            subject: "s".into(),
            question: "Which colour?".into(),
            choices: vec!["red".into(), "blue".into()],
            answer: 1,
            aliases: vec![],
        }
    }

    /// A kept answer is judged against the gold as it is now: a corrected alias or answer key
    /// turns its verdict, and an unchanged one is left (and reported) as it was.
    #[test]
    fn kept_answers_are_judged_against_the_gold_of_now() {
        let cfg = AugmentConfig::default();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let mut item = Prepared::new(&p, Probe { aliases: vec!["Portugal".into()], ..probe() }, vec![], String::new(), false);
        let mut rec = record(&item, json!("Portugal"), json!("Portugal"), "text", true, None, json!({}));
        assert!(!rejudge(Task::ShortQa, &p, &item, &mut rec), "the same gold");
        item.probe.aliases = vec!["Spain".into()];
        assert!(rejudge(Task::ShortQa, &p, &item, &mut rec));
        assert_eq!(rec["correct"], json!(false));
        let p = TaskPrompts::new(&cfg, Task::Mc).unwrap();
        let mut item = Prepared::new(&p, probe(), vec![], String::new(), false);
        let mut rec = record(&item, json!("B"), json!("B"), "text", true, None, json!({}));
        assert!(!rejudge(Task::Mc, &p, &item, &mut rec));
        item.probe.answer = 0;
        assert!(rejudge(Task::Mc, &p, &item, &mut rec));
        assert_eq!(rec["correct"], json!(false));
        let mut unreadable = record(&item, json!("?"), Value::Null, "text", false, None, json!({}));
        assert!(!rejudge(Task::Mc, &p, &item, &mut unreadable), "no answer stays wrong");
    }

    #[test]
    fn mc_prompt_is_aars_with_passages_first() {
        let cfg = AugmentConfig::default();
        let p = TaskPrompts::new(&cfg, Task::Mc).unwrap();
        let d = vec![Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() }];
        let item = Prepared::new(&p, probe(), d, String::new(), false);
        assert_eq!(
            item.prompt(&p, None),
            "Sky\nThe sky is blue.\n\nHere's a problem to solve: Which colour?\n\nAmong the 2 following options, which is the correct answer?\n- A: red\n- B: blue\n\nAnswer:"
        );
        assert!(item.prompt(&p, Some(3)).starts_with("Sky\n\nHere's"));
        assert!(item.prompt(&p, Some(0)).starts_with("Here's"));
        let two = vec![
            Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() },
            Passage { id: "p2".into(), title: "Sea".into(), text: "The sea is blue.".into() },
        ];
        let item2 = Prepared::new(&p, probe(), two, String::new(), false);
        // "Sky\nThe sky is blue." is 20 characters, then the separator "\n\n".
        assert_eq!(item2.shown_passages(0), Vec::<&str>::new());
        assert_eq!(item2.shown_passages(1), vec!["p1"]);
        assert_eq!(item2.shown_passages(22), vec!["p1"]);
        assert_eq!(item2.shown_passages(23), vec!["p1", "p2"]);
        assert!(item2.prompt(&p, Some(23)).starts_with("Sky\nThe sky is blue.\n\nS\n\nHere's"));
        let closed = Prepared::new(&p, probe(), vec![], String::new(), false);
        assert_ne!(closed.prompt_sha256, item.prompt_sha256);
    }

    #[test]
    fn the_passages_header_shows_only_with_passages() {
        let cfg: AugmentConfig = toml::from_str("[passages]\nheader = \"Use these if they help.\\n\"\n[shortqa]\ntemplate = \"{passages}Q: {question}\"\n").unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let d = vec![Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() }];
        let item = Prepared::new(&p, probe(), d, String::new(), false);
        assert_eq!(item.prompt(&p, None), "Use these if they help.\nSky\nThe sky is blue.\n\nQ: Which colour?");
        // A prompt cut until no passage shows loses the header too: it is then closed book.
        assert_eq!(item.prompt(&p, Some(0)), "Q: Which colour?");
        let closed = Prepared::new(&p, probe(), vec![], String::new(), false);
        assert_eq!(closed.prompt(&p, None), "Q: Which colour?");
    }

    #[test]
    fn shown_passages_are_those_the_cut_prompt_shows() {
        // Characters, not bytes, and each passage's text already cut to max_chars, as the
        // prompt has them: each passage shows as "{title}\n" + 4 characters of its text.
        let cfg: AugmentConfig = toml::from_str("[passages]\nmax_chars = 4\n").unwrap();
        let p = TaskPrompts::new(&cfg, Task::Mc).unwrap();
        let d = vec![
            Passage { id: "p1".into(), title: "Café".into(), text: "Crème brûlée.".into() },
            Passage { id: "p2".into(), title: "Thé".into(), text: "Vert et chaud.".into() },
        ];
        let item = Prepared::new(&p, probe(), d, String::new(), false);
        assert!(item.prompt(&p, None).starts_with("Café\nCrèm\n\nThé\nVert\n\nHere's"));
        for n in 0..30 {
            let (shown, prompt) = (item.shown_passages(n), item.prompt(&p, Some(n)));
            assert_eq!(shown.contains(&"p1"), prompt.starts_with('C'), "{n}: {shown:?} {prompt:?}");
            assert_eq!(shown.contains(&"p2"), prompt.starts_with("Café\nCrèm\n\nT"), "{n}: {shown:?} {prompt:?}");
        }
        assert_eq!(item.shown_passages(11), vec!["p1"]);
        assert_eq!(item.shown_passages(12), vec!["p1", "p2"]);
    }

    #[test]
    fn demonstrations_come_first_and_never_the_item_itself() {
        let cfg: AugmentConfig = toml::from_str("[shortqa]\ndemonstrations = 2\ndemonstrations_file = \"demos.jsonl\"\n").unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let q = |id: &str, question: &str, a: &str| Probe {
            id: id.into(),
            subject: "shortqa".into(),
            question: question.into(),
            choices: vec![],
            answer: 0,
            aliases: vec![a.into()],
        };
        let demos = vec![q("d1", "The capital of Peru is", "Lima"), q("x", "The colour of snow is", "white"), q("d2", "The language of Brazil is", "Portuguese")];
        let d = render_demos(Task::ShortQa, &p, &demos, "x", false);
        assert_eq!(d, "Q: The capital of Peru is A: Lima\n\nQ: The language of Brazil is A: Portuguese\n\n");
        let item = Prepared::new(&p, q("x", "The colour of snow is", "white"), vec![], d.clone(), false);
        assert!(item.prompt(&p, None).ends_with("Portuguese\n\nQ: The colour of snow is A:"));
        // A template without {demonstrations} (openai.toml's) gets them before the whole
        // prompt, passages included, as before that placeholder existed.
        let sky = vec![Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() }];
        let item = Prepared::new(&p, q("x", "The colour of snow is", "white"), sky, d, false);
        assert_eq!(
            item.prompt(&p, None),
            "Q: The capital of Peru is A: Lima\n\nQ: The language of Brazil is A: Portuguese\n\nSky\nThe sky is blue.\n\nQ: The colour of snow is A:"
        );
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut shipped = AugmentConfig::read(&root.join("configs/augment/openai.toml")).unwrap();
        shipped.shortqa.demonstrations = Some(2);
        shipped.shortqa.demonstrations_file = Some("demos.jsonl".into());
        let p = TaskPrompts::new(&shipped, Task::ShortQa).unwrap();
        assert_eq!(render_demos(Task::ShortQa, &p, &demos, "x", true), "Q: The capital of Peru is A: Lima\n\nQ: The language of Brazil is A: Portuguese\n\n");
        assert_eq!(render_demos(Task::ShortQa, &p, &demos, "x", false), "Q: The capital of Peru is A: Lima\n\nQ: The language of Brazil is A: Portuguese\n\n");
        let mc_cfg: AugmentConfig = toml::from_str("[mc]\ndemonstrations = 1\n").unwrap();
        assert!(TaskPrompts::new(&mc_cfg, Task::Mc).unwrap_err().to_string().contains("demonstrations_file"));
    }

    fn short(id: &str, question: &str, a: &str) -> Probe {
        Probe { id: id.into(), subject: "shortqa".into(), question: question.into(), choices: vec![], answer: 0, aliases: vec![a.into()] }
    }

    #[test]
    fn demonstrations_go_where_the_template_places_them() {
        let cfg: AugmentConfig = toml::from_str(
            "[shortqa]\ndemonstrations = 2\ndemonstrations_file = \"demos.jsonl\"\n\
             template = \"Answer briefly.\\n\\n{demonstrations}{passages}Question: {question}\\nAnswer:\"\n\
             demonstration = \"Question: {question}\\nAnswer: {answer}\"\n",
        )
        .unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let demos = vec![short("d1", "The capital of Peru is", "Lima"), short("x", "The colour of snow is", "white"), short("d2", "The language of Brazil is", "Portuguese")];
        let d = render_demos(Task::ShortQa, &p, &demos, "x", false);
        assert_eq!(d, "Question: The capital of Peru is\nAnswer: Lima\n\nQuestion: The language of Brazil is\nAnswer: Portuguese\n\n");
        let sky = vec![Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() }];
        let item = Prepared::new(&p, short("x", "The colour of snow is", "white"), sky.clone(), d.clone(), false);
        // Instruction, the examples, the passages, then the question; nothing before it all.
        assert_eq!(
            item.prompt(&p, None),
            "Answer briefly.\n\nQuestion: The capital of Peru is\nAnswer: Lima\n\nQuestion: The language of Brazil is\nAnswer: Portuguese\n\n\
             Sky\nThe sky is blue.\n\nQuestion: The colour of snow is\nAnswer:"
        );
        // A context overflow cuts the passages, never the demonstrations.
        assert_eq!(item.prompt(&p, Some(0)), format!("Answer briefly.\n\n{d}Question: The colour of snow is\nAnswer:"));
        // The prompt digest covers the demonstrations.
        let bare = Prepared::new(&p, short("x", "The colour of snow is", "white"), sky, String::new(), false);
        assert!(bare.prompt(&p, None).starts_with("Answer briefly.\n\nSky"));
        assert_ne!(bare.prompt_sha256, item.prompt_sha256);
        // Their own separator, when set.
        let cfg: AugmentConfig = toml::from_str(
            "[shortqa]\ndemonstrations = 2\ndemonstrations_file = \"demos.jsonl\"\ndemonstration = \"{question} {answer}.\"\ndemonstration_separator = \"\\n\"\n",
        )
        .unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        assert_eq!(render_demos(Task::ShortQa, &p, &demos, "d1", false), "The colour of snow is white.\nThe language of Brazil is Portuguese.\n");
    }

    #[test]
    fn an_item_is_never_its_own_demonstration() {
        let cfg: AugmentConfig =
            toml::from_str("[shortqa]\ndemonstrations = 3\ndemonstrations_file = \"demos.jsonl\"\ndemonstration = \"{question} {answer}\"\n").unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let demos = vec![short("a", "A is", "1"), short("b", "B is", "2"), short("c", "C is", "3"), short("d", "D is", "4")];
        for (exclude, want) in [("a", "B is 2\n\nC is 3\n\nD is 4\n\n"), ("c", "A is 1\n\nB is 2\n\nD is 4\n\n"), ("z", "A is 1\n\nB is 2\n\nC is 3\n\n")] {
            let d = render_demos(Task::ShortQa, &p, &demos, exclude, false);
            assert_eq!(d, want, "{exclude}");
            assert!(!d.contains(&format!("{} is", exclude.to_uppercase())), "{exclude}");
        }
    }

    #[test]
    fn a_template_with_demonstrations_but_no_demonstration_template_renders_them_as_before() {
        // Each demonstration is the task's prompt without passages and without demonstrations,
        // then its answer; they are placed, not prepended.
        let cfg: AugmentConfig =
            toml::from_str("[shortqa]\ndemonstrations = 1\ndemonstrations_file = \"demos.jsonl\"\ntemplate = \"{demonstrations}{passages}Q: {question} A:\"\n").unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        let d = render_demos(Task::ShortQa, &p, &[short("d1", "The capital of Peru is", "Lima")], "x", false);
        assert_eq!(d, "Q: The capital of Peru is A: Lima\n\n");
        let sky = vec![Passage { id: "p1".into(), title: "Sky".into(), text: "The sky is blue.".into() }];
        let item = Prepared::new(&p, short("x", "The colour of snow is", "white"), sky, d, false);
        assert_eq!(item.prompt(&p, None), "Q: The capital of Peru is A: Lima\n\nSky\nThe sky is blue.\n\nQ: The colour of snow is A:");
    }

    #[test]
    fn multiple_choice_demonstrations_show_options_and_the_answer_letter() {
        let cfg: AugmentConfig = toml::from_str(
            "[mc]\ndemonstrations = 1\ndemonstrations_file = \"demos.jsonl\"\nchoice = \"{letter}. {choice}\"\n\
             template = \"{demonstrations}{passages}{question}\\n{choices}\\nAnswer:\"\n\
             reader_template = \"Examples:\\n{demonstrations}{question}\\n{choices}\"\n\
             demonstration = \"{question}\\n{choices}\\nAnswer: {answer}\"\n",
        )
        .unwrap();
        let p = TaskPrompts::new(&cfg, Task::Mc).unwrap();
        let demo = Probe { id: "d".into(), subject: "s".into(), question: "Which is even?".into(), choices: vec!["3".into(), "4".into()], answer: 1, aliases: vec![] };
        let d = render_demos(Task::Mc, &p, &[demo], "q1", false);
        assert_eq!(d, "Which is even?\nA. 3\nB. 4\nAnswer: B\n\n");
        let item = Prepared::new(&p, probe(), vec![], d.clone(), false);
        assert_eq!(item.prompt(&p, None), format!("{d}Which colour?\nA. red\nB. blue\nAnswer:"));
        // A local reader's template places them too.
        let item = Prepared::new(&p, probe(), vec![], d.clone(), true);
        assert_eq!(item.reader_prompt(&p), format!("Examples:\n{d}Which colour?\nA. red\nB. blue"));
    }

    #[test]
    fn misspelt_demonstration_placeholders_are_refused() {
        for (recipe, what) in [
            ("[shortqa]\ndemonstration = \"{question} {answr}\"\n", "shortqa.demonstration"),
            ("[shortqa]\ndemonstration = \"{passages}{question} {answer}\"\n", "shortqa.demonstration"),
            ("[shortqa]\nreader_template = \"{passages}{question}\"\n", "shortqa.reader_template"),
        ] {
            let e = TaskPrompts::new(&toml::from_str(recipe).unwrap(), Task::ShortQa).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains("unknown placeholder"), "{recipe}: {e}");
        }
    }

    #[test]
    fn shrinking_always_makes_progress() {
        let e = json!({"prompt_tokens": 3000, "context_tokens": 2048});
        let n = shrink(6000, 9000, &e);
        assert!(n < 6000 && n > 0, "{n}");
        assert_eq!(shrink(100, 200, &json!({})), 50);
        assert!(shrink(10, 10_000, &e) < 10);
    }
}
