//! Numbered line reading shared by the readers: one record per line, errors as `file:line: ...`.

use anyhow::{anyhow, Context, Result};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Non-blank lines of a file with their 1-based numbers.
pub(crate) struct Lines {
    path: PathBuf,
    reader: BufReader<File>,
    line: usize,
}

impl Lines {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        Ok(Self { path: path.to_path_buf(), reader: BufReader::with_capacity(1 << 20, file), line: 0 })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// `file:line: msg`.
    pub(crate) fn err(&self, line: usize, msg: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("{}:{}: {}", self.path.display(), line, msg)
    }

    /// The next line that is not blank, without its line ending.
    pub(crate) fn next_line(&mut self) -> Option<Result<(usize, String)>> {
        loop {
            let mut buf = String::new();
            self.line += 1;
            match self.reader.read_line(&mut buf) {
                Ok(0) => return None,
                Ok(_) => {
                    let trimmed = buf.trim_end_matches(['\n', '\r']);
                    if trimmed.trim().is_empty() {
                        continue;
                    }
                    return Some(Ok((self.line, trimmed.to_string())));
                }
                Err(e) => return Some(Err(self.err(self.line, format!("cannot read: {e}")))),
            }
        }
    }
}

/// Parses one line: `Ok(None)` skips it (a header), `Err(msg)` becomes `file:line: msg`.
pub(crate) type ParseLine<T> = fn(usize, &str) -> std::result::Result<Option<T>, String>;

/// A streaming reader of one record per line. Yields `Err` for each bad line (and keeps going),
/// stops after an I/O error, and yields one `Err` naming the file when it holds no records.
pub struct Records<T> {
    lines: Lines,
    parse: ParseLine<T>,
    what: &'static str,
    records: usize,
    /// The line the last record came from.
    line: usize,
    done: bool,
}

impl<T> Records<T> {
    pub(crate) fn open(path: &Path, what: &'static str, parse: ParseLine<T>) -> Result<Self> {
        Ok(Self { lines: Lines::open(path)?, parse, what, records: 0, line: 0, done: false })
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        self.lines.path()
    }

    /// Each record with its 1-based line number, for errors a reader's caller finds (a
    /// repeated id, an empty text): `file:line: msg`, as the readers' own errors are.
    pub fn numbered(self) -> Numbered<T> {
        Numbered(self)
    }
}

/// [`Records::numbered`]'s iterator.
pub struct Numbered<T>(Records<T>);

impl<T> Iterator for Numbered<T> {
    type Item = Result<(usize, T)>;

    fn next(&mut self) -> Option<Self::Item> {
        let rec = self.0.next()?;
        Some(rec.map(|r| (self.0.line, r)))
    }
}

impl<T> Iterator for Records<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        while !self.done {
            match self.lines.next_line() {
                None => {
                    self.done = true;
                    if self.records == 0 {
                        return Some(Err(anyhow!("{}: empty: no {} in the file", self.lines.path().display(), self.what)));
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                Some(Ok((n, line))) => match (self.parse)(n, &line) {
                    Ok(None) => {}
                    Ok(Some(rec)) => {
                        self.records += 1;
                        self.line = n;
                        return Some(Ok(rec));
                    }
                    Err(msg) => {
                        // A bad line still means the file is not empty.
                        self.records += 1;
                        return Some(Err(self.lines.err(n, msg)));
                    }
                },
            }
        }
        None
    }
}
