//! DPR's answer matching (`has_answer` with `match_type="string"` in DPR's
//! `dpr/data/qa_validation.py`): NFD-normalise, split with DPR's `SimpleTokenizer`
//! (`[\p{L}\p{N}\p{M}]+` runs, else any single character that is not a separator or control),
//! lowercase, and look for the answer's tokens as a contiguous run of the passage's tokens.

use regex::Regex;
use std::sync::OnceLock;
use unicode_normalization::UnicodeNormalization;

fn token_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"[\p{L}\p{N}\p{M}]+|[^\p{Z}\p{C}]").expect("valid regex"))
}

/// DPR `SimpleTokenizer` words of the NFD form of `text`, lowercased.
pub fn dpr_tokens(text: &str) -> Vec<String> {
    let nfd: String = text.nfd().collect();
    token_re().find_iter(&nfd).map(|m| m.as_str().to_lowercase()).collect()
}

/// The answers of one query, tokenised once, to test many passages.
#[derive(Debug, Clone)]
pub struct AnswerMatcher {
    answers: Vec<Vec<String>>,
}

impl AnswerMatcher {
    /// An answer with no tokens (blank) is dropped: in DPR it would match every passage.
    pub fn new(answers: &[String]) -> Self {
        Self { answers: answers.iter().map(|a| dpr_tokens(a)).filter(|t| !t.is_empty()).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }

    /// Whether any answer occurs in `text` as a contiguous token run.
    pub fn matches(&self, text: &str) -> bool {
        if self.answers.is_empty() {
            return false;
        }
        let tokens = dpr_tokens(text);
        self.answers.iter().any(|a| tokens.windows(a.len()).any(|w| w == a.as_slice()))
    }
}

/// DPR's `has_answer(answers, text, tokenizer, "string")`.
pub fn has_answer(answers: &[String], text: &str) -> bool {
    AnswerMatcher::new(answers).matches(text)
}
