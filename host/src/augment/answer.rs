//! Reading answers out of what a target returned, and judging them.

/// The answer letters of `n` choices: A, B, ...
pub fn letters(n: usize) -> Vec<String> {
    (b'A'..=b'Z').take(n).map(|c| (c as char).to_string()).collect()
}

/// The choice a free-text answer names: the first standalone letter among `letters`
/// ("B", " B.", "(B)", "Answer: B"); failing that, the one choice whose text it contains.
pub fn parse_choice(text: &str, letters: &[String], choices: &[String]) -> Option<usize> {
    let chars: Vec<char> = text.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        let standalone = |j: Option<&char>| j.is_none_or(|c| !c.is_alphanumeric());
        // "A" and "I" followed by a lower-case word are an article and a pronoun, not answers.
        let word_follows = chars.get(i + 1) == Some(&' ') && chars.get(i + 2).is_some_and(|c| c.is_lowercase());
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

/// A short answer as PopQA reads it: the first non-empty line, trimmed.
pub fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
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
