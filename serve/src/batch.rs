//! Dynamic batching of encoder work, as text-embeddings-inference does: every route's texts
//! go into one bounded queue; one thread owns the encoder and takes from the queue as many
//! requests as fit a token budget (waiting at most `max_wait` for more), encodes them
//! together in length-sorted batches, and hands each request its rows. A full queue refuses
//! at once (the caller answers 429), so a burst never grows memory without bound.
//!
//! Batching changes no vector beyond float rounding: an encoder's output for a text does not
//! depend on its batchmates (what `host encode`'s length-sorted batches rely on too), though
//! batches padded to other lengths sum their GEMMs in another order.
//!
//! A request whose client has gone (its deadline passed, its connection closed) has dropped
//! its receiver: its texts are skipped, when taken and before every encoder call, so dead work
//! never holds the live requests behind it.

use crate::metrics::Metrics;
use rak_core::abi::Role;
use rak_core::plugin::Encoder;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How the batcher groups work.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Requests waiting at most (beyond it: 429).
    pub queue_capacity: usize,
    /// Tokens in one round of encoding (several requests); one larger request runs alone.
    pub max_batch_tokens: usize,
    /// Texts in one encoder call.
    pub max_batch_texts: usize,
    /// How long the first request of a round waits for company (zero: take what is queued).
    pub max_wait: Duration,
}

/// What one request gets back.
#[derive(Debug)]
pub struct Encoded {
    /// Rows, in the request's input order.
    pub rows: Vec<Vec<f32>>,
    /// Their width.
    pub dim: usize,
    /// Tokens the texts became (after truncation, special tokens included), when asked for
    /// and the encoder tells them (`Encoder::token_lengths`).
    pub tokens: Option<usize>,
}

/// Rows of one request, or why it failed.
pub type Rows = Result<Encoded, String>;

struct Job {
    texts: Vec<String>,
    role: Role,
    task: Option<String>,
    /// Whether the reply should count the texts' tokens (`/v1/embeddings`' usage).
    count_tokens: bool,
    reply: oneshot::Sender<Rows>,
}

/// The queue's sending side; cloned into every request.
#[derive(Clone)]
pub struct Batcher {
    tx: SyncSender<Job>,
    metrics: Arc<Metrics>,
    /// False once the encoder can serve no more: its thread ended, or the plugin instance is
    /// poisoned by a panic.
    healthy: Arc<AtomicBool>,
}

/// Why a request was not queued.
pub enum Refused {
    /// The queue is full (429).
    Full,
    /// The encoder thread is gone (503).
    Gone,
}

impl Batcher {
    /// Start the thread that owns `encoder`. It ends when every `Batcher` is dropped.
    pub fn start(encoder: Box<dyn Encoder>, opts: BatchOptions, metrics: Arc<Metrics>) -> (Batcher, std::thread::JoinHandle<()>) {
        let (tx, rx) = sync_channel(opts.queue_capacity.max(1));
        let m = metrics.clone();
        let healthy = Arc::new(AtomicBool::new(true));
        let h = healthy.clone();
        let thread = std::thread::Builder::new()
            .name("rak-serve-encoder".into())
            .spawn(move || {
                run(encoder, rx, opts, m, &h);
                h.store(false, Ordering::Relaxed);
            })
            .expect("spawning the encoder thread");
        (Batcher { tx, metrics, healthy }, thread)
    }

    /// Whether the encoder can still serve.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Queue `texts` for encoding; the rows arrive on the receiver (dropping it abandons them).
    /// With `count_tokens`, the reply counts their tokens too, when the encoder can.
    pub fn submit(&self, texts: Vec<String>, role: Role, task: Option<String>, count_tokens: bool) -> Result<oneshot::Receiver<Rows>, Refused> {
        let (reply, rx) = oneshot::channel();
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(Job { texts, role, task, count_tokens, reply }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    TrySendError::Full(_) => Refused::Full,
                    TrySendError::Disconnected(_) => Refused::Gone,
                })
            }
        }
    }
}

fn run(mut encoder: Box<dyn Encoder>, rx: Receiver<Job>, opts: BatchOptions, metrics: Arc<Metrics>, healthy: &AtomicBool) {
    // A request taken from the queue that did not fit the last round's budget.
    let mut carried: Option<(Job, usize)> = None;
    loop {
        let first = match carried.take() {
            Some(job) => job,
            None => match rx.recv() {
                Ok(job) => taken(job, &metrics),
                Err(_) => return,
            },
        };
        if first.0.reply.is_closed() {
            metrics.observe_abandoned(first.0.texts.len());
            continue;
        }
        let mut tokens = first.1;
        let mut round = vec![first.0];
        let deadline = Instant::now() + opts.max_wait;
        while tokens < opts.max_batch_tokens {
            let next = match rx.try_recv() {
                Ok(job) => job,
                Err(_) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => match rx.recv_timeout(left) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    },
                    _ => break,
                },
            };
            let (job, n) = taken(next, &metrics);
            if job.reply.is_closed() {
                metrics.observe_abandoned(job.texts.len());
                continue;
            }
            if tokens + n > opts.max_batch_tokens {
                carried = Some((job, n));
                break;
            }
            tokens += n;
            round.push(job);
        }
        // A panic here would leave every later request waiting forever: it fails the round's
        // requests instead (the encoder plugin's own panics already come back as errors).
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| encode_round(&mut *encoder, &round, &opts, &metrics)));
        let results = outcome.unwrap_or_else(|_| {
            healthy.store(false, Ordering::Relaxed);
            round.iter().map(|_| Err("the encoder thread panicked on this batch".to_string())).collect()
        });
        for (job, rows) in round.into_iter().zip(results) {
            if matches!(&rows, Err(e) if e.contains(rak_core::plugin::ffi::POISONED)) {
                healthy.store(false, Ordering::Relaxed);
            }
            let _ = job.reply.send(rows);
        }
    }
}

/// A job off the queue, with its tokens as the budget counts them: estimated from its
/// characters (about 4 a token in English), not by tokenising, which would double the
/// tokeniser's work for every request only to decide what to batch with it.
fn taken(job: Job, metrics: &Metrics) -> (Job, usize) {
    metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
    let n = job.texts.iter().map(|t| t.len() / 4 + 2).sum();
    (job, n)
}

/// Encode every text of a round, grouped by (role, task) and sorted by length within a group;
/// each job's rows, or the error of a batch that held one of its texts.
fn encode_round(encoder: &mut dyn Encoder, round: &[Job], opts: &BatchOptions, metrics: &Metrics) -> Vec<Rows> {
    let mut rows: Vec<Vec<Option<Vec<f32>>>> = round.iter().map(|j| vec![None; j.texts.len()]).collect();
    let mut failed: Vec<Option<String>> = vec![None; round.len()];
    let mut dims: Vec<usize> = vec![0; round.len()];
    // Token counts of the jobs that asked (None once the encoder cannot tell).
    let mut tokens: Vec<Option<usize>> = round.iter().map(|j| j.count_tokens.then_some(0)).collect();
    let mut groups: BTreeMap<(u8, Option<&str>), Vec<(usize, usize)>> = BTreeMap::new();
    for (j, job) in round.iter().enumerate() {
        for t in 0..job.texts.len() {
            groups.entry((job.role as u8, job.task.as_deref())).or_default().push((j, t));
        }
    }
    for ((_, task), mut members) in groups {
        let role = round[members[0].0].role;
        members.sort_by_key(|&(j, t)| std::cmp::Reverse(round[j].texts[t].len()));
        for all in members.chunks(opts.max_batch_texts.max(1)) {
            // Texts of requests abandoned since the round began are left out.
            let chunk: Vec<(usize, usize)> = all.iter().copied().filter(|&(j, _)| !round[j].reply.is_closed()).collect();
            metrics.observe_abandoned(all.len() - chunk.len());
            if chunk.is_empty() {
                continue;
            }
            let texts: Vec<&str> = chunk.iter().map(|&(j, t)| round[j].texts[t].as_str()).collect();
            // The tokeniser's count, for the requests that report usage: a tokenising pass of
            // the texts (about 0.03 ms for a query against 8 ms for its encoding, MiniLM on 2
            // CPU cores). An encoder that cannot tell leaves the usage to the estimate.
            let counted: Vec<usize> = (0..chunk.len()).filter(|&r| tokens[chunk[r].0].is_some()).collect();
            if !counted.is_empty() {
                let some: Vec<&str> = counted.iter().map(|&r| texts[r]).collect();
                match encoder.token_lengths(&some, role, task) {
                    Ok(Some(lengths)) if lengths.len() == some.len() => {
                        for (&r, n) in counted.iter().zip(lengths) {
                            if let Some(total) = tokens[chunk[r].0].as_mut() {
                                *total += n;
                            }
                        }
                    }
                    _ => {
                        for &r in &counted {
                            tokens[chunk[r].0] = None;
                        }
                    }
                }
            }
            metrics.observe_batch(texts.len());
            let encoded = encoder
                .encode(&texts, role, task, false)
                .and_then(|emb| rak_retrieval::pipeline::encode::embedding_rows(&emb, texts.len()));
            match encoded {
                Ok(flat) => {
                    let dim = flat.len() / texts.len();
                    for (r, &(j, t)) in chunk.iter().enumerate() {
                        rows[j][t] = Some(flat[r * dim..(r + 1) * dim].to_vec());
                        dims[j] = dim;
                    }
                }
                Err(e) => {
                    let msg = format!("{e:#}");
                    for &(j, _) in &chunk {
                        failed[j] = Some(msg.clone());
                    }
                }
            }
        }
    }
    rows.into_iter()
        .zip(failed)
        .zip(dims)
        .zip(tokens)
        .map(|(((rows, failed), dim), tokens)| match failed {
            Some(e) => Err(e),
            None => Ok(Encoded { rows: rows.into_iter().map(|r| r.unwrap_or_default()).collect(), dim, tokens }),
        })
        .collect()
}
