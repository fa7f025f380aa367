//! Tokenising ahead: [`Encoder::prepare`](crate::plugin::Encoder::prepare) hands an encoder
//! texts it will be asked to encode next, and the encoder tokenises them on a thread of its
//! own, so that tokenising is off the caller's critical path. On a GPU the host otherwise
//! tokenises each batch while the device idles: the trainer's step waits for the device at its
//! end, so the next step's tokenising ran before any of its kernels were queued (a DPR step's
//! 96 texts take about 10 ms on 2 cores, a sixth of a MiniLM step on an H100), and `host
//! encode` tokenised each batch after copying the last one's embeddings back. On the CPU the
//! tokeniser's threads would take cores from libtorch's, so the built-in encoders tokenise
//! ahead on CUDA only, unless their `tokenize_ahead` setting says otherwise.
//!
//! A hint, never a change of result: an encode call takes a prepared batch only if it is
//! exactly the same texts, role and task, and tokenises as always otherwise (or when the
//! prepared one failed, so its error is the inline call's).

use crate::abi::Role;
use crate::models::tokenizer::Encoded;
use anyhow::Result;
use std::collections::VecDeque;
use std::thread::JoinHandle;
use tch::Device;

/// Prepared batches kept at most (a step of many tasks prepares two a task); the oldest is
/// dropped beyond it, so a caller that prepares and never encodes holds bounded memory.
const MAX_PENDING: usize = 64;

/// Whether an encoder on `device` tokenises ahead: the setting when given, else on CUDA only.
pub fn enabled(setting: Option<bool>, device: Device) -> bool {
    setting.unwrap_or(matches!(device, Device::Cuda(_)))
}

struct Pending {
    role: Role,
    task: Option<String>,
    texts: Vec<String>,
    job: JoinHandle<Result<Encoded>>,
}

/// Batches being (or already) tokenised ahead, in the order they were prepared.
#[derive(Default)]
pub struct TokenizeAhead {
    pending: VecDeque<Pending>,
    /// Encode calls that found their batch prepared (for tests and profiles).
    hits: u64,
}

impl TokenizeAhead {
    /// Start tokenising `texts` on a thread of its own with `tokenize` (which must tokenise
    /// exactly as the encode call would). If no thread can be started, nothing is prepared.
    pub fn start<F>(&mut self, texts: &[&str], role: Role, task: Option<&str>, tokenize: F)
    where
        F: FnOnce(&[&str], Role, Option<&str>) -> Result<Encoded> + Send + 'static,
    {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        let task = task.map(str::to_string);
        let (job_texts, job_task) = (texts.clone(), task.clone());
        let job = std::thread::Builder::new().name("rak-tokenize".into()).spawn(move || {
            let refs: Vec<&str> = job_texts.iter().map(String::as_str).collect();
            tokenize(&refs, role, job_task.as_deref())
        });
        let Ok(job) = job else { return };
        if self.pending.len() == MAX_PENDING {
            self.pending.pop_front();
        }
        self.pending.push_back(Pending { role, task, texts, job });
    }

    /// The prepared tokens of exactly these texts, role and task, if any were prepared and
    /// tokenising them succeeded (waiting for them if they are still being made).
    pub fn take(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Option<Encoded> {
        let at = self.pending.iter().position(|p| p.role == role && p.task.as_deref() == task && p.texts.iter().map(String::as_str).eq(texts.iter().copied()))?;
        let pending = self.pending.remove(at)?;
        let encoded = pending.job.join().ok()?.ok()?;
        self.hits += 1;
        Some(encoded)
    }

    pub fn hits(&self) -> u64 {
        self.hits
    }
}

/// The batch prepared ahead for exactly these texts, role and task, else `tokenize`'s (an
/// encoder's tokens for one encode call, whether tokenising ahead is on or not).
pub fn take_or(ahead: Option<&mut TokenizeAhead>, texts: &[&str], role: Role, task: Option<&str>, tokenize: impl FnOnce() -> Result<Encoded>) -> Result<Encoded> {
    match ahead.and_then(|a| a.take(texts, role, task)) {
        Some(enc) => Ok(enc),
        None => tokenize(),
    }
}

/// Encode calls that found their batch prepared; 0 when tokenising ahead is off.
pub fn hits(ahead: Option<&TokenizeAhead>) -> u64 {
    ahead.map_or(0, TokenizeAhead::hits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    fn fake(texts: &[&str], _: Role, task: Option<&str>) -> Result<Encoded> {
        anyhow::ensure!(!texts.contains(&"bad"), "a bad text");
        let ids: Vec<i64> = texts.iter().map(|t| t.len() as i64 + task.map_or(0, |t| 100 * t.len() as i64)).collect();
        let ids = Tensor::from_slice(&ids).view([texts.len() as i64, 1]);
        Ok(Encoded { attention_mask: ids.ones_like(), token_type_ids: ids.zeros_like(), input_ids: ids })
    }

    #[test]
    fn a_prepared_batch_is_taken_only_by_the_same_texts_role_and_task() {
        let mut ahead = TokenizeAhead::default();
        ahead.start(&["a", "bb"], Role::Query, Some("nq"), fake);
        ahead.start(&["ccc"], Role::Passage, None, fake);
        assert!(ahead.take(&["a", "bb"], Role::Passage, Some("nq")).is_none(), "another role");
        assert!(ahead.take(&["a", "bb"], Role::Query, None).is_none(), "another task");
        assert!(ahead.take(&["a"], Role::Query, Some("nq")).is_none(), "a prefix of the texts");
        assert!(ahead.take(&["a", "bb", "x"], Role::Query, Some("nq")).is_none(), "more texts");
        // Out of order, as a caller may encode them.
        let p = ahead.take(&["ccc"], Role::Passage, None).expect("prepared");
        assert_eq!(Vec::<i64>::try_from(p.input_ids.view([-1])).unwrap(), vec![3]);
        let q = ahead.take(&["a", "bb"], Role::Query, Some("nq")).expect("prepared");
        assert_eq!(Vec::<i64>::try_from(q.input_ids.view([-1])).unwrap(), vec![201, 202]);
        assert!(ahead.take(&["a", "bb"], Role::Query, Some("nq")).is_none(), "taken once");
        assert_eq!(ahead.hits(), 2);
    }

    #[test]
    fn a_failed_or_dropped_preparation_leaves_the_caller_to_tokenise() {
        let mut ahead = TokenizeAhead::default();
        ahead.start(&["bad"], Role::Passage, None, fake);
        assert!(ahead.take(&["bad"], Role::Passage, None).is_none(), "the inline call reports the error");
        ahead.start(&["boom"], Role::Passage, None, |_: &[&str], _: Role, _: Option<&str>| -> Result<Encoded> { panic!("tokeniser bug") });
        assert!(ahead.take(&["boom"], Role::Passage, None).is_none());
        for i in 0..=MAX_PENDING {
            ahead.start(&[&i.to_string()], Role::Passage, None, fake);
        }
        assert_eq!(ahead.pending.len(), MAX_PENDING);
        assert!(ahead.take(&["0"], Role::Passage, None).is_none(), "the oldest was dropped");
        assert!(ahead.take(&[&MAX_PENDING.to_string()], Role::Passage, None).is_some());
        assert_eq!(ahead.hits(), 1);
    }

    #[test]
    fn on_cuda_by_default_else_as_set() {
        assert!(!enabled(None, Device::Cpu));
        assert!(enabled(None, Device::Cuda(0)));
        assert!(enabled(Some(true), Device::Cpu));
        assert!(!enabled(Some(false), Device::Cuda(1)));
    }
}
