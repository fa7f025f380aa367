//! Reading answers out of what a target returned, and judging them.

/// The answer letters of `n` choices: A, B, ...
pub fn letters(n: usize) -> Vec<String> {
    (b'A'..=b'Z').take(n).map(|c| (c as char).to_string()).collect()
}

/// Verbs that, after a standalone "A" or "I", make it an answer letter ("A is correct", "I
/// seems right"): English never puts them after the article "a" or the pronoun "I" ("I is",
/// "a seems"), while any other lower-case word ("A good guess", "I think") reads as one. Only
/// third-person present forms qualify: a past tense such as "was" follows the pronoun ("I was
/// unsure") as naturally as a letter.
const LETTER_VERBS: [&str; 9] = ["is", "seems", "appears", "looks", "fits", "matches", "answers", "describes", "holds"];

/// The choice a free-text answer names: the first standalone letter among `letters`
/// ("B", " B.", "(B)", "Answer: B", "A is correct"); failing that, the one choice whose text
/// it contains.
pub fn parse_choice(text: &str, letters: &[String], choices: &[String]) -> Option<usize> {
    let chars: Vec<char> = text.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        let standalone = |j: Option<&char>| j.is_none_or(|c| !c.is_alphanumeric());
        // "A" and "I" followed by a lower-case word are an article and a pronoun, not answers,
        // unless that word is a verb only a letter takes ("A is correct").
        let next_word: String = chars.iter().skip(i + 2).take_while(|c| c.is_alphanumeric()).collect();
        let word_follows = chars.get(i + 1) == Some(&' ')
            && chars.get(i + 2).is_some_and(|c| c.is_lowercase())
            && !LETTER_VERBS.contains(&next_word.as_str());
        if c.is_ascii_uppercase()
            && standalone(i.checked_sub(1).and_then(|j| chars.get(j)))
            && standalone(chars.get(i + 1))
            && !((*c == 'A' || *c == 'I') && word_follows)
        {
            if let Some(k) = letters.iter().position(|l| l.starts_with(*c)) {
                return Some(k);
            }
        }
    }
    let lower = text.to_lowercase();
    let named: Vec<usize> = (0..choices.len()).filter(|&k| !choices[k].trim().is_empty() && lower.contains(&choices[k].to_lowercase())).collect();
    (named.len() == 1).then(|| named[0])
}

/// A short answer: the first non-empty line, trimmed. PopQA's `run_model.py` strips one
/// leading `"\n\n"` and takes the first line, so a reply opening with a single newline is
/// empty (wrong) there; chat models often open so, and here it is read by its first line of
/// text. Accuracies can therefore run slightly above PopQA's protocol for such models.
pub fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}

/// How a short answer is judged against the gold aliases (`[answers] match`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerMatch {
    /// PopQA's rule ([`contains_alias`]): some alias is a substring of the answer.
    #[default]
    PopQa,
    /// SQuAD's and KILT's exact match: the answer equals some alias once both are normalised
    /// ([`normalize_answer`]).
    Squad,
}

impl AnswerMatch {
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "popqa" => Ok(AnswerMatch::PopQa),
            "squad" => Ok(AnswerMatch::Squad),
            other => anyhow::bail!("answers.match {other:?}: expected popqa (PopQA's alias in the answer) or squad (SQuAD's and KILT's normalised exact match)"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AnswerMatch::PopQa => "popqa",
            AnswerMatch::Squad => "squad",
        }
    }

    /// Whether `answer` (the reply's first line) is right.
    pub fn judge(self, answer: &str, aliases: &[String]) -> bool {
        match self {
            AnswerMatch::PopQa => contains_alias(answer, aliases),
            AnswerMatch::Squad => exact_match(answer, aliases),
        }
    }
}

/// SQuAD's `normalize_answer` (its official evaluation script, which KILT's reuses): lower-cased,
/// ASCII punctuation (Python's `string.punctuation`) removed, the words "a", "an" and "the"
/// removed, white space collapsed to single spaces.
pub fn normalize_answer(s: &str) -> String {
    let lower: String = s.to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
    // `re.sub(r"\b(a|an|the)\b", " ", text)`: whole words, a word being a run of Python's `\w`.
    let mut out = String::with_capacity(lower.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in lower.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// SQuAD's exact match against any alias: the normalised strings are equal. As in its script,
/// an alias that normalises to nothing ("The") matches an answer that does too (an empty reply);
/// a blank alias is no answer at all and is left out, as KILT's `get_gold_answers` leaves out
/// blank answers.
pub fn exact_match(answer: &str, aliases: &[String]) -> bool {
    let answer = normalize_answer(answer);
    aliases.iter().filter(|a| !a.trim().is_empty()).any(|a| normalize_answer(a) == answer)
}

/// PopQA's judgement (REFERENCE §6): some alias, as is, lower-cased or capitalised, is a
/// substring of the answer as the model wrote it (the answer is never lower-cased).
pub fn contains_alias(answer: &str, aliases: &[String]) -> bool {
    aliases.iter().map(|a| a.trim()).filter(|a| !a.is_empty()).any(|a| [a.to_string(), a.to_lowercase(), capitalize(a)].iter().any(|form| answer.contains(form.as_str())))
}

/// Python's `str.capitalize`, which PopQA's scorer uses: the first character upper-cased, the
/// rest lower-cased.
fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars.flat_map(char::to_lowercase)).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_run_past_d() {
        assert_eq!(letters(13).last().unwrap(), "M");
    }

    #[test]
    fn parses_free_text_choices() {
        let l = letters(4);
        let c: Vec<String> = ["red", "green", "blue", "black"].iter().map(|s| s.to_string()).collect();
        assert_eq!(parse_choice(" B", &l, &c), Some(1));
        assert_eq!(parse_choice("(C) blue", &l, &c), Some(2));
        assert_eq!(parse_choice("Answer: D.", &l, &c), Some(3));
        assert_eq!(parse_choice("A", &l, &c), Some(0));
        assert_eq!(parse_choice("It is green", &l, &c), Some(1), "no letter: the one choice named");
        assert_eq!(parse_choice("Every colour", &l, &c), None);
        assert_eq!(parse_choice("E", &l, &c), None, "E is not among 4 choices");
        let l10 = letters(10);
        let c10: Vec<String> = (0..10).map(|i| format!("option {i}")).collect();
        assert_eq!(parse_choice("I think it is C", &l10, &c10), Some(2), "the pronoun I is not answer I");
        assert_eq!(parse_choice("A good guess is B", &l10, &c10), Some(1), "the article A is not answer A");
        assert_eq!(parse_choice("I", &l10, &c10), Some(8));
    }

    /// A letter followed by a verb only a letter takes is the answer; the article and the
    /// pronoun still are not.
    #[test]
    fn a_letter_that_is_the_subject_is_read() {
        let l = letters(4);
        let c: Vec<String> = ["red", "green", "blue", "black"].iter().map(|s| s.to_string()).collect();
        assert_eq!(parse_choice("A is correct", &l, &c), Some(0));
        assert_eq!(parse_choice("A is the answer.", &l, &c), Some(0));
        assert_eq!(parse_choice("Option A is correct", &l, &c), Some(0));
        assert_eq!(parse_choice("I think A is right", &l, &c), Some(0), "the pronoun is passed over, the letter read");
        assert_eq!(parse_choice("A seems most likely", &l, &c), Some(0));
        assert_eq!(parse_choice("B is correct", &l, &c), Some(1));
        assert_eq!(parse_choice("A good answer would be C", &l, &c), Some(2), "the article A");
        assert_eq!(parse_choice("A correct answer is D", &l, &c), Some(3), "the article A before an adjective");
        assert_eq!(parse_choice("A isolated case", &l, &c), None, "a word that only begins like a verb");
        let l10 = letters(10);
        let c10: Vec<String> = (0..10).map(|i| format!("option {i}")).collect();
        assert_eq!(parse_choice("I is correct", &l10, &c10), Some(8));
        assert_eq!(parse_choice("I would say B", &l10, &c10), Some(1), "the pronoun I");
    }

    /// "I was ..." is the pronoun (a past tense follows it as naturally as a letter), with 9+
    /// choices as with fewer.
    #[test]
    fn the_pronoun_i_before_was_is_not_answer_i() {
        let l10 = letters(10);
        let c10: Vec<String> = (0..10).map(|i| format!("option {i}")).collect();
        assert_eq!(parse_choice("I was unsure; B", &l10, &c10), Some(1));
        assert_eq!(parse_choice("I was not sure, but B", &l10, &c10), Some(1));
        assert_eq!(parse_choice("I think it is C", &l10, &c10), Some(2));
        assert_eq!(parse_choice("A is correct", &l10, &c10), Some(0));
        assert_eq!(parse_choice("I seems right", &l10, &c10), Some(8), "a verb no pronoun takes");
    }

    /// SQuAD's official normalize_answer, on the cases its steps differ on.
    #[test]
    fn squad_normalisation_and_exact_match() {
        assert_eq!(normalize_answer("The  Eiffel Tower!"), "eiffel tower");
        assert_eq!(normalize_answer("an apple, a pear"), "apple pear");
        assert_eq!(normalize_answer("Theatre"), "theatre", "only whole words are articles");
        assert_eq!(normalize_answer("U.S.A."), "usa");
        assert_eq!(normalize_answer("rock-n-roll"), "rocknroll", "punctuation is removed, not spaced");
        assert_eq!(normalize_answer("A"), "");
        assert_eq!(normalize_answer("  Ça  va\t"), "ça va");
        let aliases = vec!["The Beatles".to_string(), "Beatles".to_string()];
        assert!(exact_match("the beatles.", &aliases));
        assert!(!exact_match("The Beatles were a band", &aliases), "exact, not contained");
        assert!(AnswerMatch::PopQa.judge("The Beatles were a band", &aliases));
        assert!(AnswerMatch::Squad.judge("beatles", &aliases));
        // SQuAD's script: normalize_answer(prediction) == normalize_answer(ground_truth), so
        // both empty is a match, and an empty alias matches nothing else.
        assert!(AnswerMatch::Squad.judge("", &["the".to_string()]), "both normalise to nothing: a match, as in SQuAD's script");
        // A blank alias is no answer (KILT's get_gold_answers drops it): nothing matches it.
        assert!(!exact_match("A.", &["".to_string()]) && !exact_match("", &[" ".to_string(), "Paris".to_string()]));
        assert!(!exact_match("beatles", &["the".to_string()]));
        assert_eq!(AnswerMatch::parse("squad").unwrap(), AnswerMatch::Squad);
        assert!(AnswerMatch::parse("kilt").unwrap_err().to_string().contains("answers.match"));
    }

    #[test]
    fn short_answers() {
        assert_eq!(first_line("\n Portugal\nSpain"), "Portugal");
        let aliases = vec!["Portugal".to_string(), "Portuguese Republic".to_string()];
        assert!(contains_alias("portugal, of course", &aliases));
        assert!(!contains_alias("Spain", &aliases));
        assert!(!contains_alias("", &["".to_string()]));
    }

    #[test]
    fn aliases_are_tried_as_written_lower_cased_and_capitalised() {
        // REFERENCE §6 (PopQA): the alias as is, lower-cased or capitalised (Python's
        // str.capitalize: the first character upper, the rest lower), in the output as written.
        let a = |s: &str| vec![s.to_string()];
        assert!(contains_alias("It is Paris.", &a("Paris")));
        assert!(contains_alias("paris", &a("Paris")), "lower-cased");
        assert!(contains_alias("New york city", &a("new York City")), "capitalised");
        assert!(!contains_alias("PARIS", &a("Paris")), "the output is not lower-cased");
        assert!(!contains_alias("New York City", &a("new York City")), "none of the three forms");
    }
}
