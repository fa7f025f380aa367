//! The `host augment` recipe (TOML): the target and its settings, where passages come from,
//! and the prompt templates of each task. Flags override it. See `configs/augment/openai.toml`.

use super::answer::AnswerMatch;
use super::prompt::Template;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AugmentConfig {
    #[serde(default)]
    pub target: TargetConfig,
    #[serde(default)]
    pub retrieval: RetrievalConfig,
    #[serde(default)]
    pub passages: PassageConfig,
    #[serde(default)]
    pub mc: TaskConfig,
    #[serde(default)]
    pub shortqa: TaskConfig,
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub answers: AnswersConfig,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswersConfig {
    /// How short answers are judged: `popqa` (the default: some alias is in the answer as
    /// written) or `squad` (SQuAD's and KILT's exact match after their normalisation).
    #[serde(rename = "match")]
    pub rule: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// The connector or reader plugin.
    pub name: Option<String>,
    /// The plugin's settings (a JSON object).
    #[serde(default)]
    pub settings: toml::Table,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrievalConfig {
    /// `none`, `bm25:INDEX_DIR` or `dense:INDEX_DIR`.
    pub retriever: Option<String>,
    /// Passages per question.
    pub k: Option<usize>,
    /// Where passage texts are looked up by id.
    pub corpus: Option<PathBuf>,
    /// Encoder plugin and checkpoint for dense retrieval.
    pub encoder: Option<String>,
    pub encoder_model: Option<PathBuf>,
    /// Task name for the encoder's query prefix (if it uses one).
    pub task: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PassageConfig {
    /// How one passage reads: placeholders `{title}`, `{text}`.
    pub template: String,
    /// Between passages, and after the last one.
    pub separator: String,
    /// Before the first passage, only in prompts that show one: an instruction about the
    /// passages that a closed-book prompt of the same recipe should not carry.
    pub header: String,
    /// Characters of each passage's text kept (0 = all).
    pub max_chars: usize,
}

impl Default for PassageConfig {
    fn default() -> Self {
        PassageConfig { template: "{title}\n{text}".into(), separator: "\n\n".into(), header: String::new(), max_chars: 0 }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskConfig {
    /// The prompt for API targets.
    pub template: Option<String>,
    /// The prompt for local readers, which get the passages apart (FiD).
    pub reader_template: Option<String>,
    /// Multiple choice: how one option reads (`{letter}`, `{choice}`).
    pub choice: Option<String>,
    /// Multiple choice: `logprobs` (the answer letter with the highest log-probability; the
    /// text is parsed when a server gives none) or `text`.
    pub answer_by: Option<String>,
    /// Tokens generated (short answers; multiple choice answered from text).
    pub max_tokens: Option<u64>,
    pub stop: Option<Vec<String>>,
    /// Few-shot demonstrations: the first `demonstrations` items of `demonstrations_file` (same
    /// format as the input; an item is never its own demonstration). They go where the
    /// template places `{demonstrations}`, or before the whole prompt when it has none.
    pub demonstrations: Option<usize>,
    pub demonstrations_file: Option<PathBuf>,
    /// How one demonstration reads (`{question}`, `{answer}`, `{choices}`, `{n_choices}`,
    /// `{letters}`). Unset: the task's template without passages (and without
    /// demonstrations), a space, then the answer.
    pub demonstration: Option<String>,
    /// After each demonstration (default: `[passages].separator`).
    pub demonstration_separator: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Items asked at once (the connector's own `concurrency` caps requests on the wire).
    pub workers: Option<usize>,
}

impl AugmentConfig {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        toml::from_str(&text).with_context(|| format!("{}: not a valid augment recipe", path.display()))
    }

    pub fn target_settings(&self) -> Result<Value> {
        serde_json::to_value(&self.target.settings).context("target.settings")
    }
}

/// The task being run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Mc,
    ShortQa,
}

impl Task {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mc" => Ok(Task::Mc),
            "shortqa" => Ok(Task::ShortQa),
            other => bail!("--task {other:?}: expected mc or shortqa"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Task::Mc => "mc",
            Task::ShortQa => "shortqa",
        }
    }
}

/// AAR's API prompt for MMLU (REFERENCE §6), with the passages before it.
pub const MC_TEMPLATE: &str = "{passages}Here's a problem to solve: {question}\n\nAmong the {n_choices} following options, which is the correct answer?\n{choices}\n\nAnswer:";
pub const MC_READER_TEMPLATE: &str =
    "Here's a problem to solve: {question}\n\nAmong the {n_choices} following options, which is the correct answer?\n{choices}";
pub const MC_CHOICE: &str = "- {letter}: {choice}";
/// PopQA's prompt.
pub const SHORTQA_TEMPLATE: &str = "{passages}Q: {question} A:";
pub const SHORTQA_READER_TEMPLATE: &str = "Q: {question} A:";

/// Placeholders of a task's template; a reader's template has all but `passages`.
const PROMPT_VARS: [&str; 6] = ["passages", "question", "choices", "n_choices", "letters", "demonstrations"];
const READER_VARS: [&str; 5] = ["question", "choices", "n_choices", "letters", "demonstrations"];
const DEMONSTRATION_VARS: [&str; 5] = ["question", "answer", "choices", "n_choices", "letters"];

/// A task's templates and answering settings, checked.
#[derive(Debug, Clone)]
pub struct TaskPrompts {
    pub template: Template,
    pub reader_template: Template,
    pub choice: Template,
    pub passage: Template,
    pub separator: String,
    /// `[passages].header`: before the passages, where there are any.
    pub passages_header: String,
    pub passage_chars: usize,
    pub by_logprobs: bool,
    pub max_tokens: u64,
    pub stop: Vec<String>,
    pub demonstrations: usize,
    pub demonstrations_file: Option<PathBuf>,
    /// How one demonstration reads; `None`: as the task's prompt without passages, a space,
    /// then the answer (the rendering before this setting existed).
    pub demonstration: Option<Template>,
    /// After each demonstration; `None`: `separator`.
    pub demonstration_separator: Option<String>,
    /// How short answers are judged (multiple choice is judged by its letter: always PopQa).
    pub answer_match: AnswerMatch,
}

impl TaskPrompts {
    pub fn new(cfg: &AugmentConfig, task: Task) -> Result<Self> {
        // No stop sequence by default: the answer is the reply's first non-empty line, and a
        // "\n" stop would end a reply that begins with a line break (small models often do)
        // before that line, empty. `max_tokens` caps the reply instead.
        let (t, default, reader_default, tokens) = match task {
            Task::Mc => (&cfg.mc, MC_TEMPLATE, MC_READER_TEMPLATE, 8),
            Task::ShortQa => (&cfg.shortqa, SHORTQA_TEMPLATE, SHORTQA_READER_TEMPLATE, 32),
        };
        let name = task.name();
        let by_logprobs = match t.answer_by.as_deref().unwrap_or("logprobs") {
            "logprobs" => true,
            "text" => false,
            other => bail!("{name}.answer_by {other:?}: expected logprobs or text"),
        };
        let stop = t.stop.clone().unwrap_or_default();
        if let Some(s) = stop.iter().find(|s| s.trim().is_empty()) {
            bail!(
                "{name}.stop {s:?}: a stop of white space only ends a reply that begins with it before its first word, while the answer is \
                 the reply's first non-empty line; leave it out (max_tokens caps the reply)"
            );
        }
        let answer_match = cfg.answers.rule.as_deref().map(AnswerMatch::parse).transpose()?.unwrap_or_default();
        // Only short answers are matched against aliases; a letter is right or wrong.
        let answer_match = if task == Task::ShortQa { answer_match } else { AnswerMatch::PopQa };
        let demonstrations = t.demonstrations.unwrap_or(0);
        if demonstrations > 0 && t.demonstrations_file.is_none() {
            bail!("{name}.demonstrations is {demonstrations} but {name}.demonstrations_file is not set");
        }
        Ok(TaskPrompts {
            template: Template::parse(t.template.as_deref().unwrap_or(default), &PROMPT_VARS, &format!("{name}.template"))?,
            reader_template: Template::parse(t.reader_template.as_deref().unwrap_or(reader_default), &READER_VARS, &format!("{name}.reader_template"))?,
            choice: Template::parse(t.choice.as_deref().unwrap_or(MC_CHOICE), &["letter", "choice"], &format!("{name}.choice"))?,
            passage: Template::parse(&cfg.passages.template, &["title", "text"], "passages.template")?,
            separator: cfg.passages.separator.clone(),
            passages_header: cfg.passages.header.clone(),
            passage_chars: cfg.passages.max_chars,
            by_logprobs,
            max_tokens: t.max_tokens.unwrap_or(tokens),
            stop,
            demonstrations,
            demonstrations_file: t.demonstrations_file.clone(),
            demonstration: t.demonstration.as_deref().map(|d| Template::parse(d, &DEMONSTRATION_VARS, &format!("{name}.demonstration"))).transpose()?,
            demonstration_separator: t.demonstration_separator.clone(),
            answer_match,
        })
    }

    /// What follows each demonstration.
    pub fn demonstration_separator(&self) -> &str {
        self.demonstration_separator.as_deref().unwrap_or(&self.separator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_recipe_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        // The prompt search's variants too (configs/augment/search/).
        let mut recipes: Vec<PathBuf> = ["openai.toml", "chat.toml"].iter().map(|r| root.join("configs/augment").join(r)).collect();
        recipes.extend(std::fs::read_dir(root.join("configs/augment/search")).unwrap().flatten().map(|e| e.path()));
        assert!(recipes.len() >= 6, "{recipes:?}");
        for recipe in recipes {
            let cfg = AugmentConfig::read(&recipe).unwrap();
            for task in [Task::Mc, Task::ShortQa] {
                TaskPrompts::new(&cfg, task).unwrap();
            }
            assert_eq!(cfg.target.name.as_deref(), Some("openai"), "{}", recipe.display());
        }
    }

    #[test]
    fn the_chat_recipes_demonstrations_are_none_of_the_probes() {
        // Drawn from wikidata training queries (scripts/experiments/make_demos.py): no
        // demonstration is about a page a shortqa dev question is about, or is one of them.
        use rak_retrieval::data::probes::load_shortqa;
        use std::collections::HashSet;
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let cfg = AugmentConfig::read(&root.join("configs/augment/chat.toml")).unwrap();
        let p = TaskPrompts::new(&cfg, Task::ShortQa).unwrap();
        assert!(p.template.uses("demonstrations") && p.demonstration.is_some());
        let demos = load_shortqa(&root.join(p.demonstrations_file.as_ref().unwrap())).unwrap();
        assert_eq!(demos.len(), p.demonstrations);
        let dev = load_shortqa(&root.join("data/minikilt/shortqa/dev.jsonl")).unwrap();
        let pages: HashSet<&str> = dev.iter().flat_map(|d| d.pages.iter().map(String::as_str)).collect();
        let questions: HashSet<String> = dev.iter().map(|d| d.question.trim().to_lowercase()).collect();
        let ids: HashSet<&str> = dev.iter().map(|d| d.id.as_str()).collect();
        for d in &demos {
            assert!(!d.pages.is_empty() && d.pages.iter().all(|pg| !pages.contains(pg.as_str())), "{} is about a dev page: {:?}", d.id, d.pages);
            assert!(!questions.contains(&d.question.trim().to_lowercase()), "{} is a dev question: {}", d.id, d.question);
            assert!(!ids.contains(d.id.as_str()) && d.id.starts_with("wikidata:"), "{}", d.id);
        }
    }

    #[test]
    fn no_stop_cuts_a_reply_before_its_first_non_empty_line() {
        for task in [Task::Mc, Task::ShortQa] {
            assert!(TaskPrompts::new(&AugmentConfig::default(), task).unwrap().stop.is_empty());
        }
        for stop in ["\\n", "\\n\\n", " \\n"] {
            let cfg: AugmentConfig = toml::from_str(&format!("[shortqa]\nstop = [\"{stop}\"]\n")).unwrap();
            let e = TaskPrompts::new(&cfg, Task::ShortQa).unwrap_err().to_string();
            assert!(e.contains("shortqa.stop") && e.contains("first non-empty line"), "{e}");
        }
        let cfg: AugmentConfig = toml::from_str("[shortqa]\nstop = [\"\\nQ:\"]\n").unwrap();
        assert_eq!(TaskPrompts::new(&cfg, Task::ShortQa).unwrap().stop, vec!["\nQ:".to_string()]);
    }

    #[test]
    fn short_answers_are_matched_as_the_recipe_says() {
        let p = TaskPrompts::new(&AugmentConfig::default(), Task::ShortQa).unwrap();
        assert_eq!(p.answer_match, AnswerMatch::PopQa, "PopQA's rule by default");
        let cfg: AugmentConfig = toml::from_str("[answers]\nmatch = \"squad\"\n").unwrap();
        assert_eq!(TaskPrompts::new(&cfg, Task::ShortQa).unwrap().answer_match, AnswerMatch::Squad);
        let cfg: AugmentConfig = toml::from_str("[answers]\nmatch = \"em\"\n").unwrap();
        let e = TaskPrompts::new(&cfg, Task::ShortQa).unwrap_err().to_string();
        assert!(e.contains("answers.match") && e.contains("squad"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = toml::from_str::<AugmentConfig>("[mc]\ntemplat = \"x\"\n").unwrap_err().to_string();
        assert!(e.contains("templat"), "{e}");
    }
}
