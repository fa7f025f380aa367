//! Lexical BM25 search: tantivy keeps the inverted index, the scorer is ours.
//!
//! BM25 as Lucene and Pyserini compute it, with settable constants (Pyserini's defaults,
//! k1 = 0.9, b = 0.4): a query term `t` adds `idf(t) · tf / (tf + k1 · (1 − b + b · dl / avgdl))`
//! with `idf(t) = ln(1 + (N − df + 0.5) / (df + 0.5))`, once per occurrence in the query (Lucene
//! sums repeated clauses). tantivy's own BM25 fixes k1 = 1.2, b = 0.75 (private constants), so
//! the scorer reads tantivy's postings and length norms itself, term at a time into an
//! accumulator per thread that only the query's postings touch. Lengths are tantivy's quantised
//! field norms, which follow Lucene's one-byte encoding, so `dl` is what Lucene would use too.
//!
//! Each passage is one field, `title + " " + text` (as Pyserini's `contents`), analysed like
//! Lucene's `EnglishAnalyzer` as far as tantivy's filters allow: split on runs of alphanumeric
//! characters, drop tokens of 40 bytes or more, lowercase, drop Lucene's 33 English stop words,
//! English Snowball stemmer (Lucene uses Porter; the two agree on most words). Checked against
//! `bm25s` (method `lucene`) on mini-KILT dev: see `tests/bm25_parity.rs`.
//!
//! User text is never given to tantivy's query parser (where `title:x`, quotes, `AND`, `-`
//! and parentheses mean something, and unbalanced ones are errors): it is analysed like a
//! passage and each token becomes a term, so any string searches.
//!
//! Files: `index.json` (with k1 and b) beside tantivy's own files.

use super::IndexMeta;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::path::Path;
use tantivy::fieldnorm::FieldNormReader;
use tantivy::postings::Postings;
use tantivy::schema::{Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, Value, STORED, STRING};
use tantivy::tokenizer::{Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer};
use tantivy::{DocSet, Index, IndexReader, ReloadPolicy, TantivyDocument, Term, TERMINATED};

/// BM25's constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bm25Params {
    /// Term-frequency saturation.
    pub k1: f32,
    /// Length normalisation (0: none, 1: full).
    pub b: f32,
}

impl Default for Bm25Params {
    /// Pyserini's defaults.
    fn default() -> Self {
        Bm25Params { k1: 0.9, b: 0.4 }
    }
}

impl Bm25Params {
    pub fn validate(&self) -> Result<()> {
        if !self.k1.is_finite() || self.k1 < 0.0 || !(0.0..=1.0).contains(&self.b) {
            bail!("bm25: k1 must be >= 0 and b in [0, 1] (got k1 = {}, b = {})", self.k1, self.b);
        }
        Ok(())
    }
}

/// Lucene's `EnglishAnalyzer` stop set.
const STOP_WORDS: [&str; 33] = [
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not", "of", "on", "or", "such", "that", "the", "their",
    "then", "there", "these", "they", "this", "to", "was", "will", "with",
];

/// The name the analyzer is registered under in the index's tokenizer manager.
const ANALYZER: &str = "rak_en";

fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(StopWordFilter::remove(STOP_WORDS.iter().map(|w| w.to_string())))
        .filter(Stemmer::new(Language::English))
        .build()
}

/// The most text that may wait in tantivy's queue (see [`QueueBound`]).
const QUEUE_BYTES: usize = 16 << 20;
/// The length of tantivy's queue between `add_document` and its indexing threads, in
/// documents (`PIPELINE_MAX_SIZE_IN_DOCS`, private in tantivy 0.27).
const QUEUE_DOCS: usize = 10_000;

/// Keeps the memory held by tantivy's document queue bounded while indexing. `add_document`
/// returns as soon as the document is queued, and the queue holds up to [`QUEUE_DOCS`]
/// documents: with long passages that is a whole corpus in memory (200 passages of 1 MB
/// took 0.4 GiB). A commit returns only once the queue is indexed, so the build commits when
/// the text of the last `QUEUE_DOCS` documents since the last commit (the most the queue can
/// hold) reaches [`QUEUE_BYTES`]. Passages of ordinary length (under 1.6 KB on average)
/// never reach it and are indexed without extra commits (each commit ends a segment).
#[derive(Default)]
struct QueueBound {
    sizes: std::collections::VecDeque<usize>,
    bytes: usize,
}

impl QueueBound {
    /// Count a queued document of `bytes`; true when the caller must commit now.
    fn push(&mut self, bytes: usize) -> bool {
        self.sizes.push_back(bytes);
        self.bytes += bytes;
        if self.sizes.len() > QUEUE_DOCS {
            self.bytes -= self.sizes.pop_front().unwrap_or(0);
        }
        if self.bytes < QUEUE_BYTES {
            return false;
        }
        self.sizes.clear();
        self.bytes = 0;
        true
    }
}

/// Scores of one segment's documents for one query, reused across queries on a thread: only
/// the documents a query term reaches are touched and reset, so a query costs its postings,
/// not the size of the corpus.
#[derive(Default)]
struct Accumulator {
    scores: Vec<f32>,
    touched: Vec<u32>,
}

impl Accumulator {
    fn reset(&mut self, docs: usize) {
        for &d in &self.touched {
            self.scores[d as usize] = 0.0;
        }
        self.touched.clear();
        if self.scores.len() < docs {
            self.scores.resize(docs, 0.0);
        }
    }

    fn add(&mut self, doc: u32, score: f32) {
        if score == 0.0 {
            return;
        }
        let slot = &mut self.scores[doc as usize];
        if *slot == 0.0 {
            self.touched.push(doc);
        }
        *slot += score;
    }
}

thread_local! {
    static ACCUMULATOR: std::cell::RefCell<Accumulator> = std::cell::RefCell::new(Accumulator::default());
}

pub struct Bm25Index {
    index: Index,
    reader: IndexReader,
    id: Field,
    contents: Field,
    meta: IndexMeta,
    params: Bm25Params,
    /// Passages, and their mean analysed length (from tantivy's token counts).
    docs: u64,
    avgdl: f32,
}

fn schema() -> (Schema, Field, Field) {
    let mut b = Schema::builder();
    let id = b.add_text_field("id", STRING | STORED);
    let contents =
        TextOptions::default().set_indexing_options(TextFieldIndexing::default().set_tokenizer(ANALYZER).set_index_option(IndexRecordOption::WithFreqs));
    let contents = b.add_text_field("contents", contents);
    (b.build(), id, contents)
}

impl Bm25Index {
    /// Index `(id, title, text)` documents into `dir` (atomically), then open it.
    pub fn build<I, S1, S2, S3>(dir: &Path, corpus: I, params: Bm25Params) -> Result<Self>
    where
        I: IntoIterator<Item = (S1, S2, S3)>,
        S1: AsRef<str>,
        S2: AsRef<str>,
        S3: AsRef<str>,
    {
        Self::try_build(dir, corpus.into_iter().map(Ok), params)
    }

    /// [`build`](Self::build) from a fallible stream of documents, e.g. a corpus file read
    /// line by line: the first `Err` stops the build (nothing is written to `dir`) and is
    /// returned. Documents are consumed one at a time, so the corpus is never held in memory.
    pub fn try_build<I, S1, S2, S3>(dir: &Path, corpus: I, params: Bm25Params) -> Result<Self>
    where
        I: IntoIterator<Item = Result<(S1, S2, S3)>>,
        S1: AsRef<str>,
        S2: AsRef<str>,
        S3: AsRef<str>,
    {
        params.validate()?;
        super::write_dir_atomically(dir, |tmp| {
            let (schema, id, contents) = schema();
            let index = Index::create_in_dir(tmp, schema).with_context(|| format!("{}: cannot create a tantivy index", tmp.display()))?;
            index.tokenizers().register(ANALYZER, analyzer());
            let mut writer: tantivy::IndexWriter = index.writer(200_000_000)?;
            let mut count = 0usize;
            let mut queue = QueueBound::default();
            let mut text = String::new();
            // The ids met so far, as 128-bit hashes (a 8.8M-passage corpus then holds about
            // 200 MB, not the ids themselves): a repeated id would be two documents, found twice.
            let hashers = (std::collections::hash_map::RandomState::new(), std::collections::hash_map::RandomState::new());
            let mut seen: std::collections::HashSet<u128> = std::collections::HashSet::new();
            for (i, doc) in corpus.into_iter().enumerate() {
                let (d_id, d_title, d_text) = doc?;
                let d_id = d_id.as_ref();
                if d_id.is_empty() {
                    anyhow::bail!("document #{i} has an empty id");
                }
                let hash = (u128::from(hashers.0.hash_one(d_id)) << 64) | u128::from(hashers.1.hash_one(d_id));
                if !seen.insert(hash) {
                    anyhow::bail!("passage id {d_id:?} occurs twice (the second time as record {}); give each passage its own id", i + 1);
                }
                text.clear();
                text.push_str(d_title.as_ref());
                text.push(' ');
                text.push_str(d_text.as_ref());
                let mut doc = TantivyDocument::default();
                doc.add_text(id, d_id);
                doc.add_text(contents, &text);
                writer.add_document(doc)?;
                count += 1;
                if queue.push(d_id.len() + text.len()) {
                    writer.commit()?;
                }
            }
            if count == 0 {
                anyhow::bail!("empty corpus: nothing to index");
            }
            writer.commit()?;
            writer.wait_merging_threads()?;
            let meta_params = serde_json::json!({
                "k1": params.k1, "b": params.b, "fields": ["title + ' ' + text"],
                "analyzer": "split on non-alphanumerics, drop tokens of 40+ bytes, lowercase, Lucene's English stop words, English Snowball stemmer",
                "scorer": "Lucene BM25 over tantivy 0.27 postings",
            });
            IndexMeta::new("bm25", 0, count, "bm25", meta_params).write(tmp)
        })?;
        Self::open(dir)
    }

    /// Open the index in `dir`, scoring with the k1 and b it was built with.
    pub fn open(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "bm25")?;
        let params: Bm25Params = serde_json::from_value(serde_json::json!({"k1": meta.params.get("k1"), "b": meta.params.get("b")}))
            .with_context(|| format!("{}: index.json has no valid k1 and b (built by an older version? rebuild it with host index build --kind bm25)", dir.display()))?;
        let index = Index::open_in_dir(dir).with_context(|| format!("{}: cannot open the tantivy index", dir.display()))?;
        index.tokenizers().register(ANALYZER, analyzer());
        let schema = index.schema();
        let field = |name: &str| {
            schema.get_field(name).with_context(|| {
                format!("{}: the tantivy schema has no {name:?} field (built by an older version? rebuild it with host index build --kind bm25)", dir.display())
            })
        };
        let (id, contents) = (field("id")?, field("contents")?);
        let reader: IndexReader = index.reader_builder().reload_policy(ReloadPolicy::Manual).try_into()?;
        let searcher = reader.searcher();
        let docs = searcher.num_docs();
        let mut tokens = 0u64;
        for segment in searcher.segment_readers() {
            tokens += segment.inverted_index(contents)?.total_num_tokens();
        }
        let avgdl = if docs == 0 { 1.0 } else { (tokens as f64 / docs as f64).max(1e-9) as f32 };
        Ok(Self { index, reader, id, contents, meta, params, docs, avgdl })
    }

    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }
    pub fn params(&self) -> Bm25Params {
        self.params
    }
    /// Score with other constants from now on (the index does not depend on them).
    pub fn set_params(&mut self, params: Bm25Params) -> Result<()> {
        params.validate()?;
        self.params = params;
        Ok(())
    }
    pub fn len(&self) -> usize {
        self.meta.count
    }
    pub fn is_empty(&self) -> bool {
        self.meta.count == 0
    }

    /// Call `f` with every passage id the index holds, in no particular order: the id field's
    /// terms, read from its term dictionaries without decompressing a stored document or
    /// holding all the ids at once.
    pub fn for_each_id(&self, mut f: impl FnMut(&str)) -> Result<()> {
        let searcher = self.reader.searcher();
        for segment in searcher.segment_readers() {
            let inverted = segment.inverted_index(self.id)?;
            let mut terms = inverted.terms().stream()?;
            while terms.advance() {
                f(std::str::from_utf8(terms.key()).context("a passage id in the BM25 index is not UTF-8")?);
            }
        }
        Ok(())
    }

    /// The query's analysed terms with how often each occurs.
    fn query_terms(&self, query: &str) -> Result<BTreeMap<String, u32>> {
        let mut analyzer = self.index.tokenizer_for_field(self.contents)?;
        let mut stream = analyzer.token_stream(query);
        let mut terms = BTreeMap::new();
        while let Some(tok) = stream.next() {
            *terms.entry(tok.text.clone()).or_insert(0) += 1;
        }
        Ok(terms)
    }

    /// The `k` best documents for free text `query`, as `(id, score)`, best first, equal scores
    /// in id order. A query with no indexable token returns nothing.
    ///
    /// Ties are broken by id, not by tantivy's document address: addresses depend on how the
    /// indexing threads happened to split the corpus into segments, so two builds of one
    /// corpus would otherwise rank tied passages differently (and a trainer drawing hard
    /// negatives from the ranking would not repeat itself). A few results past `k` are fetched
    /// so that a tie straddling the cut is resolved the same way too.
    pub fn search(&self, query: &str, k: usize) -> Result<Vec<(String, f32)>> {
        if k == 0 {
            anyhow::bail!("k must be at least 1");
        }
        let terms = self.query_terms(query)?;
        if terms.is_empty() {
            return Ok(vec![]);
        }
        let searcher = self.reader.searcher();
        let Bm25Params { k1, b } = self.params;
        // Per query term: its tantivy term, its weight (idf × occurrences in the query).
        let mut weighted = Vec::with_capacity(terms.len());
        for (text, count) in terms {
            let term = Term::from_field_text(self.contents, &text);
            let df = searcher.doc_freq(&term)?;
            if df == 0 {
                continue;
            }
            let idf = (1.0 + (self.docs as f64 - df as f64 + 0.5) / (df as f64 + 0.5)).ln() as f32;
            weighted.push((term, idf * count as f32));
        }
        // `k1 · (1 − b + b · dl / avgdl)` for each of the 256 one-byte length codes.
        let norm: Vec<f32> = (0..=255u8).map(|code| k1 * (1.0 - b + b * FieldNormReader::id_to_fieldnorm(code) as f32 / self.avgdl)).collect();
        const TIE_MARGIN: usize = 16;
        let keep = k.saturating_add(TIE_MARGIN);
        let mut best: Vec<(f32, u32, u32)> = Vec::new();
        ACCUMULATOR.with_borrow_mut(|acc| -> Result<()> {
            for (ord, segment) in searcher.segment_readers().iter().enumerate() {
                let inverted = segment.inverted_index(self.contents)?;
                let norms = segment.get_fieldnorms_reader(self.contents)?;
                acc.reset(segment.max_doc() as usize);
                for (term, weight) in &weighted {
                    let Some(mut postings) = inverted.read_postings(term, IndexRecordOption::WithFreqs)? else { continue };
                    let mut doc = postings.doc();
                    while doc != TERMINATED {
                        let tf = postings.term_freq() as f32;
                        acc.add(doc, weight * tf / (tf + norm[norms.fieldnorm_id(doc) as usize]));
                        doc = postings.advance();
                    }
                }
                best.extend(acc.touched.iter().map(|&d| (acc.scores[d as usize], ord as u32, d)));
                if best.len() > keep {
                    best.select_nth_unstable_by(keep - 1, |x, y| y.0.total_cmp(&x.0));
                    best.truncate(keep);
                }
            }
            Ok(())
        })?;
        let mut hits: Vec<(String, f32)> = best
            .into_iter()
            .map(|(score, ord, doc)| {
                let doc: TantivyDocument = searcher.doc(tantivy::DocAddress::new(ord, doc))?;
                let id = doc.get_first(self.id).and_then(|v| v.as_str()).context("document without an id")?.to_string();
                Ok((id, score))
            })
            .collect::<Result<_>>()?;
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        hits.truncate(k);
        Ok(hits)
    }
}
