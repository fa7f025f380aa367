//! Prompt templates: `{name}` placeholders, `{{` and `}}` for literal braces. Templates are
//! checked when the config is read, so a misspelt placeholder fails before any request.

use anyhow::{bail, Result};

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Var(String),
}

/// A parsed template.
#[derive(Debug, Clone)]
pub struct Template {
    pieces: Vec<Piece>,
    source: String,
}

impl Template {
    /// Parse `text`, refusing placeholders outside `allowed`; `what` names the template in errors.
    pub fn parse(text: &str, allowed: &[&str], what: &str) -> Result<Self> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    let mut closed = false;
                    for c in chars.by_ref() {
                        if c == '}' {
                            closed = true;
                            break;
                        }
                        name.push(c);
                    }
                    if !closed {
                        bail!("{what}: '{{{name}' is never closed (write {{{{ for a literal brace)");
                    }
                    if !allowed.contains(&name.as_str()) {
                        bail!("{what}: unknown placeholder {{{name}}} (known: {}; write {{{{ and }}}} for literal braces)", allowed.join(", "));
                    }
                    if !lit.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut lit)));
                    }
                    pieces.push(Piece::Var(name));
                }
                '}' => bail!("{what}: a lone '}}' (write }}}} for a literal brace)"),
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            pieces.push(Piece::Text(lit));
        }
        Ok(Template { pieces, source: text.to_string() })
    }

    /// The text it was parsed from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Fill in the placeholders; one missing from `vars` renders empty.
    pub fn render(&self, vars: &[(&str, &str)]) -> String {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(name) => out.push_str(vars.iter().find(|(k, _)| k == name).map(|(_, v)| *v).unwrap_or("")),
            }
        }
        out
    }

    pub fn uses(&self, name: &str) -> bool {
        self.pieces.iter().any(|p| matches!(p, Piece::Var(n) if n == name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_escapes() {
        let t = Template::parse("{passages}Q: {question} {{A}}:", &["passages", "question"], "t").unwrap();
        assert_eq!(t.render(&[("question", "Who?"), ("passages", "P\n\n")]), "P\n\nQ: Who? {A}:");
        assert_eq!(t.render(&[("question", "Who?")]), "Q: Who? {A}:");
        assert!(t.uses("passages") && !t.uses("choices"));
    }

    #[test]
    fn unknown_placeholders_are_refused() {
        let e = Template::parse("{questoin}", &["question"], "mc.template").unwrap_err().to_string();
        assert!(e.contains("mc.template") && e.contains("{questoin}") && e.contains("question"), "{e}");
        assert!(Template::parse("a } b", &[], "t").is_err());
        assert!(Template::parse("x {question", &["question"], "t").unwrap_err().to_string().contains("never closed"));
    }

    #[test]
    fn cuts_on_characters() {
        use rak_core::readers::fid::char_prefix;
        assert_eq!(char_prefix("héllo", 2), "hé");
        assert_eq!(char_prefix("hi", 5), "hi");
    }
}
