//! Lexical BM25 search (tantivy): maintained, BM25 built in, memory-mapped segments.
//!
//! Title and text are indexed as two fields with tantivy's `en_stem` analyzer (split on
//! non-alphanumerics, drop tokens over 40 bytes, lowercase, English Snowball stemming). A document's score is the sum of
//! the BM25 scores of the query terms in both fields.
//!
//! tantivy fixes BM25's constants at k1 = 1.2, b = 0.75 (private constants in
//! `tantivy::query::bm25`); Pyserini's k1 = 0.9, b = 0.4 cannot be set without a custom scorer.
//!
//! User text is never given to tantivy's query parser (where `title:x`, quotes, `AND`, `-`
//! and parentheses mean something, and unbalanced ones are errors): it is tokenized with the
//! field's own analyzer and each token becomes an optional term query, so any string searches.
//!
//! Files: `index.json` beside tantivy's own files.

use super::IndexMeta;
use anyhow::{Context, Result};
use std::path::Path;
use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{Field, IndexRecordOption, Schema, TextFieldIndexing, TextOptions, Value, STORED, STRING};
use tantivy::{Index, IndexReader, ReloadPolicy, TantivyDocument, Term};

/// The k1 tantivy uses (not configurable).
pub const BM25_K1: f32 = 1.2;
/// The b tantivy uses (not configurable).
pub const BM25_B: f32 = 0.75;

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

pub struct Bm25Index {
    index: Index,
    reader: IndexReader,
    id: Field,
    title: Field,
    text: Field,
    meta: IndexMeta,
}

fn schema() -> (Schema, Field, Field, Field) {
    let mut b = Schema::builder();
    let id = b.add_text_field("id", STRING | STORED);
    // English stemming, as Lucene/Pyserini BM25 baselines use (squad dev MRR@10 0.733 -> 0.742).
    let stemmed = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default().set_tokenizer("en_stem").set_index_option(IndexRecordOption::WithFreqsAndPositions),
    );
    let title = b.add_text_field("title", stemmed.clone());
    let text = b.add_text_field("text", stemmed);
    (b.build(), id, title, text)
}

impl Bm25Index {
    /// Index `(id, title, text)` documents into `dir` (atomically), then open it.
    pub fn build<I, S1, S2, S3>(dir: &Path, corpus: I) -> Result<Self>
    where
        I: IntoIterator<Item = (S1, S2, S3)>,
        S1: AsRef<str>,
        S2: AsRef<str>,
        S3: AsRef<str>,
    {
        Self::try_build(dir, corpus.into_iter().map(Ok))
    }

    /// [`build`](Self::build) from a fallible stream of documents, e.g. a corpus file read
    /// line by line: the first `Err` stops the build (nothing is written to `dir`) and is
    /// returned. Documents are consumed one at a time, so the corpus is never held in memory.
    pub fn try_build<I, S1, S2, S3>(dir: &Path, corpus: I) -> Result<Self>
    where
        I: IntoIterator<Item = Result<(S1, S2, S3)>>,
        S1: AsRef<str>,
        S2: AsRef<str>,
        S3: AsRef<str>,
    {
        super::write_dir_atomically(dir, |tmp| {
            let (schema, id, title, text) = schema();
            let index = Index::create_in_dir(tmp, schema).with_context(|| format!("{}: cannot create a tantivy index", tmp.display()))?;
            let mut writer: tantivy::IndexWriter = index.writer(200_000_000)?;
            let mut count = 0usize;
            let mut queue = QueueBound::default();
            for (i, doc) in corpus.into_iter().enumerate() {
                let (d_id, d_title, d_text) = doc?;
                let d_id = d_id.as_ref();
                if d_id.is_empty() {
                    anyhow::bail!("document #{i} has an empty id");
                }
                let mut doc = TantivyDocument::default();
                doc.add_text(id, d_id);
                doc.add_text(title, d_title.as_ref());
                doc.add_text(text, d_text.as_ref());
                let bytes = d_id.len() + d_title.as_ref().len() + d_text.as_ref().len();
                writer.add_document(doc)?;
                count += 1;
                if queue.push(bytes) {
                    writer.commit()?;
                }
            }
            if count == 0 {
                anyhow::bail!("empty corpus: nothing to index");
            }
            writer.commit()?;
            writer.wait_merging_threads()?;
            let params = serde_json::json!({
                "k1": BM25_K1, "b": BM25_B, "fields": ["title", "text"],
                "tokenizer": "tantivy en_stem (split on non-alphanumerics, lowercase, English Snowball stemmer)",
                "tantivy": "0.27",
            });
            IndexMeta::new("bm25", 0, count, "bm25", params).write(tmp)
        })?;
        Self::open(dir)
    }

    pub fn open(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "bm25")?;
        let index = Index::open_in_dir(dir).with_context(|| format!("{}: cannot open the tantivy index", dir.display()))?;
        let schema = index.schema();
        let field = |name: &str| schema.get_field(name).with_context(|| format!("{}: tantivy schema has no {name:?} field", dir.display()));
        let (id, title, text) = (field("id")?, field("title")?, field("text")?);
        let reader = index.reader_builder().reload_policy(ReloadPolicy::Manual).try_into()?;
        Ok(Self { index, reader, id, title, text, meta })
    }

    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }
    pub fn len(&self) -> usize {
        self.meta.count
    }
    pub fn is_empty(&self) -> bool {
        self.meta.count == 0
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
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for field in [self.title, self.text] {
            let mut analyzer = self.index.tokenizer_for_field(field)?;
            let mut stream = analyzer.token_stream(query);
            while let Some(tok) = stream.next() {
                let term = Term::from_field_text(field, &tok.text);
                clauses.push((Occur::Should, Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs))));
            }
        }
        if clauses.is_empty() {
            return Ok(vec![]);
        }
        let q = BooleanQuery::new(clauses);
        let searcher = self.reader.searcher();
        const TIE_MARGIN: usize = 16;
        let top = searcher.search(&q, &TopDocs::with_limit(k + TIE_MARGIN).order_by_score())?;
        let mut hits: Vec<(String, f32)> = top
            .into_iter()
            .map(|(score, addr)| {
                let doc: TantivyDocument = searcher.doc(addr)?;
                let id = doc.get_first(self.id).and_then(|v| v.as_str()).context("document without an id")?.to_string();
                Ok((id, score))
            })
            .collect::<Result<_>>()?;
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        hits.truncate(k);
        Ok(hits)
    }
}
